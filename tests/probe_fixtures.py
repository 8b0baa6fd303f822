"""Probe factories that tests name by import path (``tests.probe_fixtures:...``): a working one and the ways
a researcher's factory goes wrong."""
import jax.numpy as jnp

from mrl_jax.probes import Probe, RunOptions

NOT_CALLABLE = 3


def scaled(options: RunOptions, factor: float = 2.0) -> Probe:
    """Every advantage times ``factor`` (the PG loss and gradient scale by it exactly)."""
    return Probe(f"scaled{factor:g}", advantages=lambda rewards, rows, view, adv: adv * jnp.float32(factor),
                 options=options)


def not_a_probe(options: RunOptions) -> dict:
    return {"name": "scaled"}



def raises_at_build(options: RunOptions) -> Probe:
    """A factory that fails when the run builds it (tests: any exception is one line, exit 2)."""
    raise RuntimeError("no GPU for this probe")


def nan_loss(options: RunOptions) -> Probe:
    """A probe whose loss term is NaN (tests: the stop names the probe)."""
    def loss_terms(logp, rows):
        return jnp.sum(logp)[None] * jnp.float32(jnp.nan), jnp.ones((1,), jnp.float32), {}

    return Probe("nan_loss", loss_terms=loss_terms, options=options)
