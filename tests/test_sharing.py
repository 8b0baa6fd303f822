"""Faithful sharing through the path a researcher runs (issue "faithful sharing"): the KL reference, the
peers' samples with their multiplicity, cut texts, probe options from the run, run-config errors.

Each test goes through ``Run`` + ``run_round`` (the trainer's round) on the tiny two-policy config.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import support
from mrl_jax import grpo
from mrl_jax.configs import ConfigError
from mrl_jax.learner import rows_logp
from mrl_jax.tasks import RewardScorer
from mrl_jax.trainer import Run, run_round
from mrl_jax.trainer.checkpoint import RunCheckpointer
from mrl_jax.trainer.loop import text_budget


pytestmark = pytest.mark.usefixtures("jax_compile_cache")


def _run(**overrides):
    """``(run, its initial state)`` of the tiny config with ``overrides``."""
    run = Run(support.to_run_config(support.tiny_config(**overrides)))
    return run, run.initial_state()


class _Recorder:
    """Wraps each policy's update to keep the (params, batch) it was called with, round by round."""

    def __init__(self, run):
        self.calls = {p.name: [] for p in run.policies}
        self.policies = []
        for pol in run.policies:
            def rec(params, opt_state, ref, batch, view, key, step, _pol=pol):
                self.calls[_pol.name].append((jax.tree.map(jnp.copy, params), batch, view))
                return _pol.update(params, opt_state, ref, batch, view, key, step)
            self.policies.append(pol.__class__(**{**pol.__dict__, "update": rec}))


def _rounds(run, state, n, policies=None):
    out = []
    # digit_reward (support's signal reward): rewards vary from round 0, so the policy moves
    with RewardScorer(support.reward_specs({"faulty": {"seed": 0, "p": {}}})) as scorer:
        for r in range(n):
            state, metrics, _ = run_round(policies or run.policies, state, run.round_inputs(r), scorer)
            out.append(metrics)
    return state, out


# ----------------------------------------------------------------------------- the KL reference

def test_kl_reference_is_the_starting_policy_and_k3_matches_by_hand():
    run, start = _run(**{"policies.0.grpo": {"beta": 0.04}, "policies.0.probes": "none", "policies.1.probes": "none",
                  "policies.0.optimizer": {"learning_rate": 0.05}})
    pol, st = run.policies[0], start.policies[0]
    assert start.policies[1].ref_params is None                      # beta = 0: no reference held
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), st.ref_params, st.params)
    rec = _Recorder(run)
    state, metrics = _rounds(run, start, 4, rec.policies)
    assert abs(metrics[0][pol.name]["kl"]) < 1e-6                       # round 0: policy == reference
    # the first round whose update saw moved params (a round whose groups all have equal rewards moves
    # nothing): k3 of those params against the starting params, over own completion tokens
    moved = [r for r, (p, _, _) in enumerate(rec.calls[pol.name])
             if any(not np.array_equal(np.asarray(a), np.asarray(b))
                    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(st.ref_params)))]
    assert moved, "the policy never moved in 4 rounds"
    r = moved[0]
    params1, batch, _ = rec.calls[pol.name][r]
    model = lambda p: nnx.merge(pol.graphdef, p)
    prompt, pmask = batch.prompt_ids, batch.prompt_mask   # the own rows: one prompt row per completion
    lp = rows_logp(model(params1), prompt, pmask, batch.completion_ids, batch.completion_mask)[0]
    ref = rows_logp(model(st.ref_params), prompt, pmask, batch.completion_ids, batch.completion_mask)[0]
    m = np.asarray(batch.completion_mask)
    d = np.asarray(ref, np.float64) - np.asarray(lp, np.float64)
    k3 = float(np.sum((np.exp(d) - d - 1) * m) / m.sum())
    assert k3 > 1e-5                                                     # the policy has moved
    np.testing.assert_allclose(metrics[r][pol.name]["kl"], k3, rtol=2e-3, atol=1e-7)
    # the reference stays frozen (sync off) and is not the trained params
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 state.policies[0].ref_params, st.ref_params)


def test_reference_sync_mixes_toward_the_policy():
    run, start = _run(**{"policies.0.grpo": {"beta": 0.04}, "policies.0.probes": "none", "policies.1.probes": "none",
                  "policies.0.ref_model": {"sync_ref_model": True, "ref_model_sync_steps": 2,
                                           "ref_model_mixup_alpha": 0.25}})
    ref0 = jax.tree.map(np.asarray, start.policies[0].ref_params)
    s1, _ = _rounds(run, start, 1)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, s1.policies[0].ref_params), ref0)  # step 1
    run2, start2 = _run(**{"policies.0.grpo": {"beta": 0.04}, "policies.0.probes": "none", "policies.1.probes": "none",
                   "policies.0.ref_model": {"sync_ref_model": True, "ref_model_sync_steps": 2,
                                            "ref_model_mixup_alpha": 0.25}})
    s2, _ = _rounds(run2, start2, 2)                                             # step 2: synced once
    expect = jax.tree.map(lambda p, r: 0.25 * np.asarray(p) + 0.75 * r, s2.policies[0].params, ref0)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), b, rtol=1e-6, atol=1e-7),
                 s2.policies[0].ref_params, expect)


