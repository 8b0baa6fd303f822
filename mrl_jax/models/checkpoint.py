"""Load / save local Hugging Face checkpoints (``config.json`` + ``*.safetensors``), no network ever.

HF -> ours: nn.Linear ``weight`` [out, in] -> ``kernel`` [in, out] (transposed); GPT-2 Conv1D ``weight`` is
already [in, out]; norm ``weight`` -> ``scale``; embedding ``weight`` -> ``embedding``.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from .config import CheckpointError, ModelConfig
from .factory import abstract_model
from .layers import CausalLM

PathLike = Union[str, os.PathLike]
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# non-parameter buffers some checkpoints carry (GPT-2 causal-mask buffers, old Llama rotary caches)
_IGNORED = re.compile(r"(^|\.)(attn\.bias|attn\.masked_bias|rotary_emb\.inv_freq)$")

# (hf suffix, our path suffix, transpose)
_LLAMA_LAYER = [(f"self_attn.{p}.{w}", ("self_attn", p, o), w == "weight")
                for p in ("q_proj", "k_proj", "v_proj", "o_proj") for w, o in (("weight", "kernel"), ("bias", "bias"))]
_LLAMA_LAYER += [(f"mlp.{p}.{w}", ("mlp", p, o), w == "weight")
                 for p in ("gate_proj", "up_proj", "down_proj") for w, o in (("weight", "kernel"), ("bias", "bias"))]
_LLAMA_LAYER += [(f"{n}.weight", (n, "scale"), False) for n in ("input_layernorm", "post_attention_layernorm")]
_LEAF = {"kernel": "weight", "scale": "weight", "bias": "bias"}
_GPT2_LAYER = [(f"{m}.{w}", tuple(m.split(".")) + (o,), False)
               for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
               for w, o in (("weight", "kernel"), ("bias", "bias"))]
_GPT2_LAYER += [(f"{n}.{w}", (n, o), False) for n in ("ln_1", "ln_2") for w, o in (("weight", "scale"), ("bias", "bias"))]


def _llama_layer_name(p: Tuple, family: str) -> Tuple[str, bool]:
    """(HF suffix, transpose) of a llama-family layer param outside ``_LLAMA_LAYER`` (q/k norms, fused
    qkv_proj / gate_up_proj, gemma's feed-forward norms): the module path with kernel/scale/bias renamed."""
    if family == "gpt2" or p[-1] not in _LEAF:
        raise KeyError(f"no HF name for parameter {'.'.join(map(str, p))}")
    return ".".join(p[:-1]) + "." + _LEAF[p[-1]], p[-1] == "kernel"


def _name_map(paths: List[Tuple], family: str, prefix: str) -> Dict[Tuple, Tuple[str, bool]]:
    """our param path -> (HF tensor name, transpose) for every param of the model."""
    if family == "gpt2":
        top = {("wte", "embedding"): ("wte.weight", False), ("wpe", "embedding"): ("wpe.weight", False),
               ("ln_f", "scale"): ("ln_f.weight", False), ("ln_f", "bias"): ("ln_f.bias", False)}
        layer_tab, hf_layers = _GPT2_LAYER, "h"
    else:
        top = {("embed_tokens", "embedding"): ("embed_tokens.weight", False), ("norm", "scale"): ("norm.weight", False)}
        layer_tab, hf_layers = _LLAMA_LAYER, "layers"
    inv = {ours: (hf, t) for hf, ours, t in layer_tab}
    out = {}
    for p in paths:
        if p == ("lm_head", "kernel"):
            out[p] = ("lm_head.weight", True)
        elif p[0] == "layers":
            hf, t = inv.get(tuple(p[2:])) or _llama_layer_name(p[2:], family)
            out[p] = (f"{prefix}{hf_layers}.{p[1]}.{hf}", t)
        else:
            hf, t = top[tuple(p)]
            out[p] = (prefix + hf, t)
    return out


def _fmt(names, n=8) -> str:
    names = sorted(names)
    return ", ".join(names[:n]) + (f", ... ({len(names)} in all)" if len(names) > n else "")


def read_config(path: PathLike) -> dict:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {str(path)!r} does not exist (or is not a directory); "
                              "pass a local folder holding config.json and model.safetensors — nothing is downloaded")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{cfg_file}: missing; a checkpoint folder needs config.json (save one with "
                              "transformers' save_pretrained or mrl_jax.models.save_pretrained)")
    try:
        return json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file}: not valid JSON ({e})") from None


def _weight_files(path: Path) -> Dict[str, Path]:
    """HF tensor name -> file holding it (single file or sharded index)."""
    index, single = path / INDEX_FILE, path / SINGLE_FILE
    if index.is_file():
        try:
            wm = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index (needs a 'weight_map'): {e}") from None
        missing = sorted({f for f in wm.values() if not (path / f).is_file()})
        if missing:
            raise CheckpointError(f"{index} lists shard(s) that are not in {path}: {_fmt(missing)}; "
                                  "copy every shard next to the index")
        return {k: path / f for k, f in wm.items()}
    if single.is_file():
        with safe_open(str(single), framework="np") as f:
            return {k: single for k in f.keys()}
    others = sorted(p.name for p in path.iterdir() if p.suffix in (".safetensors", ".bin", ".pt", ".pth"))
    hint = (f" (found {others}: convert PyTorch .bin weights to safetensors, e.g. load with transformers and "
            "save_pretrained(..., safe_serialization=True))" if others else "")
    raise CheckpointError(f"{path}: no weights found; expected {SINGLE_FILE} or {INDEX_FILE}{hint}")


