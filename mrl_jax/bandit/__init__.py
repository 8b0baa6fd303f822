"""Contextual-bandit analysis of the sharing probes (see experiments/bandit/README.md)."""
