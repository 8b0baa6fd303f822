"""Probe options that must reach the math: clip mode under jit, LUFFY's gamma."""
import jax
import jax.numpy as jnp
import numpy as np

from mrl_jax import probes
from test_probes import _grads, _make


def test_clip_mode_runs_under_jit_and_clips_both_sides():
    f = jax.jit(lambda a, b: probes.importance_weights(a, b, truncate=2.0, mode="clip"))
    w = np.asarray(f(jnp.array([0.0, 3.0, -3.0]), jnp.zeros(3)))
    np.testing.assert_allclose(w, [1.0, 2.0, 0.5], rtol=1e-6)


def test_policy_shaping_gamma_reaches_the_loss():
    batch, view, *_ = _make([[0, 0, 0], [1, 0, 0]], [[1, 0, 1], [1, 1, 0]])
    a = _grads("prp:mode='shaping',gamma=0.1", batch, view)[0]
    b = _grads("prp:mode='shaping',gamma=2.0", batch, view)[0]
    assert abs(float(a) - float(b)) > 1e-6
