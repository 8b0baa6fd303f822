"""The Llama-derived decoders of today's families: Qwen3 (q/k norm), Phi-3 (fused qkv / gate_up, partial
rotary, longrope) and Gemma 3 text ((1 + w) norms, four norms per layer, scaled embeddings, per-layer RoPE,
logit soft-capping); also any llama-family config with yarn / longrope RoPE (cos / sin scaled).

Param paths mirror HF names without the ``model.`` prefix, as in ``llama.py``: e.g.
``layers.0.self_attn.q_norm.scale``, ``layers.0.self_attn.qkv_proj.kernel``, ``layers.0.mlp.gate_up_proj.kernel``,
``layers.0.pre_feedforward_layernorm.scale``.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from .attention import attention
from .config import ModelConfig
from .layers import CausalLM, Embed, Linear, RMSNorm, activation, dense, mlp_chunk, row_chunked
from .rope import rope_table


class PlusOneRMSNorm(nnx.Module):
    """HF GemmaRMSNorm: ``(x_normed * (1 + scale)).astype(dtype)`` in float32; ``scale`` starts at 0."""

    def __init__(self, dim: int, *, cfg: ModelConfig):
        self.scale = nnx.Param(jnp.zeros((dim,), cfg.jnp_param_dtype))
        self.eps = cfg.norm_eps
        self.dtype = cfg.jnp_dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (xf * (1.0 + self.scale[...].astype(jnp.float32))).astype(self.dtype)


def norm(dim: int, cfg: ModelConfig):
    return PlusOneRMSNorm(dim, cfg=cfg) if cfg.norm_plus_one else RMSNorm(dim, cfg=cfg)


class DecoderAttention(nnx.Module):
    """GQA with optional fused qkv_proj, per-head q/k RMSNorm before RoPE, and this layer's RoPE table."""

    def __init__(self, cfg: ModelConfig, layer: int, rngs: nnx.Rngs):
        d, h, k, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        if cfg.fused_projections:
            self.qkv_proj = Linear(d, (h + 2 * k) * hd, use_bias=cfg.qkv_bias, cfg=cfg, rngs=rngs)
        else:
            self.q_proj = Linear(d, h * hd, use_bias=cfg.qkv_bias, cfg=cfg, rngs=rngs)
            self.k_proj = Linear(d, k * hd, use_bias=cfg.qkv_bias, cfg=cfg, rngs=rngs)
            self.v_proj = Linear(d, k * hd, use_bias=cfg.qkv_bias, cfg=cfg, rngs=rngs)
        self.o_proj = Linear(h * hd, d, use_bias=cfg.o_bias, cfg=cfg, rngs=rngs)
        if cfg.qk_norm:
            self.q_norm, self.k_norm = norm(hd, cfg), norm(hd, cfg)
        self.shape = (h, k, hd)
        self.fused, self.qk_norm = cfg.fused_projections, cfg.qk_norm
        self.rope = rope_table(cfg, layer)   # static, hashable
        self.scale = (cfg.query_pre_attn_scalar or hd) ** -0.5
        self.impl = cfg.attention

    def _qkv(self, x):
        h, k, hd = self.shape
        if self.fused:
            qkv = self.qkv_proj(x)
            return qkv[:, :h * hd], qkv[:, h * hd:(h + k) * hd], qkv[:, (h + k) * hd:]
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def __call__(self, x, positions, mask, *, cache, layer, cache_index):
        B, T = positions.shape   # x: [B*T, D] rows
        h, k, hd = self.shape
        q, kk, v = self._qkv(x)
        q, kk, v = q.reshape(B, T, h, hd), kk.reshape(B, T, k, hd), v.reshape(B, T, k, hd)
        if self.qk_norm:
            q, kk = self.q_norm(q), self.k_norm(kk)
        cos, sin = self.rope.cos_sin(positions)
        q, kk = self.rope.apply(q, cos, sin), self.rope.apply(kk, cos, sin)
        out, cache = attention(q, kk, v, mask, scale=self.scale, cache=cache, layer=layer, cache_index=cache_index,
                               impl=self.impl)
        return self.o_proj(out.reshape(B * T, h * hd)), cache


