"""The `mrl bench` harness (mrl_jax.bench): runs benchmarks/bench_<name>.py scripts and gathers figures.

Fast: the harness runs on a throwaway benchmark folder; the real scripts are only loaded (never run) to check
that each exposes ``run(quick)``.
"""
import inspect
import json

import pytest

from mrl_jax import bench

CHEAP = '''
CALLS = []
def run(quick):
    CALLS.append(quick)
    return {"items_per_s": 123.0, "quick": quick}
'''
BROKEN = '''
def run(quick):
    raise RuntimeError("boom")
'''


@pytest.fixture
def bench_dir(tmp_path, monkeypatch):
    (tmp_path / "bench_cheap.py").write_text(CHEAP)
    (tmp_path / "bench_broken.py").write_text(BROKEN)
    (tmp_path / "helper.py").write_text("x = 1\n")  # not a bench_ file: ignored
    monkeypatch.setattr(bench, "BENCH_DIR", tmp_path)
    return tmp_path


def test_available_lists_bench_scripts(bench_dir):
    assert bench.available() == ["broken", "cheap"]


def test_run_only_one_returns_its_figures(bench_dir, tmp_path):
    summary = bench.run_benchmarks(tmp_path / "out", quick=True, only=["cheap"])
    assert summary["quick"] is True
    assert list(summary["benchmarks"]) == ["cheap"]
    figs = summary["benchmarks"]["cheap"]
    assert figs["items_per_s"] == 123.0 and figs["quick"] is True
    assert figs["wall_s"] >= 0
    env = summary["environment"]
    assert env["versions"]["jax"] and env["devices"]
    json.dumps(summary)  # what the CLI writes to summary.json must serialise


def test_a_failing_benchmark_is_recorded_not_raised(bench_dir, tmp_path):
    summary = bench.run_benchmarks(tmp_path / "out", quick=True)
    assert set(summary["benchmarks"]) == {"broken", "cheap"}
    assert "RuntimeError: boom" in summary["benchmarks"]["broken"]["error"]
    assert summary["benchmarks"]["cheap"]["items_per_s"] == 123.0


def test_unknown_name_raises(bench_dir, tmp_path):
    with pytest.raises(ValueError, match="unknown benchmark"):
        bench.run_benchmarks(tmp_path / "out", quick=True, only=["cheap", "nope"])


def test_missing_bench_dir_raises(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "BENCH_DIR", tmp_path / "absent")
    with pytest.raises(FileNotFoundError):
        bench.run_benchmarks(tmp_path / "out", quick=True)


def test_real_scripts_expose_run():
    names = bench.available()
    assert "trl" in names
    for name in names:
        module = bench._load(name)  # imports only; nothing is run
        assert callable(getattr(module, "run", None)), name
        assert "quick" in inspect.signature(module.run).parameters, name
