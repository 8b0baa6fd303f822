"""Multi-host start-up through JAX's own runtime (`jax.distributed.initialize`); see docs/multihost.md."""
from __future__ import annotations

import atexit
import dataclasses
import os
import socket
import sys
import threading
import time
from typing import Callable

import jax

from mrl_jax.configs import ConfigError

ENV_COORDINATOR = ("MRL_COORDINATOR", "JAX_COORDINATOR_ADDRESS")
ENV_NUM_PROCESSES = ("MRL_NUM_PROCESSES", "JAX_NUM_PROCESSES")
ENV_PROCESS_ID = ("MRL_PROCESS_ID", "JAX_PROCESS_ID")
ENV_HEARTBEAT = ("MRL_HEARTBEAT_TIMEOUT_S",)
ENV_INIT_TIMEOUT = ("MRL_INIT_TIMEOUT_S",)


class DistributedSetupError(ConfigError):
    """A multi-host start-up setting (``mrl train`` flag or its environment variable) is wrong, or the
    coordinator never answered; the message names the flag and the fix."""


DEFAULT_HEARTBEAT_S = 100   # JAX's own heartbeat timeout, where none is set


@dataclasses.dataclass(frozen=True)
class DistributedInfo:
    initialized: bool  # True when jax.distributed is running (multi-process)
    process_id: int
    num_processes: int
    coordinator_address: str | None
    heartbeat_timeout_s: int = DEFAULT_HEARTBEAT_S   # a process silent this long is dead (`trainer.watchdog`)


def _env(names: tuple[str, ...]) -> str | None:
    for n in names:
        v = os.environ.get(n)
        if v not in (None, ""):
            return v
    return None


def _int(value, label: str, env: tuple[str, ...]) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError) as e:
        raise DistributedSetupError(f"{label} {value!r} is not an integer (flag or ${' / $'.join(env)})") from e


def initialize_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None, *, auto_detect: bool | None = None,
                           local_device_ids=None, initialization_timeout: int | None = None,
                           heartbeat_timeout_s: int | None = None) -> DistributedInfo:
    """Join the processes of one run (one process per host) before any other JAX call.

    Each argument falls back to the environment: ``MRL_COORDINATOR`` / ``JAX_COORDINATOR_ADDRESS``
    (``host:port`` of process 0), ``MRL_NUM_PROCESSES`` / ``JAX_NUM_PROCESSES``, ``MRL_PROCESS_ID`` /
    ``JAX_PROCESS_ID``. With one process (nothing set, or ``num_processes=1``) it is a no-op. With
    ``auto_detect=True`` (default: ``$MRL_DISTRIBUTED_AUTO`` is 1/true) and nothing set, JAX's own cluster
    detection (SLURM, Open MPI, Cloud TPU pods, ...) decides.
    ``heartbeat_timeout_s`` (else ``$MRL_HEARTBEAT_TIMEOUT_S``, else JAX's default, 100 s): how long the others
    wait for a process that stopped answering before they abort (docs/multihost.md, "When a process dies").
    ``initialization_timeout`` (else ``$MRL_INIT_TIMEOUT_S``, else 300 s): how long a process waits for the
    coordinator (one line on stderr says it waits; a coordinator that never answers is a
    ``DistributedSetupError`` naming ``--coordinator``; processes that do not all join in time: one line naming
    ``--coordinator`` and ``--num-processes``, then exit 2 -- not JAX's abort).
    Calling it again after a successful start returns the running state. Afterwards ``jax.devices()`` is the
    global device list, and `allocate` / `plan` spread policies over every host's devices.
    """
    if jax.distributed.is_initialized():
        return DistributedInfo(True, jax.process_index(), jax.process_count(),
                               coordinator_address or _env(ENV_COORDINATOR))
    coordinator_address = coordinator_address or _env(ENV_COORDINATOR)
    num_processes = _int(num_processes if num_processes is not None else _env(ENV_NUM_PROCESSES),
                         "--num-processes", ENV_NUM_PROCESSES)
    process_id = _int(process_id if process_id is not None else _env(ENV_PROCESS_ID), "--process-id",
                      ENV_PROCESS_ID)
    timeout = _int(initialization_timeout if initialization_timeout is not None else _env(ENV_INIT_TIMEOUT),
                   "initialization timeout", ENV_INIT_TIMEOUT) or 300

    if auto_detect is None:
        auto_detect = os.environ.get("MRL_DISTRIBUTED_AUTO", "").strip().lower() in ("1", "true", "yes")
    if coordinator_address is None and num_processes is None and process_id is None:
        if not auto_detect:
            return DistributedInfo(False, 0, 1, None)
        _initialize(initialization_timeout=timeout)
        return DistributedInfo(True, jax.process_index(), jax.process_count(), None)
    if num_processes is not None and num_processes < 1:
        raise DistributedSetupError(f"--num-processes {num_processes}: must be >= 1 (one process per host)")
    if num_processes == 1:
        if process_id not in (None, 0):
            raise DistributedSetupError(f"--process-id {process_id} with --num-processes 1: the only process has "
                                        "id 0")
        return DistributedInfo(False, 0, 1, coordinator_address)
    missing = [n for n, v in (("--coordinator ($MRL_COORDINATOR)", coordinator_address),
                              ("--num-processes ($MRL_NUM_PROCESSES)", num_processes),
                              ("--process-id ($MRL_PROCESS_ID)", process_id)) if v is None]
    if missing:
        raise DistributedSetupError(f"multi-process start needs {', '.join(missing)}: set all three on every host "
                                    "(same coordinator host:port and count everywhere; ids 0..num_processes-1)")
    heartbeat = _int(heartbeat_timeout_s if heartbeat_timeout_s is not None else _env(ENV_HEARTBEAT),
                     "heartbeat timeout", ENV_HEARTBEAT)
    if heartbeat is not None and heartbeat < 1:
        raise DistributedSetupError(f"heartbeat timeout {heartbeat}: must be >= 1 second ($MRL_HEARTBEAT_TIMEOUT_S)")
    if not 0 <= process_id < num_processes:
        raise DistributedSetupError(f"--process-id {process_id} out of range for --num-processes {num_processes}: "
                                    f"use 0..{num_processes - 1}, a different one on each host")
    if ":" not in coordinator_address:
        raise DistributedSetupError(f"--coordinator {coordinator_address!r}: use host:port of process 0, "
                                    "e.g. 10.0.0.1:1234")
    try:  # CPU multi-process collectives; gloo is the default in recent jax, set it where it is unset
        if jax.config.jax_cpu_collectives_implementation is None:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except AttributeError:
        pass
    extra = {} if heartbeat is None else {"heartbeat_timeout_seconds": heartbeat}
    print(f"waiting for coordinator {coordinator_address} (process {process_id} of {num_processes}, timeout "
          f"{timeout} s)", file=sys.stderr, flush=True)
    if process_id != 0:   # process 0 serves the coordinator; the others first see its port open (JAX aborts)
        _wait_for_port(coordinator_address, timeout, process_id, num_processes)
    joined = _join_deadline(coordinator_address, timeout, process_id, num_processes)
    _initialize(coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id,
                local_device_ids=local_device_ids, initialization_timeout=timeout + JOIN_GRACE_S, **extra)
    joined.set()
    return DistributedInfo(True, jax.process_index(), jax.process_count(), coordinator_address,
                           heartbeat or DEFAULT_HEARTBEAT_S)


