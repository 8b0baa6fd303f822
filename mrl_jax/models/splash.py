"""Attention through JAX's Pallas TPU splash kernel (``jax.experimental.pallas.ops.tpu.splash_attention``).

The kernel takes a static block-sparse mask: the causal triangle, or a local band for a sliding window, at a
static query offset. Everything that varies per row -- left padding of prompts, right padding of completions,
a row that is all padding -- goes in as segment ids: a real token is segment 1, padding segment 0, and a query
only sees keys of its own segment. Every query sees at least its own key (it sits at its own slot), so no score
row is empty; padding queries' outputs are then set to zero (as `mrl_jax.models.flash` gives them), so they pass
no gradient.

Covered, forward and backward (`causal_attention`, `prefix_attention`): causal attention of T queries over
their own T keys (the update's forward, the sampler's prefill), with padding, GQA (any H % K == 0), sliding
windows and logit soft-capping; the prompt-once-per-group layout of the update (each completion over its prompt's
keys, repeated per completion, then its own: a causal mask at offset Tp). Not covered: a query offset known only
at run time (decode steps, prefill into a longer cache) -- `mrl_jax.models.attention.attention` keeps ours there.

Sequences are padded to a multiple of the kernel's 128-lane blocks (``BLOCK_ALIGN``) and cut back. The softmax
scale is folded into q (in float32, then cast to q's dtype). The kernel runs natively when lowered for TPU and
interpreted (Pallas interpret mode, plain XLA) on any other platform (``lax.platform_dependent``), so the same
model code runs its equality tests on the CPU.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Optional

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

BLOCK_ALIGN = 128            # the kernel's lane width: block sizes are multiples of it
_BLOCKS = (512, 256, 128)    # preferred block sizes, largest dividing the padded length


_MESH: contextvars.ContextVar = contextvars.ContextVar("splash_mesh", default=None)


@contextlib.contextmanager
def on_mesh(mesh):
    """Trace the kernel calls inside for ``mesh`` (a `jax.sharding.Mesh`): a Mosaic kernel is not partitioned by
    XLA, so on a mesh of several devices each call runs under ``shard_map``, rows split over every mesh axis
    where they divide its size, else replicated (each device computes all rows). Wrap a jitted step's body."""
    token = _MESH.set(mesh)
    try:
        yield
    finally:
        _MESH.reset(token)


def current_mesh():
    """The `on_mesh` mesh of the calls being traced (None outside one)."""
    return _MESH.get()


def _per_device(fn, *args):
    """``fn(*args)`` (every arg and the output with rows leading) under ``shard_map`` on the `on_mesh` mesh."""
    mesh = _MESH.get()
    if mesh is None or mesh.devices.size == 1:
        return fn(*args)
    rows = args[0].shape[0]
    lead = tuple(mesh.axis_names) if rows % mesh.devices.size == 0 else None
    spec = lambda x: PartitionSpec(lead, *([None] * (x.ndim - 1)))   # noqa: E731
    out = jax.eval_shape(fn, *args)
    return jax.shard_map(fn, mesh=mesh, in_specs=tuple(spec(a) for a in args), out_specs=spec(out),
                         check_vma=False)(*args)


