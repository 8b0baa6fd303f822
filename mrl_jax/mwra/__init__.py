"""MWRA -- Multi-Worker Resource Allocation.

Each policy gets its own sub-mesh (`allocate` / `plan`), its parameters and optimizer state are sharded on
it (`param_shardings`, `shard_params`, `shard_opt_state`, `batch_sharding`, `jit_for_mesh`), and every
policy's jitted step is launched before any is awaited (`dispatch_all`), so policies on disjoint sub-meshes
run at the same time. Multi-host uses `jax.distributed` (`initialize_distributed`); see docs/multihost.md.
"""
from mrl_jax.mwra.allocation import (
    BYTES_PER_PARAM_TRAINING,
    Plan,
    PolicyPlan,
    allocate,
    estimate_memory_bytes,
    plan,
    proportional_split,
)
from mrl_jax.mwra.dispatch import dispatch_all
from mrl_jax.mwra.distributed import LOST_EXIT_CODE, DistributedInfo, barrier, initialize_distributed, watch_run
from mrl_jax.mwra.sharding import (
    DEFAULT_MIN_SIZE,
    DEFAULT_RULES,
    FSDP,
    REPLICATED,
    batch_sharding,
    batch_shardings,
    devices_of,
    jit_for_mesh,
    opt_state_shardings,
    param_shardings,
    path_str,
    put,
    shard_batch,
    shard_opt_state,
    shard_params,
    spec_for,
    to_mesh,
)

__all__ = [
    "BYTES_PER_PARAM_TRAINING", "DEFAULT_MIN_SIZE", "DEFAULT_RULES", "FSDP", "LOST_EXIT_CODE", "REPLICATED",
    "DistributedInfo", "Plan", "PolicyPlan", "allocate", "barrier", "batch_sharding", "batch_shardings", "devices_of",
    "dispatch_all", "estimate_memory_bytes", "initialize_distributed", "jit_for_mesh", "opt_state_shardings",
    "param_shardings", "path_str", "plan", "proportional_split", "put", "shard_batch", "shard_opt_state",
    "shard_params", "spec_for", "to_mesh", "watch_run",
]
