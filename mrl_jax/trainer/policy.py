"""A policy of an MRL run: its static parts (graph, tokenizer, template, sampler and update functions)
and its state (params, optimizer state), built from a ``PolicySpec``.

``Policy`` holds only what never changes during a run (hashable config, compiled functions); the
changing arrays live in ``PolicyState``, a pytree the round passes in and returns.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
from flax import nnx, struct

from mrl_jax import models
from mrl_jax.chat import PromptFormat, stop_ids, tokenizer_folder
from mrl_jax.configs import ConfigError
from mrl_jax.learner import make_optimizer, make_update_step
from mrl_jax.probes import Probe, make_probe
from mrl_jax.rollout import SamplingConfig
from mrl_jax.tokenization import Tokenizer, load_tokenizer, train_tokenizer
from mrl_jax.trainer.config import PolicySpec, RunConfig


@struct.dataclass
class PolicyState:
    """The arrays of one policy that a round changes."""

    params: Any
    opt_state: Any


@dataclasses.dataclass(frozen=True)
class Policy:
    """Static parts of one policy (index ``index`` in the run)."""

    index: int
    spec: PolicySpec
    graphdef: Any
    tokenizer: Tokenizer
    sampling: SamplingConfig
    probe: Probe
    optimizer: Any  # optax.GradientTransformation
    update: Callable  # (params, opt_state, Batch, SeeView, key) -> (params, opt_state, metrics)
    prompt_format: PromptFormat = dataclasses.field(default_factory=PromptFormat)  # template or chat

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def completion_length(self) -> int:
        return self.sampling.max_new_tokens


def build_tokenizer(spec: PolicySpec, corpus: Sequence[str], cache_dir: str | None = None) -> Tokenizer:
    """The policy's tokenizer: a local tokenizer.json (``tokenizer.path`` or the model directory), else one
    trained deterministically on ``corpus`` with ``tokenizer.kind``."""
    path = spec.tokenizer.path or spec.model.path
    if path is not None:
        try:
            return load_tokenizer(path)
        except (OSError, ValueError) as e:
            key = "tokenizer.path" if spec.tokenizer.path else "model.path"
            raise ConfigError(f"config key 'policies.{spec.name}.{key}': {e}") from e
    try:
        return train_tokenizer(spec.tokenizer.kind, corpus, spec.tokenizer.vocab_size, cache_dir=cache_dir)
    except Exception as e:  # the tokenizers trainer raises bare Exceptions
        raise ConfigError(f"config key 'policies.{spec.name}.tokenizer': training a {spec.tokenizer.kind} tokenizer "
                          f"of vocab_size {spec.tokenizer.vocab_size} failed ({e}); raise vocab_size (byte-fallback "
                          "kinds need > 256 + the corpus alphabet).") from e


def build_prompt_format(spec: PolicySpec, tokenizer: Tokenizer) -> PromptFormat:
    """``prompt_template`` or, with ``prompt_format: chat``, the tokenizer folder's chat template."""
    if spec.prompt_format != "chat":
        return PromptFormat(template=spec.prompt_template)
    key = f"policies.{spec.name}.prompt_format"
    folder = tokenizer_folder(tokenizer)
    if folder is None:
        raise ConfigError(f"config key '{key}': chat needs a tokenizer folder with a chat template, but this "
                          "policy's tokenizer is trained locally; set tokenizer.path (or model.path) or use "
                          "prompt_format: template")
    try:
        return PromptFormat.chat_from(folder, system_prompt=spec.system_prompt)
    except ValueError as e:
        raise ConfigError(f"config key '{key}': {e}") from e


def build_stop_ids(spec: PolicySpec, tokenizer: Tokenizer) -> tuple[int, ...]:
    """The policy's stop set: tokenizer EOS + generation_config.json eos_token_id(s) + ``stop_tokens``."""
    folder = tokenizer_folder(tokenizer)
    gen_folder = Path(spec.model.path) if spec.model.path else folder
    try:
        ids = stop_ids(tokenizer, gen_folder, spec.stop_tokens)
        if folder is not None and gen_folder != folder:
            ids = tuple(dict.fromkeys(ids + stop_ids(tokenizer, folder)))
        return ids
    except ValueError as e:
        raise ConfigError(f"config key 'policies.{spec.name}.stop_tokens': {e}") from e


def build_model(spec: PolicySpec, tokenizer: Tokenizer, seed: int):
    """Load ``model.path`` (checking the tokenizer fits its embedding) or build a tiny random model."""
    m = spec.model
    if m.path is not None:
        try:
            model = models.from_pretrained(m.path, dtype=m.dtype, param_dtype=m.dtype)
        except (OSError, ValueError) as e:  # models.CheckpointError is a ValueError naming the file
            raise ConfigError(f"config key 'policies.{spec.name}.model.path': {e}") from e
        try:
            models.check_tokenizer_fits(model.config, tokenizer.vocab_size, spec.tokenizer.path or m.path)
        except ValueError as e:
            raise ConfigError(f"config key 'policies.{spec.name}.tokenizer.path': {e}") from e
        return model
    overrides = dict(hidden_size=m.hidden_size, num_layers=m.num_layers, num_heads=m.num_heads,
                     dtype=m.dtype, param_dtype=m.dtype)
    if m.family != "gpt2":
        overrides["num_kv_heads"] = m.num_kv_heads
    return models.tiny_model(m.family, tokenizer.vocab_size, seed=seed, **overrides)


def build_policy(index: int, spec: PolicySpec, tokenizer: Tokenizer, model, run: RunConfig) -> tuple[Policy, PolicyState]:
    """Split ``model`` into graph and params, build the optimizer, sampler config and jitted update."""
    graphdef, params = nnx.split(model)
    opt = spec.optimizer
    total = run.rounds * spec.grpo.num_iterations
    optimizer = make_optimizer(opt.learning_rate, opt.weight_decay, opt.max_grad_norm, opt.warmup_steps,
                               total_steps=max(total, opt.warmup_steps + 1), schedule=opt.schedule)
    probe = make_probe(spec.probes)
    grpo_cfg = dataclasses.replace(spec.grpo, num_generations=run.num_generations,
                                   max_completion_length=spec.sampling.max_new_tokens,
                                   temperature=spec.sampling.temperature)
    update = make_update_step(graphdef, optimizer, probe, grpo_cfg, opt.micro_batch_size)
    s = spec.sampling
    stops = build_stop_ids(spec, tokenizer)
    sampling = SamplingConfig(max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_k=s.top_k,
                              top_p=s.top_p, eos_id=(stops[0] if len(stops) == 1 else stops) or None,
                              pad_id=tokenizer.pad_id if tokenizer.pad_id is not None else 0)
    policy = Policy(index=index, spec=spec, graphdef=graphdef, tokenizer=tokenizer, sampling=sampling,
                    probe=probe, optimizer=optimizer, update=update,
                    prompt_format=build_prompt_format(spec, tokenizer))
    return policy, PolicyState(params=params, opt_state=optimizer.init(params))


def param_count(state: PolicyState) -> int:
    return int(sum(x.size for x in jax.tree.leaves(state.params)))