class DecoderMLP(nnx.Module):
    """down(act(gate(x)) * up(x)), gate and up as one gate_up_proj [D, 2F] when fused (phi3)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, f, b = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        if cfg.fused_projections:
            self.gate_up_proj = Linear(d, 2 * f, use_bias=b, cfg=cfg, rngs=rngs)
        else:
            self.gate_proj = Linear(d, f, use_bias=b, cfg=cfg, rngs=rngs)
            self.up_proj = Linear(d, f, use_bias=b, cfg=cfg, rngs=rngs)
        self.down_proj = Linear(f, d, use_bias=b, cfg=cfg, rngs=rngs)
        self.act, self.fused, self.f, self.chunk = cfg.hidden_act, cfg.fused_projections, f, mlp_chunk(cfg)

    def __call__(self, x):
        return row_chunked(self._rows, x, self.chunk)

    def _rows(self, x):
        if self.fused:
            gu = self.gate_up_proj(x)
            gate, up = gu[:, :self.f], gu[:, self.f:]
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(activation(self.act)(gate) * up)


class DecoderBlock(nnx.Module):
    """Pre-norm block; with ``sandwich_norms`` (gemma) the attention and MLP outputs are normalised too."""

    def __init__(self, cfg: ModelConfig, layer: int, rngs: nnx.Rngs):
        d = cfg.hidden_size
        self.input_layernorm = norm(d, cfg)
        self.self_attn = DecoderAttention(cfg, layer, rngs)
        self.post_attention_layernorm = norm(d, cfg)
        if cfg.sandwich_norms:
            self.pre_feedforward_layernorm = norm(d, cfg)
            self.post_feedforward_layernorm = norm(d, cfg)
        self.mlp = DecoderMLP(cfg, rngs)
        self.sandwich = cfg.sandwich_norms

    def __call__(self, x, positions, mask, *, cache, layer, cache_index):
        a, cache = self.self_attn(self.input_layernorm(x), positions, mask, cache=cache, layer=layer,
                                  cache_index=cache_index)
        if not self.sandwich:
            x = x + a
            return x + self.mlp(self.post_attention_layernorm(x)), cache
        x = x + self.post_attention_layernorm(a)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x))), cache


class DecoderForCausalLM(CausalLM):
    """Qwen3 / Phi-3 / Gemma 3 text causal LM, and llama-family configs with yarn / longrope (see
    ``CausalLM`` for the public API)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        if config.family != "llama":
            raise ValueError(f"DecoderForCausalLM needs a llama-family config, got {config.family!r}")
        self.config = config
        self.embed_tokens = Embed(config.vocab_size, config.hidden_size, cfg=config, rngs=rngs)
        self.layers = nnx.List([DecoderBlock(config, i, rngs) for i in range(config.num_layers)])
        self.norm = norm(config.hidden_size, config)
        self.lm_head = (None if config.tie_word_embeddings else
                        Linear(config.hidden_size, config.vocab_size, use_bias=False, cfg=config, rngs=rngs))
        self.embed_scale = math.sqrt(config.hidden_size) if config.scale_embeddings else None

    def embed(self, input_ids, positions):
        x = self.embed_tokens(input_ids)
        if self.embed_scale is None:
            return x
        return x * jnp.asarray(self.embed_scale, x.dtype)

    def final_norm(self, x):
        return self.norm(x)

    def head(self, h: jax.Array) -> jax.Array:
        if self.lm_head is None:
            logits = self.embed_tokens.attend(h)
        else:
            dt = self.config.jnp_dtype
            logits = dense(h.astype(dt), self.lm_head.kernel[...].astype(dt), preferred_element_type=jnp.float32)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else cap * jnp.tanh(logits / cap)
