"""`mrl report` plots the sampled evaluation (pass@k per policy and population) and tables the final one."""
import json

from mrl_jax.report import write_report


def test_report_plots_pass_at_k_and_tables_population(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    recs = []
    for r in (0, 1):
        recs += [{"round": r, "policy": p, "reward/mean": 0.1 * r} for p in ("a", "b")]
        recs += [{"round": r, "policy": f"{p}/eval", "success": 0.2, "avg@4": 0.25, "pass@1": 0.25, "pass@4": 0.5,
                  "maj@4": 0.3} for p in ("a", "b")]
        recs.append({"round": r, "policy": "population/eval", "success": 0.4, "pass@1": 0.4, "pass@4": 0.75})
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in recs))
    summary = {"policies": {"a": {"eval": {"success": 0.2, "pass@1": 0.25, "pass@4": 0.5}},
                            "b": {"eval": {"success": 0.1, "pass@1": 0.125, "pass@4": 0.375}}},
               "population": {"pass@1": 0.4, "pass@4": 0.75, "policies": ["a", "b"],
                              "transfer": [[0.0, 0.125], [0.25, 0.0]]}}
    (run / "summary.json").write_text(json.dumps(summary))
    rep = write_report(run, tmp_path / "rep")
    assert rep["figures"]["pass_at_k"] == "pass_at_k.png" and (tmp_path / "rep" / "pass_at_k.png").stat().st_size > 0
    assert rep["last_eval"]["population"]["pass@4"] == 0.75
    md = (tmp_path / "rep" / "summary.md").read_text()
    assert "| policy | pass@1 | pass@4 |" in md and "| b | 0.125 | 0.375 |" in md
    assert "| **population** | 0.4 | 0.75 |" in md and "| b | 0.25 | 0 |" in md


def test_complementarity_uses_the_logged_verifier_success():
    from mrl_jax.report.data import complementarity

    groups = [{"round": 0, "policy": "a", "prompt_ids": [1, 2], "rewards": [[1.2, 0.0], [0.0, 0.0]], "tau": 1.0,
               "success": [[False, False], [False, False]]},
              {"round": 0, "policy": "b", "prompt_ids": [1, 2], "rewards": [[0.5, 0.0], [1.0, 0.0]], "tau": 1.0,
               "success": [[False, False], [True, False]]}]
    assert complementarity(groups, ["a", "b"])["mean"] == [[0.0, 0.5], [0.0, 0.0]]
    for g in groups:
        del g["success"]   # older logs: reward >= tau
    assert complementarity(groups, ["a", "b"])["mean"] == [[0.0, 0.5], [0.5, 0.0]]
