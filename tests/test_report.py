"""``mrl report`` (issue 16) on a 2-round tiny run: every listed figure is written, the complementarity
numbers equal a direct computation from the run's per-prompt rewards, the summary has the last eval and
sample completions; a run still going / killed (no summary.json, torn lines, half-logged round) works;
``mrl train``'s progress off a terminal prints at most one line per round.
"""

import contextlib
import io
import json
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import support  # noqa: E402
from mrl_jax import cli  # noqa: E402
from mrl_jax.report import write_report  # noqa: E402
from mrl_jax.trainer import train  # noqa: E402

TAU = 0.15  # digit_reward gives partial credit: a low threshold makes successes (and complementarity) happen
FIGURES = ["reward", "kl", "entropy", "clip_ratio", "counters_prp", "counters_sgt", "counters_xgrpo",
           "complementarity"]  # tiny config: llama_bpe xgrpo+sgt, gpt2_uni prp


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 2-round tiny run with an eval every round, its progress output (stderr, not a terminal)."""
    restore = support.enable_compile_cache()
    out = tmp_path_factory.mktemp("run")
    cfg = support.to_run_config(support.tiny_config(**{"rounds": 2, "eval_every": 1, "see.success_threshold": TAU}))
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            train(cfg, out, reward_specs=support.reward_specs({"faulty": {"seed": 0, "p": {}}}), progress=True)
    finally:
        restore()
    return out, err.getvalue()


@pytest.fixture(scope="module")
def report(run, tmp_path_factory):
    """``(report dict, its directory)`` of the finished run."""
    rep = tmp_path_factory.mktemp("report")
    return write_report(run[0], rep), rep


def direct_complementarity(run_dir: Path, policies):
    """matrix[r][i][j] from groups.jsonl rewards, written out independently of mrl_jax.report."""
    recs = [json.loads(line) for line in (run_dir / "groups.jsonl").read_text().splitlines()]
    out = {}
    for r in sorted({g["round"] for g in recs}):
        rew = {g["policy"]: np.asarray(g["rewards"]) for g in recs if g["round"] == r}
        m = np.zeros((len(policies), len(policies)))
        for i, a in enumerate(policies):
            for j, b in enumerate(policies):
                P = rew[a].shape[0]
                m[i, j] = sum(rew[a][p].max() < TAU and rew[b][p].max() >= TAU for p in range(P)) / P
        out[r] = m
    return out


def test_groups_hold_the_rounds_rewards(run):
    out, _ = run
    groups = [json.loads(line) for line in (out / "groups.jsonl").read_text().splitlines()]
    metrics = {(m["round"], m["policy"]): m for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert {(g["round"], g["policy"]) for g in groups} == {(r, p) for r in (0, 1) for p in ("llama_bpe", "gpt2_uni")}
    for g in groups:
        rewards = np.asarray(g["rewards"])
        assert rewards.shape == (4, 4) and g["tau"] == TAU and len(g["prompt_ids"]) == 4
        m = metrics[(g["round"], g["policy"])]
        assert "groups" not in m
        assert rewards.mean() == pytest.approx(m["reward/mean"], abs=1e-6)
        assert (rewards >= TAU).mean() == pytest.approx(m["reward/success_rate"], abs=1e-6)
        first = [s for s in samples if s["round"] == g["round"] and s["policy"] == g["policy"]][0]
        assert first["reward"] == pytest.approx(rewards[0, 0], abs=1e-6)  # sample 0 of prompt 0


def test_report_has_every_figure_and_the_complementarity_of_the_rewards(run, report):
    out, _ = run
    report, rep = report
    assert sorted(report["figures"]) == sorted(FIGURES)
    for name in FIGURES:
        png = rep / f"{name}.png"
        assert png.is_file() and png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG", name
    comp = report["complementarity"]
    assert comp["policies"] == ["llama_bpe", "gpt2_uni"] and comp["rounds"] == [0, 1]
    direct = direct_complementarity(out, comp["policies"])
    for r, mat in zip(comp["rounds"], comp["matrix"]):
        np.testing.assert_allclose(mat, direct[r], atol=1e-12)
    np.testing.assert_allclose(comp["mean"], np.mean([direct[0], direct[1]], axis=0), atol=1e-12)
    assert np.all(np.diag(comp["mean"]) == 0)
    assert json.loads((rep / "report.json").read_text())["complementarity"] == comp


def test_summary_has_last_eval_complementarity_and_samples(run, report):
    out, _ = run
    md = (report[1] / "summary.md").read_text()
    assert "Status: finished" in md and "## Last round (1)" in md
    summary = json.loads((out / "summary.json").read_text())
    ev = summary["policies"]["llama_bpe"]["eval"]
    assert re.search(rf"\| llama_bpe \| end of run \| {ev['success']:.4g} \| {ev['n']} \|", md)
    assert "## Complementarity" in md and "| fails \\ solves | llama_bpe | gpt2_uni |" in md
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    for s in samples:
        if s["round"] == 1:
            assert s["prompt"] in md and f"**{s['policy']}**" in md
    for name in FIGURES:
        assert f"({name}.png)" in md


def test_cli_report_of_a_killed_run(run, tmp_path):
    out, _ = run
    killed = tmp_path / "killed"
    shutil.copytree(out, killed)
    (killed / "summary.json").unlink()
    with (killed / "metrics.jsonl").open("a") as f:
        f.write('{"round": 2, "policy": "llama_bpe", "reward/mean": 0.')  # torn by the kill
    first = (killed / "groups.jsonl").read_text().splitlines()[0]
    with (killed / "groups.jsonl").open("a") as f:  # round 2 logged by one policy only
        f.write(json.dumps(dict(json.loads(first), round=2)) + "\n")
    assert cli.main(["report", str(killed), "--out", str(tmp_path / "rep")]) == 0
    report = json.loads((tmp_path / "rep" / "summary.json").read_text())
    assert report == json.loads((tmp_path / "rep" / "report.json").read_text())
    assert report["status"] == "partial" and report["last_round"] == 1
    assert report["figures"]["complementarity"] == "complementarity.png"
    assert report["complementarity"]["rounds"] == [0, 1]
    md = (tmp_path / "rep" / "summary.md").read_text()
    assert "in progress or stopped" in md
    assert "| llama_bpe | 1 |" in md  # the last eval logged during the run (round 1)


def test_cli_report_refuses_to_overwrite_a_run_and_needs_one(run, tmp_path):
    out, _ = run
    assert cli.main(["report", str(out), "--out", str(out)]) == 2  # would overwrite the run's summary.json
    assert cli.main(["report", str(tmp_path / "nothing"), "--out", str(tmp_path / "r2")]) == 2


def test_train_progress_off_a_terminal_prints_at_most_one_line_per_round(run):
    _, err = run
    lines = [line for line in err.splitlines() if line.startswith("[train]")]
    rounds = [line for line in lines if re.match(r"\[train\] round \d+", line)]
    assert 1 <= len(rounds) <= 2
    assert len({re.match(r"\[train\] round (\d+)", line).group(1) for line in rounds}) == len(rounds)
    assert "(compile" in rounds[0]
    assert "llama_bpe: reward" in rounds[0] and "gpt2_uni: reward" in rounds[0] and "kl" in rounds[0]
    assert "reward nan" not in err and "eval success llama_bpe" in err


def test_groups_are_kept_out_of_metrics_and_truncated_on_resume(tmp_path):
    from mrl_jax.trainer.metrics import RunLog

    log = RunLog(tmp_path, tensorboard=False, progress=False)
    for r in range(4):
        g = {"prompt_ids": [7, 9], "rewards": [[0.0, 1.0], [0.0, 0.0]], "tau": 1.0}
        log.log_round(r, {"a": {"reward/mean": 0.25, "groups": g}, "b": {"reward/mean": 0.0, "groups": g}})
    log.truncate_after(1)
    log.close()
    groups = [json.loads(line) for line in (tmp_path / "groups.jsonl").read_text().splitlines()]
    assert [(g["round"], g["policy"]) for g in groups] == [(0, "a"), (0, "b"), (1, "a"), (1, "b")]
    assert groups[0]["prompt_ids"] == [7, 9] and groups[0]["rewards"] == [[0.0, 1.0], [0.0, 0.0]]
    assert "groups" not in (tmp_path / "metrics.jsonl").read_text()


def _captured_figure(monkeypatch, draw):
    """Run ``draw()`` (which saves and closes a matplotlib figure) and return that figure, drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figs = []
    monkeypatch.setattr(plt, "close", lambda fig=None: figs.append(fig))
    draw()
    fig = figs[-1]
    fig.canvas.draw()
    return fig


