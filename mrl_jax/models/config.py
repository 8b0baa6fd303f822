"""Model configuration shared by every architecture family, and conversion from/to HF ``config.json``.

``ModelConfig`` is a frozen, hashable dataclass (it lives in the static part of ``nnx.split``'s graphdef).
Dtypes are stored as canonical strings ("float32", "bfloat16", ...); use ``.jnp_dtype`` /
``.jnp_param_dtype`` for the JAX dtype objects.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Tuple, Union

import jax.numpy as jnp

from .attention import IMPLS as ATTENTION_IMPLS
from .rope import SUPPORTED_ROPE_TYPES, rope_inv_freq

__all__ = ["SUPPORTED_MODEL_TYPES", "SUPPORTED_ROPE_TYPES", "SUPPORTED_ACTIVATIONS", "LAYER_TYPES", "CheckpointError",
           "ModelConfig", "canonical_dtype", "rope_inv_freq"]

# HF model_type -> our architecture family.
SUPPORTED_MODEL_TYPES = {"llama": "llama", "qwen2": "llama", "mistral": "llama", "qwen3": "llama", "phi3": "llama",
                         "gemma3_text": "llama", "gpt2": "gpt2"}
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
}
LAYER_TYPES = ("full_attention", "sliding_attention")
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

    family: "llama" (llama / qwen2 / mistral / qwen3 / phi3 / gemma3_text) or "gpt2".
    model_type: the HF ``model_type`` string, kept for ``to_hf``.
    vocab_size, hidden_size (n_embd), num_layers (num_hidden_layers / n_layer),
    num_heads (num_attention_heads / n_head), num_kv_heads (num_key_value_heads; == num_heads for MHA),
    head_dim (explicit in config or hidden_size // num_heads), intermediate_size (n_inner or 4*n_embd).
    rope_theta: RoPE base; rope_scaling: None or sorted tuple of (key, value) items of the HF rope
      parameters (rope_type "linear" | "llama3" | "yarn" | "longrope"). Unused by gpt2.
    partial_rotary_factor: RoPE rotates the first int(head_dim * factor) features (phi3).
    rope_local_theta: RoPE base of the sliding-window layers (gemma3 rope_local_base_freq; None = rope_theta).
    norm_eps: RMSNorm / LayerNorm epsilon.  hidden_act: "silu" | "gelu_new" | "gelu" ...
    qkv_bias: q/k/v projections have a bias (qwen2: always; llama: attention_bias; gpt2: always).
    o_bias: output projection has a bias (llama attention_bias; gpt2 always).  mlp_bias: MLP biases.
    tie_word_embeddings: LM head shares the input embedding.
    max_position_embeddings (n_positions): size of GPT-2's learned position table; informative for RoPE.
    sliding_window: window size (mistral / qwen2 with use_sliding_window) or None;
      layer_types: per-layer "full_attention" | "sliding_attention" (None = all full).
    qk_norm: per-head RMSNorm of queries and keys before RoPE (qwen3, gemma3: q_norm / k_norm).
    norm_plus_one: RMSNorm multiplies by (1 + weight) in float32 (gemma).
    sandwich_norms: also normalise the attention and MLP outputs (gemma's post_attention /
      post_feedforward norms; the MLP input norm is then pre_feedforward_layernorm).
    scale_embeddings: embeddings times sqrt(hidden_size) in the compute dtype (gemma).
    query_pre_attn_scalar: attention scale is its -1/2 power (gemma; None = head_dim ** -0.5).
    final_logit_softcapping: logits = cap * tanh(logits / cap) (gemma; None = off).
    fused_projections: one qkv_proj and one gate_up_proj linear (phi3).
    bos/eos/pad_token_id: from config.json (eos may be a tuple, as in Llama 3 instruct).
    param_dtype: storage dtype of the parameters; dtype: compute dtype (activations, matmuls, KV cache).
      Softmax, norms' statistics and logits are always float32.
    remat: per-decoder-layer rematerialisation of the differentiated forward (``layers.REMAT_POLICIES``);
    attention: "auto" | "dense" | "blockwise" | "splash" | "cudnn" (``attention.attention``'s ``impl``). Neither
      is in config.json.
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
    partial_rotary_factor: float = 1.0
    rope_local_theta: Optional[float] = None
    qk_norm: bool = False
    norm_plus_one: bool = False
    sandwich_norms: bool = False
    scale_embeddings: bool = False
    query_pre_attn_scalar: Optional[float] = None
    final_logit_softcapping: Optional[float] = None
    fused_projections: bool = False
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
            set_("rope_scaling", tuple(sorted((k, _freeze(v)) for k, v in self.rope_scaling.items())) or None)
        if self.layer_types is not None:
            set_("layer_types", tuple(self.layer_types))
        set_("eos_token_id", _tuple_or_int(self.eos_token_id))
        if self.remat not in REMAT_NAMES:
            raise ValueError(f"remat must be one of {REMAT_NAMES}, got {self.remat!r}")
        if self.attention not in ATTENTION_IMPLS:
            raise ValueError(f"attention must be one of {'|'.join(ATTENTION_IMPLS)}, got {self.attention!r}")
        if self.family not in ("llama", "gpt2"):
            raise ValueError(f"family must be 'llama' or 'gpt2', got {self.family!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"hidden_act {self.hidden_act!r} not supported; use one of {SUPPORTED_ACTIVATIONS}")
        if self.layer_types is not None and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        bad = sorted(set(self.layer_types or ()) - set(LAYER_TYPES))
        if bad:
            raise ValueError(f"layer_types entry {bad[0]!r} is not supported; use {list(LAYER_TYPES)}")
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_scaling type {self.rope_type!r} is not supported; use one of {SUPPORTED_ROPE_TYPES}")
        if self.partial_rotary_factor != 1.0 and self.model_type != "phi3":
            raise ValueError(f"partial_rotary_factor {self.partial_rotary_factor}: transformers rotates the whole head "
                             f"for model_type {self.model_type!r}; only phi3 supports a partial rotary")
        if not 0.0 < self.partial_rotary_factor <= 1.0 or int(self.head_dim * self.partial_rotary_factor) % 2:
            raise ValueError(f"partial_rotary_factor {self.partial_rotary_factor} must be in (0, 1] and give an even "
                             f"rotary dimension of head_dim {self.head_dim}")

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
            per += 2 * self.head_dim * self.qk_norm + 2 * d * self.sandwich_norms
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
                f"Mistral -> 'mistral', Qwen3 -> 'qwen3', Gemma 3 text -> 'gemma3_text', Phi-3 / Phi-4-mini -> 'phi3', "
                f"GPT-2 -> 'gpt2')")
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
        hf = {**_HF_DEFAULTS.get(mt, {}), **hf}
        heads, hidden, n = int(hf["num_attention_heads"]), int(hf["hidden_size"]), int(hf["num_hidden_layers"])
        theta, rope, partial, local_theta = _hf_rope(hf, mt)
        window, layer_types = _hf_windows(hf, mt, n)
        bias = bool(hf.get("attention_bias", False))
        gemma = mt == "gemma3_text"
        if gemma and hf.get("attn_logit_softcapping") is not None:
            raise ValueError("attn_logit_softcapping (Gemma 2's attention soft-capping) is not supported; set it to null")
        if gemma and hf.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention=true is not supported (causal LMs only); set it to false")
        return cls(
            family="llama", model_type=mt, vocab_size=int(hf["vocab_size"]), hidden_size=hidden,
            num_layers=n, num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hidden // heads),
            intermediate_size=int(hf["intermediate_size"]), rope_theta=theta,
            rope_scaling=tuple(sorted(rope.items())) or None, partial_rotary_factor=partial,
            rope_local_theta=local_theta,
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            hidden_act=hf.get("hidden_activation" if gemma else "hidden_act") or "silu",
            qkv_bias=True if mt == "qwen2" else bias, o_bias=False if mt == "qwen2" else bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            sliding_window=None if window is None else int(window), layer_types=layer_types,
            qk_norm=mt in ("qwen3", "gemma3_text"), norm_plus_one=gemma, sandwich_norms=gemma,
            scale_embeddings=gemma, query_pre_attn_scalar=hf.get("query_pre_attn_scalar") if gemma else None,
            final_logit_softcapping=hf.get("final_logit_softcapping") if gemma else None,
            fused_projections=mt == "phi3",
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
        rope = {"rope_theta": self.rope_theta, "rope_type": "default",
                **{k: list(v) if isinstance(v, tuple) else v for k, v in self.rope_params.items()}}
        out = {**common, "hidden_size": self.hidden_size, "num_hidden_layers": self.num_layers,
               "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
               "head_dim": self.head_dim, "intermediate_size": self.intermediate_size,
               "hidden_act": self.hidden_act, "rms_norm_eps": self.norm_eps,
               "max_position_embeddings": self.max_position_embeddings,
               "rope_theta": self.rope_theta, "rope_parameters": rope, "attention_dropout": 0.0}
        if self.rope_scaling:
            out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
        if self.qkv_bias != self.o_bias and self.model_type != "qwen2":
            raise CheckpointError(f"{self.model_type} config.json cannot express qkv_bias != o_bias "
                                  "(HF attention_bias covers both); use model_type 'qwen2' for qkv-only bias")
        if self.model_type in ("qwen2", "qwen3"):
            out.update(use_sliding_window=self.sliding_window is not None, sliding_window=self.sliding_window)
            if self.layer_types is not None:
                out["layer_types"] = list(self.layer_types)
                out["max_window_layers"] = next(
                    (i for i, t in enumerate(self.layer_types) if t == "sliding_attention"), self.num_layers)
        elif self.model_type == "mistral" or self.sliding_window is not None:
            out["sliding_window"] = self.sliding_window
        if self.model_type in ("llama", "qwen3", "gemma3_text"):
            out["attention_bias"] = self.qkv_bias
        if self.model_type == "llama":
            out["mlp_bias"] = self.mlp_bias
        if self.model_type == "phi3":
            rope["partial_rotary_factor"] = self.partial_rotary_factor
            out.update(partial_rotary_factor=self.partial_rotary_factor, sliding_window=self.sliding_window,
                       original_max_position_embeddings=int(rope.get("original_max_position_embeddings",
                                                                     self.max_position_embeddings)))
        if self.model_type == "gemma3_text":
            out.update(self._gemma_hf(rope))
        return out

    def _gemma_hf(self, rope: dict) -> dict:
        local = self.rope_theta if self.rope_local_theta is None else self.rope_local_theta
        return {"hidden_activation": self.hidden_act, "query_pre_attn_scalar": self.query_pre_attn_scalar,
                "layer_types": list(self.layer_types or ["full_attention"] * self.num_layers),
                "sliding_window": self.sliding_window, "final_logit_softcapping": self.final_logit_softcapping,
                "attn_logit_softcapping": None, "use_bidirectional_attention": False, "rope_local_base_freq": local,
                "rope_parameters": {"full_attention": rope,
                                    "sliding_attention": {"rope_type": "default", "rope_theta": local}}}


# transformers' config-class defaults of the fields a config.json may leave out
_HF_DEFAULTS = {
    "phi3": {"rms_norm_eps": 1e-5, "max_position_embeddings": 4096},
    "gemma3_text": {"head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256,
                    "sliding_window": 4096, "tie_word_embeddings": True, "max_position_embeddings": 131072,
                    "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0},
}


def _freeze(v):
    return tuple(_freeze(x) for x in v) if isinstance(v, (list, tuple)) else v


def _hf_rope(hf: dict, mt: str):
    """(rope_theta, rope parameters without theta, partial_rotary_factor, local theta) of a config.json;
    reads both the v4 (rope_theta / rope_scaling) and the v5 (rope_parameters, per layer type) layouts."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    local = None
    if mt == "gemma3_text":
        if set(params) & set(LAYER_TYPES):
            sliding = dict(params.get("sliding_attention") or {})
            if sliding.get("rope_type", sliding.get("type", "default")) != "default":
                raise ValueError("rope_parameters.sliding_attention: only the default rope type is supported "
                                 "for sliding-window layers")
            local = sliding.get("rope_theta")
            params = dict(params.get("full_attention") or {})
        local = float(local or hf["rope_local_base_freq"])
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    partial = float(params.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    partial = partial if mt == "phi3" else 1.0   # the other families' transformers code rotates the whole head
    kind = params.pop("rope_type", params.pop("type", "default"))
    params.pop("type", None)
    if mt == "phi3" and kind in ("su", "yarn"):
        kind = "longrope"   # transformers' Phi3Config renames these
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: {list(SUPPORTED_ROPE_TYPES)}); "
                         "remove rope scaling from config.json only if you will not use long contexts")
    if kind == "default":
        return theta, {}, partial, local
    if kind == "longrope" and "original_max_position_embeddings" in hf:
        params["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
    if kind in ("yarn", "longrope"):
        params.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings", 2048))
    return theta, {"rope_type": kind, **{k: _freeze(v) for k, v in params.items()}}, partial, local


def _hf_windows(hf: dict, mt: str, n: int):
    """(sliding_window or None, layer_types or None) of a llama-family config.json."""
    bad = sorted(set(hf.get("layer_types") or ()) - set(LAYER_TYPES))
    if bad:
        raise ValueError(f"layer_types entry {bad[0]!r} is not supported; use {list(LAYER_TYPES)}")
    window, layer_types = hf.get("sliding_window"), None
    if mt in ("qwen2", "qwen3"):
        if not hf.get("use_sliding_window", False):
            window = None
        elif window is not None:
            mwl = int(hf.get("max_window_layers", n))
            layer_types = tuple(hf.get("layer_types") or
                                ["sliding_attention" if i >= mwl else "full_attention" for i in range(n)])
    elif mt == "gemma3_text":
        pattern = int(hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6)
        layer_types = tuple(hf.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                                      for i in range(n)])
    elif hf.get("layer_types") and window is not None:
        layer_types = tuple(hf["layer_types"])
    return window, layer_types
