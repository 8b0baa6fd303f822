"""Static checks: pyflakes over the library, the benchmarks and the tests (no undefined or unused names).

A name that is never defined only fails when its line runs, and benchmarks run rarely; this catches it here.
"""
from pathlib import Path

import pytest

pyflakes_api = pytest.importorskip("pyflakes.api")
from pyflakes import reporter as pyflakes_reporter  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


class _Collect(pyflakes_reporter.Reporter):
    def __init__(self):
        self.messages: list[str] = []

    def flake(self, message):
        self.messages.append(str(message))

    def syntaxError(self, filename, msg, lineno, offset, text):
        self.messages.append(f"{filename}:{lineno}: syntax error: {msg}")

    def unexpectedError(self, filename, msg):
        self.messages.append(f"{filename}: {msg}")


def _flakes(folder: str) -> list[str]:
    rep = _Collect()
    for path in sorted((ROOT / folder).rglob("*.py")):
        pyflakes_api.checkPath(str(path), rep)
    return rep.messages


@pytest.mark.parametrize("folder", ["mrl_jax", "benchmarks", "tests"])
def test_pyflakes_clean(folder):
    messages = _flakes(folder)
    assert not messages, "\n".join(messages)


def test_the_check_sees_an_undefined_name(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    return section('x')\n")
    rep = _Collect()
    pyflakes_api.checkPath(str(bad), rep)
    assert any("undefined name 'section'" in m for m in rep.messages)
