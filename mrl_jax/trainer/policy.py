"""A policy of an MRL run: one record of its static parts (spec, tokenizer, prompt format, sampler, mesh,
jitted update, SEE view layout) and its state (params, optimizer state, reference), built from a
``PolicySpec`` on the mesh its run's placement gives it (born placed: no record without a mesh).

``Policy`` holds only what never changes during a run (hashable config, compiled functions); the
changing arrays live in ``PolicyState``, a pytree the round passes in and returns.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import jax
from flax import nnx, struct

from mrl_jax import models
from mrl_jax.tokenization.chat import PromptFormat, stop_ids, tokenizer_folder
from mrl_jax.configs import ConfigError, config_warning
from mrl_jax.learner import iterate, make_logp_fn, make_update_step
from mrl_jax.mwra import lockstep
from mrl_jax.models import lora as lora_lib
from mrl_jax.probes import Probe, RunOptions, chain, make_probe
from mrl_jax.sampler import SamplingConfig
from mrl_jax.see import ViewShape
from mrl_jax.tokenization import Tokenizer, load_tokenizer, train_tokenizer
from mrl_jax.trainer.config import PolicySpec, RunConfig
from mrl_jax.trainer.dynamic_sampling import filter_groups
from mrl_jax.trainer.reference import reference_sync


@struct.dataclass
class PolicyState:
    """The arrays of one policy that a round changes; ref_params: the frozen KL reference (None when beta = 0)."""

    params: Any
    opt_state: Any
    ref_params: Any = None


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
    # the reference's log-probs (beta > 0) and the round's mu updates, one jitted step (learner.iterate): (params,
    # opt_state, ref_params, own Rows, SeeView, key, step i32[]) -> (params, opt_state, ref_params, metrics); step:
    # updates done before the round
    update: Callable
    mesh: Any  # its MWRA sub-mesh (`Placement.meshes`): the update is pinned to it, the sampler runs on it
    prompt_format: PromptFormat = dataclasses.field(default_factory=PromptFormat)  # template or chat
    num_generations: int = 1  # G: completions per prompt
    view_shape: ViewShape = ViewShape()  # its SEE view slots per prompt
    prompt_limit: int = 1 << 30  # prompt tokens it accepts (template and BOS included)
    slots: Optional[int] = None  # decode slots (sampling.slots, else the memory plan's S; None: every row)
    slot_width: int = 0  # prompt entries of each slot, at least (the widest train prompt: one decode program)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def max_completion_length(self) -> int:
        return self.sampling.max_new_tokens

    def init_state(self, params, ref_params=None) -> PolicyState:
        """``params`` with a fresh optimizer state (a LoRA policy's covers its adapters only)."""
        return fresh_state(self.spec, self.optimizer, params, ref_params)


def fresh_state(spec: PolicySpec, optimizer, params, ref_params=None) -> PolicyState:
    """``params`` with a fresh ``optimizer`` state (a LoRA policy's covers its adapters only)."""
    trainable = lora_lib.split_adapters(params)[0] if spec.lora.rank else params
    return PolicyState(params=params, opt_state=optimizer.init(trainable), ref_params=ref_params)


def _check_model_dir(spec: PolicySpec) -> None:
    """``model.path`` names a directory (a file there would be blamed on the config.json it lacks)."""
    if spec.model.path is not None and Path(spec.model.path).is_file():
        raise ConfigError(f"config key 'policies.{spec.name}.model.path': {spec.model.path} is a file; give the "
                          "model's directory (config.json + *.safetensors, as transformers saves it)")


def build_tokenizer(spec: PolicySpec, corpus: Sequence[str], cache_dir: str | None = None) -> Tokenizer:
    """The policy's tokenizer: a local tokenizer.json (``tokenizer.path`` or the model directory), else one
    trained deterministically on ``corpus`` with ``tokenizer.kind``."""
    _check_model_dir(spec)
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
        return PromptFormat.chat_from(folder, system_prompt=spec.system_prompt,
                                      template_kwargs=spec.chat_template_kwargs)
    except ValueError as e:
        raise ConfigError(f"config key '{key}': {e}") from e


def build_stop_ids(spec: PolicySpec, tokenizer: Tokenizer) -> tuple[int, ...]:
    """The policy's stop set: tokenizer EOS + generation_config.json eos_token_id(s) + ``stop_tokens``."""
    folder = tokenizer_folder(tokenizer)
    gen_folder = Path(spec.model.path) if spec.model.path else folder
    try:
        ids = stop_ids(tokenizer, gen_folder, spec.stop_tokens, chat=spec.prompt_format == "chat")
        if folder is not None and gen_folder != folder:
            ids = tuple(dict.fromkeys(ids + stop_ids(tokenizer, folder)))
        return ids
    except ValueError as e:
        raise ConfigError(f"config key 'policies.{spec.name}.stop_tokens': {e}") from e


def warn_about_stops(spec: PolicySpec, tokenizer: Tokenizer, fmt: PromptFormat, stops: Sequence[int]) -> None:
    """One warning line when no completion can end early: no stop token at all, or a chat template whose
    end-of-turn token is not in the stop set."""
    key = f"policies.{spec.name}.stop_tokens"
    if not stops:
        config_warning(key, "the tokenizer has no EOS and no stop token is configured, so every completion runs "
                            f"to sampling.max_new_tokens ({spec.sampling.max_new_tokens}); add stop_tokens")
    eot = fmt.chat.end_of_turn() if fmt.is_chat else None
    if eot is not None and tokenizer.token_to_id(eot) not in stops:
        config_warning(key, f"the chat template ends an assistant turn with {eot!r}, which is not a stop token "
                            f"(stop set {list(stops)}), so completions run on past the answer; add "
                            f"stop_tokens: [{eot!r}]")


def build_model(spec: PolicySpec, tokenizer: Tokenizer, seed: int, *, abstract: bool = False, platform: str = "cpu"):
    """Load ``model.path`` (checking the tokenizer fits its embedding) or build a tiny random model.

    abstract: params as ``jax.ShapeDtypeStruct`` (a checkpoint's ``config.json`` is read, no weights); platform:
    where the model runs, for ``model.attention: auto`` (`models.attention.resolve_impl`)."""
    m = spec.model
    _check_model_dir(spec)
    attention = models.resolve_attention(m.attention, platform)
    if m.path is not None:
        try:
            if abstract:
                cfg = models.ModelConfig.from_hf(models.read_config(m.path), dtype=m.dtype, param_dtype=m.dtype,
                                                 source=str(Path(m.path) / "config.json"))
                model = models.abstract_model(cfg.replace(remat=m.remat, attention=attention))
            else:
                model = models.from_pretrained(m.path, dtype=m.dtype, param_dtype=m.dtype, remat=m.remat,
                                               attention=attention)
        except (OSError, ValueError) as e:  # models.CheckpointError is a ValueError naming the file
            raise ConfigError(f"config key 'policies.{spec.name}.model.path': {e}") from e
        try:
            models.check_tokenizer_fits(model.config, tokenizer.vocab_size, spec.tokenizer.path or m.path)
        except ValueError as e:
            raise ConfigError(f"config key 'policies.{spec.name}.tokenizer.path': {e}") from e
        return model
    overrides = dict(hidden_size=m.hidden_size, num_layers=m.num_layers, num_heads=m.num_heads,
                     dtype=m.dtype, param_dtype=m.dtype, remat=m.remat, attention=attention)
    if m.family != "gpt2":
        overrides["num_kv_heads"] = m.num_kv_heads
    if abstract:
        return models.abstract_model(models.tiny_config(m.family, tokenizer.vocab_size, **overrides))
    return models.tiny_model(m.family, tokenizer.vocab_size, seed=seed, **overrides)


def add_lora(spec: PolicySpec, model, seed: int):
    """``model`` with ``spec.lora`` adapters (unchanged when lora.rank is 0); errors name the config key."""
    lo = spec.lora
    if lo.rank == 0:
        return model
    from mrl_jax.trainer.config import LORA_DEFAULT_TARGETS

    try:
        return lora_lib.apply_lora(model, rank=lo.rank, alpha=lo.alpha, targets=lo.target_modules,
                                   dropout=lo.dropout, seed=seed,
                                   strict=tuple(lo.target_modules) != LORA_DEFAULT_TARGETS)
    except lora_lib.LoRAError as e:
        key, _, msg = str(e).partition(": ")
        raise ConfigError(f"config key 'policies.{spec.name}.{key}': {msg}") from e


def lora_graphdef(model):
    """The graph a LoRA policy's update differentiates: ``nnx.LoRAParam`` leaves first, dropout on (``model``
    is left with dropout off)."""
    graphdef, _, _ = nnx.split(lora_lib.set_dropout(model, True), nnx.LoRAParam, ...)
    lora_lib.set_dropout(model, False)
    return graphdef


def _lora_update(graphdef, optimizer, probe, grpo_cfg, micro_batch_size: int) -> Callable:
    """``update(params, opt_state, rows, view, key)`` of a LoRA policy (``graphdef``: `lora_graphdef`):
    ``params`` is the full state, only its ``nnx.LoRAParam`` leaves are differentiated and held in
    ``opt_state`` (the base goes to the learner as ``frozen``, never donated, never copied). Adapter dropout is
    on in this graph only, with fresh keys from ``key`` every call."""
    inner = make_update_step(graphdef, optimizer, probe, grpo_cfg, micro_batch_size)

    def update(params, opt_state, rows, see_view, key, probe_index=0):
        adapters, frozen = lora_lib.split_adapters(params)
        keyed = lora_lib.dropout_keys(frozen, jax.random.fold_in(key, 1))
        adapters, opt_state, metrics = inner(adapters, opt_state, rows, see_view, key, probe_index, frozen=keyed)
        return nnx.merge_state(adapters, frozen), opt_state, metrics

    return update


def reference_scorer(graphdef, lora: bool, grpo_cfg, micro_batch_size: int) -> Optional[Callable]:
    """``reference(params, ref_params, rows) -> rows`` with the rows' ``ref_logp`` (beta > 0; None otherwise),
    for `mrl_jax.learner.iterate`: the frozen reference's log-probs of the own rows (``graphdef``: the policy's
    whole graph), or, for a LoRA policy, its base with the adapters zeroed (no reference copy is held)."""
    if grpo_cfg.beta <= 0:
        return None
    logp = make_logp_fn(graphdef, grpo_cfg, micro_batch_size)
    if not lora:
        return lambda params, ref, rows: rows.replace(ref_logp=logp(ref, rows))

    def lora_reference(params, ref, rows):
        adapters, frozen = lora_lib.split_adapters(params)
        return rows.replace(ref_logp=logp(lora_lib.adapters_off(adapters), rows, frozen=frozen))

    return lora_reference


def update_factory(model, lora: bool, optimizer, probe, grpo_cfg, spec: PolicySpec) -> Callable[[int], Callable]:
    """``micro_batch_size -> update`` of a policy built on ``model`` (a LoRA one when ``lora``): the reference's
    log-probs (beta > 0), then the round's ``spec.grpo.num_iterations`` updates and reference syncs as one jitted
    step (`mrl_jax.learner.iterate`, params and optimizer state donated); the memory plan compiles it at other
    micro-batch sizes. Holds the graph only, never the weights."""
    graphdef = lora_graphdef(model) if lora else nnx.graphdef(model)
    make = _lora_update if lora else make_update_step
    sync = reference_sync(spec)
    return lambda micro_batch_size: jax.jit(
        iterate(make(graphdef, optimizer, probe, grpo_cfg, micro_batch_size), spec.grpo.num_iterations, sync,
                reference_scorer(graphdef, lora, grpo_cfg, micro_batch_size)), donate_argnums=(0, 1))


def prompt_limit(spec: PolicySpec, model) -> int:
    """A policy's prompt token limit: ``max_prompt_length``, else its context minus the completion length;
    ``max_prompt_length + sampling.max_new_tokens`` beyond the model's positions is a ``ConfigError``."""
    context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    new = spec.sampling.max_new_tokens
    if context is None:
        return spec.max_prompt_length or 1 << 30
    if spec.max_prompt_length:
        if spec.max_prompt_length + new > context:
            raise ConfigError(
                f"config key 'policies.{spec.name}.max_prompt_length': {spec.max_prompt_length} + sampling."
                f"max_new_tokens {new} exceeds the model's {context} positions (max_position_embeddings); set "
                f"max_prompt_length <= {context - new} (or 0 = {context - new}).")
        return spec.max_prompt_length
    limit = int(context) - new
    if limit < 1:
        raise ConfigError(f"config key 'policies.{spec.name}.sampling.max_new_tokens': {new} leaves no room for a "
                          f"prompt in the model's context of {context} tokens; lower it.")
    return limit


@dataclasses.dataclass(frozen=True)
class BuiltPolicy:
    """What `build_policy` makes: a policy's built pieces on its mesh, before its sampler is sized -- the fields
    of its `Policy` (all but ``slot_width`` and ``slots``), the model's params (host or built weights; shapes for an
    abstract build), the shapes of its ``PolicyState`` and ``update_at(micro_batch_size)``, its unpinned update at
    another micro-batch (the memory plan's fix search compiles those). The planners read these; `policy` makes the
    record once the sampler is sized."""

    index: int
    spec: PolicySpec
    graphdef: Any
    tokenizer: Tokenizer
    sampling: SamplingConfig
    probe: Probe
    optimizer: Any
    update: Callable
    mesh: Any
    prompt_format: PromptFormat
    num_generations: int
    view_shape: ViewShape
    prompt_limit: int
    params: Any
    state_shapes: PolicyState
    update_at: Callable[[int], Callable]

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def max_completion_length(self) -> int:
        return self.sampling.max_new_tokens

    def policy(self, slot_width: int, slots: Optional[int]) -> Policy:
        """The policy's record with its sampler sized: ``slot_width`` prompt entries per slot, ``slots`` decode
        slots (None: every row)."""
        return Policy(index=self.index, spec=self.spec, graphdef=self.graphdef, tokenizer=self.tokenizer,
                      sampling=self.sampling, probe=self.probe, optimizer=self.optimizer, update=self.update,
                      mesh=self.mesh, prompt_format=self.prompt_format, num_generations=self.num_generations,
                      view_shape=self.view_shape, prompt_limit=self.prompt_limit, slots=slots, slot_width=slot_width)


def build_policy(index: int, spec: PolicySpec, tokenizer: Tokenizer, model, run: RunConfig,
                 placement, prompt_format: Optional[PromptFormat] = None) -> BuiltPolicy:
    """Policy ``index`` of ``model`` (with its adapters: `add_lora`) on ``placement.meshes[index]``: graph,
    optimizer, sampler config, and its update jitted for that mesh with the state sharded as
    ``placement.shardings`` places it; ``prompt_format``: `build_prompt_format`'s (None: built here).

    ``spec.lora.rank > 0``: the params are the full state (base + adapters, what the sampler and checkpoints
    use) and ``Policy.init_state`` gives an optimizer state of the adapters only."""
    from mrl_jax.trainer.placement import pin_update
    from mrl_jax.trainer.reference import holds_reference

    limit = prompt_limit(spec, model)
    graphdef, params = nnx.split(model)
    opt = spec.optimizer
    optimizer = opt.build(total_steps=run.rounds * spec.grpo.num_iterations)
    grpo_cfg = spec.grpo.resolved(run.num_generations, spec.sampling.max_new_tokens, spec.sampling.temperature)
    options = RunOptions.of(grpo_cfg, run.see.success_threshold)
    probe = make_probe(spec.probes, options)
    if run.dynamic_sampling.enable:   # DAPO's filter: uniform groups leave the PG loss (trainer.dynamic_sampling)
        probe = chain(filter_groups(options=options), probe)
    update_at = update_factory(model, bool(spec.lora.rank), optimizer, probe, grpo_cfg, spec)
    stops = build_stop_ids(spec, tokenizer)
    model_vocab = model.config.vocab_size
    if prompt_format is None:
        prompt_format = build_prompt_format(spec, tokenizer)
    warn_about_stops(spec, tokenizer, prompt_format, stops)
    sampling = spec.sampling.build(tuple(stops), pad_id=tokenizer.pad_id if tokenizer.pad_id is not None else 0,
                                   vocab_size=tokenizer.vocab_size if tokenizer.vocab_size < model_vocab else 0)
    shapes = jax.eval_shape(lambda p: fresh_state(spec, optimizer, p, p if holds_reference(spec) else None), params)
    mesh = placement.meshes[index]
    update = lockstep(mesh, pin_update(update_at(opt.micro_batch_size), mesh, placement.shardings(index, shapes)))
    return BuiltPolicy(index=index, spec=spec, graphdef=graphdef, tokenizer=tokenizer, sampling=sampling,
                       probe=probe, optimizer=optimizer, update=update, mesh=mesh, prompt_format=prompt_format,
                       num_generations=run.num_generations, view_shape=run.see.view_shape(), prompt_limit=limit,
                       params=params, state_shapes=shapes, update_at=update_at)


def param_count(state: PolicyState) -> int:
    return int(sum(x.size for x in jax.tree.leaves(state.params)))


def trainable_param_count(state: PolicyState) -> int:
    """Parameters the optimizer updates: the adapters of a LoRA policy, else every parameter."""
    adapters, _ = lora_lib.split_adapters(state.params)
    n = sum(x.size for x in jax.tree.leaves(adapters))
    return int(n) if n else param_count(state)
