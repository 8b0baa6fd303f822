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
    assert any(l.startswith("items[i].schedule (Literal") and "lr schedule" in l for l in lines)
    assert len(lines) == 8   # name, rounds, inner.{2}, items, items[i].{2}, path
