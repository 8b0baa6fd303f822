"""Model construction: from a ``ModelConfig`` (random init or abstract) and the ``tiny_model`` test factory."""
from __future__ import annotations

from typing import Union

from flax import nnx

from .config import ModelConfig
from .gpt2 import GPT2LMHeadModel
from .layers import CausalLM
from .llama import LlamaForCausalLM

Model = Union[LlamaForCausalLM, GPT2LMHeadModel]

_TINY = {
    "llama": dict(num_heads=4, num_kv_heads=2, tie_word_embeddings=False, qkv_bias=False, rope_theta=10000.0,
                  bos_token_id=1, eos_token_id=2),
    "qwen2": dict(num_heads=4, num_kv_heads=2, tie_word_embeddings=True, qkv_bias=True, rope_theta=1000000.0),
    "mistral": dict(num_heads=4, num_kv_heads=2, tie_word_embeddings=False, qkv_bias=False, rope_theta=10000.0,
                    bos_token_id=1, eos_token_id=2),
    "gpt2": dict(num_heads=4, num_kv_heads=4, tie_word_embeddings=True, qkv_bias=True, o_bias=True, mlp_bias=True,
                 hidden_act="gelu_new", norm_eps=1e-5, max_position_embeddings=512),
}


def model_class(config: ModelConfig) -> type:
    return GPT2LMHeadModel if config.family == "gpt2" else LlamaForCausalLM


def build_model(config: ModelConfig, *, seed: int = 0) -> CausalLM:
    """Random-initialised model (kernels/embeddings ~ N(0, 0.02), norms 1, biases 0)."""
    return model_class(config)(config, rngs=nnx.Rngs(seed))


def abstract_model(config: ModelConfig) -> CausalLM:
    """Model whose params are ``jax.ShapeDtypeStruct`` (no memory, no compute), to be filled by a loader."""
    return nnx.eval_shape(lambda: build_model(config))


def tiny_config(family: str, vocab_size: int, **overrides) -> ModelConfig:
    """Small config: 2 layers, hidden 64, 4 heads (2 kv heads for llama-family), intermediate 128.

    family: "llama" | "qwen2" | "mistral" | "gpt2"; overrides: any ``ModelConfig`` field
    (``dtype`` / ``param_dtype`` included). ``head_dim`` defaults to hidden_size // num_heads."""
    if family not in _TINY:
        raise ValueError(f"unknown tiny_model family {family!r}; choose one of {sorted(_TINY)}")
    kw = dict(family="gpt2" if family == "gpt2" else "llama", model_type=family, vocab_size=int(vocab_size),
              hidden_size=64, num_layers=2, intermediate_size=128, norm_eps=1e-6, hidden_act="silu",
              max_position_embeddings=2048)
    kw.update(_TINY[family])
    kw.update(overrides)
    if "head_dim" not in overrides:
        kw["head_dim"] = kw["hidden_size"] // kw["num_heads"]
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
