"""LoRA adapters on our NNX models, built on Flax NNX's own ``nnx.LoRA`` / ``nnx.LoRAParam``; PEFT I/O.

    model = apply_lora(model, rank=8, alpha=16.0, targets=("q_proj", "v_proj"), seed=0)
    graphdef, adapters, frozen = nnx.split(model, nnx.LoRAParam, ...)   # train ``adapters`` only
    save_adapters(model, "out/")        # adapter_config.json + adapter_model.safetensors (PEFT names)
    plain = merge(model)                # kernel + (alpha/r) A @ B: a model ``save_pretrained`` writes

Why ``nnx.LoRA`` and not ``qwix``: our layers are NNX modules with their own ``Linear`` (kernel [in, out]) and
the model is used through several methods (``__call__``/``hidden`` in the learner, ``decode_hidden``/``head``
in the sampler). ``nnx.LoRA(base_module=...)`` wraps a module *in the tree*, so every method and every
``nnx.split``/``merge`` sees the adapters, and its ``nnx.LoRAParam`` type is exactly the filter that separates
trainable adapters from the frozen base (``nnx.split(model, nnx.LoRAParam, ...)``). qwix's LoRA provider
instead intercepts ``dot_general``/``einsum`` calls made while one chosen method runs (one method per NNX
model), creates adapters in the base param's dtype (a bf16 base would get bf16 adapters), identifies the
weight by the array handed to the op (our ``kernel[...].astype(dtype)`` hides it) and is an extra dependency
(qwix is not installed with flax). So each adapted layer here is :class:`LoRALinear`, an ``nnx.LoRA`` whose
``base_module`` is the original layer, adding the PEFT scaling ``alpha / rank`` and input dropout.

Adapters are float32 whatever the base dtype; the delta ``(alpha/r) * dropout(x) @ A @ B`` is computed in
float32 and added in the base's compute dtype, as PEFT does. ``A`` f32[in, r] (PEFT ``lora_A.weight`` is its
transpose [r, in]), ``B`` f32[r, out] (``lora_B.weight`` [out, r]); B starts at zero, so a fresh adapter leaves
the logits unchanged. The KL reference of a LoRA policy is the same model with the adapters zeroed
(:func:`adapters_off`): no second copy of the base weights.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import load_file, save_file

from .checkpoint import _name_map
from .layers import Linear

__all__ = ["ADAPTER_FILE", "LoRADropoutKey", "LoRAError", "LoRALinear", "adapters_off", "apply_lora",
           "base_model", "dropout_keys", "lora_modules", "load_adapters", "merge", "peft_state_dict", "read_adapter_config",
           "save_adapters", "set_dropout", "split_adapters", "targets_from_peft"]

ADAPTER_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"


class LoRAError(ValueError):
    """A LoRA setting does not fit the model (message names the key and the fix)."""


class LoRADropoutKey(nnx.Variable):
    """uint32[2] raw PRNG key of one adapter's input dropout (not a Param: never trained or decayed)."""


class LoRALinear(nnx.LoRA):
    """``y = base(x) + (alpha / rank) * dropout(x) @ lora_a @ lora_b``; ``base_module`` is our ``Linear``."""

    def __init__(self, base: Linear, *, rank: int, alpha: float, dropout: float = 0.0, rngs: nnx.Rngs):
        din, dout = base.kernel.shape
        super().__init__(din, rank, dout, base_module=base, param_dtype=jnp.float32, rngs=rngs)
        self.scaling = float(alpha) / int(rank)
        self.rank, self.alpha, self.dropout_rate = int(rank), float(alpha), float(dropout)
        self.dropout_on = False  # static: set by ``set_dropout`` on the training graph only
        self.dropout_key = LoRADropoutKey(jnp.zeros((2,), jnp.uint32)) if dropout > 0 else None

    def delta(self, x: jax.Array) -> jax.Array:
        """f32[..., out] adapter output for inputs x[..., in]."""
        xf = x.astype(jnp.float32)
        if self.dropout_on and self.dropout_rate > 0:
            key = jax.random.wrap_key_data(self.dropout_key[...])
            keep = jax.random.bernoulli(key, 1.0 - self.dropout_rate, xf.shape)
            xf = jnp.where(keep, xf / (1.0 - self.dropout_rate), 0.0)
        return (xf @ self.lora_a[...]) @ self.lora_b[...] * self.scaling

    def __call__(self, x: jax.Array) -> jax.Array:
        y = self.base_module(x)
        return y + self.delta(x).astype(y.dtype)


def _get(obj, key):
    return obj[key] if isinstance(key, int) else getattr(obj, key)


def _set(obj, key, value):
    if isinstance(key, int):
        obj[key] = value
    else:
        setattr(obj, key, value)


