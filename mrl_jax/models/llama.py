"""Llama-family decoder (model_type llama / qwen2 / mistral): RMSNorm, RoPE, GQA, SwiGLU.

Param paths mirror HF names without the ``model.`` prefix, e.g. ``layers.0.self_attn.q_proj.kernel``,
``embed_tokens.embedding``, ``norm.scale``, ``lm_head.kernel`` (absent when tied).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from .attention import apply_rope, attention, rope_cos_sin
from .config import ModelConfig, rope_inv_freq
from .layers import CausalLM, Embed, Linear, RMSNorm, activation, dense, mlp_chunk, row_chunked


class LlamaAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, h, k, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = Linear(d, h * hd, use_bias=cfg.qkv_bias, cfg=cfg, rngs=rngs)
        self.k_proj = Linear(d, k * hd, use_bias=cfg.qkv_bias, cfg=cfg, rngs=rngs)
        self.v_proj = Linear(d, k * hd, use_bias=cfg.qkv_bias, cfg=cfg, rngs=rngs)
        self.o_proj = Linear(h * hd, d, use_bias=cfg.o_bias, cfg=cfg, rngs=rngs)
        self.shape = (h, k, hd)
        self.inv_freq = tuple(float(f) for f in rope_inv_freq(cfg))  # static, hashable
        self.impl = cfg.attention

    def __call__(self, x, positions, mask, *, cache, layer, cache_index):
        B, T = positions.shape   # x: [B*T, D] rows
        h, k, hd = self.shape
        q = self.q_proj(x).reshape(B, T, h, hd)
        kk = self.k_proj(x).reshape(B, T, k, hd)
        v = self.v_proj(x).reshape(B, T, k, hd)
        cos, sin = rope_cos_sin(positions, jnp.asarray(self.inv_freq, jnp.float32))
        q, kk = apply_rope(q, cos, sin), apply_rope(kk, cos, sin)
        out, cache = attention(q, kk, v, mask, scale=hd ** -0.5, cache=cache, layer=layer, impl=self.impl,
                               cache_index=cache_index)
        return self.o_proj(out.reshape(B * T, h * hd)), cache


class LlamaMLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, f, b = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = Linear(d, f, use_bias=b, cfg=cfg, rngs=rngs)
        self.up_proj = Linear(d, f, use_bias=b, cfg=cfg, rngs=rngs)
        self.down_proj = Linear(f, d, use_bias=b, cfg=cfg, rngs=rngs)
        self.act, self.chunk = cfg.hidden_act, mlp_chunk(cfg)

    def __call__(self, x):
        return row_chunked(self._rows, x, self.chunk)

    def _rows(self, x):
        return self.down_proj(activation(self.act)(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg=cfg)
        self.self_attn = LlamaAttention(cfg, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg=cfg)
        self.mlp = LlamaMLP(cfg, rngs)

    def __call__(self, x, positions, mask, *, cache, layer, cache_index):
        a, cache = self.self_attn(self.input_layernorm(x), positions, mask, cache=cache, layer=layer,
                                  cache_index=cache_index)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x)), cache


class LlamaForCausalLM(CausalLM):
    """Llama / Qwen2 / Mistral causal LM (see ``CausalLM`` for the public API)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        if config.family != "llama":
            raise ValueError(f"LlamaForCausalLM needs a llama-family config, got {config.family!r}")
        self.config = config
        self.embed_tokens = Embed(config.vocab_size, config.hidden_size, cfg=config, rngs=rngs)
        self.layers = nnx.List([LlamaBlock(config, rngs) for _ in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, cfg=config)
        self.lm_head = (None if config.tie_word_embeddings else
                        Linear(config.hidden_size, config.vocab_size, use_bias=False, cfg=config, rngs=rngs))

    def embed(self, input_ids, positions):
        return self.embed_tokens(input_ids)

    def final_norm(self, x):
        return self.norm(x)

    def head(self, h: jax.Array) -> jax.Array:
        if self.lm_head is None:
            return self.embed_tokens.attend(h)
        dt = self.config.jnp_dtype
        return dense(h.astype(dt), self.lm_head.kernel[...].astype(dt),
                     preferred_element_type=jnp.float32)
