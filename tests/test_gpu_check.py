"""benchmarks/gpu_check.py, the one-shot script a lent accelerator runs: its slot sampler section on the CPU at
tiny shapes, so the device session does not find it broken."""
import importlib.util
import json
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


def test_the_slot_sampler_section_runs_and_moves_the_tail(tmp_path, monkeypatch):
    """16 rows on long-tailed lengths: the ladder moves to 8 slots (fewer row-steps than 16 fixed slots) and both
    slot runs give the static sampler's tokens (f32 on the CPU: equal exactly)."""
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    gpu_check = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", gpu_check)   # its dataclasses look their module up
    spec.loader.exec_module(gpu_check)
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--tiny", "--sections", "model,slots_longtail", "--out", str(out)]) == 0
    r = json.loads(out.read_text())["sections"]["slots_longtail"]
    assert "error" not in r, r.get("traceback")
    ladder, fixed = r["slots_ladder"], r["slots_fixed"]
    assert ladder["rungs"] == [16, 8] and fixed["rungs"] == [16]
    assert ladder["tokens_equal_fraction"] == fixed["tokens_equal_fraction"] == 1.0
    assert ladder["row_steps_per_kept_token"] < fixed["row_steps_per_kept_token"]
