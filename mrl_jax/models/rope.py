"""RoPE frequency tables of the HF rope types: default, linear, llama3, yarn, longrope (and partial rotary).

Every function reads a ``ModelConfig``-like object (``head_dim``, ``rope_theta``, ``rope_params``,
``rope_type``, ``partial_rotary_factor``, ``max_position_embeddings``) and mirrors
``transformers.modeling_rope_utils`` in float32.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from .attention import apply_rope, rope_cos_sin

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


class RopeTable(NamedTuple):
    """Static (hashable) RoPE of one layer: ``inv_freq`` [rot_dim // 2]; ``long_inv_freq`` (longrope only)
    replaces it when the forward's largest position + 1 exceeds ``original_max``; cos / sin are multiplied
    by ``attention_factor`` (yarn / longrope)."""

    inv_freq: Tuple[float, ...]
    attention_factor: float = 1.0
    long_inv_freq: Optional[Tuple[float, ...]] = None
    original_max: int = 0

    def cos_sin(self, positions: jax.Array) -> Tuple[jax.Array, jax.Array]:
        """f32 cos, sin [B, T, rot_dim] for int positions [B, T]."""
        inv = jnp.asarray(self.inv_freq, jnp.float32)
        if self.long_inv_freq is not None:
            use_long = jnp.max(positions) + 1 > self.original_max
            inv = jnp.where(use_long, jnp.asarray(self.long_inv_freq, jnp.float32), inv)
        cos, sin = rope_cos_sin(positions, inv)
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos, sin

    def apply(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        """x [B, T, N, D]: rotate the first rot_dim features (partial rotary), keep the rest."""
        rd = cos.shape[-1]
        if rd == x.shape[-1]:
            return apply_rope(x, cos, sin)
        return jnp.concatenate([apply_rope(x[..., :rd], cos, sin), x[..., rd:]], axis=-1)


def rotary_dim(cfg) -> int:
    return int(cfg.head_dim * cfg.partial_rotary_factor)


def _base_inv_freq(theta: float, dim: int) -> np.ndarray:
    return (1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))).astype(np.float32)


def _llama3(inv, p, max_pos):
    factor, lo, hi = float(p["factor"]), float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old = float(p.get("original_max_position_embeddings", max_pos))
    lo_wl, hi_wl = old / lo, old / hi
    wl = 2 * math.pi / inv
    scaled = np.where(wl > lo_wl, inv / factor, inv)
    smooth = (old / wl - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wl < hi_wl) & ~(wl > lo_wl)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn(theta, dim, p, max_pos):
    """(inv_freq, attention_factor) of HF ``_compute_yarn_parameters``."""
    factor = float(p["factor"])
    old = float(p.get("original_max_position_embeddings", max_pos))

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    att = p.get("attention_factor")
    if att is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        att = mscale(factor, m) / mscale(factor, m_all) if (m and m_all) else mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def corr_dim(rot):
        return dim * math.log(old / (rot * 2 * math.pi)) / (2 * math.log(theta))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    extra = 1.0 - ramp
    pos_freqs = (theta ** (np.arange(0, dim, 2).astype(np.float32) / dim)).astype(np.float32)
    inv = (1.0 / (factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra
    return inv.astype(np.float32), float(att)


def _longrope(theta, dim, p, max_pos):
    """(short inv_freq, long inv_freq, attention_factor, original max) of HF ``_compute_longrope_parameters``."""
    old = int(p["original_max_position_embeddings"])
    factor = p.get("factor") or max_pos / old
    att = p.get("attention_factor")
    if att is None:
        att = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old))
    shape = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim
    base = (theta ** shape).astype(np.float32)
    short, long = (np.float32(1.0) / (np.asarray(p[k], np.float32) * base) for k in ("short_factor", "long_factor"))
    return short.astype(np.float32), long.astype(np.float32), float(att), old


def rope_table(cfg, layer: int = 0) -> RopeTable:
    """The RoPE of ``layer``: sliding layers of a config with ``rope_local_theta`` (Gemma 3) use plain RoPE at
    that base; every other layer the config's rope type."""
    dim = rotary_dim(cfg)
    tup = lambda a: tuple(float(f) for f in a)  # noqa: E731
    if cfg.rope_local_theta is not None and cfg.layer_window(layer) is not None:
        return RopeTable(tup(_base_inv_freq(cfg.rope_local_theta, dim)))
    p, kind, theta = cfg.rope_params, cfg.rope_type, cfg.rope_theta
    if kind == "yarn":
        inv, att = _yarn(theta, dim, p, cfg.max_position_embeddings)
        return RopeTable(tup(inv), att)
    if kind == "longrope":
        short, long, att, old = _longrope(theta, dim, p, cfg.max_position_embeddings)
        return RopeTable(tup(short), att, tup(long), old)
    inv = _base_inv_freq(theta, dim)
    if kind == "linear":
        inv = inv / np.float32(p["factor"])
    elif kind == "llama3":
        inv = _llama3(inv, p, cfg.max_position_embeddings)
    return RopeTable(tup(inv))


def rope_inv_freq(cfg) -> np.ndarray:
    """float32[rot_dim // 2] inverse frequencies of layer 0 (the short factors for longrope)."""
    return np.asarray(rope_table(cfg).inv_freq, np.float32)
