"""MWRA -- Multi-Worker Resource Allocation.

Each policy gets its own sub-mesh (`allocate` / `plan`), its parameters and optimizer state are sharded on
it (`param_shardings`, `opt_state_shardings`, `row_shardings`, placed with `put`), and the trainer launches
every policy's jitted step before awaiting any, so policies on disjoint sub-meshes run at the same time. Multi-host uses `jax.distributed` (`initialize_distributed`); see docs/multihost.md.
"""
from mrl_jax.mwra.allocation import (
    BYTES_PER_PARAM_TRAINING,
    Plan,
    PlanError,
    PolicyPlan,
    allocate,
    estimate_memory_bytes,
    plan,
    proportional_split,
)
from mrl_jax.mwra.distributed import DistributedInfo, barrier, initialize_distributed, lockstep, owners
from mrl_jax.mwra.sharding import (
    DEFAULT_MIN_SIZE,
    DEFAULT_RULES,
    FSDP,
    REPLICATED,
    row_sharding,
    row_shardings,
    devices_of,
    opt_state_shardings,
    param_shardings,
    path_str,
    put,
    shard_rows,
    spec_for,
    to_mesh,
)

__all__ = [
    "lockstep", "owners",
    "BYTES_PER_PARAM_TRAINING", "DEFAULT_MIN_SIZE", "DEFAULT_RULES", "FSDP", "REPLICATED",
    "DistributedInfo", "Plan", "PlanError", "PolicyPlan", "allocate", "barrier", "row_sharding", "row_shardings",
    "devices_of",
    "estimate_memory_bytes", "initialize_distributed", "opt_state_shardings", "param_shardings", "path_str", "plan",
    "proportional_split", "put", "shard_rows", "spec_for", "to_mesh",
]
