"""Model configuration shared by every architecture family, and conversion from/to HF ``config.json``.

``ModelConfig`` is a frozen, hashable dataclass (it lives in the static part of ``nnx.split``'s graphdef).
Dtypes are stored as canonical strings ("float32", "bfloat16", ...); use ``.jnp_dtype`` /
``.jnp_param_dtype`` for the JAX dtype objects.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Tuple, Union

import jax.numpy as jnp
import numpy as np

# HF model_type -> our architecture family.
SUPPORTED_MODEL_TYPES = {"llama": "llama", "qwen2": "llama", "mistral": "llama", "gpt2": "gpt2"}
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
    "gpt2": "GPT2LMHeadModel",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
SUPPORTED_ACTIVATIONS = ("silu", "gelu") + _TANH_GELUS
REMAT_NAMES = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable")


class CheckpointError(ValueError):
    """A checkpoint / config cannot be loaded or saved; the message names the file and the fix."""


def canonical_dtype(dtype: Any) -> str:
    """'float32' | 'bfloat16' | 'float16' from a string, numpy/jax dtype or jnp scalar type."""
    if dtype is None:
        return "float32"
    name = jnp.dtype(dtype).name
    if name not in ("float32", "bfloat16", "float16", "float64"):
        raise ValueError(f"unsupported floating dtype {dtype!r} (use float32 or bfloat16)")
    return name


def _tuple_or_int(x: Any) -> Union[int, Tuple[int, ...], None]:
    if isinstance(x, (list, tuple)):
        return tuple(int(i) for i in x)
    return None if x is None else int(x)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters (HF names in parentheses).

    family: "llama" (llama / qwen2 / mistral) or "gpt2".
    model_type: the HF ``model_type`` string, kept for ``to_hf``.
    vocab_size, hidden_size (n_embd), num_layers (num_hidden_layers / n_layer),
    num_heads (num_attention_heads / n_head), num_kv_heads (num_key_value_heads; == num_heads for MHA),
    head_dim (explicit in config or hidden_size // num_heads), intermediate_size (n_inner or 4*n_embd).
    rope_theta: RoPE base; rope_scaling: None or sorted tuple of (key, value) items of the HF rope
      parameters (rope_type "linear" | "llama3"). Unused by gpt2.
    norm_eps: RMSNorm / LayerNorm epsilon.  hidden_act: "silu" | "gelu_new" | "gelu" ...
    qkv_bias: q/k/v projections have a bias (qwen2: always; llama: attention_bias; gpt2: always).
    o_bias: output projection has a bias (llama attention_bias; gpt2 always).  mlp_bias: MLP biases.
    tie_word_embeddings: LM head shares the input embedding.
    max_position_embeddings (n_positions): size of GPT-2's learned position table; informative for RoPE.
    sliding_window: window size (mistral / qwen2 with use_sliding_window) or None;
      layer_types: per-layer "full_attention" | "sliding_attention" (None = all full).
    bos/eos/pad_token_id: from config.json (eos may be a tuple, as in Llama 3 instruct).
    param_dtype: storage dtype of the parameters; dtype: compute dtype (activations, matmuls, KV cache).
      Softmax, norms' statistics and logits are always float32.
    remat: per-decoder-layer rematerialisation of the differentiated forward (``layers.REMAT_POLICIES``);
    attention: "auto" | "dense" | "blockwise" (``attention.attention``'s ``impl``). Neither is in config.json.
    """

    family: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10000.0
    rope_scaling: Optional[Tuple[Tuple[str, Any], ...]] = None
    norm_eps: float = 1e-6
    hidden_act: str = "silu"
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    sliding_window: Optional[int] = None
    layer_types: Optional[Tuple[str, ...]] = None
    bos_token_id: Optional[int] = None
    eos_token_id: Union[int, Tuple[int, ...], None] = None
    pad_token_id: Optional[int] = None
    param_dtype: str = "float32"
    dtype: str = "float32"
    remat: str = "none"
    attention: str = "auto"

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731  (frozen dataclass)
        set_("param_dtype", canonical_dtype(self.param_dtype))
        set_("dtype", canonical_dtype(self.dtype))
        if isinstance(self.rope_scaling, dict):
            set_("rope_scaling", tuple(sorted(self.rope_scaling.items())) or None)
        if self.layer_types is not None:
            set_("layer_types", tuple(self.layer_types))
        set_("eos_token_id", _tuple_or_int(self.eos_token_id))
        if self.remat not in REMAT_NAMES:
            raise ValueError(f"remat must be one of {REMAT_NAMES}, got {self.remat!r}")
        if self.attention not in ("auto", "dense", "blockwise"):
            raise ValueError(f"attention must be auto|dense|blockwise, got {self.attention!r}")
        if self.family not in ("llama", "gpt2"):
            raise ValueError(f"family must be 'llama' or 'gpt2', got {self.family!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"hidden_act {self.hidden_act!r} not supported; use one of {SUPPORTED_ACTIVATIONS}")
        if self.layer_types is not None and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_type {self.rope_type!r} not supported; use one of {SUPPORTED_ROPE_TYPES}")

    # ---------------------------------------------------------------- derived
    @property
    def jnp_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def jnp_param_dtype(self):
        return jnp.dtype(self.param_dtype)

    @property
    def rope_params(self) -> dict:
        return dict(self.rope_scaling or ())

    @property
    def rope_type(self) -> str:
        p = self.rope_params
        return p.get("rope_type", p.get("type", "default"))

    def layer_window(self, layer: int) -> Optional[int]:
        """Sliding-window size of ``layer`` (None = full causal attention)."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return int(self.sliding_window)
        return None

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    def num_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if self.family == "gpt2":
            per = d * 3 * d + 3 * d + d * d + d + 2 * d * f + f + d + 4 * d
            extra = self.max_position_embeddings * d + 2 * d
        else:
            per = d * (q + 2 * kv) + q * d + 3 * d * f + 2 * d
            per += (q + 2 * kv) * self.qkv_bias + d * self.o_bias + (2 * f + d) * self.mlp_bias
            extra = d
        head = 0 if self.tie_word_embeddings else v * d
        return v * d + self.num_layers * per + extra + head

    # ---------------------------------------------------------------- HF conversion
    @classmethod
    def from_hf(cls, hf: dict, *, dtype=None, param_dtype=None, source: str = "config.json") -> "ModelConfig":
        """Build from a parsed HF ``config.json`` dict. Raises ``CheckpointError`` naming ``source``."""
        mt = hf.get("model_type")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise CheckpointError(
                f"{source}: model_type {mt!r} is not supported; supported model types: "
                f"{sorted(SUPPORTED_MODEL_TYPES)} (Llama/SmolLM -> 'llama', Qwen2/2.5 -> 'qwen2', "
                f"Mistral -> 'mistral', GPT-2 -> 'gpt2')")
        if param_dtype is None:
            param_dtype = "float32"
        if dtype is None:
            dtype = param_dtype
        try:
            if SUPPORTED_MODEL_TYPES[mt] == "gpt2":
                return cls._from_hf_gpt2(hf, dtype, param_dtype)
            return cls._from_hf_llama(hf, dtype, param_dtype)
        except KeyError as e:
            raise CheckpointError(f"{source}: required field {e.args[0]!r} missing for model_type {mt!r}") from None
        except ValueError as e:
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"{source}: {e}") from None

    @classmethod
    def _from_hf_llama(cls, hf, dtype, param_dtype):
        mt = hf["model_type"]
        heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
        if "type" in rope and "rope_type" not in rope:
            rope["rope_type"] = rope.pop("type")
        rope.pop("type", None)
        if rope.get("rope_type", "default") == "default":
            rope = {}
        if rope and rope.get("rope_type") not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope type {rope.get('rope_type')!r} is not supported (supported: {SUPPORTED_ROPE_TYPES});"
                             " remove rope scaling from config.json only if you will not use long contexts")
        window, layer_types = hf.get("sliding_window"), None
        n = int(hf["num_hidden_layers"])
        if mt == "qwen2":
            if not hf.get("use_sliding_window", False):
                window = None
            elif window is not None:
                mwl = int(hf.get("max_window_layers", n))
                layer_types = tuple(hf.get("layer_types") or
                                    ["sliding_attention" if i >= mwl else "full_attention" for i in range(n)])
        elif hf.get("layer_types") and window is not None:
            layer_types = tuple(hf["layer_types"])
        bias = bool(hf.get("attention_bias", False))
        return cls(
            family="llama", model_type=mt, vocab_size=int(hf["vocab_size"]), hidden_size=hidden,
            num_layers=n, num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hidden // heads),
            intermediate_size=int(hf["intermediate_size"]), rope_theta=theta,
            rope_scaling=tuple(sorted(rope.items())) or None,
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)), hidden_act=hf.get("hidden_act", "silu"),
            qkv_bias=True if mt == "qwen2" else bias, o_bias=False if mt == "qwen2" else bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            sliding_window=None if window is None else int(window), layer_types=layer_types,
            bos_token_id=hf.get("bos_token_id"), eos_token_id=hf.get("eos_token_id"),
            pad_token_id=hf.get("pad_token_id"), param_dtype=param_dtype, dtype=dtype)

    @classmethod
    def _from_hf_gpt2(cls, hf, dtype, param_dtype):
        if hf.get("scale_attn_by_inverse_layer_idx") or hf.get("scale_attn_weights") is False:
            raise ValueError("GPT-2 variants with scale_attn_by_inverse_layer_idx=true or "
                             "scale_attn_weights=false are not supported")
        d, h = int(hf["n_embd"]), int(hf["n_head"])
        return cls(
            family="gpt2", model_type="gpt2", vocab_size=int(hf["vocab_size"]), hidden_size=d,
            num_layers=int(hf["n_layer"]), num_heads=h, num_kv_heads=h, head_dim=d // h,
            intermediate_size=int(hf.get("n_inner") or 4 * d), norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
            hidden_act=hf.get("activation_function", "gelu_new"), qkv_bias=True, o_bias=True, mlp_bias=True,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
            max_position_embeddings=int(hf.get("n_positions", 1024)),
            bos_token_id=hf.get("bos_token_id"), eos_token_id=hf.get("eos_token_id"),
            pad_token_id=hf.get("pad_token_id"), param_dtype=param_dtype, dtype=dtype)

    def to_hf(self) -> dict:
        """A ``config.json`` dict that ``transformers`` (v4 and v5) loads as the same architecture."""
        eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
        common = {
            "architectures": [_ARCHITECTURES[self.model_type]], "model_type": self.model_type,
            "vocab_size": self.vocab_size, "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id, "eos_token_id": eos, "pad_token_id": self.pad_token_id,
            "torch_dtype": self.param_dtype, "dtype": self.param_dtype,
        }
        if self.family == "gpt2":
            return {**common, "n_embd": self.hidden_size, "n_layer": self.num_layers, "n_head": self.num_heads,
                    "n_inner": self.intermediate_size, "n_positions": self.max_position_embeddings,
                    "n_ctx": self.max_position_embeddings, "layer_norm_epsilon": self.norm_eps,
                    "activation_function": self.hidden_act, "scale_attn_weights": True,
                    "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
        rope = {"rope_theta": self.rope_theta, "rope_type": "default", **self.rope_params}
        out = {**common, "hidden_size": self.hidden_size, "num_hidden_layers": self.num_layers,
               "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
               "head_dim": self.head_dim, "intermediate_size": self.intermediate_size,
               "hidden_act": self.hidden_act, "rms_norm_eps": self.norm_eps,
               "max_position_embeddings": self.max_position_embeddings,
               "rope_theta": self.rope_theta, "rope_parameters": rope, "attention_dropout": 0.0}
        if self.rope_scaling:
            out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
        if self.model_type == "qwen2":
            out.update(use_sliding_window=self.sliding_window is not None, sliding_window=self.sliding_window)
            if self.layer_types is not None:
                out["layer_types"] = list(self.layer_types)
                out["max_window_layers"] = next(
                    (i for i, t in enumerate(self.layer_types) if t == "sliding_attention"), self.num_layers)
        else:
            if self.model_type == "mistral" or self.sliding_window is not None:
                out["sliding_window"] = self.sliding_window
            if self.model_type == "llama":
                if self.qkv_bias != self.o_bias:
                    raise CheckpointError("llama config.json cannot express qkv_bias != o_bias "
                                          "(HF attention_bias covers both); use model_type 'qwen2' for qkv-only bias")
                out.update(attention_bias=self.qkv_bias, mlp_bias=self.mlp_bias)
        return out


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """float32[head_dim // 2] inverse frequencies (HF ``default`` / ``linear`` / ``llama3`` rope types)."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / d))
    inv = inv.astype(np.float32)
    p, kind = cfg.rope_params, cfg.rope_type
    if kind == "linear":
        inv = inv / np.float32(p["factor"])
    elif kind == "llama3":
        factor, lo, hi = float(p["factor"]), float(p["low_freq_factor"]), float(p["high_freq_factor"])
        old = float(p.get("original_max_position_embeddings", cfg.max_position_embeddings))
        lo_wl, hi_wl = old / lo, old / hi
        wl = 2 * math.pi / inv
        scaled = np.where(wl > lo_wl, inv / factor, inv)
        smooth = (old / wl - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wl < hi_wl) & ~(wl > lo_wl)
        inv = np.where(medium, smoothed, scaled).astype(np.float32)
    return inv
