"""A slot sampler round launched and read: :func:`launch` dispatches a round's one program (not awaited) and returns
a :class:`Launched`; :func:`read` fetches it; :func:`generate_slots` is the two in turn.

    launched = launch(graphdef, params, ids, mask, key, cfg, num_samples=G, slots=S)   # device work under way
    out, stats = read(launched)         # Rollout of host arrays [B, N], the sampler's figures
    outs = drive([a, b, c], stats)      # read every Launched among several (the others passed through)

Names (those of :mod:`mrl_jax.sampler.slots`): P prompts, G ``num_samples``, B = P * G rows, N the completion length
(``SamplingConfig.max_new_tokens``), S ``slots`` (the first rung), Tp the prompt ids' width and ``width`` the
slots' prompt width (>= Tp: the prompts are left-padded to it, so one program serves every prompt bucket). The
rungs (``rungs``): the slot counts the round decodes in (:mod:`mrl_jax.sampler.ladder`), chosen by ``shrink`` (move
the tail down at all) and ``ladder`` (a :class:`~mrl_jax.sampler.ladder.Ladder`: how the rungs step down).

With ``mesh`` the slots (S rounded up to a multiple of the mesh's size) are split over its devices. Several
processes (``jax.distributed``): the round's program is launched in lockstep by every process of the mesh
(`mrl_jax.mwra.lockstep`); nothing is read on the host before the end, so no process decides anything alone, and
:func:`read` returns the mesh's arrays, which every process reads with ``trainer.placement.fetch``.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import jax
import numpy as np

from mrl_jax.models import splash
from mrl_jax.sampler.batch import Rollout
from mrl_jax.sampler.ladder import Ladder, graph_token, paged_layout, ragged, rungs, slot_count
from mrl_jax.sampler.sampling import SamplingConfig
from mrl_jax.sampler.slots import _round, _split, admit_count, shares_prompts

__all__ = ["Launched", "launch", "read", "drive", "generate_slots", "round_program"]


class Launched(NamedTuple):
    """A launched round (:func:`launch`): rollout (:class:`Rollout` of device arrays [B, N], still computing);
    counts (int32[3] on device: decode steps, row-steps, the deepest rung reached); rungs (the slot counts it may
    decode in, S first); slot_devices (the devices the slots split over); shared_prompts (the first rung reads each
    prompt's entries once for its G slots); spanning (the mesh spans processes: :func:`read` leaves the arrays
    there)."""

    rollout: Rollout
    counts: jax.Array
    rungs: tuple
    slot_devices: int
    shared_prompts: bool
    spanning: bool


def _placement(mesh, rows: int, slots: int | None):
    """(S, slot sharding or None, a function placing a host value replicated / on the default device)."""
    if mesh is None:
        return slot_count(rows, slots), None, jax.device_put
    from jax.sharding import NamedSharding, PartitionSpec

    from mrl_jax import mwra

    repl = NamedSharding(mesh, PartitionSpec())
    return slot_count(rows, slots, int(mesh.devices.size)), mwra.row_sharding(mesh), lambda x: mwra.put(x, repl)


def round_program(graphdef, config: SamplingConfig, g: int, rungs: tuple, width: int, admit: int, rows) -> Callable:
    """The round's program (:func:`~mrl_jax.sampler.slots._round`) of one sampler shape, jitted, with the TPU
    kernels placed on the slots' mesh: ``(params, ids int32[P, width], mask bool[P, width], key) -> (Rollout,
    counts)``. What the sampler runs (memoised by :func:`_program`) and what the memory plan compiles for its
    figure."""
    mesh = None if rows is None else rows.mesh

    def whole(params, ids, mask, k):
        with splash.on_mesh(mesh):
            return _round(graphdef, params, ids, mask, k, config, num_samples=g, rungs=rungs, width=width, admit=admit,
                          rows=rows)
    return jax.jit(whole)


_PROGRAMS: dict = {}


def _program(graphdef, config: SamplingConfig, g: int, rungs: tuple, width: int, admit: int, rows) -> Callable:
    """:func:`round_program` once per process and sampler shape (the GraphDef found by identity:
    :func:`~mrl_jax.sampler.ladder.graph_token`), launched in lockstep by every process of a mesh spanning processes
    (`mrl_jax.mwra.lockstep`)."""
    key = (graph_token(graphdef), config, g, rungs, width, admit, rows)
    found = _PROGRAMS.get(key)
    if found is None:
        from mrl_jax.mwra import lockstep

        found = round_program(graphdef, *key[1:])
        found = _PROGRAMS[key] = found if rows is None else lockstep(rows.mesh, found)
    return found


def _slot_devices(rows) -> int:
    """The devices a slot sharding ``rows`` (None: one device) places the slots on (1 where it replicates them)."""
    return 1 if rows is None or rows.is_fully_replicated else len(rows.device_set)


def launch(graphdef, params, prompt_ids, prompt_mask, key, config: SamplingConfig, *, num_samples: int = 1,
           slots: int | None = None, admit: int | None = None, width: int | None = None, mesh=None,
           shrink: bool = True, ladder: Ladder = Ladder()) -> Launched:
    """:func:`generate_slots`'s round dispatched, not awaited (arguments as there): a :class:`Launched` that
    :func:`read` fetches, so several policies' rounds run while the first is read."""
    ids, mask = np.asarray(prompt_ids), np.asarray(prompt_mask)
    num_prompts, tp = ids.shape
    num_samples = int(num_samples)
    num_rows = num_prompts * num_samples
    slots, rows, put = _placement(mesh, num_rows, slots)   # S: the first rung
    width = tp if width is None else int(width)
    if width < tp:
        raise ValueError(f"generate_slots: width {width} is below the prompt width {tp}")
    if width > tp:   # left-padded to the slots' width: one program whatever the round's prompt bucket
        ids, mask = (np.pad(x, ((0, 0), (width - tp, 0))) for x in (ids, mask))
    devices = 1 if mesh is None else int(mesh.devices.size)
    sizes = rungs(graphdef, params, slots, config.max_new_tokens, devices, shrink,
                  ragged=ragged(config.eos_ids, slots, num_rows), ladder=ladder)
    admit = admit_count(slots, admit) if slots < num_rows else 0   # a slot per row: no queue to refill from
    program = _program(graphdef, config, num_samples, sizes, width, admit, rows)
    out, counts = program(params, *put((ids, mask, key)))
    shared = shares_prompts(paged_layout(graphdef, params), slots, num_prompts, num_samples, _split(rows))
    return Launched(rollout=out, counts=counts, rungs=sizes, slot_devices=_slot_devices(rows),
                    shared_prompts=shared, spanning=jax.process_count() > 1 and mesh is not None)


