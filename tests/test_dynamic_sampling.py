"""Dynamic sampling (DAPO's filter_groups, mrl_jax.trainer.dynamic_sampling): uniform groups leave the loss and
its denominators exactly; SGT keeps its all-fail groups; oversampled prompts fill the batch in draw order."""

import dataclasses
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mrl_jax import objective, probes, see
from mrl_jax.configs import ConfigError
from mrl_jax.learner import GRPOConfig
from mrl_jax.rows import concat, own_rows, peer_rows
from mrl_jax.trainer.dynamic_sampling import DynamicSamplingSpec, degenerate, filter_groups, select, useful

P, G, TC, V = 5, 3, 4, 7
REWARDS = np.asarray([[0.0, 1.0, 0.5],      # kept
                      [1.0, 1.0, 1.0],      # all success: leaves
                      [0.2, 0.2, 0.9],      # kept
                      [0.0, 0.0, 0.0],      # all fail: leaves
                      [0.7, 0.7, 0.7]], np.float32)   # uniform (a weighted sum): leaves
KEPT = np.asarray([0, 2])


def _own(prompts: np.ndarray):
    """Own rows of ``prompts`` (indices into the fixed batch): random ids, ragged masks, pi_old and ref."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, V, (P, G, TC))
    lengths = rng.integers(1, TC + 1, (P, G))
    mask = (np.arange(TC) < lengths[..., None]).astype(np.float32)
    old = rng.normal(-2.0, 0.3, (P, G, TC)).astype(np.float32)
    ref = rng.normal(-2.0, 0.3, (P, G, TC)).astype(np.float32)
    n = len(prompts)
    flat = lambda a: jnp.asarray(a[prompts].reshape((n * G,) + a.shape[2:]))
    return own_rows(jnp.zeros((n, 2), jnp.int32), jnp.ones((n, 2), bool), flat(ids), flat(mask), flat(old),
                    flat(ref), flat(REWARDS), jnp.zeros((n * G,), bool), consumer=0, num_generations=G)


def _loss_and_grad(rows, probe, cfg):
    def loss(theta):
        def logp_fn(rw):
            lp = jax.nn.log_softmax(theta)[rw.completion_ids]
            return lp, jnp.zeros_like(lp)
        return objective.objective(logp_fn, rows, None, jax.random.key(0), probe, cfg)[0]
    theta = jnp.linspace(-1.0, 1.0, V)
    return jax.jit(jax.value_and_grad(loss))(theta)   # one program, not one per op


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "bnpo"])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_filtered_loss_and_gradient_equal_the_batch_without_uniform_groups(loss_type, scale):
    """Loss and gradient (PG + KL) of the full batch under filter_groups == those of the kept groups alone."""
    rows = _own(np.arange(P))
    cfg = GRPOConfig(num_generations=G, max_completion_length=TC, loss_type=loss_type, scale_rewards=scale,
                     beta=0.05, epsilon=0.1)
    opts = probes.RunOptions.of(cfg)
    got = _loss_and_grad(rows, probes.chain(filter_groups(options=opts), probes.none(options=opts)), cfg)
    want = _loss_and_grad(_own(KEPT), probes.none(options=opts), cfg)
    unfiltered = _loss_and_grad(rows, probes.none(options=opts), cfg)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-6, atol=1e-8)
    assert not np.allclose(unfiltered[1], want[1], rtol=1e-4)   # the uniform groups did count without the filter


def _view_with_peer_success():
    """A peer (policy 1) view with one verified success per prompt, K = 1 slot per prompt."""
    v = see.empty_view(P, 1, TC, TC, 2)
    return v.replace(completion_ids=jnp.ones((P, TC), jnp.int32), completion_mask=jnp.ones((P, TC)),
                     rewards=jnp.ones((P,)),
                     dst_chunk=jnp.tile(jnp.arange(TC), (P, 1)), chunk_valid=jnp.ones((P, TC), bool),
                     source=jnp.ones((P,), jnp.int32), row_kind=jnp.full((P,), probes.ARCHIVE, jnp.int32),
                     prompt_slot=jnp.arange(P, dtype=jnp.int32))


def test_sgt_still_rescues_all_fail_groups_under_the_filter():
    """The all-fail group (prompt 3) leaves the PG term but SGT's rescue term fires on it as without the filter."""
    view = _view_with_peer_success()
    own = _own(np.arange(P))
    rows = concat(own, peer_rows(view, own.prompt_ids[::G], own.prompt_mask[::G]))
    sgt = probes.make_probe("sgt")
    plain, m_plain = sgt.extend(rows, view, jax.random.key(1))
    both, m_both = probes.chain(filter_groups(), sgt).extend(rows, view, jax.random.key(1))
    failed = np.asarray(REWARDS.max(1) < 1.0)
    assert failed[3] and not failed[1]
    np.testing.assert_array_equal(np.asarray(both.sft_weight), np.asarray(plain.sft_weight))
    assert float(both.sft_weight[P * G + 3]) == 1.0                       # the rescue row of prompt 3
    assert m_both["sgt/prompts_rescued"] == m_plain["sgt/prompts_rescued"]
    pg_row = np.asarray(both.pg_row[:P * G]).reshape(P, G)
    np.testing.assert_array_equal(pg_row[:, 0], ~degenerate(REWARDS.reshape(-1), G))
    np.testing.assert_array_equal(np.asarray(both.pg_row[P * G:]), np.asarray(plain.pg_row[P * G:]))


