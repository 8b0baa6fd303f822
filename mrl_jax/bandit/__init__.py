"""Contextual-bandit analysis of the sharing probes: exact expectations and Monte Carlo on a heterogeneous bandit.

    from mrl_jax.bandit import run
    summary = run("out/bandit", quick=True)      # summary.json, summary.md, plane.png, curves.png

Modules: ``env`` (bandit, heterogeneous softmax policies, min-p sampler), ``lab_probes`` (the compared probe
configurations, built from ``mrl_jax.probes``), ``updates`` (sampled rounds through the library's probe
code), ``exact`` (closed-form expected updates), ``measure`` (training over seeds, exact flow, figures),
``report`` (tables and plots), ``lab`` (``run`` and ``LabConfig``). Imports ``mrl_jax.grpo`` and
``mrl_jax.probes`` only; no model code.
"""

from mrl_jax.bandit.lab import LabConfig, default_config, load_config, run

__all__ = ["run", "LabConfig", "default_config", "load_config"]