def test_reference_is_checkpointed(tmp_path):
    run, start = _run(**{"policies.0.grpo": {"beta": 0.04}})
    state, _ = _rounds(run, start, 1)
    ck = RunCheckpointer(tmp_path)
    ck.save(0, state, {"round": 0})
    restored, _ = ck.restore(_run(**{"policies.0.grpo": {"beta": 0.04}})[0].state_template())
    ck.close()
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 restored.policies[0].ref_params, state.policies[0].ref_params)


# ----------------------------------------------------------------------------- peers' samples, with multiplicity

def test_greedy_peer_fills_every_prp_slot_every_round():
    """A greedy peer repeats one completion G times per prompt; the consumer's PRP gets
    peer_rollouts_per_prompt rows of it per prompt in every round (de-duplication left 1, then 0)."""
    k = 4
    run, start = _run(**{"policies.0.probes": "prp", "policies.1.probes": "none",
                  "policies.1.sampling": {"max_new_tokens": 6, "top_k": 1}, "see.peer_rollouts_per_prompt": k})
    rec = _Recorder(run)
    _, metrics = _rounds(run, start, 2, rec.policies)
    P = run.cfg.prompts_per_round
    for r in range(2):
        view = rec.calls[run.policies[0].name][r][2]
        kinds = np.asarray(view.row_kind).reshape(P, -1)[:, :k]
        assert (kinds == 1).all(), r                                     # every rollout slot holds a PEER sample
        n_ok = int(np.sum(~np.asarray(view.truncated).reshape(P, -1)[:, :k]))
        assert metrics[r][run.policies[0].name]["prp/rows"] == n_ok      # PRP trains each (non-truncated) sample


# ----------------------------------------------------------------------------- run-config errors

@pytest.mark.parametrize("override,key", [
    ({"policies.0.probes": "none|sgt"}, "probes"),
    ({"policies.0.probes": "sgt:tau=0.5"}, "policies.0.probes"),
    ({"policies.0.probes": "xgrpo:scale=none"}, "policies.0.probes"),
    ({"policies.0.ref_model": {"path": "/nowhere"}}, "ref_model.path"),
])
def test_run_config_rejects_contradictions(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        support.to_run_config(support.tiny_config(**override))


def test_probe_options_agreeing_with_the_run_are_accepted():
    support.to_run_config(support.tiny_config(**{"policies.0.probes": "sgt:tau=1.0", "policies.1.probes": "xgrpo:scale=group"}))


def test_text_budget_fits_the_longest_tokens():
    run, start = _run()
    need = max(int(p.tokenizer.byte_table.lengths.max()) * p.max_completion_length for p in run.policies)
    assert start.see.rollouts.text.shape[1] == need == text_budget(0, run.policies)
    with pytest.raises(ConfigError, match=r"see\.max_text_bytes.*>= %d" % need):
        text_budget(need - 1, run.policies)


def test_xgrpo_follows_the_runs_scale_rewards():
    """Under scale_rewards none, XGRPO with no peer data is GRPO (before: its own scale='group' differed)."""
    from mrl_jax import probes, see
    from mrl_jax.learner import GRPOConfig, make_grad_fn
    from mrl_jax.rows import own_rows
    from mrl_jax.models import tiny_model

    model = tiny_model("llama", 40, seed=0, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1)
    gd, params = nnx.split(model)
    P, G, T = 2, 4, 3
    rng = np.random.default_rng(0)
    batch = own_rows(prompt_ids=jnp.asarray(rng.integers(1, 40, (P, 2)), jnp.int32), prompt_mask=jnp.ones((P, 2), bool),
                  completion_ids=jnp.asarray(rng.integers(1, 40, (P * G, T)), jnp.int32),
                  completion_mask=jnp.ones((P * G, T)), old_logp=jnp.zeros((P * G, T)) - 3.0,
                  ref_logp=jnp.zeros((P * G, T)), rewards=jnp.asarray([1, 0, 0, 1, 0.5, 0, 0, 0], jnp.float32),
                  truncated=jnp.zeros((P * G,), bool))
    view = see.empty_view(P, 1, T, T, 2)
    cfg = GRPOConfig(num_generations=G, max_completion_length=T, scale_rewards="none")
    g0 = make_grad_fn(gd, "none", cfg)(params, batch, view, jax.random.key(0))[1]
    g1 = make_grad_fn(gd, "xgrpo", cfg)(params, batch, view, jax.random.key(0))[1]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), g1, g0)
    with pytest.raises(ValueError, match="scale_rewards"):
        make_grad_fn(gd, probes.xgrpo(scale="group"), cfg)(params, batch, view, jax.random.key(0))
    assert grpo.SCALES  # the scales the run may name
