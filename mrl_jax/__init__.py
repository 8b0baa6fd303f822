"""mrl_jax: Mutual Reinforcement Learning for heterogeneous LLM policies in JAX/Flax."""

__version__ = "0.1.0"
