"""GPT-2: LayerNorm, learned positions, GELU (tanh approx, "gelu_new"), fused c_attn qkv, tied head.

Param paths: ``wte.embedding``, ``wpe.embedding``, ``layers.N.{ln_1,attn.c_attn,attn.c_proj,ln_2,mlp.c_fc,
mlp.c_proj}``, ``ln_f`` (HF ``h.N`` is named ``layers.N`` so every family exposes ``model.layers``).
Kernels are [in, out] exactly like HF's Conv1D weights.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from .attention import attention
from .config import ModelConfig
from .layers import CausalLM, Embed, LayerNorm, Linear, activation, dense, mlp_chunk, row_chunked


class GPT2Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d = cfg.hidden_size
        self.c_attn = Linear(d, 3 * d, use_bias=True, cfg=cfg, rngs=rngs)
        self.c_proj = Linear(d, d, use_bias=True, cfg=cfg, rngs=rngs)
        self.shape = (cfg.num_heads, cfg.head_dim)
        self.impl = cfg.attention

    def __call__(self, x, positions, mask, *, cache, layer, cache_index):
        B, T = positions.shape   # x: [B*T, D] rows
        h, hd = self.shape
        q, k, v = jnp.split(self.c_attn(x), 3, axis=-1)
        q, k, v = (t.reshape(B, T, h, hd) for t in (q, k, v))
        out, cache = attention(q, k, v, mask, scale=hd ** -0.5, cache=cache, layer=layer, impl=self.impl,
                               cache_index=cache_index)
        return self.c_proj(out.reshape(B * T, h * hd)), cache


class GPT2MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.c_fc = Linear(cfg.hidden_size, cfg.intermediate_size, use_bias=True, cfg=cfg, rngs=rngs)
        self.c_proj = Linear(cfg.intermediate_size, cfg.hidden_size, use_bias=True, cfg=cfg, rngs=rngs)
        self.act, self.chunk = cfg.hidden_act, mlp_chunk(cfg)

    def __call__(self, x):
        return row_chunked(self._rows, x, self.chunk)

    def _rows(self, x):
        return self.c_proj(activation(self.act)(self.c_fc(x)))


class GPT2Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.ln_1 = LayerNorm(cfg.hidden_size, cfg=cfg)
        self.attn = GPT2Attention(cfg, rngs)
        self.ln_2 = LayerNorm(cfg.hidden_size, cfg=cfg)
        self.mlp = GPT2MLP(cfg, rngs)

    def __call__(self, x, positions, mask, *, cache, layer, cache_index):
        a, cache = self.attn(self.ln_1(x), positions, mask, cache=cache, layer=layer, cache_index=cache_index)
        x = x + a
        return x + self.mlp(self.ln_2(x)), cache


class GPT2LMHeadModel(CausalLM):
    """GPT-2 causal LM (see ``CausalLM`` for the public API). Positions index the learned table ``wpe``;
    they must stay below ``config.max_position_embeddings`` (out-of-range positions are clamped)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        if config.family != "gpt2":
            raise ValueError(f"GPT2LMHeadModel needs a gpt2 config, got {config.family!r}")
        self.config = config
        self.wte = Embed(config.vocab_size, config.hidden_size, cfg=config, rngs=rngs)
        self.wpe = Embed(config.max_position_embeddings, config.hidden_size, cfg=config, rngs=rngs)
        self.layers = nnx.List([GPT2Block(config, rngs) for _ in range(config.num_layers)])
        self.ln_f = LayerNorm(config.hidden_size, cfg=config)
        self.lm_head = (None if config.tie_word_embeddings else
                        Linear(config.hidden_size, config.vocab_size, use_bias=False, cfg=config, rngs=rngs))

    def embed(self, input_ids, positions):
        positions = jnp.clip(positions, 0, self.config.max_position_embeddings - 1)
        return self.wte(input_ids) + self.wpe(positions)

    def final_norm(self, x):
        return self.ln_f(x)

    def head(self, h: jax.Array) -> jax.Array:
        if self.lm_head is None:
            return self.wte.attend(h)
        dt = self.config.jnp_dtype
        return dense(h.astype(dt), self.lm_head.kernel[...].astype(dt),
                     preferred_element_type=jnp.float32)
