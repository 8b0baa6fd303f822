"""Every run-config key named as TRL names it either has TRL's default or says TRL's default in its help text
(``mrl config-help``)."""

import dataclasses
import re
import typing

import pytest

from mrl_jax.configs import describe
from mrl_jax.learner import GRPOConfig
from mrl_jax.trainer.config import RunConfig

# TRL's GRPOConfig (huggingface/trl f2cd577, 2026-07) and the transformers TrainingArguments it inherits (5.24);
# the warm start is an SFT step: its learning_rate is compared with TRL's SFTConfig.
TRL = {"num_generations": 8, "max_completion_length": 512, "epsilon": 0.2, "epsilon_high": None, "beta": 0.0,
       "loss_type": "dapo", "importance_sampling_level": "token", "scale_rewards": "group",
       "mask_truncated_completions": False, "num_iterations": 1, "temperature": 1.0, "top_k": 0, "top_p": 1.0,
       "min_p": None, "learning_rate": 1e-6, "chat_template_kwargs": None, "sync_ref_model": False,
       "ref_model_sync_steps": 512, "ref_model_mixup_alpha": 0.6, "top_entropy_quantile": 1.0,
       "seed": 42, "weight_decay": 0.0, "max_grad_norm": 1.0, "warmup_steps": 0, "report_to": "none"}
SFT = {"learning_rate": 2e-5}
NOT_TRL = ("task.",)   # the task generator's seed is not TrainingArguments' seed


def _fields(cls, prefix=""):
    """(dotted key, field) of every leaf field of a config dataclass."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        item = (typing.get_args(tp) or [None])[0]
        if dataclasses.is_dataclass(tp):
            yield from _fields(tp, f"{prefix}{f.name}.")
        elif typing.get_origin(tp) in (list, tuple) and dataclasses.is_dataclass(item):
            yield from _fields(item, f"{prefix}{f.name}[i].")
        else:
            yield f"{prefix}{f.name}", f


def _default(f):
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING


def _differs(ours, trl) -> bool:
    if isinstance(ours, float) and isinstance(trl, float):
        return abs(ours - trl) > 1e-12
    return ours != trl


def _trl_spellings(value):
    if isinstance(value, float):
        return {repr(value), f"{value:g}", f"{value:.0e}".replace("e-0", "e-")}
    return {str(value)}


@pytest.mark.parametrize("cls", [RunConfig, GRPOConfig])
def test_help_names_trl_default_where_ours_differs(cls):
    help_lines = {line.split(" (", 1)[0]: line for line in describe(cls)}
    checked = []
    for key, f in _fields(cls):
        name = key.rsplit(".", 1)[-1]
        table = SFT if key.startswith("policies[i].warm_start.") else TRL
        if name not in table or key.startswith(NOT_TRL):
            continue
        ours = _default(f)
        if ours is None and getattr(f, "metadata", {}).get("help", "").startswith("set by"):
            continue   # a run-set value (num_generations, max_completion_length, temperature of a policy's grpo)
        if _differs(ours, table[name]):
            line = help_lines[key]
            assert "TRL" in line and any(s in line for s in _trl_spellings(table[name])), (key, line)
            checked.append(key)
    assert checked   # loss_type at least
    assert any(k.endswith("loss_type") for k in checked)


def test_trl_table_matches_installed_trl():
    trl = pytest.importorskip("trl")
    fields = {f.name: f for f in dataclasses.fields(trl.GRPOConfig)}
    for name, value in TRL.items():
        if name in fields and name != "report_to":
            assert _default(fields[name]) == value, name


def test_loss_type_help_says_why_grpo_is_kept():
    line = next(x for x in describe(RunConfig) if x.startswith("policies[i].grpo.loss_type"))
    assert re.search(r"TRL's default is dapo; kept grpo .*existing run", line)
