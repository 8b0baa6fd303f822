"""The run config of ``mrl train``: frozen dataclasses, loadable from YAML, every field documented.

A run is a list of policies (each with its own model, tokenizer, prompt template, sampling, optimizer,
GRPO options and probe chain), one task, and the run-wide settings (rounds, prompts per round, SEE,
checkpoints, evaluation, reward isolation). ``mrl config-help`` prints every key.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Optional, Union

from mrl_jax.configs import ConfigError, check, field
from mrl_jax.grpo import normalize_scale
from mrl_jax.learner import GRPOConfig, make_optimizer
from mrl_jax.sampler import SamplingConfig
from mrl_jax.see import ViewShape
from mrl_jax.sampler.ladder import FLOOR, Ladder
from mrl_jax.probes import RunOptions, make_probe
from mrl_jax.trainer.dynamic_sampling import DynamicSamplingSpec
from mrl_jax.trainer.task_spec import TaskSpec

MODEL_FAMILIES = ("llama", "qwen2", "mistral", "qwen3", "phi3", "gemma3_text", "gpt2")
TOKENIZER_KINDS = ("byte_bpe", "metaspace_bpe", "unigram", "wordpiece", "char")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Where a policy's weights come from: a local Hugging Face directory, or a tiny random init."""

    path: Optional[str] = field(None, help="local HF directory (config.json + *.safetensors); None = tiny random init")
    family: Literal["llama", "qwen2", "mistral", "qwen3", "phi3", "gemma3_text", "gpt2"] = field(
        "llama", help="tiny-init architecture family")
    hidden_size: int = field(64, help="tiny-init hidden size")
    num_layers: int = field(2, help="tiny-init number of layers")
    num_heads: int = field(4, help="tiny-init attention heads")
    num_kv_heads: int = field(2, help="tiny-init key/value heads (llama family; gpt2 uses num_heads)")
    dtype: Literal["float32", "bfloat16"] = field("float32", help="compute and parameter dtype")
    remat: Literal["none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable"] = field(
        "full", help="per-layer rematerialisation in the update: full = keep only each layer's input (activation "
        "memory linear in length and depth); none = keep everything (fastest, most memory)")
    attention: Literal["auto", "dense", "blockwise", "splash", "cudnn"] = field(
        "auto", help="the update's and the prefill's attention: auto = JAX's Pallas splash kernel on TPU, cuDNN "
        "flash (jax.nn.dot_product_attention) on a CUDA GPU where its dtype / head-dim limits hold, ours elsewhere "
        "(dense, or blockwise past 512 keys); splash on another backend runs the kernel interpreted (slow: for "
        "checks); cudnn off a GPU runs jax's XLA implementation")

    def __post_init__(self):
        for key in ("hidden_size", "num_layers", "num_heads", "num_kv_heads"):
            check(getattr(self, key) > 0, key, f"must be > 0, got {getattr(self, key)}")
        check(self.hidden_size % self.num_heads == 0, "hidden_size",
              f"{self.hidden_size} is not divisible by num_heads={self.num_heads}")


@dataclasses.dataclass(frozen=True)
class TokenizerSpec:
    """A policy's tokenizer: a local tokenizer.json, or one trained on the task corpus."""

    path: Optional[str] = field(None, help="dir or file of a tokenizer.json; None = the model path, else trained")
    kind: Literal["byte_bpe", "metaspace_bpe", "unigram", "wordpiece", "char"] = field(
        "byte_bpe", help="algorithm of the locally trained tokenizer")
    vocab_size: int = field(256, help="vocabulary size of the locally trained tokenizer")

    def __post_init__(self):
        check(self.vocab_size >= 16, "vocab_size", f"must be >= 16, got {self.vocab_size}")


