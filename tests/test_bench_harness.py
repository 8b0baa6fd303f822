"""The `mrl bench` harness (mrl_jax.bench.harness): runs benchmarks/bench_<name>.py scripts and gathers figures.

Fast: the harness runs on a throwaway benchmark folder; the real scripts are only loaded (never run) to check
that each exposes ``run(quick)``.
"""
import inspect
import json

import pytest

from mrl_jax.bench import harness

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
    monkeypatch.setattr(harness, "BENCH_DIR", tmp_path)
    return tmp_path


def test_available_lists_bench_scripts(bench_dir):
    assert harness.available() == ["broken", "cheap"]


def test_run_only_one_returns_its_figures(bench_dir, tmp_path):
    summary = harness.run_benchmarks(tmp_path / "out", quick=True, only=["cheap"])
    assert summary["quick"] is True
    assert list(summary["benchmarks"]) == ["cheap"]
    figs = summary["benchmarks"]["cheap"]
    assert figs["items_per_s"] == 123.0 and figs["quick"] is True
    assert figs["wall_s"] >= 0
    env = summary["environment"]
    assert env["versions"]["jax"] and env["devices"]
    json.dumps(summary)  # what the CLI writes to summary.json must serialise


def test_a_failing_benchmark_is_recorded_not_raised(bench_dir, tmp_path):
    summary = harness.run_benchmarks(tmp_path / "out", quick=False)
    assert set(summary["benchmarks"]) == {"broken", "cheap"}
    assert "RuntimeError: boom" in summary["benchmarks"]["broken"]["error"]
    assert summary["benchmarks"]["cheap"]["items_per_s"] == 123.0


def test_quick_is_a_quick_look(bench_dir, tmp_path, monkeypatch):
    """--quick runs the QUICK_LOOK benchmarks only and names the others; the full run and ``only`` run them."""
    monkeypatch.setattr(harness, "QUICK_LOOK", ("cheap",))
    quick = harness.run_benchmarks(tmp_path / "q", quick=True)["benchmarks"]
    assert quick["cheap"]["items_per_s"] == 123.0 and "error" not in quick["broken"]
    assert "full run only" in quick["broken"]["skipped"]
    assert "boom" in harness.run_benchmarks(tmp_path / "f", quick=False)["benchmarks"]["broken"]["error"]
    assert "boom" in harness.run_benchmarks(tmp_path / "o", quick=True, only=["broken"])["benchmarks"]["broken"]["error"]


def test_quick_look_names_real_benchmarks():
    assert set(harness.QUICK_LOOK) < set(harness.available())
    assert set(harness.OWN_COMMAND) < set(harness.available())