@pytest.mark.parametrize("rounds", [3, 7])
def test_metric_figures_are_readable(tmp_path, monkeypatch, rounds):
    """Every panel: a title that is not the raw key, a y label with the quantity, 'round' on x with integer
    ticks only; one figure legend, outside every panel; the eval line only on a fraction panel."""
    from mrl_jax.report.data import RunRecords
    from mrl_jax.report.figures import axis_labels, metric_panels

    keys = ["sgt/rows_fired", "sgt/prompts_failed", "sgt/prompts_rescued", "sgt/nll", "reward/success_rate"]
    train_recs = [{"round": r, "policy": p, **{k: (r + 1) * (i + 1) / 10 for i, k in enumerate(keys)}}
                  for r in range(rounds) for p in ("a", "b")]
    evals = [{"round": r, "policy": p, "success": 0.5} for r in range(0, rounds, 2) for p in ("a", "b")]
    run = RunRecords(run_dir=tmp_path, train=train_recs, evals=evals, groups=[], samples=[], summary=None,
                     config=None)
    fig = _captured_figure(monkeypatch, lambda: metric_panels(run, keys, tmp_path / "f.png", "t", evals=True))
    assert (tmp_path / "f.png").is_file()
    panels = [ax for ax in fig.axes if ax.axison]
    assert len(panels) == len(keys)
    for ax, key in zip(panels, keys):
        assert ax.get_title() not in ("", key) and ax.get_title() == axis_labels(key)[0]
        assert ax.get_ylabel() == axis_labels(key)[1] and ax.get_xlabel() == "round"
        lo, hi = ax.get_xlim()
        ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks
        assert ax.get_legend() is None
        dashed = [ln for ln in ax.get_lines() if ln.get_linestyle() == "--"]
        assert bool(dashed) == (key == "reward/success_rate")   # eval success only beside another fraction
    assert len(fig.legends) == 1
    legend_box = fig.legends[0].get_window_extent()
    assert not any(legend_box.overlaps(ax.get_window_extent()) for ax in panels)
    assert "fraction" in axis_labels("sgt/prompts_failed")[1] and "per round" in axis_labels("sgt/rows_fired")[1]
