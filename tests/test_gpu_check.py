"""benchmarks/gpu_check.py, the one-shot script a lent accelerator runs: its slot sampler section on the CPU at
tiny shapes, so the device session does not find it broken."""
import importlib.util
import json
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


def _load(monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    gpu_check = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", gpu_check)   # its dataclasses look their module up
    spec.loader.exec_module(gpu_check)
    return gpu_check


def test_the_slot_sampler_section_runs_and_moves_the_tail(tmp_path, monkeypatch):
    """16 rows on long-tailed lengths: the ladder moves to 8 slots (fewer row-steps than 16 fixed slots) and both
    slot runs give the static sampler's tokens (f32 on the CPU: equal exactly)."""
    gpu_check = _load(monkeypatch)
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--tiny", "--sections", "model,slots_longtail", "--out", str(out)]) == 0
    r = json.loads(out.read_text())["sections"]["slots_longtail"]
    assert "error" not in r, r.get("traceback")
    ladder, fixed = r["slots_ladder"], r["slots_fixed"]
    assert ladder["rungs"] == [16, 8] and fixed["rungs"] == [16]
    assert ladder["tokens_equal_fraction"] == fixed["tokens_equal_fraction"] == 1.0
    assert ladder["row_steps_per_kept_token"] < fixed["row_steps_per_kept_token"]


def test_the_cudnn_section_runs_its_plumbing_on_the_cpu(tmp_path, monkeypatch, capsys):
    """--tiny on the CPU: the update's and the prefill's attention, "cudnn" (jax's XLA implementation here) beside
    ours, timed, printed and within bf16 rounding of ours; without --tiny the section says why it skips."""
    gpu_check = _load(monkeypatch)
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--tiny", "--sections", "cudnn_attention", "--out", str(out)]) == 0
    r = json.loads(out.read_text())["sections"]["cudnn_attention"]
    assert "error" not in r, r.get("traceback")
    assert r["implementation"] == "xla"
    update, prefill = r["update_4x(8+24)"], r["prefill_4x16"]
    assert set(update) == {"cudnn", "blockwise", "dense", "completion_mean"} and set(prefill) == {"cudnn", "dense"}
    assert update["cudnn"]["max_rel_diff_vs_blockwise"] < 3e-2 and prefill["cudnn"]["max_rel_diff_vs_dense"] < 3e-2
    assert update["cudnn"]["median_s"] > 0 and update["blockwise"]["speedup_vs_blockwise"] == 1.0
    printed = capsys.readouterr().out
    assert "[gpu_check] cudnn_attention update_4x(8+24): cudnn " in printed and ", blockwise " in printed
    assert gpu_check.main(["--sections", "cudnn_attention", "--out", str(out)]) == 0
    skipped = json.loads(out.read_text())["sections"]["cudnn_attention"]["skipped"]
    assert skipped == "no CUDA GPU: cuDNN's path runs only there (use --tiny for the plumbing)"