def _round_up(n: int) -> int:
    return -(-n // BLOCK_ALIGN) * BLOCK_ALIGN


def _block(n: int) -> int:
    return next(b for b in _BLOCKS if n % b == 0)


def _kernel(Tq: int, Sk: int, heads: int, offset: int, window: Optional[int], softcap: Optional[float],
            interpret: bool):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    if window is None:
        mask = sm.CausalMask((Tq, Sk), offset=offset)
    else:   # query at slot o + t sees keys s with o + t - (window - 1) <= s <= o + t
        mask = sm.LocalMask((Tq, Sk), window_size=(window - 1, 0), offset=offset)
    bq, bk = _block(Tq), _block(Sk)
    blocks = sk.BlockSizes(block_q=bq, block_kv=bk, block_kv_compute=bk, block_q_dkv=bq, block_kv_dkv=bk,
                           block_kv_dkv_compute=bk, block_q_dq=bq, block_kv_dq=bk)
    return sk.make_splash_mha(sm.MultiHeadMask([mask] * heads), block_sizes=blocks, head_shards=1, q_seq_shards=1,
                              attn_logits_soft_cap=softcap, interpret=interpret), sk.SegmentIds


def _splash(q, k, v, q_valid, kv_valid, *, offset: int, scale: float, window: Optional[int],
            softcap: Optional[float]) -> jax.Array:
    """q [B, T, H, D] at slots offset + t; k, v [B, S, K, D] at slots s (offset + T <= S); q_valid bool[B, T],
    kv_valid bool[B, S]. Returns [B, T, H, D] in q.dtype, zero at the invalid queries."""
    B, T, H, D = q.shape
    S = k.shape[1]
    Tq = _round_up(T)
    Sk = _round_up(max(S, offset + Tq))   # a padding query at slot offset + t finds its own (padding) key
    dt = q.dtype
    qh = jnp.pad((q.astype(jnp.float32) * scale).astype(dt), ((0, 0), (0, Tq - T), (0, 0), (0, 0))).swapaxes(1, 2)
    kh, vh = (jnp.pad(x.astype(dt), ((0, 0), (0, Sk - S), (0, 0), (0, 0))).swapaxes(1, 2) for x in (k, v))
    q_seg = jnp.pad(jnp.asarray(q_valid, jnp.int32), ((0, 0), (0, Tq - T)))
    kv_seg = jnp.pad(jnp.asarray(kv_valid, jnp.int32), ((0, 0), (0, Sk - S)))

    def run(interpret: bool, *arrays):
        kernel, segment_ids = _kernel(Tq, Sk, H, offset, window, softcap, interpret)
        return jax.vmap(lambda a, b, c, qs, ks: kernel(a, b, c, segment_ids=segment_ids(q=qs, kv=ks)))(*arrays)

    out = _per_device(lambda *a: jax.lax.platform_dependent(*a, tpu=lambda *b: run(False, *b),
                                                            default=lambda *b: run(True, *b)),
                      qh, kh, vh, q_seg, kv_seg)
    out = out.swapaxes(1, 2)[:, :T]
    return jnp.where(jnp.asarray(q_valid, bool)[:, :, None, None], out, 0).astype(dt)


def causal_attention(q, k, v, kv_valid, *, scale: float, window: Optional[int] = None,
                     softcap: Optional[float] = None) -> jax.Array:
    """Causal self-attention: q [B, T, H, D], k, v [B, T, K, D], query t and key t at slot t; kv_valid
    bool[B, T] (padding False). ``window``: key s visible iff s > t - window. Returns [B, T, H, D]."""
    return _splash(q, k, v, kv_valid, kv_valid, offset=0, scale=scale, window=window, softcap=softcap)


def prefix_attention(q, k, v, prompt_mask, completion_mask, *, scale: float, window: Optional[int] = None,
                     softcap: Optional[float] = None) -> jax.Array:
    """The prompt-shared layout (`mrl_jax.models.attention.PrefixMask`): q [1, N, H, D], k, v [1, N, K, D] with
    N = P*Tp + P*M*Tc; prompt_mask bool[P, Tp], completion_mask bool[P*M, Tc]. Prompts attend causally within
    themselves; completion b = p*M + m over prompt p's keys (slots 0..Tp-1) then its own (slots Tp..).
    Returns [1, N, H, D]."""
    P, Tp = prompt_mask.shape
    B, Tc = completion_mask.shape
    H, K, D = q.shape[2], k.shape[2], q.shape[3]
    M, n = B // P, P * Tp
    opts = dict(scale=scale, window=window, softcap=softcap)
    pk, pv = (x[0, :n].reshape(P, Tp, K, D) for x in (k, v))
    out_p = causal_attention(q[0, :n].reshape(P, Tp, H, D), pk, pv, prompt_mask, **opts)
    kc, vc = (jnp.concatenate([jnp.repeat(p, M, axis=0), x[0, n:].reshape(B, Tc, K, D)], axis=1)
              for p, x in ((pk, k), (pv, v)))
    valid = jnp.concatenate([jnp.repeat(prompt_mask, M, axis=0), completion_mask], axis=1)
    out_c = _splash(q[0, n:].reshape(B, Tc, H, D), kc, vc, completion_mask, valid, offset=Tp, **opts)
    return jnp.concatenate([out_p.reshape(n, H, D), out_c.reshape(B * Tc, H, D)], 0)[None]


__all__ = ["BLOCK_ALIGN", "causal_attention", "on_mesh", "prefix_attention"]
