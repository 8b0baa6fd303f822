"""A malformed JSONL task file: ``mrl train`` prints one line naming the file and line, exit code 2 (issue 12,
item 13)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from mrl_jax import cli
from mrl_jax.tasks import JsonlFormatError, load_jsonl

TINY = Path(__file__).resolve().parents[1] / "experiments" / "configs" / "tiny_two_policy.yaml"
GOOD = json.dumps({"prompt": "1+1=", "answer": "2"})


def _config(tmp_path: Path, data: Path) -> Path:
    cfg = yaml.safe_load(TINY.read_text())
    cfg["task"] = {"name": "jsonl", "path": str(data)}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.parametrize("content,line,what", [
    ((GOOD + "\n" + '{"prompt": "2+2=", "answer": 4,}' + "\n").encode(), 2, "invalid JSON"),
    ((GOOD + "\n\n" + json.dumps({"prompt": "x"}) + "\n").encode(), 3, "missing field 'answer'"),
    (GOOD.encode() + b'\n{"prompt": "caf\xe9", "answer": "1"}\n', 2, "not UTF-8"),
])
def test_bad_jsonl_task_file_is_one_line_exit_2(tmp_path, capsys, content, line, what):
    data = tmp_path / "tasks.jsonl"
    data.write_bytes(content)
    rc = cli.main(["train", "--config", str(_config(tmp_path, data)), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("mrl train: ") and f"{data}:{line}:" in err and what in err, err
    assert not (tmp_path / "out" / "summary.json").exists()


def test_empty_jsonl_is_a_format_error(tmp_path, capsys):
    data = tmp_path / "empty.jsonl"
    data.write_text("\n\n")
    with pytest.raises(JsonlFormatError, match="empty"):
        load_jsonl(data)
    rc = cli.main(["train", "--config", str(_config(tmp_path, data)), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and str(data) in err, err
