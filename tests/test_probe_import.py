"""Probes by import path (``probes: "pkg.mod:factory:k=v+sgt"``): the worked example (experiments/probes/hedge.py)
is exactly the mix of ``none`` and ``xgrpo`` it documents, chains with built-ins, and every way a researcher's
factory can go wrong is one line naming the spec (a ConfigError naming the config key in a run config)."""
import jax
import numpy as np
import pytest

from mrl_jax import probes
from mrl_jax.configs import ConfigError
from mrl_jax.trainer.config import PolicySpec
from test_probes import _close, _grads, _make

HEDGE = "experiments.probes.hedge:hedge"


def _batch():
    return _make([[1, 0, 0], [0, 1, 1]], [[1, 1, 0], [0, 0, 0]])[:2]


def test_hedge_is_the_documented_mix_of_none_and_xgrpo():
    batch, view = _batch()
    l0, g0, _ = _grads("none", batch, view)
    l1, g1, _ = _grads("xgrpo", batch, view)
    assert abs(float(l1) - float(l0)) > 1e-4   # the peers' groups move the pooled baseline
    lz, gz, _ = _grads(f"{HEDGE}:lam=0.0", batch, view)
    lo, go, _ = _grads(f"{HEDGE}:lam=1.0", batch, view)
    lh, gh, m = _grads(f"{HEDGE}:lam=0.25", batch, view)
    _close(gz, g0, rtol=1e-5, atol=1e-7)
    _close(go, g1, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(float(lh), 0.75 * float(l0) + 0.25 * float(l1), rtol=1e-5)
    _close(gh, jax.tree.map(lambda a, b: 0.75 * a + 0.25 * b, g0, g1), rtol=1e-4, atol=1e-7)
    assert float(m["hedge/shift"]) > 0 and float(m["hedge/lam"]) == 0.25


def test_an_external_probe_chains_with_builtins():
    batch, view = _batch()
    l_n, g_n, _ = _grads("none", batch, view)
    l_s, g_s, _ = _grads("sgt", batch, view)
    l_c, g_c, m = _grads("tests.probe_fixtures:scaled:factor=3.0+sgt", batch, view)
    # scaled advantages triple the PG term; SGT adds its rescue term on top
    np.testing.assert_allclose(float(l_c), 3 * float(l_n) + float(l_s - l_n), rtol=1e-5, atol=1e-6)
    _close(g_c, jax.tree.map(lambda a, b: 3 * a + b - a, g_n, g_s), rtol=1e-4, atol=1e-6)
    chain = probes.make_probe(f"{HEDGE}:lam=0.2+sgt:lam=0.3")
    assert chain.name == "hedge+sgt" and chain.needs_peers
    assert "sgt/rows_fired" in m


def test_the_factory_gets_the_runs_options():
    opts = probes.RunOptions(scale_rewards="batch", reward_eps=1e-3, tau=0.5)
    assert probes.make_probe("tests.probe_fixtures:scaled", opts).options == opts
    assert probes.make_probe("tests.probe_fixtures:scaled").options == probes.RunOptions()


@pytest.mark.parametrize("spec, words", [
    ("no_such_pkg.probes:hedge", ["cannot import 'no_such_pkg.probes'", "ModuleNotFoundError", "PYTHONPATH"]),
    ("tests.probe_fixtures_broken:x", ["cannot import", "RuntimeError: this module is broken on import"]),
    ("tests.probe_fixtures:missing", ["module 'tests.probe_fixtures' has no 'missing'"]),
    ("tests.probe_fixtures:NOT_CALLABLE", ["is a int, not a probe factory"]),
    ("tests.probe_fixtures:not_a_probe", ["returned a dict, not a mrl_jax.probes.Probe"]),
    ("tests.probe_fixtures:scaled:gain=2", ["bad options", "unexpected keyword argument 'gain'",
                                             "scaled(options: mrl_jax.probes._probe.RunOptions, factor: float = 2.0)"]),
    (f"{HEDGE}:lam", ["must be key=value"]),
    ("tests.probe_fixtures", ["is not 'package.module:factory[:key=value,...]'"]),
    ("sgtx", ["unknown probe 'sgtx'", "by import path"]),
])
def test_bad_import_path_probes_are_one_line_errors(spec, words):
    with pytest.raises(ValueError) as e:
        probes.make_probe(spec + "+sgt")
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg
    with pytest.raises(ConfigError) as c:   # in a run config: the config key names where
        PolicySpec(name="a", probes=spec)
    assert str(c.value).startswith("config key 'probes': ") and "\n" not in str(c.value)


def test_a_factory_that_rejects_a_value_is_a_config_error():
    with pytest.raises(ConfigError, match=r"config key 'probes'.*hedge: lam must be in \[0, 1\], got 2"):
        PolicySpec(name="a", probes=f"{HEDGE}:lam=2")


# ----------------------------------------------------------------------------- on the bandit lab's plane

def test_an_external_probe_is_placed_on_the_bandit_plane(tmp_path):
    """Monte Carlo through the same objective: hedge at lam=1 trains exactly as the lab's xgrpo (same seeds), at
    lam=0 as none (zero out-of-support gain); it has no closed form, so no exact column."""
    from mrl_jax.bandit import env as E
    from mrl_jax.bandit import lab
    specs = (f"{HEDGE}:lam=0.0", f"{HEDGE}:lam=1.0", "none", "xgrpo")
    cfg = lab.LabConfig(probes=specs, group_sizes=(2,), sigmas=(0.0,), headline_G=2, headline_sigma=0.0,
                        steps=10, seeds=2, record_every=5, compile_mode="fast",
                        env=E.EnvConfig(num_arms=4, policies=("tabular", "fourier")))
    got = lab.run(str(tmp_path), config=cfg, verbose=False)["probes"]
    for a, b in ((specs[0], "none"), (specs[1], "xgrpo")):
        np.testing.assert_allclose(got[a]["final_reward"], got[b]["final_reward"], rtol=1e-6)
        np.testing.assert_allclose(got[a]["support"], got[b]["support"], atol=1e-7)
        assert got[a]["exact"] is False and "support_exact" not in got[a]
    assert got["xgrpo"]["final_reward"] != got["none"]["final_reward"]
    assert (tmp_path / "plane.png").stat().st_size > 100


def test_the_bandit_lab_names_a_bad_probe_spec():
    from mrl_jax.bandit import lab
    with pytest.raises(ConfigError, match=r"config key 'probes': unknown bandit probe 'no_such\.mod:p'.*cannot import"):
        lab.LabConfig(probes=("none", "no_such.mod:p"))


# ----------------------------------------------------------------------------- end to end: `mrl train`

OUTSIDE = '''
from mrl_jax import probes

def gentle_sgt(options, lam=0.05):
    """A researcher's probe kept outside the repository: SGT with a small weight, under its own name."""
    return probes.sgt(lam=lam, options=options)._replace(name="gentle_sgt")
'''


@pytest.mark.usefixtures("jax_compile_cache")
def test_mrl_train_runs_the_worked_example_and_a_probe_from_outside_the_repo(tmp_path, monkeypatch):
    import json

    import yaml

    import support
    from mrl_jax.cli import main

    (tmp_path / "lab_probes_outside.py").write_text(OUTSIDE)
    monkeypatch.syspath_prepend(str(tmp_path))
    data = support.tiny_config(rounds=2, **{"policies.0.probes": f"{HEDGE}:lam=0.5+sgt",
                                         "policies.1.probes": "lab_probes_outside:gentle_sgt:lam=0.02+xgrpo"})
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(data))
    out = tmp_path / "run"
    assert main(["train", "--config", str(cfg), "--out", str(out)]) == 0
    assert json.loads((out / "summary.json").read_text())["rounds"] == 2
    records = support.training_records(out)
    assert support.contiguity_problems(records, ["llama_bpe", "gpt2_uni"], 2) == []
    llama = [r for r in records if r["policy"] == "llama_bpe"]
    gpt2 = [r for r in records if r["policy"] == "gpt2_uni"]
    assert all(r["hedge/lam"] == 0.5 and "sgt/rows_fired" in r for r in llama)
    assert all("sgt/rows_fired" in r and "xgrpo/peer_solved_frac" in r for r in gpt2)
