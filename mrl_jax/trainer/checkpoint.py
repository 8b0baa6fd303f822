"""Atomic run checkpoints with orbax: every policy's params and optimizer state, the SEE buffer, the
run's RNG key, round and data position.

Orbax writes each step into a temporary directory and renames it when complete, so a process killed
mid-write leaves no directory that ``latest_round`` would take; ``keep`` bounds retention. The state is a
pytree; restoring needs a *template* of the same structure (the freshly initialised run state), which
also gives the restored arrays their dtypes and shardings.

Layouts (MWRA): sharded ``jax.Array`` s are saved as they are (orbax writes each shard, no gather to one
host), and a restore reads every array straight onto the template's sharding -- the *current* plan, whatever
device count or mesh the run was saved with (8 devices -> 4 works). `read` restores onto the host.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp


class CheckpointError(RuntimeError):
    """A checkpoint is missing or does not match the run it is restored into."""


def _check_matches(template: Any, restored: Any, where: Path) -> None:
    """Every restored leaf has its template's shape and dtype (orbax restores a stored array of another
    shape without complaint, which would surface later as an obscure shape error inside a jitted step)."""
    t_leaves = jax.tree_util.tree_flatten_with_path(template)[0]
    r_leaves = jax.tree.leaves(restored)
    if len(t_leaves) != len(r_leaves):
        raise CheckpointError(f"checkpoint {where} holds {len(r_leaves)} arrays, this run's state {len(t_leaves)}; "
                              "resume with the config that wrote it, or start a new --out directory.")
    for (path, t), r in zip(t_leaves, r_leaves):
        r = r if hasattr(r, "shape") and hasattr(r, "dtype") else np.asarray(r)
        t = t if hasattr(t, "shape") and hasattr(t, "dtype") else np.asarray(t)
        if tuple(t.shape) != tuple(r.shape) or t.dtype != r.dtype:
            raise CheckpointError(
                f"checkpoint {where}: array {jax.tree_util.keystr(path)} is {r.dtype}{list(r.shape)} but this "
                f"run's config gives {t.dtype}{list(t.shape)}. Resume with the config that wrote the checkpoint "
                "(its copy is config.json next to checkpoints/), or start a new --out directory.")


def _reason(e: BaseException, limit: int = 400) -> str:
    """The most specific message of an orbax / TensorStore failure, on one line: the innermost exception of the
    chain (e.g. TensorStore's ``OUT_OF_RANGE: Error reading "<array>" ...``), without the TensorStore spec repr
    orbax appends (``See full TensorStore details: <bound method ...>``)."""
    chain = [e]
    while (nxt := chain[-1].__cause__ or chain[-1].__context__) is not None and len(chain) < 16:
        chain.append(nxt)
    for x in reversed(chain):
        msg = " ".join(str(x).split()).split(" See full TensorStore details")[0].strip()
        if msg:
            return f"{type(x).__name__}: {msg}"[:limit]
    return type(e).__name__


def _is_array_meta(m) -> bool:
    return hasattr(m, "shape") and hasattr(m, "dtype")


def _norm_path(path) -> str:
    """A pytree path as ``a/0/b`` without nnx's ``value`` components (the saved tree spells them out)."""
    from mrl_jax.mwra import path_str

    return "/".join(c for c in path_str(path).split("/") if c != "value")


def _check_against_saved(template: Any, saved: dict, where: Path) -> None:
    """Name the first template array whose shape or dtype differs from the checkpoint's (by path)."""
    for path, t in jax.tree_util.tree_flatten_with_path(template)[0]:
        got = saved.get(_norm_path(path))
        if got is not None and (tuple(np.shape(t)), np.dtype(t.dtype)) != got:
            raise CheckpointError(
                f"checkpoint {where}: array {jax.tree_util.keystr(path)} is {got[1]}{list(got[0])} but this "
                f"run's config gives {np.dtype(t.dtype)}{list(np.shape(t))}. Resume with the config that wrote the "
                "checkpoint (its copy is config.json next to checkpoints/), or start a new --out directory.")


def _savable(x):
    """A leaf as orbax saves it: a ``jax.Array`` on a mesh as it is (sharded: each shard written where it
    lives, by the process that holds it), anything else -- numpy, or an array on one local device such as the
    SEE buffer, which each process of a multi-host run holds identically -- as numpy."""
    if isinstance(x, jax.ShapeDtypeStruct) or (isinstance(x, jax.Array) and
                                               not isinstance(x.sharding, jax.sharding.SingleDeviceSharding)):
        return x
    return np.asarray(x)


def host_template(template: Any) -> Any:
    """``template`` as abstract arrays on this process's first local device: a restore onto it reads every
    array to this process (what a multi-host run does before placing the state on its meshes)."""
    dev = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=dev), template)