def from_pretrained(path: PathLike, *, dtype=None, param_dtype=None, remat: str = "none",
                    attention: str = "auto") -> CausalLM:
    """Load a local HF checkpoint folder into an NNX model.

    param_dtype: storage dtype of the params (default float32, whatever the file's dtype); dtype: compute
    dtype (default = param_dtype); remat, attention: ``ModelConfig`` fields (not in config.json).
    Raises ``CheckpointError`` naming the file/tensor and the fix."""
    path = Path(path)
    hf = read_config(path)
    cfg = ModelConfig.from_hf(hf, dtype=dtype, param_dtype=param_dtype, source=str(path / "config.json"))
    cfg = cfg.replace(remat=remat, attention=attention)
    files = _weight_files(path)
    model = abstract_model(cfg)
    graphdef, state = nnx.split(model)
    flat = {tuple(p): v for p, v in nnx.to_flat_state(state)}
    prefixes = ["transformer.", ""] if cfg.family == "gpt2" else ["model.", ""]
    embed = "wte.weight" if cfg.family == "gpt2" else "embed_tokens.weight"
    prefix = next((p for p in prefixes if p + embed in files), prefixes[0])
    names = _name_map(list(flat), cfg.family, prefix)

    expected = {hf for hf, _ in names.values()}
    missing = sorted(expected - set(files))
    if missing:
        hint = ""
        if "lm_head.weight" in missing:
            hint = (" — lm_head.weight is absent: if this model shares the input embedding as its output head, set "
                    "\"tie_word_embeddings\": true in config.json")
        raise CheckpointError(f"{path}: tensors missing from the weights ({_fmt({str(f.name) for f in files.values()})})"
                              f" for model_type {cfg.model_type!r}: {_fmt(missing)}{hint}. Check config.json "
                              "(num_hidden_layers, attention_bias, mlp_bias, tie_word_embeddings) against the weights")
    tied_extra = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    unexpected = sorted(n for n in set(files) - expected - tied_extra if not _IGNORED.search(n))
    if unexpected:
        raise CheckpointError(f"{path}: unexpected tensors in the weights for model_type {cfg.model_type!r}: "
                              f"{_fmt(unexpected)}; config.json does not describe these weights (wrong model_type, "
                              "num_hidden_layers, attention_bias/mlp_bias, or an unsupported architecture variant)")

    handles = {}
    pure: Dict[Tuple, jax.Array] = {}
    pd = cfg.jnp_param_dtype
    try:
        for p, var in flat.items():
            hf_name, transpose = names[p]
            f = files[hf_name]
            if f not in handles:
                handles[f] = safe_open(str(f), framework="np")
            want = tuple(var.shape)
            want_hf = want[::-1] if transpose else want
            found = tuple(handles[f].get_slice(hf_name).get_shape())
            if found != want_hf:
                raise CheckpointError(f"{f}: tensor {hf_name!r} has shape {list(found)} but config.json implies "
                                      f"{list(want_hf)}; config.json and the weights disagree (check hidden_size, "
                                      "heads, head_dim, intermediate_size, vocab_size)")
            arr = handles[f].get_tensor(hf_name)
            if transpose:
                arr = arr.T
            pure[p] = jnp.asarray(np.ascontiguousarray(arr).astype(pd))
    finally:
        handles.clear()
    nested: dict = {}
    for p, a in pure.items():
        d = nested
        for key in p[:-1]:
            d = d.setdefault(key, {})
        d[p[-1]] = a
    nnx.replace_by_pure_dict(state, nested)
    return nnx.merge(graphdef, state)


def hf_state_dict(model: CausalLM) -> Dict[str, np.ndarray]:
    """HF-named numpy tensors (tied head omitted, as transformers does)."""
    cfg = model.config
    flat = {tuple(p): v for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    names = _name_map(list(flat), cfg.family, "transformer." if cfg.family == "gpt2" else "model.")
    out = {}
    for p, var in flat.items():
        hf_name, transpose = names[p]
        arr = np.asarray(jax.device_get(var[...]))
        out[hf_name] = np.ascontiguousarray(arr.T if transpose else arr)
    return out


def save_pretrained(model: CausalLM, path: PathLike, *, max_shard_bytes: Optional[int] = None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (sharded with an index when ``max_shard_bytes`` is set and
    exceeded) that ``transformers`` loads with the same logits. Weights are saved in the param dtype."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = hf_state_dict(model)
    (path / "config.json").write_text(json.dumps(model.config.to_hf(), indent=2))
    meta = {"format": "pt"}
    total = sum(a.nbytes for a in tensors.values())
    if max_shard_bytes is None or total <= max_shard_bytes:
        save_file(tensors, str(path / SINGLE_FILE), metadata=meta)
        return path
    shards: List[Dict[str, np.ndarray]] = [{}]
    size = 0
    for name, a in tensors.items():
        if shards[-1] and size + a.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = a
        size += a.nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / fname), metadata=meta)
        weight_map.update({n: fname for n in shard})
    (path / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return path


def check_tokenizer_fits(model_config, tokenizer_vocab_size: int, path: PathLike = "<tokenizer>") -> None:
    """Raise ``CheckpointError`` if a tokenizer with ``tokenizer_vocab_size`` ids (named by ``path``) can emit
    ids outside the model's embedding. ``model_config``: a ``ModelConfig`` or a model."""
    cfg = getattr(model_config, "config", model_config)
    if int(tokenizer_vocab_size) > cfg.vocab_size:
        raise CheckpointError(
            f"{path}: tokenizer has {int(tokenizer_vocab_size)} ids but the model's embedding has only "
            f"{cfg.vocab_size} rows (model_type {cfg.model_type!r}); ids >= {cfg.vocab_size} would be out of range. "
            "Use the tokenizer saved with this model, or build the model with vocab_size >= the tokenizer's size")
