"""The typed config loader: unknown keys, wrong types, nesting, YAML round trip."""
import dataclasses
from typing import Literal, Optional

import pytest

from mrl_jax.configs import ConfigError, check, describe, field, from_dict, load_yaml, to_dict


@dataclasses.dataclass(frozen=True)
class Inner:
    learning_rate: float = field(1e-3, help="step size")
    schedule: Literal["constant", "cosine"] = field("constant", help="lr schedule")

    def __post_init__(self):
        check(self.learning_rate > 0, "learning_rate", f"must be > 0, got {self.learning_rate}")


@dataclasses.dataclass(frozen=True)
class Outer:
    name: str = field(help="run name")
    rounds: int = field(10, help="rounds")
    inner: Inner = field(default_factory=Inner, help="optimizer")
    items: list[Inner] = field(default_factory=list, help="many")
    path: Optional[str] = field(None, help="optional path")


def test_nested_build_and_round_trip(tmp_path):
    cfg = from_dict(Outer, {"name": "a", "inner": {"learning_rate": 2}, "items": [{"schedule": "cosine"}]})
    assert cfg.inner.learning_rate == 2.0 and isinstance(cfg.inner.learning_rate, float)
    assert cfg.items[0].schedule == "cosine"
    import yaml
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(to_dict(cfg)))
    assert load_yaml(Outer, p) == cfg


def test_unknown_key_names_key_and_suggests():
    with pytest.raises(ConfigError) as e:
        from_dict(Outer, {"name": "a", "inner": {"learning_rat": 1.0}})
    assert "inner.learning_rat" in str(e.value) and "learning_rate" in str(e.value)


@pytest.mark.parametrize("data, fragment", [
    ({"name": "a", "rounds": "ten"}, "rounds"),
    ({"name": "a", "rounds": True}, "rounds"),
    ({"name": "a", "inner": {"schedule": "linear"}}, "inner.schedule"),
    ({"name": "a", "items": [{"learning_rate": -1.0}]}, "items[0].learning_rate"),
    ({"rounds": 3}, "name"),
])
def test_bad_values_name_the_key(data, fragment):
    with pytest.raises(ConfigError) as e:
        from_dict(Outer, data)
    assert fragment in str(e.value)


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_yaml(Outer, tmp_path / "nope.yaml")
    p = tmp_path / "bad.yaml"
    p.write_text("name: [unclosed")
    with pytest.raises(ConfigError, match="bad.yaml"):
        load_yaml(Outer, p)


def test_describe_lists_every_leaf():
    lines = describe(Outer)
    assert any(l.startswith("inner.learning_rate (float") and "step size" in l for l in lines)
    assert any(l.startswith("items (list of Inner, default [...])") for l in lines)
    assert any(l.startswith("items[i].schedule (one of 'constant' | 'cosine', default 'constant')") and
               "lr schedule" in l for l in lines)
    assert len(lines) == 8   # name, rounds, inner.{2}, items, items[i].{2}, path


def _choice_keys(cls, prefix=""):
    """``{key: allowed values}`` of every Literal field under ``cls`` (dotted, lists as ``[i]``)."""
    import typing

    out = {}
    for f in dataclasses.fields(cls):
        tp = typing.get_type_hints(cls)[f.name]
        args = typing.get_args(tp)
        if dataclasses.is_dataclass(tp):
            out.update(_choice_keys(tp, f"{prefix}{f.name}."))
        elif typing.get_origin(tp) is list and args and dataclasses.is_dataclass(args[0]):
            out.update(_choice_keys(args[0], f"{prefix}{f.name}[i]."))
        else:
            lits = [a for a in (args if typing.get_origin(tp) is not Literal else (tp,))
                    if typing.get_origin(a) is Literal]
            if lits:
                out[prefix + f.name] = [v for lit in lits for v in typing.get_args(lit)]
    return out


def test_config_help_shows_the_allowed_values_of_every_choice_key():
    from mrl_jax.trainer.config import RunConfig

    lines = {line.split(" (", 1)[0]: line for line in describe(RunConfig)}
    choices = _choice_keys(RunConfig)
    assert {"policies[i].optimizer.schedule", "policies[i].grpo.loss_type", "mwra.devices"} <= choices.keys()
    for key, values in choices.items():
        head = lines[key].split("): ", 1)[0]
        assert all(repr(v) in head for v in values), (key, head)
    assert "(one of 'constant' | 'cosine' | 'linear', default 'constant')" in lines["policies[i].optimizer.schedule"]


@pytest.mark.parametrize("text, where, fragment", [
    ("rounds: 3\npolicies:\n\t- name: a\n", ":3:1:", "use spaces"),
    ("rounds: [1,\n", ":2:1:", "expected the node content"),
    ("a:\n  b: 1\n c: 2\n", ":3:2:", "expected <block end>"),
])
def test_yaml_syntax_error_is_one_line_with_file_line_column(tmp_path, text, where, fragment):
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_yaml(Outer, p)
    msg = str(e.value)
    assert msg.startswith(f"{p}{where} not valid YAML") and fragment in msg
    assert "\n" not in msg and "<unicode string>" not in msg


@pytest.mark.parametrize("policy, run, key, other", [
    ({"grpo": {"num_generations": 4}}, {"num_generations": 2}, "policies[0].grpo.num_generations", "num_generations: 2"),
    ({"grpo": {"max_completion_length": 64}}, {}, "policies[0].grpo.max_completion_length",
     "sampling.max_new_tokens: 16"),
    ({"grpo": {"temperature": 0.7}, "sampling": {"temperature": 0.9}}, {}, "policies[0].grpo.temperature",
     "sampling.temperature: 0.9"),
])
def test_grpo_keys_set_by_the_run_refuse_another_value(policy, run, key, other):
    from mrl_jax.trainer.config import RunConfig

    with pytest.raises(ConfigError) as e:
        from_dict(RunConfig, {"policies": [{"name": "a", **policy}], **run})
    assert f"config key '{key}'" in str(e.value) and other in str(e.value)


def test_grpo_keys_set_by_the_run_reach_the_learner():
    from mrl_jax.trainer.config import RunConfig

    cfg = from_dict(RunConfig, {"num_generations": 3, "policies": [
        {"name": "a", "grpo": {"num_generations": 3, "epsilon": 0.1}, "sampling": {"max_new_tokens": 5,
                                                                                  "temperature": 0.5}}]})
    g = cfg.policies[0].grpo.resolved(3, 5, 0.5)
    assert (g.num_generations, g.max_completion_length, g.temperature, g.epsilon) == (3, 5, 0.5, 0.1)


def test_config_json_of_an_earlier_run_still_loads(tmp_path):
    """Runs written before G had one source saved GRPOConfig's defaults in policies[i].grpo; they load (mrl
    eval / export), and a real contradiction there is still refused."""
    import json

    from mrl_jax.trainer.config import load_run_config

    data = {"num_generations": 4, "policies": [{"name": "a", "grpo": {"num_generations": 8, "temperature": 1.0,
                                                                      "max_completion_length": 64}}]}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    cfg = load_run_config(path)
    assert cfg.num_generations == 4 and cfg.policies[0].grpo.resolved(4, 16, 1.0).num_generations == 4
    data["policies"][0]["grpo"]["num_generations"] = 6
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"config.json: config key 'policies\[0\].grpo.num_generations': 6"):
        load_run_config(path)
