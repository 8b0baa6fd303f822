"""experiments/reasoning/run.py's tables: per-run rows, and mean ± spread over seeds from run summaries."""

import importlib.util
import json
from pathlib import Path

RUN = Path(__file__).resolve().parents[1] / "experiments" / "reasoning" / "run.py"


def _module():
    spec = importlib.util.spec_from_file_location("reasoning_run", RUN)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _summary(b1, a1, b4, a4):
    ev = lambda p1, p4: {"success": 0.0, "pass@1": p1, "pass@2": 0.0, "pass@4": p4, "avg@4": p1}
    return {"before": {"pol": ev(b1, b4), "population": ev(b1, b4)},
            "policies": {"pol": {"eval": ev(a1, a4)}}, "population": ev(a1, a4)}


def test_collect_pairs_runs_and_reports_mean_and_sample_std(tmp_path):
    mod = _module()
    for seed, (b1, a1) in enumerate([(0.1, 0.2), (0.3, 0.6)]):
        d = tmp_path / f"rg_sgt_s{seed}"
        d.mkdir()
        (d / "summary.json").write_text(json.dumps(_summary(b1, a1, 0.5, 0.5)))
    (tmp_path / "rg_none_s0").mkdir()   # unfinished: no summary.json, not counted
    results = mod.collect(tmp_path)
    assert [(r["probes"], r["seed"]) for r in results] == [("sgt", 0), ("sgt", 1)]
    text = mod.seed_table(results)
    row = next(line for line in text.splitlines() if "| pol |" in line)
    # pass@1 before: mean 0.2, std 0.1414; after: mean 0.4, std 0.2828; pass@4: 0.5 ± 0 both
    assert row == "| rg | sgt | 2 | pol | 0.200 ± 0.141 | 0.400 ± 0.283 | 0.500 ± 0.000 | 0.500 ± 0.000 |"
    assert "K = 4" in text
