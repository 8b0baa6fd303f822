"""Trained models out of a run directory: ``mrl export`` and ``mrl eval --model``.

    export_policy("runs/r1", "llama_bpe", "out/llama")              # a Hugging Face directory
    export_policy("runs/r1", "qwen_lora", "out/qwen")               # LoRA policy: a PEFT adapter directory
    export_policy("runs/r1", "qwen_lora", "out/qwen", merge_lora=True)   # LoRA merged: a full checkpoint

The run's ``config.json`` (written by ``mrl train``) rebuilds the run's state template, the checkpoint of the
chosen round (default: the latest complete one) is restored into it, and the policy's params are written with
``mrl_jax.models.save_pretrained`` (config.json + model.safetensors; ``transformers`` loads them with the same
logits) next to its tokenizer files (tokenizer.json, tokenizer_config.json with any chat template,
special_tokens_map.json, copied; or written for a locally trained tokenizer) and a ``generation_config.json``
whose ``eos_token_id`` is the policy's stop set. The exported ``tokenizer_config.json`` names
``tokenizer_class: PreTrainedTokenizerFast``: ``AutoTokenizer`` then runs tokenizer.json as it is, as the trainer
did, so a deployed model gets the ids it was trained on (a model-specific class such as transformers 5's
``LlamaTokenizer`` rebuilds the pipeline and encodes Phi-3's chat prompts differently). ``mrl_export.json`` records where it came from. The run
directory is only read. Every refusal is one ``ExportError`` line naming the key or path and the fix.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

from flax import nnx

from mrl_jax import models
from mrl_jax.tokenization.chat import tokenizer_folder
from mrl_jax.configs import ConfigError
from mrl_jax.models import lora as lora_lib

__all__ = ["ExportError", "evaluate_exported", "export_policy"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
PROVENANCE = "mrl_export.json"


class ExportError(ValueError):
    """An export (or an evaluation of an exported directory) was refused; the message names path/key and fix."""


def _run_config(run_dir: Path):
    from mrl_jax.trainer.config import saved_run_config

    path = run_dir / "config.json"
    if not path.is_file():
        raise ExportError(f"{path}: missing; --run must be a run directory written by `mrl train` (it holds "
                          "config.json and checkpoints/)")
    try:
        return saved_run_config(json.loads(path.read_text()))
    except (ValueError, ConfigError) as e:
        msg = " ".join(str(e).split())
        raise ExportError(f"{path}: not the config.json of an `mrl train` run ({msg}); pass --run the --out "
                          "directory of `mrl train`") from e


def _policy_index(cfg, name: str, where: Path, flag: str = "--policy") -> int:
    names = [p.name for p in cfg.policies]
    if name not in names:
        raise ExportError(f"{flag} {name!r}: {where} has no policy of that name; choose one of {names}")
    return names.index(name)


def _check_out(out: Path, run_dir: Path, force: bool) -> None:
    from mrl_jax.trainer.run_lock import holds_run

    o, r = out.resolve(), run_dir.resolve()
    if o == r or r in o.parents or o in r.parents:
        raise ExportError(f"--out {out}: overlaps the run directory {run_dir} (export never writes into a run); "
                          "choose a directory outside it")
    if holds_run(out):
        raise ExportError(f"--out {out}: holds another run of `mrl train` (export never writes into a run, "
                          "--force included); choose a new or empty directory")
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out}: exists and is not a directory; choose another path")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ExportError(f"--out {out}: directory is not empty; pass --force to replace its contents, or choose "
                          "an empty or new directory")


def _complete_rounds(run_dir: Path) -> list[int]:
    ck = run_dir / "checkpoints"
    rounds = sorted(int(p.name) for p in ck.iterdir() if p.is_dir() and p.name.isdigit()) if ck.is_dir() else []
    if not rounds:
        raise ExportError(f"{ck}: no complete checkpoint; export needs a run that saved at least one round "
                          "(checkpoint_every)")
    return rounds


def _restore(run_dir: Path, cfg, index: int, checkpoint: int | None):
    """(BuiltPolicy, PolicyState, round) of policy ``index`` at ``checkpoint`` (default: latest)."""
    from mrl_jax.trainer.checkpoint import CheckpointError, RunCheckpointer
    from mrl_jax.trainer.parts import build_parts
    from mrl_jax.trainer.run_lock import read_lock

    rounds = _complete_rounds(run_dir)
    step = rounds[-1] if checkpoint is None else int(checkpoint)
    if step not in rounds:
        raise ExportError(f"--checkpoint {step}: {run_dir / 'checkpoints'} has no complete checkpoint of that round; "
                          f"complete rounds: {rounds}")
    parts = build_parts(cfg)   # samples nothing: no sampler to size, no memory plan
    with read_lock(run_dir):   # a train writing there (checkpoints written and deleted) refuses the export
        ckpt = RunCheckpointer(run_dir, keep=cfg.keep_checkpoints)
        try:
            state, meta = ckpt.restore(parts.state_template(), step)
        except CheckpointError as e:
            raise ExportError(str(e)) from e
        finally:
            ckpt.close()
    return parts.policies[index], state.policies[index], int(meta.get("round", step))


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except ValueError:
        return {}


def write_tokenizer_files(policy, out: Path) -> list[str]:
    """Copy the policy's tokenizer files (or save a locally trained tokenizer) and write generation_config.json
    with the stop set as ``eos_token_id``; returns the file names written."""
    tok = policy.tokenizer
    folder = tokenizer_folder(tok)
    written = []
    if folder is None:
        tok.save(out)
        written += ["tokenizer.json", "tokenizer_config.json"]
    else:
        shutil.copyfile(tok.source, out / "tokenizer.json")
        written.append("tokenizer.json")
        for name in TOKENIZER_FILES[1:]:
            if (folder / name).is_file():
                shutil.copyfile(folder / name, out / name)
                written.append(name)
        conf = _read_json(out / "tokenizer_config.json")
        if conf:   # AutoTokenizer: tokenizer.json as the trainer ran it, not a rebuilt model-specific pipeline
            conf["tokenizer_class"] = "PreTrainedTokenizerFast"
            (out / "tokenizer_config.json").write_text(json.dumps(conf, indent=2, ensure_ascii=False))
    model_dir = Path(policy.spec.model.path) if policy.spec.model.path else None
    gen = _read_json(model_dir / "generation_config.json") if model_dir else {}
    gen = gen or (_read_json(folder / "generation_config.json") if folder else {})
    stops = list(policy.sampling.eos_ids)
    if stops:
        gen["eos_token_id"] = stops[0] if len(stops) == 1 else stops
    for key, value in (("bos_token_id", tok.bos_id), ("pad_token_id", tok.pad_id)):
        if value is not None:
            gen.setdefault(key, int(value))
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return written + ["generation_config.json"]


def _prepare_out(out: Path, force: bool) -> None:
    if out.is_dir() and force:
        for child in out.iterdir():
            shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
    out.mkdir(parents=True, exist_ok=True)


def export_policy(run_dir, policy: str, out_dir, *, checkpoint: int | None = None, merge_lora: bool = False,
                  force: bool = False) -> dict:
    """Write policy ``policy`` of run ``run_dir`` at round ``checkpoint`` (default latest) into ``out_dir``:
    a Hugging Face directory, or for a LoRA policy a PEFT adapter directory (``merge_lora``: the merged full
    model). Returns a summary dict. Raises ``ExportError``; ``run_dir`` is never modified."""
    run_dir, out = Path(run_dir), Path(out_dir)
    cfg = _run_config(run_dir)
    index = _policy_index(cfg, policy, run_dir / "config.json")
    _check_out(out, run_dir, force)
    _complete_rounds(run_dir)
    if merge_lora and cfg.policies[index].lora.rank == 0:
        raise ExportError(f"--merge-lora: policy {policy!r} has no LoRA adapters (lora.rank is 0); drop --merge-lora")
    pol, ps, round_index = _restore(run_dir, cfg, index, checkpoint)
    model = nnx.merge(pol.graphdef, ps.params)
    _prepare_out(out, force)
    if pol.spec.lora.rank and not merge_lora:
        kind = "peft"
        base = pol.spec.model.path
        files = ["adapter_config.json", lora_lib.ADAPTER_FILE]
        if base is None:  # a tiny random-init base exists nowhere else: write it next to the adapters
            base = str((out / "base").resolve())
            models.save_pretrained(lora_lib.base_model(model), out / "base")
            files.append("base/")
        lora_lib.save_adapters(model, out, base_model_name_or_path=str(Path(base).resolve()))
    else:
        kind = "hf"
        if pol.spec.lora.rank:
            model = lora_lib.merge(model)
        models.save_pretrained(model, out)
        files = ["config.json", models.checkpoint.SINGLE_FILE]
    files += write_tokenizer_files(pol, out)
    info = {"format": kind, "run": str(run_dir.resolve()), "policy": policy, "round": round_index,
            "merged_lora": bool(merge_lora), "prompt_format": pol.spec.prompt_format,
            "stop_ids": list(pol.sampling.eos_ids)}
    (out / PROVENANCE).write_text(json.dumps(info, indent=2))
    return dict(info, out=str(out), files=files + [PROVENANCE])


def _check_model_dir(model_dir: Path) -> None:
    """``--model`` is a model directory (``config.json`` with a ``model_type``, safetensors weights and a
    tokenizer), not a run directory or another folder; ``ExportError`` naming ``--model`` otherwise."""
    cfg_file = model_dir / "config.json"
    try:
        hf = json.loads(cfg_file.read_text()) if cfg_file.is_file() else None
    except ValueError:
        hf = None
    if isinstance(hf, dict) and "policies" in hf:
        raise ExportError(f"--model {model_dir} is a run directory of `mrl train`, not a model; evaluate it with "
                          f"--run {model_dir}, or write a model with `mrl export --run {model_dir} --policy NAME`")
    missing = [what for what, ok in (
        ("config.json with a model_type", isinstance(hf, dict) and "model_type" in hf),
        ("*.safetensors weights", any(model_dir.glob("*.safetensors"))),
        ("tokenizer.json", (model_dir / "tokenizer.json").is_file())) if not ok]
    if missing:
        raise ExportError(f"--model {model_dir}: not a model directory (no {', no '.join(missing)}); pass a "
                          "directory written by `mrl export` (or a Hugging Face checkpoint)")


def evaluate_exported(config_path, model_dir, policy: str | None = None) -> dict:
    """``mrl eval --model DIR``: held-out success of an exported directory (HF or PEFT adapter) on the task of
    ``config_path``, prompted and sampled as the config's policy ``policy`` (default: the only one)."""
    from mrl_jax.trainer.config import load_run_config
    from mrl_jax.trainer.loop import Run

    cfg = load_run_config(config_path)
    model_dir = Path(model_dir)
    if policy is None:
        if len(cfg.policies) != 1:
            raise ExportError(f"--policy: {config_path} has policies {[p.name for p in cfg.policies]}; name the one "
                              "whose prompt format and sampling the exported model uses")
        policy = cfg.policies[0].name
    spec = cfg.policies[_policy_index(cfg, policy, Path(config_path))]
    adapter = lora_lib.read_adapter_config(model_dir) if (model_dir / "adapter_config.json").is_file() else None
    if adapter is not None:
        base = adapter.get("base_model_name_or_path")
        if not base or not Path(base).is_dir():
            raise ExportError(f"{model_dir / 'adapter_config.json'}: base_model_name_or_path {base!r} is not a local "
                              "directory; set it to the base checkpoint folder (or export with --merge-lora)")
        spec = dataclasses.replace(spec, model=dataclasses.replace(spec.model, path=base),
                                   lora=dataclasses.replace(
                                       spec.lora, rank=adapter["r"], alpha=float(adapter["lora_alpha"]),
                                       dropout=float(adapter.get("lora_dropout") or 0.0),
                                       target_modules=lora_lib.targets_from_peft(adapter["target_modules"])))
    else:
        _check_model_dir(model_dir)
        spec = dataclasses.replace(spec, model=dataclasses.replace(spec.model, path=str(model_dir)),
                                   lora=dataclasses.replace(spec.lora, rank=0))
    spec = dataclasses.replace(spec, tokenizer=dataclasses.replace(spec.tokenizer, path=str(model_dir)),
                               warm_start=dataclasses.replace(spec.warm_start, steps=0))
    run = Run(dataclasses.replace(cfg, policies=[spec]))
    state = run.initial_state()
    if adapter is not None:
        pol, ps = run.policies[0], state.policies[0]
        model = nnx.merge(pol.graphdef, ps.params)
        lora_lib.load_adapters(model, model_dir)
        state = state.replace(policies=(ps.replace(params=nnx.state(model)),))
    return {"model": str(model_dir), "policy": policy, "eval": run.evaluate(state, cfg.eval_prompts)}
