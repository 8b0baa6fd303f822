"""The progress display (issue 16): plain lines off a terminal (at most one per round, compile rounds
labelled, ETA without them), the live rich line, the key figures per policy, RunLog's use of it (eval
success instead of ``reward nan``)."""

import io
import re
import time

import jax
import jax.numpy as jnp
import pytest

import mrl_jax.report.progress as progress_mod

from mrl_jax.report.progress import Progress, compile_seconds, round_figures
from mrl_jax.trainer.metrics import RunLog

METRICS = {"llama": {"reward/mean": 0.25, "reward/success_rate": 0.125, "kl": 0.002, "sgt/rows_fired": 3.0,
                     "loss": 1.0},
           "gpt2": {"reward/mean": 0.5, "reward/success_rate": 0.0, "kl": 0.01, "prp/ess": 0.4}}


def test_round_figures_show_reward_success_kl_and_the_probe_counter():
    text = round_figures(METRICS, {"llama": 0.75})
    assert "llama: reward 0.25 success 0.125 kl 0.002 sgt rows 3" in text
    assert "gpt2: reward 0.5 success 0 kl 0.01 prp ess 0.4" in text
    assert text.endswith("eval success llama 0.750")
    assert "loss" not in text


def test_plain_lines_at_most_one_per_round_with_compile_label_and_eta():
    buf = io.StringIO()
    bar = Progress(6, title="train", stream=buf, min_interval=0.0)
    assert not bar.live  # a StringIO is not a terminal
    for r in range(6):
        bar.start(str(r), compile=r == 0)
        bar.done(round_figures(METRICS), label=str(r))
    bar.close()
    lines = buf.getvalue().splitlines()
    assert len(lines) == 6
    assert [re.match(r"\[train\] round (\d+)", line).group(1) for line in lines] == [str(r) for r in range(6)]
    assert "(compile" in lines[0] and all("(compile" not in line for line in lines[1:])
    assert "1/6" in lines[0] and "6/6" in lines[-1]
    assert "eta ?" in lines[0] and re.search(r"eta \d+:\d\d", lines[1])  # ETA once a non-compile step is timed
    assert len(bar.durations) == 5  # the compile round is left out of the ETA


def test_plain_lines_are_periodic():
    buf = io.StringIO()
    bar = Progress(50, title="demo", stream=buf, min_interval=3600.0)
    for r in range(50):
        bar.start(str(r))
        bar.done("x")
    lines = buf.getvalue().splitlines()
    assert len(lines) == 2 and "1/50" in lines[0] and "50/50" in lines[1]  # first and last only


def test_a_step_that_compiles_is_labelled_after_the_fact(request):
    # a persistent compilation cache (turned on by earlier tests in this process) adds the program's write to
    # the step, which can outlast a tiny compile: off here, so the step is the compile
    was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    request.addfinalizer(lambda: jax.config.update("jax_enable_compilation_cache", was))
    compile_seconds()  # start listening
    buf = io.StringIO()
    bar = Progress(2, title="t", stream=buf, min_interval=0.0)
    bar.start("a")
    before = compile_seconds()
    c = float(time.time_ns() % 1_000_003)   # a constant of this run: no persistent-cache hit from an earlier run
    jax.jit(lambda x: jnp.sin(x) * c + x.sum())(jnp.arange(7.0)).block_until_ready()
    assert compile_seconds() > before                # the listener saw a real compile
    progress_mod._compile_s[0] += 60.0                # and the step is labelled by what it reports (a 0.1 s
    bar.done()                                        # compile against a loaded step's wall time is a coin flip)
    bar.start("b")
    bar.done()
    a, b = buf.getvalue().splitlines()
    assert "(compile" in a and "(compile" not in b


@pytest.mark.parametrize("auto_refresh", [True, False])
def test_live_line_renders_with_rich(auto_refresh):
    buf = io.StringIO()
    bar = Progress(3, title="bench", unit="benchmark", stream=buf, live=True, auto_refresh=auto_refresh)
    assert bar.live
    for name in ("rollout", "thl", "see"):
        bar.start(name)
        bar.done(f"{name} ok")
    bar.close()
    out = buf.getvalue()
    assert "bench benchmark see" in out and "3/3" in out and "see ok" in out
    assert "\x1b[" in out  # terminal control codes: one line that updates


def test_run_log_progress_one_line_per_round_and_eval_success(tmp_path):
    buf = io.StringIO()
    log = RunLog(tmp_path, tensorboard=False, rounds=(0, 3),
                 progress=Progress(3, title="train", stream=buf, min_interval=0.0))
    for r in range(3):
        log.log_round(r, METRICS)
        log.log_round(r, {"llama/eval": {"success": 0.5 + r / 10}, "gpt2/eval": {"success": 0.25}})
    log.close()
    lines = buf.getvalue().splitlines()
    rounds = [line for line in lines if re.match(r"\[train\] round \d", line)]
    assert len(rounds) == 3 and "(compile" in rounds[0]
    assert "nan" not in buf.getvalue()
    assert "eval success llama 0.500 gpt2 0.250" in rounds[1]  # round 0's eval, beside the next round
    assert lines[-1].startswith("[train] 3 rounds logged; eval success llama 0.700 gpt2 0.250")

