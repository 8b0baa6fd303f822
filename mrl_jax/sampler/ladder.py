"""The slot ladder: the slot counts (rungs) a round of the slot sampler (:mod:`mrl_jax.sampler.slots`) decodes in,
and the decode row-steps rows of given lengths cost there.

    Ladder().rungs(128)                # (128, 96, 64, 48, 32, 16, 8)
    Ladder(0.5, 1).rungs(128)          # (128, 64, 32, 16, 8, 4, 2, 1)
    ladder_row_steps(lengths, rungs)   # == generate_slots(...)[1]["row_steps"] at S >= rows on one device

A round's rows start in S slots; once the queue is empty and the live rows fit the next rung, they move there, so
a long tail of lengths decodes in few slots. Each rung is a decode loop (and a move) in the round's one program,
whose compile grows with the rungs, so the default ladder is short: steps of 3/4 (to round numbers) above FINE slots,
halves below, where a step's fixed cost dominates. A :class:`Ladder` with a ratio trades compile for row-steps
(figures: benchmarks/RESULTS.md §3).

Names: ``slots`` (S) the first rung's slot count; ``shrink`` whether the tail moves down at all (config key
``sampling.ladder``); ``ladder`` a :class:`Ladder`, how the rungs step down (config keys ``sampling.ladder_ratio`` /
``ladder_floor``); ``rungs`` the slot counts, S first; ``max_new_tokens`` N the completion length; ``multiple`` the
devices the slots split over (every rung a multiple of it).
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np
from flax import nnx

__all__ = ["Ladder", "rungs", "ragged", "paged_layout", "graph_token", "slot_count", "min_row_steps",
           "ladder_row_steps"]

FINE = 32    # the slot ladder's rungs above this many slots step down by 3/4 or 2/3, half at or below it
FLOOR = 8    # the ladder's last rung holds at least this many slots
RUNGS = 10   # the default ladder's rungs at most: a decode loop each in the round's program
MAX_RUNGS = 64   # a ladder with a ratio: its rungs at most
SHORT = 32   # a round of at most this many new tokens keeps its S: too short a tail to repay the rungs' compiles


def _round_number(x: int) -> int:
    """The largest 2^k or 3 * 2^k at most ``x`` (>= 1)."""
    p = 1 << (int(x).bit_length() - 1)
    return 3 * p // 2 if p >= 2 and 3 * p // 2 <= x else p


@dataclasses.dataclass(frozen=True)
class Ladder:
    """How a round's rungs step down (``sampling.ladder_ratio`` / ``ladder_floor``): ``ratio`` None: the default
    (3/4 steps to round numbers above FINE slots, halves below, RUNGS at most); a float in (0, 1): each rung holds at
    most ``ratio`` x the slots of the one above (at least one fewer), MAX_RUNGS at most -- finer rungs take fewer
    row-steps and compile a decode loop each. ``floor``: the last rung holds at least this many slots."""

    ratio: Optional[float] = None
    floor: int = FLOOR

    def __post_init__(self):
        if self.ratio is not None and not 0 < self.ratio < 1:
            raise ValueError(f"sampling.ladder_ratio must be in (0, 1) (or unset: the default ladder), got "
                             f"{self.ratio}")
        if self.floor < 1:
            raise ValueError(f"sampling.ladder_floor must be >= 1, got {self.floor}")

    def below(self, slots: int) -> int:
        """The next rung's slots before rounding to the devices (may be >= ``slots``: no rung below)."""
        if self.ratio is None:
            return _round_number(max(1, slots * 3 // 4 if slots > FINE else slots // 2))
        return min(slots - 1, int(slots * self.ratio))

    def rungs(self, slots: int, multiple: int = 1, shrink: bool = True) -> tuple[int, ...]:
        """The slot counts a round decodes in, largest first: ``slots``, then each rung's :meth:`below` rounded up
        to a multiple of ``multiple``, while that is below the last and at least max(``floor``, multiple), RUNGS (a
        ratio: MAX_RUNGS) at most; (slots,) without ``shrink``. Once the queue is empty and the live rows fit the
        next rung, they move there (`slots._compact`): the long tail of a round decodes in few slots, each default
        step above FINE in at most ~1.5 x its live rows' slots (below it a step's fixed cost dominates). Default: 128
        -> (128, 96, 64, 48, 32, 16, 8); 512 -> (512, 384, 256, ..., 32, 16); 100 -> (100, 64, 48, 32, 16, 8); 12 ->
        (12,)."""
        out, m = [int(slots)], int(multiple)
        most = RUNGS if self.ratio is None else MAX_RUNGS
        while shrink and len(out) < most:
            nxt = -(-self.below(out[-1]) // m) * m
            if self.ratio is not None and nxt >= out[-1]:   # a ratio steps down at least one multiple
                nxt = out[-1] - m
            if nxt >= out[-1] or nxt < max(self.floor, m):
                break
            out.append(nxt)
        return tuple(out)


_GRAPHS: dict = {}   # GraphDef -> its token: hashed once per distinct graph
_BY_ID: dict = {}    # id(GraphDef) -> (that GraphDef, its token); the entry holds the object, so its id is not reused
_PAGED: dict = {}    # token -> paged_layout


def graph_token(graphdef) -> int:
    """A small int naming ``graphdef``'s graph (equal GraphDefs, equal tokens), found by identity first: hashing a
    GraphDef walks the model's whole graph (milliseconds for a real model), and a run passes each policy's one
    GraphDef object to its sampler every round."""
    hit = _BY_ID.get(id(graphdef))
    if hit is not None and hit[0] is graphdef:
        return hit[1]
    token = _GRAPHS.setdefault(graphdef, len(_GRAPHS))
    if len(_BY_ID) >= 64:   # bounded: a caller that splits its model anew every call only misses
        _BY_ID.clear()
    _BY_ID[id(graphdef)] = (graphdef, token)
    return token


def paged_layout(graphdef, params) -> bool:
    """Whether the model's slot cache takes the ``pages`` layout (``attention: splash``, the TPU path): each slot's
    attention reads its own length there, so a free slot costs one page and the ladder would buy no step time for
    its compiles and moves (`mrl_jax.sampler.launch` keeps S); the ``heads`` layout (CPU, GPU) reads every slot's
    part up to the furthest slot, so its tail moves down the ladder. ``params`` may be abstract (ShapeDtypeStructs)."""
    token = graph_token(graphdef)
    if token not in _PAGED:
        mcfg = getattr(nnx.merge(graphdef, params), "config", None)
        _PAGED[token] = getattr(mcfg, "attention", None) == "splash"
    return _PAGED[token]


def ragged(stops, slots: int, rows: int) -> bool:
    """Whether a round's rows can end at different steps, so that its tail could move down the ladder: it has stop
    ids (``stops``: the sampling config's ``eos_ids``), or fewer ``slots`` than ``rows`` (rows enter as slots free).
    Without either every row ends at step N - 1, all at once."""
    return bool(stops) or slots < rows


def rungs(graphdef, params, slots: int, max_new_tokens: int, multiple: int = 1, shrink: bool = True, *,
          ragged: bool = True, ladder: Ladder = Ladder()) -> tuple[int, ...]:
    """The slot counts a round of this model decodes in: ``ladder.rungs(slots, multiple, shrink)`` on the ``heads``
    cache layout, for a round of more than SHORT ``max_new_tokens`` whose rows can end at different steps
    (``ragged``: :func:`ragged`); else ``(slots,)``: on the ``pages`` layout (:func:`paged_layout`), where rows that
    end all at once have nothing to move, and for short rounds, whose tail lasts at most SHORT steps: too few for
    the rungs' decode loops and moves to repay their compile (`mrl demo --quick`, 8 new tokens, compiles a third
    fewer programs without them: RESULTS §12)."""
    return ladder.rungs(slots, multiple,
                        shrink and ragged and max_new_tokens > SHORT and not paged_layout(graphdef, params))


def slot_count(rows: int, slots: int | None, multiple: int = 1) -> int:
    """S: ``slots`` (None: every row; never more than the rows) rounded up to a multiple of ``multiple`` (the
    devices the slots split over)."""
    s = int(rows if slots is None else slots)
    if s < 1:
        raise ValueError(f"sampling.slots must be >= 1, got {slots}")
    return -(-min(s, rows) // multiple) * multiple


def min_row_steps(lengths, slots: int) -> int:
    """The fewest row-steps (``stats["row_steps"]``) any sampler of ``slots`` fixed slots can take for rows of kept
    ``lengths`` (int[B], token 0 from the prefill): step 0 of every row, then S row-steps per decode step, and at
    least max(L) - 1 decode steps (the longest row) and sum(L - 1) / S (the work). A long tail makes the first
    dominate: S * (max(L) - 1) / sum(L) row-steps per kept token at least."""
    need = np.maximum(np.asarray(lengths, np.int64) - 1, 0)
    return int(need.size + slots * max(int(need.max(initial=0)), -(-int(need.sum()) // slots)))


def ladder_row_steps(lengths, sizes: Sequence[int]) -> int:
    """The row-steps (``stats["row_steps"]``) of rows of kept ``lengths`` (int[B], token 0 from the prefill) that
    all start in the first of the slot counts ``sizes`` (S >= B: no queue) and move down them at the first step
    their live rows fit the next one, as the sampler does on one device: step 0 of every row, then each step the
    slots of its rung. ``(S,)``: :func:`min_row_steps` at S >= B."""
    need, rung, work = np.maximum(np.asarray(lengths, np.int64) - 1, 0), 0, int(np.size(lengths))
    for t in range(int(need.max(initial=0))):
        live = int((need > t).sum())
        while rung + 1 < len(sizes) and live <= sizes[rung + 1]:
            rung += 1
        work += int(sizes[rung])
    return work
