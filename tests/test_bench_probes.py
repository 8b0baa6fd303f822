"""`mrl bench probes`: the quick comparison writes every section, its cells are reused, a killed cell reruns, a
bad spec is one line before any training; the paired statistics are Student's t."""
import json
import math

import pytest

from mrl_jax.bench import probes as B

pytestmark = pytest.mark.usefixtures("jax_compile_cache")
# the worked example as benchmarks/PROBES.md runs it (an import-path probe chained with `sgt` has its loss and
# gradients checked in tests/test_probe_import.py; chained here, a facts cell compiled 40 s instead of 24, contended)
HEDGE = "experiments.probes.hedge:hedge:lam=0.5"


def test_paired_difference_is_students_t():
    d = B.paired([1.0, 2.0, 3.0], [0.0, 0.0, 1.0])           # differences 1, 2, 2
    assert d["mean"] == pytest.approx(5 / 3) and d["se"] == pytest.approx(1 / 3)
    assert d["t"] == pytest.approx(5.0)
    assert d["p"] == pytest.approx(1 - 5 / math.sqrt(27))    # two-sided, 2 degrees of freedom (closed form)
    assert B.paired([1.0], [0.5]) == {"mean": 0.5, "se": None, "n": 1, "t": None, "p": None}


@pytest.mark.slow
def test_quick_comparison_writes_every_section_and_reuses_its_cells(tmp_path, capsys, monkeypatch, fresh_clone):
    """Run as PROBES.md runs it, from a clean clone's root on the README's plain install (tests/installs.py)."""
    import shutil

    import mrl_jax.trainer
    from mrl_jax.cli import main

    out = tmp_path / "bench"
    proc = fresh_clone.run(f"python -m mrl_jax.cli bench probes --quick --probes none,{HEDGE} --out {out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((out / "probes.json").read_text())
    assert res["probes_run"] == ["none", HEDGE] and res["settings"]["seeds"] == 1
    assert list(res["workloads"]) == ["facts", "reasoning"]
    for task, skills, n_policies in (("facts", ["own_facts", "foreign_facts", "copy"], 2),
                                     ("reasoning", ["copy", "rev", "sort"], 3)):
        w = res["workloads"][task]
        s, names = w["settings"], w["policies"]
        assert len(names) == n_policies and w["skills"] == skills
        for p in ("none", HEDGE):
            e = w["probes"][p]
            for n in names + ["average"]:    # warm start, then every round (quick: eval_every 1)
                assert e["curves"][n]["rounds"] == list(range(s["rounds"] + 1))
                assert len(e["curves"][n]["mean"]) == s["rounds"] + 1
            for n in names:
                for k in skills + ["pass@1", "kl", "grad_norm_spread", "skipped_updates", "s_per_round/update",
                                   "rows_computed", "reward_at_1_gain"]:
                    assert e["figures"][f"{n}/{k}"]["mean"] is not None, (task, p, n, k)
            gain = e["figures"]["average/reward_at_1_gain"]["mean"]
            curve = e["curves"]["average"]["mean"]
            assert gain == pytest.approx(curve[-1] - curve[0])
        assert "vs_none" not in w["probes"]["none"]
        assert w["probes"][HEDGE]["vs_none"]["average/reward_at_1_final"]["n"] == 1
        cells = sorted((out / task / "cells").glob("*/seed0"))
        assert len(cells) == 2 and all((c / "summary.json").is_file() for c in cells)
        for f in (f"{task}_reward_at_1.png", f"{task}_skills.png"):
            assert (out / f).stat().st_size > 1000
    # the reasoning curve is the sampled reward@1 (pass@1 of the K samples), not the greedy success
    cell = out / "reasoning" / "cells" / "none" / "seed0"
    before = json.loads((cell / "summary.json").read_text())["before"]
    name = res["workloads"]["reasoning"]["policies"][0]
    first = res["workloads"]["reasoning"]["per_cell"]["none"][0]["policies"][name]["reward_at_1"]["values"][0]
    assert first == before[name]["pass@1"]
    for p in ("none", HEDGE):
        assert 0.0 <= res["bandit"][p]["support"] <= 1.0
    assert res["bandit"]["none"]["support"] == 0.0 and res["bandit"]["none"]["exact"] is True
    assert res["bandit"][HEDGE]["exact"] is False
    md = (out / "PROBES.md").read_text()
    for section in ("Task `facts`", "Task `reasoning`", "reward@1", "Final skills", "pass@k", "Stability", "Cost",
                    "bandit lab"):
        assert section in md
    assert (out / "bandit/plane.png").stat().st_size > 1000
    cells = sorted((out / "facts" / "cells").glob("*/seed0"))
    stamps = {c: (c / "summary.json").stat().st_mtime_ns for c in cells}

    # two worker processes reuse the finished cells and give the same figures
    assert B.compare(out, ["none", HEDGE], quick=True, verbose=False, jobs=2)["workloads"] == res["workloads"]

    # a killed cell (no summary.json, a half-written file) is deleted and trained again from its start; a
    # finished one is skipped (the training is the trainer's, stood in for here by the first run's files)
    killed = out / "facts" / "cells" / B.slug(HEDGE) / "seed0"
    saved = tmp_path / "saved"
    shutil.copytree(killed, saved)
    (killed / "summary.json").unlink()
    (killed / "junk.tmp").write_text("half written")
    calls = []

    def fake_train(cfg, cell, **kw):
        calls.append((cfg.policies[0].probes, sorted(p.name for p in cell.iterdir())))
        for f in saved.iterdir():
            if f.name != "cell.json":
                (shutil.copytree if f.is_dir() else shutil.copy)(f, cell / f.name)

    monkeypatch.setattr(mrl_jax.trainer, "train", fake_train)
    again = B.compare(out, ["none", HEDGE], quick=True, verbose=False)
    assert calls == [(HEDGE, ["cell.json"])]            # only the killed cell, in a fresh directory
    none = out / "facts" / "cells" / "none" / "seed0"
    assert (none / "summary.json").stat().st_mtime_ns == stamps[none]
    assert not (killed / "junk.tmp").exists()
    assert {w: r["probes"] for w, r in again["workloads"].items()} == {w: r["probes"] for w, r in res["workloads"].items()}
    monkeypatch.undo()

    capsys.readouterr()
    assert main(["bench", "probes", "--quick", "--probes", "none,no_such.mod:p", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mrl bench: config error: --probes: probe 'no_such.mod:p': cannot import") and "\n" not in err
    for flags, msg in ((["--tasks", "facts,maths"], "--tasks: unknown task 'maths'; choose from facts, reasoning"),
                       (["--jobs", "0"], "--jobs: must be >= 1, got 0")):
        assert main(["bench", "probes", "--quick", *flags, "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert err == f"mrl bench: config error: {msg}", err


def test_jobs_workers_share_the_parents_compilation_cache(tmp_path):
    """``--jobs`` workers are spawned (fresh interpreters): each gets the parent's persistent compilation cache
    (or none), so a comparison compiles a shape once, not once per cell."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    for directory in (str(tmp_path / "xla"), None):
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=B._share_compile_cache,
                                 initargs=(directory,)) as pool:
            assert pool.submit(B._compile_cache_dir).result() == directory
