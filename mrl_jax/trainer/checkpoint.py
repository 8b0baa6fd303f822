"""Atomic run checkpoints with orbax: every policy's params and optimizer state, the SEE buffer, the
run's RNG key, round and data position.

Orbax writes each step into a temporary directory and renames it when complete, so a process killed
mid-write leaves no directory that ``latest_round`` would take; ``keep`` bounds retention. The state is a
pytree; restoring needs a *template* of the same structure (the freshly initialised run state), which
also gives the restored arrays their dtypes and shardings.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp


class CheckpointError(RuntimeError):
    """A checkpoint is missing or does not match the run it is restored into."""


class RunCheckpointer:
    """Save / restore ``(state pytree, meta dict)`` per round under ``<out>/checkpoints``."""

    def __init__(self, out_dir: str | Path, *, keep: int = 2):
        self.directory = (Path(out_dir) / "checkpoints").absolute()
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=False, create=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_round(self) -> int | None:
        """The round of the newest *complete* checkpoint, or None."""
        self._manager.reload()
        return self._manager.latest_step()

    def save(self, round_index: int, state: Any, meta: dict) -> None:
        """Write the checkpoint of ``round_index`` (blocking; atomic)."""
        state = jax.tree.map(np.asarray, state)
        self._manager.save(round_index, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)
        self._manager.wait_until_finished()

    def restore(self, template: Any, round_index: int | None = None) -> tuple[Any, dict]:
        """Restore into the structure of ``template``; returns ``(state, meta)``."""
        step = self.latest_round() if round_index is None else round_index
        if step is None:
            raise CheckpointError(
                f"no complete checkpoint in {self.directory}; start without --resume to begin a new run.")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, jax.tree.map(np.asarray, template))
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        except (ValueError, KeyError, FileNotFoundError) as e:
            raise CheckpointError(
                f"checkpoint {self.directory / str(step)} does not match this run's config ({e}). Resume with "
                f"the config that wrote it, or start a new --out directory.") from e
        return restored.state, dict(restored.meta)

    def close(self) -> None:
        self._manager.close()
