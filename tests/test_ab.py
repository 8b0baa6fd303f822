"""benchmarks/ab.py, the one A/B tool: both sides really run (their own modules, swapped in one process), a case's
outputs agree when the code is the same, and an unknown case is one line."""
import pytest

from benchmarks import ab


def test_see_add_case_runs_both_sides_of_the_same_revision_alike(monkeypatch):
    imported = []
    real = ab.Side.module

    def module(self, name):
        mod = real(self, name)
        imported.append((self.name, mod.__file__))
        return mod

    monkeypatch.setattr(ab.Side, "module", module)
    r = ab.run("HEAD", ("see_add",), quick=True, repeats=2)
    figs = r["figures"]
    assert set(figs) == {"see_add_10pct_successes", "see_add_50pct_successes"}
    assert all(f["same_output"] is True and len(f["head_all"]) == len(f["base_all"]) == 2 for f in figs.values())
    assert r["same_output"] and r["cases"] == ["see_add"]
    head = {f for side, f in imported if side == "head"}
    base = {f for side, f in imported if side == "base"}
    assert head and base and not head & base          # each side imported its own tree's mrl_jax.see
    assert all(str(ab.REPO) in f for f in head) and not any(f.startswith(str(ab.REPO / "mrl_jax")) for f in base)


def test_unknown_case_is_one_line():
    with pytest.raises(SystemExit, match="unknown --case 'nope'; choose from trl, rollout, slots, update, see_add, round"):
        ab.run("HEAD", ("nope",))