def read(launched: Launched) -> tuple[Rollout, dict]:
    """Fetch a :class:`Launched` round: (Rollout of host arrays, stats: ``row_steps``, ``decode_steps``,
    ``slots``, ``rungs`` (those it decoded in), ``slot_devices``, ``shared_prompts``). On a mesh spanning processes
    (Rollout of the mesh's arrays, {"counts": the mesh's int32[3], "slots": S}): every process reads the arrays with
    ``trainer.placement.fetch``, in the same order."""
    sizes = launched.rungs
    if launched.spanning:
        return launched.rollout, {"counts": launched.counts, "slots": sizes[0]}
    out, (decode, row_steps, reached) = jax.device_get((launched.rollout, launched.counts))
    return out, {"row_steps": int(row_steps), "decode_steps": int(decode), "slots": sizes[0],
                 "rungs": sizes[:int(reached) + 1], "slot_devices": launched.slot_devices,
                 "shared_prompts": launched.shared_prompts}


def drive(items: Sequence, stats: list | None = None) -> list:
    """:func:`read` every :class:`Launched` among ``items`` (each already launched, so their device work overlaps
    the others' reads), in order; returns their Rollouts, other items unchanged. ``stats``: a list that gets each
    item's stats dict (None for the other items)."""
    out, info = list(items), [None] * len(items)
    for i, x in enumerate(items):
        if isinstance(x, Launched):
            out[i], info[i] = read(x)
    if stats is not None:
        stats.extend(info)
    return out


def generate_slots(graphdef, params, prompt_ids, prompt_mask, key, config: SamplingConfig, *, num_samples: int = 1,
                   slots: int | None = None, admit: int | None = None, width: int | None = None, mesh=None,
                   shrink: bool = True, ladder: Ladder = Ladder()) -> tuple[Rollout, dict]:
    """:func:`mrl_jax.sampler.oracle.generate`'s rows (same key => same tokens and log-probs) decoded in S slots.

    Args as ``generate``; ``slots``: S (None: every row, B; rounded up to a multiple of the mesh's devices);
    ``admit``: rows admitted per step at most (default max(8, S / 8)); ``width``: the slots' prompt width (>= Tp:
    the prompts are left-padded to it, so a fixed width keeps one program across prompt buckets); ``mesh``: slots
    split over its devices; ``shrink``: the rows left once the queue is empty move to fewer slots (the ``heads``
    cache layout only; False: S slots to the end); ``ladder``: how the rungs step down (:class:`Ladder`: the
    default, or a ratio between rungs and a floor). Returns :func:`read`'s (:class:`Rollout` of host numpy arrays
    [B, N], stats). The round is one program (:func:`round_program`), compiled once per sampler shape.
    """
    return read(launch(graphdef, params, prompt_ids, prompt_mask, key, config, num_samples=num_samples, slots=slots,
                       admit=admit, width=width, mesh=mesh, shrink=shrink, ladder=ladder))