@contextlib.contextmanager
def interrupts_deferred(line: str):
    """SIGINT inside the block is held until it ends (then raised as ``KeyboardInterrupt``), with ``line`` on
    stderr; a second SIGINT raises at once. A no-op off the main thread (where no handler can be set) and where
    SIGINT is ignored (a script's background job: the run ignores it throughout, the write too)."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is signal.SIG_IGN):
        yield
        return
    pending: list[int] = []

    def hold(signum, frame):
        if pending:
            raise KeyboardInterrupt
        pending.append(signum)
        print(line, file=sys.stderr, flush=True)

    previous = signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if pending:
        raise KeyboardInterrupt


def _quiet(method):
    """``method`` with orbax's absl log lines kept off stderr (e.g. ``Failed to json parse Metadata file`` for a
    damaged ``_CHECKPOINT_METADATA``, which orbax then does without); what matters reaches the caller raised."""
    @functools.wraps(method)
    def quiet(*args, **kwargs):
        logger = logging.getLogger("absl")
        level = logger.level
        logger.setLevel(logging.CRITICAL)
        try:
            return method(*args, **kwargs)
        finally:
            logger.setLevel(level)

    return quiet


def _tree_difference(template: Any, saved: dict) -> str | None:
    """The arrays of ``template`` missing from a checkpoint's ``saved`` ``{path: (shape, dtype)}`` and those only
    there, as one short phrase (None when the paths agree or the metadata was unreadable)."""
    if not saved:
        return None
    mine = {_norm_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(template)[0]}
    missing, extra = sorted(mine - set(saved)), sorted(set(saved) - mine)
    if not missing and not extra:
        return None
    parts = [f"{len(missing)} of this run's arrays are not in it (first {missing[0]})"] if missing else []
    parts += [f"{len(extra)} of its arrays are not in this run (first {extra[0]})"] if extra else []
    return "; ".join(parts)


class RunCheckpointer:
    """Save / restore ``(state pytree, meta dict)`` per round under ``<out>/checkpoints``."""

    @_quiet
    def __init__(self, out_dir: str | Path, *, keep: int = 2):
        self.directory = (Path(out_dir) / "checkpoints").absolute()
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=False, create=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    @_quiet
    def latest_round(self) -> int | None:
        """The round of the newest *complete* checkpoint, or None."""
        self._manager.reload()
        return self._manager.latest_step()

    @_quiet
    def save(self, round_index: int, state: Any, meta: dict) -> None:
        """Write the checkpoint of ``round_index`` (blocking; atomic). A Ctrl-C during the write waits for it
        to end (`interrupts_deferred`): orbax's writer threads would otherwise go on filling its temporary
        folder after the main thread left."""
        state = jax.tree.map(_savable, state)
        started = set(threading.enumerate())
        try:
            with interrupts_deferred(f"mrl: finishing the checkpoint of round {round_index}; Ctrl-C again abandons "
                                     "it"):
                self._manager.save(round_index, args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)
                self._manager.wait_until_finished()
        except KeyboardInterrupt:
            self._abandon(round_index, started)
            raise

    def _abandon(self, round_index: int, started: set, limit_s: float = 60.0) -> None:
        """A second Ctrl-C left the write of ``round_index`` unfinished: its writer threads (those the save started,
        idle thread-pool workers aside) end first -- they would refill the temporary folder, or write metadata
        through an executor ``close`` shuts down -- with Ctrl-C ignored for at most ``limit_s``; then the folder
        goes."""
        import concurrent.futures.thread as pool
        import shutil
        import time

        ignored = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if ignored else None
        try:
            deadline = time.monotonic() + limit_s
            workers = set(getattr(pool, "_threads_queues", {}))
            for t in set(threading.enumerate()) - started - workers - {threading.current_thread()}:
                t.join(max(deadline - time.monotonic(), 0.0))
            for tmp in self.directory.glob(f"{round_index}.orbax-checkpoint-tmp*"):
                shutil.rmtree(tmp, ignore_errors=True)
        finally:
            if ignored:
                signal.signal(signal.SIGINT, previous)

    @_quiet
    def all_rounds(self) -> list[int]:
        """Rounds of every complete checkpoint kept, oldest first."""
        self._manager.reload()
        return sorted(self._manager.all_steps())

    @_quiet
    def restore(self, template: Any, round_index: int | None = None) -> tuple[Any, dict]:
        """Restore into the structure of ``template``; returns ``(state, meta)``.

        Raises ``CheckpointError`` naming the checkpoint directory and the fix when it is missing, unreadable
        (files deleted or corrupted) or written by a different config (tree structure, shape or dtype of a
        leaf differs from ``template``'s).
        """
        steps = self.all_rounds()
        step = (steps[-1] if steps else None) if round_index is None else round_index
        if step is None:
            raise CheckpointError(
                f"no complete checkpoint in {self.directory}; start without --resume to begin a new run.")
        where = self.directory / str(step)
        if step not in steps:
            raise CheckpointError(f"no complete checkpoint of round {step} in {self.directory} (complete: {steps}).")
        template = jax.tree.map(_savable, template)
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)   # jax.Array: with its sharding
        try:   # a template of another config refused from the metadata, before orbax starts a read it would abandon
            saved = self._saved_shapes(step)
        except Exception:  # noqa: BLE001 -- unreadable metadata: the restore below names the damage
            saved = {}
        _check_against_saved(template, saved, where)
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        except Exception as e:  # noqa: BLE001 -- orbax/tensorstore raise many types; all mean "unusable"
            msg, outer = _reason(e), " ".join(str(e).split()).lower()
            if "mismatch" in msg.lower() or "mismatch" in outer or "not found in metadata" in outer:
                diff = _tree_difference(template, saved) or msg.split(":", 2)[-1].strip()[:160]
                raise CheckpointError(
                    f"checkpoint {where} does not match this run's config ({diff}). Resume with the config that "
                    "wrote it (its copy is config.json next to checkpoints/), or start a new --out directory.") from e
            earlier = [s for s in steps if s < step]
            fix = (f"delete {where} to resume from the previous complete checkpoint (round {earlier[-1]})"
                   if earlier else "start a new --out directory (no earlier checkpoint is kept)")
            raise CheckpointError(
                f"checkpoint {where} (round {step}) is incomplete or corrupted: {msg}. "
                f"Fix: {fix}.") from e
        _check_matches(template, restored.state, where)
        return restored.state, dict(restored.meta)

    def _saved_shapes(self, step: int) -> dict:
        """``{array path: (shape, dtype)}`` of a checkpoint, from its metadata (nothing read)."""
        md = ocp.StandardCheckpointer().metadata(self.directory / str(step) / "state")
        md = getattr(md, "item_metadata", md)
        tree = getattr(md, "tree", md)
        leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_array_meta)[0]
        return {_norm_path(p): (tuple(m.shape), np.dtype(m.dtype)) for p, m in leaves if _is_array_meta(m)}

    @_quiet
    def read(self, round_index: int | None = None) -> tuple[Any, dict]:
        """Template-free restore for inspection and comparison: ``(tree of numpy arrays as saved, meta)``
        (nested dicts/lists; no config needed). ``restore`` is what a resumed run uses."""
        step = self.latest_round() if round_index is None else round_index
        if step is None:
            raise CheckpointError(f"no complete checkpoint in {self.directory}.")
        md = ocp.StandardCheckpointer().metadata(self.directory / str(step) / "state")
        md = getattr(md, "item_metadata", md)
        meta_tree = getattr(md, "tree", md)
        host = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        abstract = jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=host), meta_tree,
                                is_leaf=_is_array_meta)
        restored = self._manager.restore(step, args=ocp.args.Composite(   # any saved layout, onto one device
            state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        return jax.tree.map(np.asarray, restored.state), dict(restored.meta)

    @_quiet
    def close(self) -> None:
        self._manager.close()