def _matches(path: tuple, target: str) -> bool:
    dotted = ".".join(str(p) for p in path)
    return dotted == target or dotted.endswith("." + target)


def lora_modules(model) -> list[tuple[tuple, LoRALinear]]:
    """``[(module path, LoRALinear)]`` of an adapted model, in tree order."""
    return [(p, m) for p, m in nnx.iter_modules(model) if isinstance(m, LoRALinear)]


def apply_lora(model, *, rank: int, alpha: float, targets: Sequence[str], dropout: float = 0.0, seed: int = 0,
               strict: bool = True):
    """Wrap every ``Linear`` whose dotted path is, or ends with ``.``, one of ``targets`` in a ``LoRALinear``
    (in place; returns ``model``). ``strict``: each target must match a module (else only: some target must).
    Raises ``LoRAError`` for a target matching nothing, the output head, or a rank above a matched layer's
    smallest dimension."""
    linears = [(p, m) for p, m in nnx.iter_modules(model) if isinstance(m, Linear) and p]
    chosen = {}
    for t in targets:
        hit = [(p, m) for p, m in linears if _matches(p, t)]
        if strict and not hit:
            names = sorted({str(p[-1]) for p, _ in linears})
            raise LoRAError(f"lora.target_modules: {t!r} matches no linear layer of this "
                            f"{model.config.model_type} model; use names from {names} (or dotted suffixes "
                            "such as mlp.c_proj)")
        chosen.update(hit)
    if not chosen:
        raise LoRAError(f"lora.target_modules: {list(targets)} match no linear layer of this {model.config.model_type} "
                        f"model; use names from {sorted({str(p[-1]) for p, _ in linears})}")
    if any(p[0] == "lm_head" for p in chosen):
        raise LoRAError("lora.target_modules: the output head lm_head cannot be adapted; drop it from target_modules")
    smallest = min(chosen.items(), key=lambda pm: min(pm[1].kernel.shape))
    dim = min(smallest[1].kernel.shape)
    if rank > dim:
        raise LoRAError(f"lora.rank: {rank} exceeds the smallest dimension ({dim}) of target "
                        f"{'.'.join(map(str, smallest[0]))} {list(smallest[1].kernel.shape)}; use rank <= {dim}")
    rngs = nnx.Rngs(params=seed)
    for path, lin in sorted(chosen.items(), key=lambda pm: [str(k) for k in pm[0]]):
        parent = model
        for key in path[:-1]:
            parent = _get(parent, key)
        _set(parent, path[-1], LoRALinear(lin, rank=rank, alpha=alpha, dropout=dropout, rngs=rngs))
    return model


def split_adapters(state: nnx.State) -> tuple[nnx.State, nnx.State]:
    """Full model state -> ``(adapters: the LoRAParam leaves, frozen: everything else)``."""
    adapters, frozen = nnx.split_state(state, nnx.LoRAParam, ...)
    return adapters, frozen


def adapters_off(adapters: nnx.State) -> nnx.State:
    """Zeroed adapters (same tree): merged with the frozen base it is the base model (the KL reference)."""
    return jax.tree.map(jnp.zeros_like, adapters)


def set_dropout(model, on: bool):
    """Switch the adapters' input dropout on (training graph) or off (sampling, scoring); returns ``model``."""
    for _, m in lora_modules(model):
        m.dropout_on = bool(on)
    return model


def dropout_keys(frozen: nnx.State, key: jax.Array) -> nnx.State:
    """``frozen`` with a fresh, distinct dropout key per adapter drawn from ``key`` (identity without dropout)."""
    leaves, tree = jax.tree.flatten(frozen, is_leaf=lambda x: isinstance(x, nnx.Variable))
    slots = [i for i, v in enumerate(leaves) if isinstance(v, LoRADropoutKey)]
    if not slots:
        return frozen
    keys = jax.random.key_data(jax.random.split(key, len(slots)))
    leaves = list(leaves)
    for k, i in enumerate(slots):
        leaves[i] = leaves[i].replace(keys[k].astype(jnp.uint32))
    return jax.tree.unflatten(tree, leaves)


def base_model(model):
    """The frozen base alone: a plain model (adapters dropped), sharing nothing with ``model``."""
    g, state = nnx.split(model)
    adapters, frozen = split_adapters(state)
    return merge(nnx.merge(g, adapters_off(adapters), frozen))


def merge(model):
    """A plain model (no adapters) whose kernels are ``kernel + (alpha/r) A @ B`` (in the base param dtype)."""
    model = nnx.clone(model)
    for path, m in lora_modules(model):
        base = m.base_module
        k = base.kernel[...]
        delta = (m.lora_a[...].astype(jnp.float32) @ m.lora_b[...].astype(jnp.float32)) * m.scaling
        base.kernel[...] = (k.astype(jnp.float32) + delta).astype(k.dtype)
        parent = model
        for key in path[:-1]:
            parent = _get(parent, key)
        _set(parent, path[-1], base)
    return model


