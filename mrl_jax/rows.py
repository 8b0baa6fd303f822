"""The padded row layout every probe reads and writes, and its named constructors.

R = P*G own rows (prompt-major, row = p*G + g) followed by the P*K peer slots of the consumer's
``SeeView`` (row = P*G + p*K + k). One layout for every probe, so every probe compiles the same shapes.

    rows = concat(own_rows(prompt_ids, prompt_mask, completion_ids, ...), peer_rows(see_view, prompt_ids, prompt_mask))

The trainer builds a policy's own rows from its rollout (``own_rows``); SEE's per-consumer view (``SeeView``) holds
the peer slots under the same field names, lifted into rows by ``peer_rows`` inside the update.

Per-row fields are the ones declared with ``per_row()``; ``PER_ROW`` is derived from the dataclass.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from mrl_jax.thl import chunk_sum, chunk_to_tokens

# Row kinds, defined once (SEE's view slots use the same codes): the policy's own rollout, a peer's current-round
# rollout, an archived verified peer success, the policy's own archived success, an empty slot.
OWN, PEER, ARCHIVE, OWN_ARCHIVE, EMPTY = 0, 1, 2, 3, -1


def per_row(**kw):
    """A pytree field whose leading axis is the row axis R."""
    return struct.field(pytree_node=True, metadata={"per_row": True}, **kw)


@struct.dataclass
class Rows:
    """Inputs: prompt_ids int32[R, Tp], prompt_mask bool[R, Tp], completion_ids int32[R, Tc],
    completion_mask f32[R, Tc], old_logp f32[R, Tc] (pi_old; peer rows: the consumer's current log-probs,
    filled by the objective's no-grad pre-pass when a probe needs them), ref_logp f32[R, Tc] (frozen
    reference; own rows only), rewards f32[R], truncated bool[R], row_kind int32[R] (OWN=0, PEER=1
    current-round peer rollout, ARCHIVE=2 archived verified peer success, OWN_ARCHIVE=3 own archived success,
    EMPTY=-1), prompt_slot int32[R] (0..P-1), source int32[R] (generating policy), dst_chunk int32[R, Tc]
    (THL chunk of each completion token, -1 pad; own rows -1), src_chunk_logp f32[R, C] (source behaviour
    log-prob summed per chunk), chunk_valid bool[R, C] (False = THL residual chunk).
    Probe-controlled: pg_row f32[R] (row counts in the policy-gradient term), pg_mask f32[R, Tc] (tokens of
    the PG term), pg_weight f32[R, Tc] (stop-gradient per-token weight, e.g. PRP importance weights),
    aux_weight f32[R, Tc] (stop-gradient per-token weight of a probe's own PG-like term, e.g. PRP's LUFFY
    shaping; such rows keep pg_row / pg_mask so they count in the PG denominator, with pg_weight 0),
    sft_weight f32[R] (SGT / replay weight), advantages f32[R].
    Scalars: consumer int32[], probe_index int32[] (acting chain of a ``switch``).
    pooled_advantages f32[R] or None: the pooled-group (XGRPO) advantages of every row, set once per chain by
    the pooling probes (``probes._pooling``) and dropped when the advantages are final (``objective.prepare``).
    Static: num_prompts, num_generations. (The run's options are bound into the probes, not carried here.)
    """
    prompt_ids: jax.Array = per_row()
    prompt_mask: jax.Array = per_row()
    completion_ids: jax.Array = per_row()
    completion_mask: jax.Array = per_row()
    old_logp: jax.Array = per_row()
    ref_logp: jax.Array = per_row()
    rewards: jax.Array = per_row()
    truncated: jax.Array = per_row()
    row_kind: jax.Array = per_row()
    prompt_slot: jax.Array = per_row()
    source: jax.Array = per_row()
    dst_chunk: jax.Array = per_row()
    src_chunk_logp: jax.Array = per_row()
    chunk_valid: jax.Array = per_row()
    pg_row: jax.Array = per_row()
    pg_mask: jax.Array = per_row()
    pg_weight: jax.Array = per_row()
    aux_weight: jax.Array = per_row()
    sft_weight: jax.Array = per_row()
    advantages: jax.Array = per_row()
    consumer: jax.Array = struct.field(pytree_node=True, default=None)
    probe_index: jax.Array = struct.field(pytree_node=True, default=None)
    pooled_advantages: jax.Array = struct.field(pytree_node=True, default=None)
    num_prompts: int = struct.field(pytree_node=False, default=0)
    num_generations: int = struct.field(pytree_node=False, default=0)

    @property
    def num_own(self) -> int:
        return self.num_prompts * self.num_generations

    @property
    def num_rows(self) -> int:
        return self.rewards.shape[0]

    def take(self, start: int, stop: int | None = None) -> "Rows":
        """Rows [start, stop) (static slice of every per-row field)."""
        return self.replace(**{f: getattr(self, f)[start:stop] for f in PER_ROW})


PER_ROW = tuple(f.name for f in dataclasses.fields(Rows) if f.metadata.get("per_row"))


def own_rows(prompt_ids, prompt_mask, completion_ids, completion_mask, old_logp, ref_logp, rewards, truncated, *,
             consumer=0, num_chunks: int = 1, num_generations: int | None = None, probe_index=0) -> Rows:
    """The policy's own P x G rollouts as active PG rows: prompt_ids int32[P, Tp] (one row per prompt, repeated
    G times here), prompt_mask bool[P, Tp], completion_ids int32[P*G, Tc] (prompt-major), completion_mask
    f32[P*G, Tc] (1 up to and incl. the stop token), old_logp f32[P*G, Tc] (the behaviour log-probs, pi_old),
    ref_logp f32[P*G, Tc] (frozen reference; zeros when beta = 0), rewards f32[P*G], truncated bool[P*G].
    Host numpy in, host numpy out (the trainer then places the rows on the policy's mesh); jax arrays in
    (traced too), jax arrays out."""
    xp = np if all(isinstance(x, np.ndarray) for x in (prompt_ids, completion_ids, rewards)) else jnp
    P = prompt_ids.shape[0]
    n, Tc = completion_ids.shape
    G = n // P if num_generations is None else num_generations
    slot = xp.repeat(xp.arange(P, dtype=xp.int32), G)
    cm = xp.asarray(completion_mask, xp.float32)
    cons = xp.asarray(consumer, xp.int32)
    return Rows(
        prompt_ids=xp.asarray(prompt_ids, xp.int32)[slot], prompt_mask=xp.asarray(prompt_mask, bool)[slot],
        completion_ids=xp.asarray(completion_ids, xp.int32), completion_mask=cm,
        old_logp=xp.asarray(old_logp, xp.float32), ref_logp=xp.asarray(ref_logp, xp.float32),
        rewards=xp.asarray(rewards, xp.float32), truncated=xp.asarray(truncated, bool),
        row_kind=xp.full((n,), OWN, xp.int32), prompt_slot=slot, source=xp.full((n,), cons, xp.int32),
        dst_chunk=xp.full((n, Tc), -1, xp.int32), src_chunk_logp=xp.zeros((n, num_chunks), xp.float32),
        chunk_valid=xp.zeros((n, num_chunks), bool), pg_row=xp.ones((n,), xp.float32), pg_mask=cm,
        pg_weight=xp.ones((n, Tc), xp.float32), aux_weight=xp.zeros((n, Tc), xp.float32),
        sft_weight=xp.zeros((n,), xp.float32), advantages=xp.zeros((n,), xp.float32),
        consumer=cons, probe_index=xp.asarray(probe_index, xp.int32),
        num_prompts=P, num_generations=G)


def peer_rows(view, prompt_ids, prompt_mask) -> Rows:
    """The view's S = P*K slots (``SeeView``: the same field names) as inactive rows (a probe's extend
    activates them); prompts from the consumer's own prompt_ids int32[P, Tp] by slot."""
    S, Tc = view.completion_ids.shape
    ps = view.prompt_slot.astype(jnp.int32)
    z = lambda *s, dt=jnp.float32: jnp.zeros(s, dt)
    return Rows(
        prompt_ids=jnp.asarray(prompt_ids, jnp.int32)[ps], prompt_mask=jnp.asarray(prompt_mask, bool)[ps],
        completion_ids=view.completion_ids.astype(jnp.int32), completion_mask=view.completion_mask.astype(jnp.float32),
        old_logp=z(S, Tc), ref_logp=z(S, Tc), rewards=view.rewards.astype(jnp.float32),
        truncated=view.truncated.astype(bool), row_kind=view.row_kind.astype(jnp.int32), prompt_slot=ps,
        source=view.source.astype(jnp.int32), dst_chunk=view.dst_chunk.astype(jnp.int32),
        src_chunk_logp=view.src_chunk_logp.astype(jnp.float32), chunk_valid=view.chunk_valid.astype(bool),
        pg_row=z(S), pg_mask=z(S, Tc), pg_weight=z(S, Tc), aux_weight=z(S, Tc), sft_weight=z(S), advantages=z(S),
        consumer=jnp.asarray(view.consumer, jnp.int32), probe_index=jnp.asarray(0, jnp.int32))


