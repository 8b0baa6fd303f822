"""Attention through ``jax.nn.dot_product_attention``: cuDNN's fused flash kernel on an NVIDIA GPU.

cuDNN expresses padding only as per-row lengths (the real tokens first, padding after) and the causal mask only
top-left aligned (query t sees keys s <= t of an equally long row). The models' rows put padding elsewhere (a
prompt is left-padded, a completion right-padded), so each row is *compacted* first: its real tokens, in order,
moved to the front (a gather of q, k, v; RoPE is already applied, so positions travel with them), attention run
with ``is_causal`` and the row's length as both query and key length, and the outputs moved back (padding
queries' outputs zero, as `mrl_jax.models.flash` gives them, so they pass no gradient). Causal order among the
real tokens is kept, so this equals ours for any padding; a sliding window counts real tokens, so it equals ours
where each row's real tokens are contiguous -- the update's rows (left-padded prompt ++ right-padded completion)
and the prefill's (a left-padded prompt) are.

Covered, forward and backward: causal attention of T queries over their own T keys (the update's forward, the
sampler's prefill: `causal_attention`), GQA (any H % K == 0), sliding windows; the prompt-once-per-group layout
(`prefix_attention`): each completion attends over [its prompt's keys ++ its own] as one causal row, the prompt's
queries, keys and values repeated per completion (the prompt's outputs read from its first completion's row;
gradients of the repeats sum back), since cuDNN has no query offset. Not covered, and left to ours: logit
soft-capping, float32 (cuDNN takes bf16 / fp16), head dims past cuDNN's (a multiple of 8, at most 128; 256 from
Hopper on), decode steps (one query at a run-time offset).

``implementation`` is ``jax.nn.dot_product_attention``'s: "cudnn" on a CUDA GPU; "xla", the same call in plain
XLA (a [B, H, T, S] score array), is what the CPU runs, so these functions are checked against ours there.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

_CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)


def _cuda_head_dim_max() -> int:
    """cuDNN flash attention's largest head dim on the default device: 256 from Hopper (sm_90) on, else 128."""
    cc = getattr(jax.devices()[0], "compute_capability", "0.0")
    return 256 if tuple(int(x) for x in str(cc).split(".")[:2]) >= (9, 0) else 128


def _on_cuda() -> bool:
    if jax.default_backend() != "gpu":
        return False
    client = getattr(jax.devices()[0], "client", None)
    return "cuda" in str(getattr(client, "platform_version", "")).lower()


def implementation(dtype, head_dim: int, softcap: Optional[float]) -> Optional[str]:
    """``jax.nn.dot_product_attention``'s implementation for this call, or None where ours must run.

    "cudnn" on a CUDA GPU where cuDNN's constraints hold (bf16 / fp16, head dim a multiple of 8 within its
    limit); "xla" on the CPU (the checks); None with soft-capping (neither implementation has it), on other
    backends, and on a GPU outside cuDNN's constraints."""
    if softcap is not None:
        return None
    if _on_cuda():
        ok = jnp.dtype(dtype) in _CUDNN_DTYPES and head_dim % 8 == 0 and head_dim <= _cuda_head_dim_max()
        return "cudnn" if ok else None
    return "xla" if jax.default_backend() == "cpu" else None


def _compaction(valid: jax.Array):
    """valid bool[B, T] -> (order int32[B, T]: the slots of each row's real tokens first, then its padding, each
    in slot order; slot int32[B, T]: where slot t goes in that order; lengths int32[B], at least 1)."""
    B, T = valid.shape
    real = jnp.cumsum(valid, axis=1, dtype=jnp.int32)
    lengths = real[:, -1]
    slot = jnp.where(valid, real - 1, lengths[:, None] + jnp.cumsum(~valid, axis=1, dtype=jnp.int32) - 1)
    order = jnp.zeros((B, T), jnp.int32).at[jnp.arange(B)[:, None], slot].set(jnp.arange(T, dtype=jnp.int32))
    # a row all padding still gets length 1 (its first padding query over its own key): cuDNN is not asked for
    # an empty row, and that query's output is zeroed below
    return order, slot, jnp.maximum(lengths, 1)


def _gather(x: jax.Array, idx: jax.Array) -> jax.Array:
    """x [B, T, N, D] reordered along T by idx int32[B, T]."""
    return jnp.take_along_axis(x, idx[:, :, None, None], axis=1)


def causal_attention(q, k, v, valid, *, scale: float, window: Optional[int] = None,
                     implementation: str = "cudnn") -> jax.Array:
    """Causal self-attention: q [B, T, H, D], k, v [B, T, K, D], query t and key t at slot t; valid bool[B, T]
    (padding False). ``window``: key s visible iff s > t - window (real tokens contiguous per row). Returns
    [B, T, H, D] in q.dtype, zero at the padding queries."""
    valid = jnp.asarray(valid, bool)
    order, slot, lengths = _compaction(valid)
    dt = q.dtype
    qc, kc, vc = (_gather(x.astype(dt), order) for x in (q, k, v))
    out = jax.nn.dot_product_attention(
        qc, kc, vc, scale=scale, is_causal=True, query_seq_lengths=lengths, key_value_seq_lengths=lengths,
        local_window_size=None if window is None else (window - 1, 0), implementation=implementation)
    return jnp.where(valid[:, :, None, None], _gather(out, slot), 0).astype(dt)


def prefix_attention(q, k, v, prompt_mask, completion_mask, *, scale: float, window: Optional[int] = None,
                     implementation: str = "cudnn") -> jax.Array:
    """The prompt-shared layout (`mrl_jax.models.attention.PrefixMask`): q [1, N, H, D], k, v [1, N, K, D] with
    N = P*Tp + P*M*Tc; prompt_mask bool[P, Tp], completion_mask bool[P*M, Tc]. Completion b = p*M + m attends
    causally over the row [prompt p ++ completion b]; prompt p's outputs are those of row p*M. Returns
    [1, N, H, D]."""
    P, Tp = prompt_mask.shape
    B, Tc = completion_mask.shape
    H, D = q.shape[2], q.shape[3]
    M, n = B // P, P * Tp

    def rows(x):   # [1, N, n_heads, D] -> [B, Tp + Tc, n_heads, D]
        prompt = jnp.repeat(x[0, :n].reshape(P, Tp, *x.shape[2:]), M, axis=0)
        return jnp.concatenate([prompt, x[0, n:].reshape(B, Tc, *x.shape[2:])], axis=1)

    valid = jnp.concatenate([jnp.repeat(jnp.asarray(prompt_mask, bool), M, axis=0),
                             jnp.asarray(completion_mask, bool)], axis=1)
    out = causal_attention(rows(q), rows(k), rows(v), valid, scale=scale, window=window,
                           implementation=implementation)
    out_p = out[::M, :Tp].reshape(n, H, D)
    return jnp.concatenate([out_p, out[:, Tp:].reshape(B * Tc, H, D)], 0)[None]


__all__ = ["causal_attention", "implementation", "prefix_attention"]
