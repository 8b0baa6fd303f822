"""The replay probe (own archived successes as an anchor) and its separation from SGT."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mrl_jax import probes, see
from mrl_jax.learner import assemble_rows, rows_logp
from test_probes import GRAPHDEF, G, KEY, P, PARAMS, _close, _make, _sgt_term_grad


def _own_archive_view(peer_r):
    """Every view slot is one of the consumer's own archived records (source 0 = consumer)."""
    kind = np.full(P * G, see.OWN_ARCHIVE)
    batch, view, lp, mask, comp, slot = _make([[0, 0, 0], [1, 1, 1]], peer_r, peer_kind=kind)
    return batch, view.replace(source=jnp.zeros_like(view.source)), mask, comp


def test_replay_gradient_is_lambda_mean_grad_logp_of_own_successes():
    batch, view, mask, comp = _own_archive_view([[1, 0, 0], [0, 0, 1]])
    g, rows = _sgt_term_grad(probes.replay(lam=0.2), batch, view)
    fired = np.nonzero(np.asarray(rows.sft_weight))[0]
    assert list(fired) == [P * G, P * G + 5]            # the two successful own archived rows, gate "always"

    def mean_logp(params):
        total = 0.0
        for r in fired:
            p = int(np.asarray(rows.prompt_slot)[r])
            lpp = rows_logp(nnx.merge(GRAPHDEF, params), batch.prompt_ids[::G][p:p + 1],
                            jnp.ones((1, batch.prompt_ids.shape[1]), bool), comp[r:r + 1], mask[r:r + 1])[0]
            total = total + jnp.sum(lpp * mask[r:r + 1]) / jnp.sum(mask[r:r + 1])
        return total / len(fired)

    expect = jax.tree.map(lambda x: -0.2 * x, jax.grad(mean_logp)(PARAMS))
    _close(g, expect, rtol=1e-5, atol=1e-7)


def test_replay_gate_own_failure_only_fires_on_failed_prompts():
    batch, view, *_ = _own_archive_view([[1, 1, 0], [1, 0, 1]])
    rows, _ = probes.replay(gate="own_failure").extend(assemble_rows(batch, view), view, KEY)
    fired = np.nonzero(np.asarray(rows.sft_weight))[0]
    assert set(np.asarray(rows.prompt_slot)[fired]) == {0}   # prompt 1 is solved by the own group


def test_sgt_and_replay_do_not_take_each_others_rows():
    batch, view, *_ = _own_archive_view([[1, 1, 1], [1, 1, 1]])
    g, rows = _sgt_term_grad(probes.sgt(gate="always"), batch, view)     # own archive is not a peer success
    assert float(jnp.sum(rows.sft_weight)) == 0.0
    jax.tree.map(lambda x: np.testing.assert_array_equal(np.asarray(x), 0.0), g)
    batch, view, *_ = _make([[0, 0, 0], [0, 0, 0]], [[1, 1, 1], [1, 1, 1]])   # peer successes only
    g, rows = _sgt_term_grad(probes.replay(), batch, view)
    jax.tree.map(lambda x: np.testing.assert_array_equal(np.asarray(x), 0.0), g)


def test_replay_rejects_bad_options():
    with pytest.raises(ValueError, match="gate"):
        probes.replay(gate="sometimes")
    assert probes.make_probe("sgt+replay:lam=0.3").needs_peers
