"""Model construction: from a ``ModelConfig`` (random init or abstract) and the ``tiny_model`` test factory."""
from __future__ import annotations

from typing import Union

from flax import nnx

from .config import ModelConfig
from .decoder import DecoderForCausalLM
from .gpt2 import GPT2LMHeadModel
from .layers import CausalLM
from .llama import LlamaForCausalLM

Model = Union[LlamaForCausalLM, DecoderForCausalLM, GPT2LMHeadModel]
_DECODER_TYPES = ("qwen3", "phi3", "gemma3_text")

_TINY = {
    "llama": dict(num_heads=4, num_kv_heads=2, tie_word_embeddings=False, qkv_bias=False, rope_theta=10000.0,
                  bos_token_id=1, eos_token_id=2),
    "qwen2": dict(num_heads=4, num_kv_heads=2, tie_word_embeddings=True, qkv_bias=True, rope_theta=1000000.0),
    "mistral": dict(num_heads=4, num_kv_heads=2, tie_word_embeddings=False, qkv_bias=False, rope_theta=10000.0,
                    bos_token_id=1, eos_token_id=2),
    "gpt2": dict(num_heads=4, num_kv_heads=4, tie_word_embeddings=True, qkv_bias=True, o_bias=True, mlp_bias=True,
                 hidden_act="gelu_new", norm_eps=1e-5, max_position_embeddings=512),
    # head_dim 24 != hidden / heads
    "qwen3": dict(num_heads=4, num_kv_heads=2, head_dim=24, tie_word_embeddings=True, qk_norm=True,
                  rope_theta=1000000.0),
    # fused projections, 3/4 of each head rotated, an untied head
    "phi3": dict(num_heads=4, num_kv_heads=2, tie_word_embeddings=False, fused_projections=True,
                 partial_rotary_factor=0.75, norm_eps=1e-5, bos_token_id=1, eos_token_id=2),
    # sliding (window 4, local RoPE base) then global layer, (1 + w) norms, q/k norm, head_dim 32
    "gemma3_text": dict(num_heads=4, num_kv_heads=1, head_dim=32, tie_word_embeddings=True, qk_norm=True,
                        norm_plus_one=True, sandwich_norms=True, scale_embeddings=True, query_pre_attn_scalar=32,
                        hidden_act="gelu_pytorch_tanh", sliding_window=4,
                        layer_types=("sliding_attention", "full_attention"), rope_theta=1000000.0,
                        rope_local_theta=10000.0, bos_token_id=2, eos_token_id=1, pad_token_id=0),
}


def model_class(config: ModelConfig) -> type:
    if config.family == "gpt2":
        return GPT2LMHeadModel
    c = config
    plain = (c.rope_type in ("default", "linear", "llama3") and c.partial_rotary_factor == 1.0
             and c.rope_local_theta is None and c.query_pre_attn_scalar is None and c.final_logit_softcapping is None
             and not (c.qk_norm or c.norm_plus_one or c.sandwich_norms or c.scale_embeddings or c.fused_projections))
    return LlamaForCausalLM if plain and c.model_type not in _DECODER_TYPES else DecoderForCausalLM


def build_model(config: ModelConfig, *, seed: int = 0) -> CausalLM:
    """Random-initialised model (kernels/embeddings ~ N(0, 0.02), norms 1, biases 0)."""
    return model_class(config)(config, rngs=nnx.Rngs(seed))


def abstract_model(config: ModelConfig) -> CausalLM:
    """Model whose params are ``jax.ShapeDtypeStruct`` (no memory, no compute), to be filled by a loader."""
    return nnx.eval_shape(lambda: build_model(config))


def tiny_config(family: str, vocab_size: int, **overrides) -> ModelConfig:
    """Small config: 2 layers, hidden 64, 4 heads (2 kv heads for llama-family), intermediate 128.

    family: "llama" | "qwen2" | "mistral" | "qwen3" | "phi3" | "gemma3_text" | "gpt2"; overrides: any ``ModelConfig`` field
    (``dtype`` / ``param_dtype`` included). ``head_dim`` defaults to hidden_size // num_heads."""
    if family not in _TINY:
        raise ValueError(f"unknown tiny_model family {family!r}; choose one of {sorted(_TINY)}")
    kw = dict(family="gpt2" if family == "gpt2" else "llama", model_type=family, vocab_size=int(vocab_size),
              hidden_size=64, num_layers=2, intermediate_size=128, norm_eps=1e-6, hidden_act="silu",
              max_position_embeddings=2048)
    kw.update(_TINY[family])
    kw.update(overrides)
    if "head_dim" not in overrides and "head_dim" not in _TINY[family]:
        kw["head_dim"] = kw["hidden_size"] // kw["num_heads"]
    if family == "gemma3_text" and "layer_types" not in overrides:   # Gemma's local/global alternation
        kw["layer_types"] = tuple("full_attention" if i % 2 else "sliding_attention" for i in range(kw["num_layers"]))
    if family == "gpt2" and "num_kv_heads" not in overrides:
        kw["num_kv_heads"] = kw["num_heads"]
    if family == "qwen2" and "o_bias" not in overrides:
        kw["o_bias"] = False
    if family == "llama" and "o_bias" not in overrides:
        kw["o_bias"] = kw["qkv_bias"]
    return ModelConfig(**kw)


def tiny_model(family: str, vocab_size: int, *, seed: int = 0, **overrides) -> CausalLM:
    """Small random-init model for tests and demos (see ``tiny_config`` for defaults and overrides)."""
    return build_model(tiny_config(family, vocab_size, **overrides), seed=seed)