def _initialize(**kwargs) -> None:
    """`jax.distributed.initialize` with a recoverable coordination service: a process that stops answering is
    marked dead (`trainer.watchdog.Watchdog` sees it and stops this process with one line) instead of the service
    pushing a fatal error that JAX's C++ client turns into an abort (exit 134) racing that line."""
    try:
        jax.config.update("jax_enable_recoverability", True)
    except AttributeError:   # a JAX without the option: the abort may then win the race (docs/multihost.md)
        pass
    jax.distributed.initialize(**kwargs)
    patience = kwargs.get("heartbeat_timeout_seconds", DEFAULT_HEARTBEAT_S) + 10
    atexit.register(_leave, patience)   # runs before JAX's own exit hook (registered at import): see _leave


def coordination_client():
    """This process's client of JAX's coordination service (``wait_at_barrier``, ``get_live_nodes``); None in a
    single-process run. From ``jax._src``: jax 0.10 has no public accessor (``jax.distributed`` exposes
    ``initialize`` / ``is_initialized`` / ``shutdown`` only, and ``multihost_utils.live_devices`` is a collective
    every process must enter, not a query one process can make)."""
    from jax._src import distributed

    return distributed.global_state.client


JOIN_GRACE_S = 30   # JAX's own start-up limit is this much later than ours: its expiry is an abort (exit 134)


def _join_deadline(address: str, timeout_s: float, process_id: int, num_processes: int) -> threading.Event:
    """A daemon thread that, unless the returned event is set within ``timeout_s``, prints one line naming
    ``--coordinator`` and ``--num-processes`` and exits 2 -- ahead of JAX's abort when the processes never all
    join (a missing process, another count or coordinator on one host)."""
    joined = threading.Event()

    def expire():
        if not joined.wait(timeout_s):
            print(f"mrl train: --coordinator {address}: the {num_processes} processes (--num-processes) did not all "
                  f"join within {timeout_s:g} s (this is process {process_id}); start every process with the same "
                  "--coordinator and --num-processes and ids 0..n-1, or wait longer with $MRL_INIT_TIMEOUT_S",
                  file=sys.stderr, flush=True)
            os._exit(2)

    threading.Thread(target=expire, name="mrl-join-deadline", daemon=True).start()
    return joined