def test_own_command_benchmarks_run_only_when_named(bench_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(harness, "OWN_COMMAND", ("cheap",))
    full = harness.run_benchmarks(tmp_path / "f", quick=False)["benchmarks"]
    assert "`mrl bench --only cheap`" in full["cheap"]["skipped"] and "boom" in full["broken"]["error"]
    assert harness.run_benchmarks(tmp_path / "o", quick=False, only=["cheap"])["benchmarks"]["cheap"]["items_per_s"] == 123.0


def test_unknown_name_is_one_line_naming_the_flag(bench_dir, tmp_path, capsys):
    """An unknown ``--only`` name is a config error (exit 2, one line, the names to choose from); ``probes``, a
    benchmark script once, points to its own verb."""
    from mrl_jax import cli

    with pytest.raises(ValueError, match="unknown benchmark"):
        harness.run_benchmarks(tmp_path / "out", quick=True, only=["cheap", "nope"])
    for only, tail in (("cheap,nope", ""), ("probes", "; the probe comparison is its own verb: `mrl bench probes`")):
        assert cli.main(["bench", "--only", only, "--out", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err.strip()
        unknown = only.split(",")[-1]
        assert err == f"mrl bench: config error: --only: unknown benchmark(s) {unknown}; choose from broken, cheap{tail}"


def test_missing_bench_dir_raises(tmp_path, monkeypatch):
    monkeypatch.setattr(harness, "BENCH_DIR", tmp_path / "absent")
    with pytest.raises(FileNotFoundError):
        harness.run_benchmarks(tmp_path / "out", quick=True)


def test_real_scripts_expose_run():
    names = harness.available()
    assert "trl" in names
    for name in names:
        module = harness._load(name)  # imports only; nothing is run
        assert callable(getattr(module, "run", None)), name
        assert "quick" in inspect.signature(module.run).parameters, name


# ------------------------------------------------------------------------------ load recording (mrl_jax.bench.load)
from mrl_jax.bench import load as bench_load  # noqa: E402


def test_default_threshold_scales_with_cores():
    assert bench_load.default_threshold(2) == 0.5
    assert bench_load.default_threshold(16) == 4.0


def test_contended_marking():
    assert not bench_load.is_contended(0.3, 0.1, 0.5)
    assert bench_load.is_contended(0.51, 0.0, 0.5)  # loaded before the section
    assert bench_load.is_contended(0.1, 0.8, 0.5)  # others busy during it


def _fake_clock():
    t = [0.0]
    return t, (lambda: t[0]), (lambda dt: t.__setitem__(0, t[0] + dt))


def test_wait_idle_stops_when_quiet():
    loads = iter([2.0, 1.0, 0.4, 0.1])
    _, clock, sleep = _fake_clock()
    w = bench_load.wait_idle(100.0, 0.5, poll_s=5.0, load_reader=lambda: next(loads), sleep=sleep, clock=clock)
    assert w["idle"] and w["polls"] == 2 and w["waited_s"] == 10.0 and w["load"] == 0.4


def test_wait_idle_is_bounded():
    t, clock, sleep = _fake_clock()
    w = bench_load.wait_idle(12.0, 0.5, poll_s=5.0, load_reader=lambda: 3.0, sleep=sleep, clock=clock)
    assert not w["idle"] and t[0] == 12.0 and w["polls"] == 3  # 5 + 5 + 2 s: never past the bound


def _snapshots(other_ticks_during):
    """cpu_times-like snapshots: this process, its child, and one other process."""
    import os
    me = os.getpid()
    before = {me: ("python", 1, 0), 999001: ("child", me, 0), 999002: ("other", 1, 100)}
    after = {me: ("python", 1, 500), 999001: ("child", me, 500), 999002: ("other", 1, 100 + other_ticks_during)}
    return iter([before, after])


def test_section_marks_contended_from_other_processes_only():
    clk = bench_load._CLK
    t = iter([0.0, 10.0])
    snaps = _snapshots(other_ticks_during=int(8 * clk))  # the other process used 0.8 cores over 10 s
    with bench_load.section("x", 0.5, load_reader=lambda: 0.2, snapshot=lambda: next(snaps),
                           clock=lambda: next(t)) as rec:
        pass
    assert rec["contended"] and rec["other_cores"] == 0.8
    assert [b["name"] for b in rec["busy"]] == ["other"]  # self and own child excluded
    t = iter([0.0, 10.0])
    snaps = _snapshots(other_ticks_during=int(1 * clk))  # 0.1 cores: quiet
    with bench_load.section("y", 0.5, load_reader=lambda: 0.2, snapshot=lambda: next(snaps),
                           clock=lambda: next(t)) as rec:
        pass
    assert not rec["contended"] and rec["load_before"] == 0.2 and rec["load_after"] == 0.2
    names = [r["name"] for r in bench_load.collect()]
    assert names[-2:] == ["x", "y"] and bench_load.collect() == []


def test_summarize_any_section_contended():
    quiet = {"name": "a", "load_before": 0.1, "other_cores": 0.0, "contended": False}
    busy = {"name": "b", "load_before": 0.9, "other_cores": 0.0, "contended": True}
    assert not bench_load.summarize([quiet])["contended"]
    s = bench_load.summarize([quiet, busy])
    assert s["contended"] and s["max_load_before"] == 0.9
    assert bench_load.summarize([], {"idle": False})["contended"]


def test_run_benchmarks_attach_load(bench_dir, tmp_path):
    summary = harness.run_benchmarks(tmp_path / "out", quick=True, only=["cheap"])
    figs = summary["benchmarks"]["cheap"]
    assert isinstance(figs["contended"], bool) and "load_before" in figs["load"]["whole_run"]
    assert summary["contended"] == figs["contended"]


def test_script_main_wait_idle_flag(monkeypatch, capsys):
    monkeypatch.setattr(bench_load, "load_average", lambda: 0.0)
    monkeypatch.setattr(bench_load, "cpu_times", lambda: {})  # no other process: quiet
    assert harness.script_main(lambda quick: {"q": quick}, "x", ["--quick", "--wait-idle", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["q"] is True and out["load"]["wait_idle"]["idle"] is True and "contended" in out


def test_cli_bench_waits_for_idle_with_the_given_threshold(bench_dir, tmp_path, monkeypatch):
    """`mrl bench --wait-idle S --idle-load L` waits (bounded) on the given threshold before timing."""
    from mrl_jax import cli
    seen = []
    real = bench_load.wait_idle
    monkeypatch.setattr(bench_load, "wait_idle", lambda s, t=None, **kw: seen.append((s, t)) or real(s, t, **kw))
    out = tmp_path / "out"
    assert cli.main(["bench", "--only", "cheap", "--wait-idle", "0.5", "--idle-load", "1000", "--out", str(out)]) == 0
    assert seen and set(seen) == {(0.5, 1000.0)}   # before the run and before each section
    summary = json.loads((out / "summary.json").read_text())
    assert summary["benchmarks"]["cheap"]["items_per_s"] == 123.0


def test_sections_settle_to_quiet_first_when_asked(monkeypatch):
    """settle_sections(S): a section waits (bounded) for the load its own set-up left, then starts quiet."""
    clk = bench_load._CLK
    loads = iter([0.9, 0.7, 0.3, 0.3, 0.3])   # decaying 1-minute load, one reading per poll
    slept = []
    snaps = _snapshots(other_ticks_during=int(1 * clk))
    t = iter([0.0, 10.0])
    bench_load.settle_sections(60)
    try:
        with bench_load.section("z", 0.5, load_reader=lambda: next(loads), snapshot=lambda: next(snaps),
                               clock=lambda: next(t), sleep=slept.append) as rec:
            pass
    finally:
        bench_load.settle_sections(0)
    assert len(slept) == 2 and rec["load_before"] == 0.3 and not rec["contended"]
    bench_load.collect()