def concat(own: Rows, peers: Rows) -> Rows:
    """Own rows followed by peer slots; scalars and static fields from ``own``."""
    if own.completion_ids.shape[1] != peers.completion_ids.shape[1]:
        raise ValueError(f"peer completion length {peers.completion_ids.shape[1]} != own completion length "
                         f"{own.completion_ids.shape[1]}")
    C = peers.src_chunk_logp.shape[1]
    own = own.replace(src_chunk_logp=jnp.zeros((own.num_rows, C), jnp.float32),
                      chunk_valid=jnp.zeros((own.num_rows, C), bool))
    return own.replace(**{f: jnp.concatenate([getattr(own, f), getattr(peers, f)], 0) for f in PER_ROW})


def chunk_sums(x: jax.Array, dst_chunk: jax.Array, num_chunks: int) -> jax.Array:
    """Per-row chunk sums: x f32[R, T], dst_chunk int32[R, T] (-1 ignored) -> f32[R, C] (THL ``chunk_sum``,
    one segment_sum: O(R*T) memory)."""
    return chunk_sum(x.astype(jnp.float32), dst_chunk, num_chunks)


def chunk_gather(v: jax.Array, dst_chunk: jax.Array) -> jax.Array:
    """Per-token value of its chunk: v f32[R, C], dst_chunk int32[R, T] -> f32[R, T] (0 where -1)."""
    return chunk_to_tokens(v, dst_chunk)