def _hf_module_names(model, paths: Iterable[tuple]) -> dict[tuple, str]:
    """module path -> its HF module name (``model.layers.0.self_attn.q_proj``, ``transformer.h.0.attn.c_attn``)."""
    cfg = model.config
    prefix = "transformer." if cfg.family == "gpt2" else "model."
    names = _name_map([tuple(p) + ("kernel",) for p in paths], cfg.family, prefix)
    return {tuple(p[:-1]): hf.removesuffix(".weight") for p, (hf, _) in names.items()}


def peft_state_dict(model) -> dict[str, np.ndarray]:
    """PEFT-named f32 tensors: ``base_model.model.<hf module>.lora_A.weight`` [r, in], ``.lora_B.weight`` [out, r]."""
    mods = lora_modules(model)
    names = _hf_module_names(model, [p for p, _ in mods])
    out = {}
    for p, m in mods:
        stem = f"base_model.model.{names[p]}"
        out[f"{stem}.lora_A.weight"] = np.ascontiguousarray(np.asarray(m.lora_a[...], np.float32).T)
        out[f"{stem}.lora_B.weight"] = np.ascontiguousarray(np.asarray(m.lora_b[...], np.float32).T)
    return out


def save_adapters(model, path, *, base_model_name_or_path: str | None = None) -> Path:
    """Write ``adapter_config.json`` + ``adapter_model.safetensors`` that ``peft.PeftModel.from_pretrained``
    loads onto the transformers model of the same base (same logits)."""
    mods = lora_modules(model)
    if not mods:
        raise LoRAError("save_adapters: the model has no LoRA adapters; use models.save_pretrained")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    first = mods[0][1]
    names = _hf_module_names(model, [p for p, _ in mods])
    conf = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": first.rank, "lora_alpha": first.alpha,
            "lora_dropout": first.dropout_rate, "target_modules": sorted(names.values()), "bias": "none",
            "fan_in_fan_out": model.config.family == "gpt2", "use_rslora": False, "use_dora": False,
            "modules_to_save": None, "init_lora_weights": True, "inference_mode": True,
            "base_model_name_or_path": base_model_name_or_path}
    (path / CONFIG_FILE).write_text(json.dumps(conf, indent=2))
    save_file(peft_state_dict(model), str(path / ADAPTER_FILE), metadata={"format": "pt"})
    return path


def targets_from_peft(names) -> list[str]:
    """PEFT ``target_modules`` (HF module names or name suffixes) -> our module paths / suffixes
    (``model.layers.0.self_attn.q_proj`` -> ``layers.0.self_attn.q_proj``, ``transformer.h.1.attn.c_attn`` ->
    ``layers.1.attn.c_attn``)."""
    names = [names] if isinstance(names, str) else list(names)
    out = []
    for n in names:
        n = n.removeprefix("base_model.model.").removeprefix("model.").removeprefix("transformer.")
        out.append("layers." + n[2:] if n.startswith("h.") else n)
    return out


def read_adapter_config(path) -> dict:
    """``adapter_config.json`` of a PEFT LoRA directory (raises ``LoRAError`` naming the file)."""
    f = Path(path) / CONFIG_FILE
    try:
        conf = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise LoRAError(f"{f}: unreadable ({e}); pass a directory written by `mrl export` for a LoRA policy") from e
    if conf.get("peft_type") != "LORA" or not isinstance(conf.get("r"), int):
        raise LoRAError(f"{f}: not a LoRA adapter config (peft_type {conf.get('peft_type')!r}); only LoRA is read")
    return conf


def load_adapters(model, path):
    """Load ``adapter_model.safetensors`` (PEFT names) into the adapters of ``model`` (in place; returns it).
    Raises ``LoRAError`` when a module's tensors are missing or shaped differently."""
    f = Path(path) / ADAPTER_FILE
    tensors = load_file(str(f))
    mods = lora_modules(model)
    names = _hf_module_names(model, [p for p, _ in mods])
    for p, m in mods:
        stem = f"base_model.model.{names[p]}"
        a, b = tensors.get(f"{stem}.lora_A.weight"), tensors.get(f"{stem}.lora_B.weight")
        if a is None or b is None or a.T.shape != m.lora_a.shape or b.T.shape != m.lora_b.shape:
            raise LoRAError(f"{f}: tensors {stem}.lora_A/B.weight missing or of another shape than rank "
                            f"{m.rank} adapters of {names[p]}; load them onto the base and rank they were trained with")
        m.lora_a[...] = jnp.asarray(a.T, jnp.float32)
        m.lora_b[...] = jnp.asarray(b.T, jnp.float32)
    return model
