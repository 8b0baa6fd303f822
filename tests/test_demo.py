"""The embedded-default demo end to end on a tiny budget, and its honest verdict."""
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import support
from mrl_jax.demo import _verdict

REPO = Path(__file__).resolve().parents[1]
# run_demo in a fresh process: an xdist worker that had imported torch (other modules' parity tests) segfaulted
# twice inside XLA:CPU while this test compiled (once in backend_compile_and_load, once in deserialize_executable);
# a process with jax alone is what `mrl demo` runs in; like `mrl demo`, it keeps a persistent compilation cache (the
# suite's, `support.compile_cache_dir`, else its own): the second probe's runs load the programs the first compiled
TINY_DEMO = """
import json, sys
from mrl_jax import compile_cache
from mrl_jax.demo import DemoSettings, run_demo
import jax
from mrl_jax.trainer import evaluation, run as run_mod

lrs, real = [], run_mod.warm_start
run_mod.warm_start = lambda *a, **kw: lrs.append(kw["learning_rate"]) or real(*a, **kw)
evals, generate = set(), evaluation.mesh_generate   # the params' sharding of every evaluation, per policy
evaluation.mesh_generate = lambda pol, params, *a, **kw: evals.add(
    (pol.name, repr(jax.tree.leaves(params)[0].sharding))) or generate(pol, params, *a, **kw)
s = DemoSettings(seeds=1, rounds=2, prompts_per_round=8, num_generations=4, sft_steps=3, num_facts=8,
                 eval_copy_prompts=8, eval_every=1, sft_learning_rate=2e-3)
compile_cache.enable(sys.argv[2])
summary = run_demo(sys.argv[1], probes=["none", "sgt"], settings=s)
print(json.dumps({"lrs": lrs, "round_time_split_s": summary["round_time_split_s"], "eval_shardings": sorted(evals)}))
"""


def test_demo_tiny_budget_writes_every_artefact(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = tmp_path / "demo"
    cache = support.compile_cache_dir() or str(tmp_path / "jax_cache")
    proc = subprocess.run([sys.executable, "-c", TINY_DEMO, str(out), cache], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    # the warm start's evaluation samples from params on the runs' meshes, as theirs do: one sampler program each
    names = [name for name, _ in summary["eval_shardings"]]
    assert sorted(set(names)) == sorted(names) == ["gpt2-unigram", "llama-bpe"], summary["eval_shardings"]
    assert summary["lrs"] == [2e-3, 2e-3]   # the runs' warm start (WarmStartSpec), once per policy and seed, shared by the probes
    for name in ("summary.json", "summary.md", "curves.png", "success.png"):
        assert (out / name).stat().st_size > 0
    on_disk = json.loads((out / "summary.json").read_text())
    assert set(on_disk["probes"]) == {"none", "sgt"}
    for probe, entry in on_disk["probes"].items():
        assert set(entry) == {"llama-bpe", "gpt2-unigram"}
        for pol in entry.values():
            for col in ("own_facts", "foreign_facts", "copy"):
                assert 0.0 <= pol[col]["mean"] <= 1.0 and len(pol[col]["values"]) == 1
            assert len(pol["reward_curve"]) == 2
            sc = pol["success_curve"]  # warm start, the eval after round 1, the final eval
            assert sc["rounds"] == [0, 1, 2] and len(sc["foreign_facts"]["mean"]) == 3
            assert sc["own_facts"]["mean"][-1] == pol["own_facts"]["mean"]
    assert (on_disk["probes"]["none"]["llama-bpe"]["success_curve"]["copy"]["mean"][0]
            == on_disk["warm_start"]["llama-bpe"]["copy"]["mean"])
    assert on_disk["periodic_eval"]["evaluations"] == 2 and on_disk["periodic_eval"]["seconds"] > 0
    # the mechanism counters come from the probes that produce them, and only from those
    assert "sgt/rows_fired" in on_disk["probes"]["sgt"]["llama-bpe"]["counters"]
    assert "sgt/rows_fired" not in on_disk["probes"]["none"]["llama-bpe"]["counters"]
    assert summary["round_time_split_s"]["update"] > 0
    assert "| sgt |" in (out / "summary.md").read_text()


def test_rounds_flag_sets_the_rounds_and_refuses_fewer_than_one(tmp_path, monkeypatch, capsys):
    import mrl_jax.demo
    from mrl_jax.cli import main

    seen = []
    monkeypatch.setattr(mrl_jax.demo, "run_demo", lambda out, **kw: seen.append(kw) or {})
    assert main(["demo", "--quick", "--rounds", "3", "--out", str(tmp_path / "a")]) == 0
    (kw,) = seen
    quick = mrl_jax.demo.DemoSettings.make(True, None)
    assert kw["settings"].rounds == 3 and kw["settings"] == dataclasses.replace(quick, rounds=3)   # the rest: --quick's
    capsys.readouterr()
    assert main(["demo", "--rounds", "0", "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err.strip()
    assert "--rounds 0: must be >= 1" in err and "\n" not in err, err
    assert len(seen) == 1


def _entry(own, foreign, std=0.0):
    cell = lambda m: {"mean": m, "std": std, "values": [m]}
    return {"p": {"own_facts": cell(own), "foreign_facts": cell(foreign), "copy": cell(0.5)}}


def test_verdict_says_when_sharing_did_not_help():
    summary = {"probes": {"none": _entry(1.0, 0.0, 0.05), "xgrpo": _entry(1.0, 0.02, 0.05),
                          "sgt": _entry(0.8, 0.5, 0.05)}}
    lines = _verdict(summary, ["p"])
    assert any(l.startswith("xgrpo, p: foreign facts did not change (within 2 s.e.)") for l in lines)
    assert any(l.startswith("sgt, p: foreign facts gained (+0.50") and "own facts -0.20" in l for l in lines)