@dataclasses.dataclass(frozen=True)
class SamplingSpec:
    """Rollout sampling."""

    max_new_tokens: int = field(16, help="completion length limit (tokens)")
    temperature: float = field(1.0, help="softmax temperature (the learner scores with the same one)")
    top_k: int = field(0, help="keep the k most likely tokens; 0 = off")
    top_p: float = field(1.0, help="nucleus mass; 1.0 = off")
    min_p: float = field(0.0, help="keep tokens with probability >= min_p x the top one's; 0 = off (TRL's "
                                           "default None means the same)")
    slots: Optional[int] = field(None, help="decode slots of the sampler (mrl_jax.sampler: rows enter as "
                                            "slots free, one decode program); None = every row (P x G), rounded "
                                            "up to a multiple of the policy's data axis")
    ladder: bool = field(True, help="once the queue is empty, move a round's last rows to fewer slots as they "
                                    "fit (by default 3/4 steps to 32, halves to 8: 128 -> 96, 64, 48, 32, 16, 8; a "
                                    "decode loop each in the round's one program, compiled in round 0); TPU's paged "
                                    "cache and rounds of at most 32 new tokens keep S; false = S slots to the end")
    ladder_ratio: Optional[float] = field(None, help="each rung at most this fraction of the slots above it (in "
                                                     "(0, 1); finer rungs take fewer row-steps and compile a decode "
                                                     "loop each: 0.9 to floor 1 takes 30 rungs from 128 slots); "
                                                     "None = the default ladder")
    ladder_floor: int = field(FLOOR, help="the ladder's last rung holds at least this many slots")

    def __post_init__(self):
        check(self.slots is None or self.slots >= 1, "slots",
              f"must be >= 1 (or unset: every row), got {self.slots}")
        check(self.max_new_tokens > 0, "max_new_tokens", f"must be > 0, got {self.max_new_tokens}")
        check(self.ladder_ratio is None or 0 < self.ladder_ratio < 1, "ladder_ratio",
              f"must be in (0, 1) (or unset: the default ladder), got {self.ladder_ratio}")
        check(self.ladder_floor >= 1, "ladder_floor", f"must be >= 1, got {self.ladder_floor}")
        # inert settings are errors: a ladder key that shapes no rung would be ignored without a word
        check(self.ladder or self.ladder_ratio is None, "ladder_ratio",
              f"{self.ladder_ratio} shapes the ladder, which ladder: false turns off (S slots to the end); drop "
              "ladder_ratio, or drop ladder: false")
        check(self.ladder or self.ladder_floor == FLOOR, "ladder_floor",
              f"{self.ladder_floor} shapes the ladder, which ladder: false turns off (S slots to the end); drop "
              "ladder_floor, or drop ladder: false")
        check(self.slots is None or self.ladder_floor == FLOOR or self.ladder_floor < self.slots, "ladder_floor",
              f"{self.ladder_floor} is not below slots: {self.slots}, so the ladder has no rung below S; give a "
              f"ladder_floor below {self.slots}, or set ladder: false")
        check(self.temperature > 0, "temperature", f"must be > 0, got {self.temperature}")
        check(self.top_k >= 0, "top_k", f"must be >= 0, got {self.top_k}")
        check(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        check(0 <= self.min_p < 1, "min_p", f"must be in [0, 1), got {self.min_p}")

    @property
    def ladder_shape(self) -> Ladder:
        """How the slot sampler's rungs step down (`mrl_jax.sampler.Ladder`)."""
        return Ladder(self.ladder_ratio, self.ladder_floor)

    def build(self, stop_ids: tuple[int, ...], pad_id: int, vocab_size: int = 0) -> SamplingConfig:
        """The sampler's config: stops at any of ``stop_ids`` (none: never), writes ``pad_id`` after a stop, never
        picks an id >= ``vocab_size`` (0: any)."""
        return SamplingConfig(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_k=self.top_k,
                              top_p=self.top_p, min_p=self.min_p,
                              eos_id=(stop_ids[0] if len(stop_ids) == 1 else tuple(stop_ids)) or None,
                              pad_id=pad_id, vocab_size=vocab_size)


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    """AdamW with global-norm clipping and a schedule."""

    learning_rate: float = field(1e-3, help="peak learning rate (TRL's default 1e-6 suits pretrained LLMs; "
                                                 "1e-3 suits the tiny from-scratch models a policy without model.path "
                                                 "builds: set it for a pretrained model)")
    weight_decay: float = field(0.0, help="AdamW decoupled weight decay")
    max_grad_norm: float = field(1.0, help="clip gradients to this global norm; 0 = off")
    warmup_steps: int = field(0, help="linear warm-up steps")
    schedule: Literal["constant", "cosine", "linear"] = field("constant", help="decay after warm-up")
    micro_batch_size: int = field(0, help="rows per micro-batch (gradient accumulation); 0 = whole batch")

    def __post_init__(self):
        check(self.learning_rate > 0, "learning_rate", f"must be > 0, got {self.learning_rate}")
        check(self.weight_decay >= 0, "weight_decay", f"must be >= 0, got {self.weight_decay}")
        check(self.max_grad_norm >= 0, "max_grad_norm", f"must be >= 0, got {self.max_grad_norm}")
        check(self.micro_batch_size >= 0, "micro_batch_size", f"must be >= 0, got {self.micro_batch_size}")

    def build(self, total_steps: int):
        """The optax transform over ``total_steps`` updates (the schedule's length; at least past the warm-up)."""
        return make_optimizer(self.learning_rate, self.weight_decay, self.max_grad_norm, self.warmup_steps,
                              total_steps=max(total_steps, self.warmup_steps + 1), schedule=self.schedule)


@dataclasses.dataclass(frozen=True)
class WarmStartSpec:
    """Optional supervised warm start on a part of the task before RL."""

    steps: int = field(0, help="SFT steps; 0 = none")
    part: Optional[str] = field(None, help="task part to learn (e.g. 'A'); None = all train prompts")
    learning_rate: float = field(3e-3, help="SFT learning rate (TRL's SFTConfig default 2e-5 suits pretrained "
                                                 "LLMs; 3e-3 suits tiny from-scratch models)")
    batch_size: int = field(64, help="SFT examples per step")


RUN_SET_GRPO_KEYS = {"num_generations": "num_generations", "max_completion_length": "sampling.max_new_tokens",
                     "temperature": "sampling.temperature"}   # grpo key -> the key that sets it in a run


@dataclasses.dataclass(frozen=True)
class PolicyGRPOConfig(GRPOConfig):
    """``GRPOConfig`` of a run's policy: G, the completion length and the temperature are set once, by the run's
    ``num_generations`` and the policy's ``sampling``; here they may only repeat those values."""

    num_generations: Optional[int] = field(None, help="set by the run key num_generations; leave unset (a "
                                                      "different value here is an error)")
    max_completion_length: Optional[int] = field(None, help="set by policies[i].sampling.max_new_tokens; leave "
                                                            "unset (a different value here is an error)")
    temperature: Optional[float] = field(None, help="set by policies[i].sampling.temperature; leave unset (a "
                                                    "different value here is an error)")

    def __post_init__(self):
        self.resolved(1, 1, 1.0)   # GRPOConfig's checks of every other key

    def resolved(self, num_generations: int, max_completion_length: int, temperature: float) -> GRPOConfig:
        """The ``GRPOConfig`` the learner uses, with the run-set values."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(GRPOConfig)}
        values.update(num_generations=num_generations, max_completion_length=max_completion_length,
                      temperature=temperature)
        return GRPOConfig(**values)


LORA_DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj",
                        "gate_up_proj",
                        "c_attn", "c_proj", "c_fc")


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """LoRA adapters on the policy's linear layers (rank 0 = full fine-tuning). Only the adapters are trained
    and held in the optimizer; the frozen base keeps ``model.dtype`` (e.g. bfloat16), adapters are float32."""

    rank: int = field(0, help="adapter rank r; 0 = no LoRA (train every parameter)")
    alpha: float = field(16.0, help="scaling: the adapter adds (alpha / rank) * x @ A @ B")
    dropout: float = field(0.0, help="dropout on the adapter input while training (PEFT's lora_dropout)")
    target_modules: list[str] = field(
        default_factory=lambda: list(LORA_DEFAULT_TARGETS),
        help="linear layers to adapt, by name (last path component, e.g. q_proj) or dotted path suffix "
             "(e.g. mlp.c_proj); default: the attention and MLP projections of the llama and gpt2 families")

    def __post_init__(self):
        check(self.rank >= 0, "rank", f"must be >= 0, got {self.rank}")
        check(self.alpha > 0, "alpha", f"must be > 0, got {self.alpha}")
        check(0.0 <= self.dropout < 1.0, "dropout", f"must be in [0, 1), got {self.dropout}")
        check(len(self.target_modules) > 0, "target_modules", "needs at least one module name")


@dataclasses.dataclass(frozen=True)
class RefModelSpec:
    """The frozen KL reference (used only when grpo.beta > 0; with beta = 0 no reference is held)."""

    path: Optional[str] = field(None, help="local HF directory of a separate reference model (same architecture "
                                           "and shapes as the policy); None = the policy's params at the start of "
                                           "RL (after the warm start)")
    sync_ref_model: bool = field(False, help="TRL's sync_ref_model: move the reference toward the policy every "
                                             "ref_model_sync_steps updates")
    ref_model_sync_steps: int = field(512, help="updates between reference syncs (TRL's name)")
    ref_model_mixup_alpha: float = field(0.6, help="sync: ref = alpha * policy + (1 - alpha) * ref (TRL's name)")

    def __post_init__(self):
        check(self.ref_model_sync_steps >= 1, "ref_model_sync_steps", f"must be >= 1, got {self.ref_model_sync_steps}")
        check(0.0 <= self.ref_model_mixup_alpha <= 1.0, "ref_model_mixup_alpha",
              f"must be in [0, 1], got {self.ref_model_mixup_alpha}")


@dataclasses.dataclass(frozen=True)
class PolicySpec:
    """One policy of the run."""

    name: str = field(help="unique name used in logs and checkpoints")
    model: ModelSpec = field(default_factory=ModelSpec, help="weights")
    tokenizer: TokenizerSpec = field(default_factory=TokenizerSpec, help="tokenizer")
    prompt_template: str = field("{prompt}", help="how this policy formats a prompt (prompt_format: template); "
                                                  "must contain {prompt}")
    prompt_format: Literal["template", "chat"] = field(
        "template", help="template = prompt_template (BOS prepended when the tokenizer has one); chat = the "
                         "tokenizer folder's chat_template (tokenizer_config.json) rendered by transformers as a "
                         "user turn with the generation prompt")
    system_prompt: Optional[str] = field(None, help="prompt_format: chat: a system turn before the user turn")
    chat_template_kwargs: dict[str, Any] = field(
        default_factory=dict, help="prompt_format: chat: extra chat-template variables, as TRL's "
                                   "chat_template_kwargs (e.g. {enable_thinking: false} for Qwen3); TRL's "
                                   "default None means the same as {}")
    stop_tokens: list[Union[int, str]] = field(
        default_factory=list, help="extra stop tokens (spellings such as '<|im_end|>', or ids), added to the "
                                   "tokenizer's EOS and generation_config.json's eos_token_id list")
    lora: LoraSpec = field(default_factory=LoraSpec, help="LoRA adapters (rank 0 = full fine-tuning)")
    sampling: SamplingSpec = field(default_factory=SamplingSpec, help="rollout sampling")
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec, help="optimizer")
    grpo: PolicyGRPOConfig = field(default_factory=PolicyGRPOConfig, help="GRPO loss options (TRL names)")
    probes: str = field("none", help="probe chain, e.g. 'none', 'sgt', 'xgrpo+sgt', 'prp'; scale/eps/tau come "
                                      "from grpo.scale_rewards, grpo.reward_eps and see.success_threshold")
    ref_model: RefModelSpec = field(default_factory=RefModelSpec, help="KL reference (grpo.beta > 0)")
    warm_start: WarmStartSpec = field(default_factory=WarmStartSpec, help="supervised warm start")
    max_prompt_length: int = field(
        0, help="prompt token limit of this policy (template and BOS included); 0 = the model's context "
                "(max_position_embeddings) minus sampling.max_new_tokens. Longer prompts are handled as the "
                "run's overlong_prompts says")
    devices: Union[int, list[int], None] = field(
        None, help="MWRA override: a device count (taken from the devices no explicit id list claims) or a list "
                   "of device ids (jax.devices() ids) for this policy's mesh; None = sized by cost")
    cost: float = field(0.0, help="MWRA cost override (only ratios matter); 0 = parameters x tokens per round")

    def __post_init__(self):
        check(self.prompt_format == "chat" or "{prompt}" in self.prompt_template, "prompt_template",
              f"must contain '{{prompt}}', got {self.prompt_template!r}")
        for key in ("max_completion_length", "temperature"):
            given, run_key = getattr(self.grpo, key), RUN_SET_GRPO_KEYS[key]
            run_value = getattr(self.sampling, run_key.split(".")[1])
            check(given is None or given == run_value, f"grpo.{key}",
                  f"{given!r} contradicts this policy's {run_key}: {run_value!r}, which sets it; drop grpo.{key}")
        check(self.system_prompt is None or self.prompt_format == "chat", "system_prompt",
              "is used only with prompt_format: chat; set prompt_format: chat or put it in prompt_template")
        check(not self.chat_template_kwargs or self.prompt_format == "chat", "chat_template_kwargs",
              "is used only with prompt_format: chat; set prompt_format: chat")
        check(self.max_prompt_length >= 0, "max_prompt_length", f"must be >= 0, got {self.max_prompt_length}")
        check(self.cost >= 0, "cost", f"must be >= 0 (0 = automatic), got {self.cost}")
        if isinstance(self.devices, int):
            check(self.devices >= 1, "devices", f"a device count must be >= 1, got {self.devices}")
        elif self.devices is not None:
            check(len(self.devices) >= 1, "devices", "an id list needs at least one device id")
            check(len(set(self.devices)) == len(self.devices), "devices", f"ids repeat in {list(self.devices)}")
            check(all(i >= 0 for i in self.devices), "devices", f"ids must be >= 0, got {list(self.devices)}")
        check("|" not in self.probes, "probes",
              f"{self.probes!r}: '|' builds a probes.switch (one compile over several chains, for library use); "
              "a run trains one chain per policy: name it with '+' (e.g. 'xgrpo+sgt')")
        try:
            make_probe(self.probes)
        except (ValueError, TypeError) as e:
            check(False, "probes", f"{self.probes!r}: {e}")
        if self.grpo.beta == 0.0:
            check(self.ref_model.path is None, "ref_model.path", "a reference model is used only with grpo.beta > 0; "
                  "set grpo.beta or drop ref_model.path")
            check(not self.ref_model.sync_ref_model, "ref_model.sync_ref_model",
                  "syncs the KL reference, which exists only with grpo.beta > 0")


@dataclasses.dataclass(frozen=True)
class SeeSpec:
    """Shared Experience Exchange capacity and success threshold."""

    capacity: int = field(4096, help="rollout records kept (ring)")
    per_prompt_cap: int = field(32, help="records kept per prompt id")
    success_threshold: float = field(1.0, help="reward >= this is a verified success (SGT's tau)")
    peer_rollouts_per_prompt: int = field(8, help="peer rollout slots per prompt in a consumer's view (PRP)")
    peer_successes_per_prompt: int = field(2, help="archived peer success slots per prompt (SGT)")
    own_successes_per_prompt: int = field(1, help="archived own success slots per prompt (replay probe)")
    max_text_bytes: int = field(0, help="bytes of completion text stored per record; 0 = sized so that "
                                        "max_new_tokens of the longest tokens of every policy's tokenizer fit "
                                        "(a smaller value is an error: a cut text would not be the sample)")

    def __post_init__(self):
        for key in ("capacity", "per_prompt_cap"):
            check(getattr(self, key) > 0, key, f"must be > 0, got {getattr(self, key)}")
        check(self.max_text_bytes >= 0, "max_text_bytes", f"must be >= 0 (0 = auto), got {self.max_text_bytes}")
        for key in ("peer_rollouts_per_prompt", "peer_successes_per_prompt", "own_successes_per_prompt"):
            check(getattr(self, key) >= 0, key, f"must be >= 0, got {getattr(self, key)}")

    def view_shape(self) -> ViewShape:
        """The slots per prompt of every consumer's view."""
        return ViewShape(peer_rollouts=self.peer_rollouts_per_prompt, peer_successes=self.peer_successes_per_prompt,
                         own_successes=self.own_successes_per_prompt)

    def build(self, text_bytes: int, max_completion_length: int, num_policies: int, num_prompts: int):
        """The empty exchange (`mrl_jax.see.init`): ``capacity`` records of ``text_bytes`` text and
        ``max_completion_length`` tokens, for ``num_policies`` producers over ``num_prompts`` prompt ids."""
        from mrl_jax import see

        return see.init(self.capacity, text_bytes, max_completion_length, num_policies, num_prompts,
                        per_prompt_cap=self.per_prompt_cap, success_capacity=self.capacity,
                        tau=self.success_threshold)


@dataclasses.dataclass(frozen=True)
class MwraSpec:
    """MWRA: how the run's policies are placed on the devices (mrl_jax.mwra; docs/multihost.md)."""

    devices: Union[Literal["all"], int] = field(
        "all", help="devices the plan uses: 'all' = jax.devices() (every process's after a multi-host start), "
                    "or the first N of them (ordered by process, id)")
    time_share: Literal["pack", "full"] = field(
        "pack", help="fewer devices than policies: pack = one device each, packed greedily by cost (equal costs: "
                     "policy i on device i % D); full = every policy on the whole mesh (one after the other)")
    rules: list[list[Any]] = field(
        default_factory=list,
        help="sharding rules [[path regex, spec], ...] tried before the defaults, first match wins; spec = "
             "'fsdp' (largest divisible dim over the data axis), 'replicated', or a PartitionSpec as a list "
             "(e.g. [null, 'data']). Paths look like 'layers/0/attn/q_proj/kernel'")
    min_size: int = field(1 << 16, help="leaves with fewer elements are replicated whatever the rules say")
    memory_gb: float = field(0.0, help="per-device memory (GiB) each policy's compiled update and sampler must fit "
                                       "(checked at start, with the fixes); 0 = what the device reports "
                                       "(accelerators), no compile and no check where it reports nothing (CPU)")
    topology: Optional[str] = field(
        None, help="a TPU slice to check the run against before any work (v5e-8, v5p-16, v6e-8, v4-8, or a "
                   "topology string such as v5e:2x4): every policy's update and sampler compiled for it by XLA:TPU "
                   "on this machine (libtpu; no TPU needed), as `mrl plan` does; the run stops when one does not fit")

    def __post_init__(self):
        if self.topology is not None:
            from mrl_jax.mwra import tpu

            try:
                tpu.resolve(self.topology)
            except tpu.TopologyError as e:
                check(False, "topology", str(e))
        if not isinstance(self.devices, str):
            check(self.devices >= 1, "devices", f"must be 'all' or a count >= 1, got {self.devices}")
        check(self.min_size >= 0, "min_size", f"must be >= 0, got {self.min_size}")
        check(self.memory_gb >= 0, "memory_gb", f"must be >= 0 (0 = the device's own figure), got {self.memory_gb}")
        for i, rule in enumerate(self.rules):
            check(isinstance(rule, (list, tuple)) and len(rule) == 2 and isinstance(rule[0], str), f"rules[{i}]",
                  f"expected [path regex, spec], got {rule!r}")
            spec = rule[1]
            ok = spec in ("fsdp", "replicated") or (isinstance(spec, (list, tuple)) and all(
                e is None or isinstance(e, str) or (isinstance(e, (list, tuple)) and all(isinstance(a, str) for a in e))
                for e in spec))
            check(ok, f"rules[{i}]", f"spec {spec!r}: use 'fsdp', 'replicated' or a list of axis names / null")
            try:
                import re

                re.compile(rule[0])
            except re.error as e:
                check(False, f"rules[{i}]", f"bad regex {rule[0]!r}: {e}")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """An MRL run."""

    policies: list[PolicySpec] = field(help="the policies trained together")
    task: TaskSpec = field(default_factory=TaskSpec, help="task")
    seed: int = field(0, help="run seed (params init, sampling, prompt order); TRL's (transformers') "
                                  "default 42, kept 0 so that existing runs keep their prompts and samples")
    rounds: int = field(50, help="number of MRL rounds")
    prompts_per_round: int = field(32, help="prompts per round")
    num_generations: int = field(8, help="completions per prompt per policy (G); >= 2 (a group of one has no "
                                         "spread, so no advantage)")
    see: SeeSpec = field(default_factory=SeeSpec, help="shared experience")
    mwra: MwraSpec = field(default_factory=MwraSpec, help="device placement of the policies (MWRA)")
    checkpoint_every: int = field(10, help="rounds between checkpoints")
    keep_checkpoints: int = field(2, help="complete checkpoints kept")
    eval_every: int = field(0, help="rounds between held-out evaluations; 0 = only at the end")
    eval_prompts: int = field(128, help="held-out prompts per evaluation")
    eval_samples: int = field(0, help="sampled completions per held-out prompt at each evaluation (0 = greedy only): "
                                      "adds avg@K, pass@k for k = 1, 2, 4, ..., K, maj@K and the population metrics "
                                      "(mrl_jax.trainer.evaluation_metrics)")
    eval_temperature: float = field(1.0, help="sampling temperature of the eval_samples completions")
    rewards: list[dict[str, Any]] = field(
        default_factory=list,
        help="reward functions (TRL's reward_funcs + reward_weights): [{function: 'pkg.mod:name', weight, name, "
             "isolation: thread | process}, "
             "{builtin: accuracy | format (pattern; default TRL's think format "
             "'<think>\\n.*?\\n</think>\\n<answer>\\n.*?\\n</answer>') | overlong (max_length, cache), weight, "
             "name}]; user functions "
             "take TRL's (prompts, completions, completion_ids, **columns) and return floats or None; the total is "
             "the weighted sum. Empty = the task's verifier alone. A verified success (SEE, SGT's rescue set, "
             "success_rate) is the verifier's accuracy >= see.success_threshold, never the weighted sum "
             "(mrl_jax.tasks.reward_funcs)")
    reward_timeout_s: float = field(5.0, help="time limit of one reward call")
    max_reward_failures: int = field(200, help="stop when a reward function fails this many calls in a row")
    max_skipped_updates: int = field(5, help="stop when a policy skips this many non-finite updates in a row "
                                             "(counted in its optimizer state: the count runs on across a resume)")
    dynamic_sampling: DynamicSamplingSpec = field(
        default_factory=DynamicSamplingSpec,
        help="DAPO's dynamic sampling (verl's algorithm.filter_groups): groups whose rewards are all equal leave "
             "each policy's PG loss and its denominators, and up to max_num_gen_batches batches of prompts are "
             "generated to keep prompts_per_round useful prompts. SGT still sees its all-fail groups (a policy "
             "whose probe reads peers keeps its all-fail prompts; only its own PG rows leave), PRP's peer rows "
             "stay; under XGRPO a uniform own group leaves too, with its pooled advantage. Metrics "
             "dynamic_sampling/kept_groups, /generated_batches, /drawn_prompts (mrl_jax.trainer.dynamic_sampling)")
    overlong_prompts: Literal["reject", "truncate"] = field(
        "reject", help="prompts longer than a policy's max_prompt_length: 'reject' = never sample them (the "
                       "round draws others), 'truncate' = keep the longest tail of the prompt text that fits every "
                       "policy; counted per round as data/prompts_rejected, data/prompts_truncated")
    report_to: list[str] = field(
        default_factory=lambda: ["tensorboard", "jsonl"],
        help="experiment trackers (TRL's name; TRL's (transformers') default 'none', here tensorboard and "
             "jsonl): any of tensorboard (tb/), jsonl (metrics.jsonl: always written, "
             "resume and `mrl report` read it), wandb (pip install 'mrl-jax[wandb]'; WANDB_MODE=offline works "
             "without network; files under the run directory); ['none'] = no tracker. Trackers get TRL's metric "
             "names under <policy>/ (mrl_jax.trainer.trackers.TRL_NAMES)")

    def __post_init__(self):
        check(len(self.policies) >= 1, "policies", "needs at least one policy")
        from mrl_jax.trainer.trackers import validate_report_to

        try:
            validate_report_to(self.report_to)
        except ValueError as e:
            check(False, "report_to", str(e))
        names = [p.name for p in self.policies]
        check(len(set(names)) == len(names), "policies", f"names must be unique, got {names}")
        for key in ("rounds", "prompts_per_round", "num_generations", "checkpoint_every", "keep_checkpoints"):
            check(getattr(self, key) > 0, key, f"must be > 0, got {getattr(self, key)}")
        check(self.num_generations >= 2, "num_generations",
              f"must be >= 2, got {self.num_generations}: GRPO's advantage is a reward's distance from its group's "
              "mean, so a group of one never learns (TRL refuses it too)")
        check(self.reward_timeout_s > 0, "reward_timeout_s", f"must be > 0, got {self.reward_timeout_s}")
        for key in ("eval_prompts", "max_skipped_updates"):
            check(getattr(self, key) > 0, key, f"must be > 0, got {getattr(self, key)}")
        if self.rewards:
            from mrl_jax.tasks.reward_funcs import build_reward_specs

            try:
                build_reward_specs(self.rewards, None, timeout_s=self.reward_timeout_s)
            except (ValueError, TypeError) as e:
                raise ConfigError(str(e)) from None
        check(self.eval_temperature > 0, "eval_temperature", f"must be > 0, got {self.eval_temperature}")
        for key in ("eval_every", "max_reward_failures", "eval_samples"):
            check(getattr(self, key) >= 0, key, f"must be >= 0, got {getattr(self, key)}")
        claimed: dict[int, str] = {}
        for p in self.policies:
            if isinstance(p.devices, list):
                for d in p.devices:
                    check(d not in claimed, f"policies.{p.name}.devices",
                          f"device {d} is also given to policy {claimed.get(d)!r}: sub-meshes must not overlap")
                    claimed[d] = p.name
        for i, p in enumerate(self.policies):
            g = p.grpo.num_generations
            check(g is None or g == self.num_generations, f"policies[{i}].grpo.num_generations",
                  f"{g} contradicts num_generations: {self.num_generations}, which sets G for every policy; drop "
                  f"policies[{i}].grpo.num_generations")
            try:   # the probes bound to this run's options: an explicit probe option must agree with them
                make_probe(p.probes, RunOptions(scale_rewards=normalize_scale(p.grpo.scale_rewards),
                                                reward_eps=p.grpo.reward_eps, tau=self.see.success_threshold))
            except ValueError as e:
                check(False, f"policies.{i}.probes", str(e))


_OLD_GRPO_DEFAULTS = {"num_generations": 8, "max_completion_length": 64, "temperature": 1.0}


def saved_run_config(data: dict) -> RunConfig:
    """A run's ``config.json`` as a ``RunConfig``. Runs written before ``policies[i].grpo`` lost its own G,
    completion length and temperature hold ``GRPOConfig``'s defaults there (the trainer used the run-set values):
    those are dropped."""
    from mrl_jax.configs import from_dict

    for pol in data.get("policies") or []:
        grpo = pol.get("grpo") if isinstance(pol, dict) else None
        if isinstance(grpo, dict):
            for key, old in _OLD_GRPO_DEFAULTS.items():
                if grpo.get(key) == old:
                    grpo.pop(key)
    return from_dict(RunConfig, data)


def load_run_config(path) -> RunConfig:
    """A run config from a YAML file, or from a run's ``config.json`` (``saved_run_config``)."""
    import json
    from pathlib import Path

    from mrl_jax.configs import load_yaml

    path = Path(path)
    if path.name == "config.json" and path.is_file():
        try:
            return saved_run_config(json.loads(path.read_text()))
        except ValueError as e:
            raise ConfigError(f"{path}: {e}") from None
    return load_yaml(RunConfig, path)
