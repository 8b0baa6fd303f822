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


def _imports(package: Path, prefix: str) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports (top-level and inside functions; TYPE_CHECKING too)."""
    import ast

    mods = {prefix + "." + ".".join(p.relative_to(package).with_suffix("").parts).removesuffix(".__init__"): p
            for p in package.rglob("*.py")}
    graph = {}
    for name, path in mods.items():
        pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(pkg.split(".")[: len(pkg.split(".")) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            deps |= {t for t in targets if t in mods and t != name and t != pkg}
        graph[name] = deps
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        state[n] = 2
        stack.pop()
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return []


def test_tasks_modules_import_no_cycle():
    """``mrl_jax.tasks``' modules (its package ``__init__`` aside) form no import cycle: the reward types are a leaf."""
    graph = {k: v - {"mrl_jax.tasks"} for k, v in _imports(ROOT / "mrl_jax" / "tasks", "mrl_jax.tasks").items()
             if k != "mrl_jax.tasks"}
    assert _cycle(graph) == [], " -> ".join(_cycle(graph))
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]   # the check finds one