def _lane(rewards, needs_peers):
    """(a policy, its samples) with just what ``useful`` reads."""
    pol = SimpleNamespace(num_generations=G, probe=SimpleNamespace(needs_peers=needs_peers))
    return pol, SimpleNamespace(score=SimpleNamespace(rewards=np.asarray(rewards, np.float32).reshape(-1)))


def _useful(*lanes, tau=1.0):
    return useful([pol for pol, _ in lanes], [s for _, s in lanes], tau).tolist()


def test_useful_prompts_keep_the_rescue_set_of_a_peer_reading_policy():
    """Uniform for every policy -> not useful, except an all-fail group of a policy whose probe reads peers."""
    assert _useful(_lane(REWARDS, False)) == [True, False, True, False, False]
    assert _useful(_lane(REWARDS, True)) == [True, False, True, True, True]
    other = np.zeros_like(REWARDS)
    other[1] = [0.0, 1.0, 0.0]
    assert _useful(_lane(REWARDS, False), _lane(other, False)) == [True, True, True, False, False]


def test_select_fills_in_draw_order_first_batch_useful_kept():
    u0 = np.asarray([True, False, True, False])
    u1 = np.asarray([False, True, False, False])
    u2 = np.asarray([True, True, False, False])
    assert select([u0], 4) == [(0, 0), (0, 1), (0, 2), (0, 3)]
    assert select([u0, u1], 4) == [(0, 0), (0, 1), (0, 2), (1, 1)]            # one slot still not useful
    assert select([u0, u1, u2], 4) == [(0, 0), (0, 2), (1, 1), (2, 0)]


def test_config_is_off_by_default_and_checks_the_batch_limit():
    from mrl_jax.configs import from_dict
    from mrl_jax.trainer.config import RunConfig

    assert RunConfig.__dataclass_fields__["dynamic_sampling"].default_factory() == DynamicSamplingSpec()
    assert not DynamicSamplingSpec().enable
    with pytest.raises(ConfigError, match="dynamic_sampling.max_num_gen_batches"):
        DynamicSamplingSpec(enable=True, max_num_gen_batches=0)
    with pytest.raises(ConfigError, match="dynamic_sampling"):
        from_dict(RunConfig, {"policies": [{"name": "a"}], "dynamic_sampling": {"enabled": True}})


def _half_uniform(prompt, completion):
    """0 on even prompt ids (uniform for every policy), else the completion length's parity."""
    return float(len(completion) % 2) if prompt.id % 2 else 0.0


@pytest.mark.usefixtures("jax_compile_cache")
def test_oversampled_round_is_the_selection_of_its_batches_sampled_alone():
    """A round with dynamic sampling == its batches sampled one by one (same rows, same rewards: a row's noise
    is a function of (run key, round, batch, row)), picked by ``select``; counters logged per policy."""
    import support
    from mrl_jax.tasks import RewardScorer, RewardSpec
    from mrl_jax.trainer import Run, run_round

    cfg = support.to_run_config(support.tiny_config(**{"dynamic_sampling": {"enable": True, "max_num_gen_batches": 3},
                                                 "policies.0.probes": "none", "policies.1.probes": "none"}))
    run = Run(cfg)
    assert [p.probe.name for p in run.policies] == ["filter_groups", "filter_groups"]
    params, scorer = run.warm_params(), RewardScorer([RewardSpec(_half_uniform, name="half")])
    inputs = run.round_inputs(0)
    assert run.round_inputs(0).oversampler.draw(1).prompts == inputs.oversampler.draw(1).prompts
    alone, u = [], []
    for k in range(3):
        ins = inputs if k == 0 else inputs.oversampler.draw(k)
        _, m, _ = run_round(run.policies, run.initial_state(params), dataclasses.replace(ins, oversampler=None),
                            scorer)
        alone.append(m)
        u.append(np.any([~degenerate(np.asarray(m[n]["groups"]["rewards"]), cfg.num_generations) for n in m], 0))
    n_batches = next((k + 1 for k in range(3) if sum(x.sum() for x in u[:k + 1]) >= cfg.prompts_per_round), 3)
    assert n_batches > 1, "the fixture must need oversampling"
    picks = select(u[:n_batches], cfg.prompts_per_round)
    _, got, _ = run_round(run.policies, run.initial_state(params), inputs, scorer)
    for name in got:
        g = got[name]["groups"]
        assert g["prompt_ids"] == [alone[b][name]["groups"]["prompt_ids"][p] for b, p in picks]
        assert g["rewards"] == [alone[b][name]["groups"]["rewards"][p] for b, p in picks]
        assert got[name]["dynamic_sampling/generated_batches"] == n_batches
        assert got[name]["dynamic_sampling/drawn_prompts"] == n_batches * cfg.prompts_per_round
        assert got[name]["dynamic_sampling/kept_groups"] == (~degenerate(np.asarray(g["rewards"]), cfg.num_generations)).sum()