def _wait_for_port(address: str, timeout_s: float, process_id: int, num_processes: int) -> None:
    """Block until a TCP connection to ``address`` (``host:port``) succeeds; ``DistributedSetupError`` naming
    ``--coordinator`` when nothing answers within ``timeout_s``."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=1.0):
                return
        except (OSError, ValueError) as e:
            if isinstance(e, ValueError) or time.monotonic() >= deadline:
                why = "its port is not a number" if isinstance(e, ValueError) else f"{e.strerror or e}"
                raise DistributedSetupError(
                    f"--coordinator {address}: nothing answered there within {timeout_s:g} s (process {process_id} "
                    f"of {num_processes}; {why}); start process 0 with the same --coordinator first, check the host "
                    "and port, or wait longer with $MRL_INIT_TIMEOUT_S") from None
        time.sleep(0.25)


_BARRIERS: dict = {}


def barrier(name: str, process_ids=None, timeout_s: float = 3600.0) -> None:
    """Wait until every process in ``process_ids`` (default: all) reaches its same-numbered ``name`` barrier.

    Through the coordination service (``jax.distributed``), not the devices, so it never interleaves with a
    program's collectives. Each call gets the next number for ``(name, process_ids)``: the processes must make
    the same sequence of calls. A no-op in a single-process run."""
    client = coordination_client()
    if client is None or jax.process_count() == 1:
        return
    procs = tuple(sorted(process_ids)) if process_ids is not None else None
    n = _BARRIERS[(name, procs)] = _BARRIERS.get((name, procs), -1) + 1
    label = "all" if procs is None else "-".join(map(str, procs))
    client.wait_at_barrier(f"{name}.{label}.{n}", int(timeout_s * 1000),
                           None if procs is None or len(procs) == jax.process_count() else list(procs))


def owners(mesh) -> list[int]:
    """The processes whose devices ``mesh`` holds."""
    return sorted({d.process_index for d in mesh.devices.flat})


def _signature(args) -> tuple:
    """What a jitted function's program depends on: the tree and each leaf's shape, dtype and sharding."""
    leaves, tree = jax.tree.flatten(args)
    return tree, tuple((x.shape, x.dtype, getattr(x, "sharding", None)) if hasattr(x, "shape") else repr(x)
                       for x in leaves)


def lockstep(mesh, fn: Callable) -> Callable:
    """``fn`` (jitted) itself on a mesh inside one process. On a mesh spanning processes: compiled ahead of time
    per input signature, then launched by every process of the mesh after a barrier (`mwra.barrier`): the CPU
    collectives (gloo) of one program must start on all its processes within their connect timeout (~30 s),
    which processes that compile at different speeds (or hit the compile cache unevenly) would miss. Every
    process makes the same calls in the same order (docs/multihost.md), so the barriers pair up."""
    procs = owners(mesh)
    if len(procs) < 2 or jax.process_count() == 1:   # (one process compiling for a multi-host TPU topology)
        return fn
    compiled: dict = {}

    def call(*args):
        if jax.process_index() not in procs:   # nothing of it runs here
            return fn(*args)
        key = _signature(args)
        exe = compiled.get(key)
        if exe is None:
            exe = compiled[key] = fn.lower(*args).compile()
        barrier("mrl.lockstep", procs)
        return exe(*args)

    return call


def _leave(patience_s: float) -> None:
    """At exit of a multi-process run (after a watchdog's own `Watchdog.stop`): wait (at most ``patience_s``) for
    every process to finish (`mwra.barrier`), then the processes other than 0 leave the coordination service
    first and process 0, which serves it, last: the recoverable service has no shutdown barrier of its own, and a
    client whose service is already gone aborts in its shutdown call (exit 134)."""
    client = coordination_client()
    if client is None:
        return
    try:
        barrier("mrl.exit", timeout_s=patience_s)
    except Exception:  # noqa: BLE001 -- a peer that never arrives: leave all the same
        pass
    if jax.process_index() == 0:
        _await_departures(client, jax.process_count(), patience_s)
    jax.distributed.shutdown()


def _await_departures(client, num_processes: int, timeout_s: float) -> None:
    """Block (at most ``timeout_s``) until process 0 is the only one the coordination service still counts as
    alive: every other process has left (or been declared dead). The service's answer waits for every live
    process to ask too (their watchdogs do, every second), hence the thread."""
    def poll():
        try:
            while set(client.get_live_nodes(list(range(num_processes)))) - {0}:
                time.sleep(0.1)
        except Exception:  # noqa: BLE001 -- the service is failing: nothing left to wait for
            pass

    waiter = threading.Thread(target=poll, name="mrl-leave", daemon=True)
    waiter.start()
    waiter.join(timeout=timeout_s)
