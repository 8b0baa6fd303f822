"""A round's time on a TPU slice, from XLA:TPU's estimate of each compiled program (`mwra.cost_model`): estimates,
never measurements.

Per policy (`PolicyTime`): the update (the round's whole update program: reference scoring, mu iterations of its
micro-batches), the sampler's prefill (its round program outside the decode loop) and one decode step at S slots
(the first rung's loop iteration: all S slots decode one token). A round decodes ``decode_steps(mean)`` steps:
the longest row sets it at a slot per row; with fewer slots than rows the rows queue, so ``rows x (mean - 1) / S``
steps when that is more (every step priced at the first rung's S: the ladder's cheaper tail steps are not
credited, an upper bound). The update pads every row to the completion length, so its time does not depend on
the mean.

Model FLOPs (MFU, as MaxText counts them: no remat recompute): 6 x matmul parameters x trained tokens per
iteration, 2 x for the reference's forward (beta > 0), plus causal attention 6 x layers x heads x head_dim x T^2
per row per iteration (forward + backward; a third of that for the reference). Matmul parameters: all but the
input embedding's lookup (a tied LM head counts). A decode step's HBM roofline: the weights on a device read
once, plus the KV cache its S slots hold on average (prompt + half the completion).

The synchronous round (`RoundTime`): the policies that share a device run one after another; the slowest device
group sets the round and every other idles for the rest (``idle`` per policy).
"""
from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Optional, Sequence

from mrl_jax.mwra.cost_model import Chip, StepTime


class RoundShape(NamedTuple):
    """What one policy's round computes, per the plan's compiled shapes (``rows``: P x G, P padded to the data
    axis; ``prompt_width`` Tp and ``completion_length`` the update's row layout; ``slots`` S)."""

    name: str
    devices: int
    rows: int
    prompt_width: int
    completion_length: int
    slots: int
    micro_batches: int        # per iteration
    iterations: int           # num_iterations mu
    reference_forward: bool   # beta > 0: the reference scores the rows once
    matmul_params: int
    layers: int
    heads: int
    head_dim: int
    kv_bytes_per_token: int   # K and V of every layer, whole model
    weight_bytes: int         # params bytes on one device (what each decode step reads)


def model_flops(shape: RoundShape) -> float:
    """The update's model FLOPs per round (module doc)."""
    t = shape.prompt_width + shape.completion_length
    dense = 2.0 * shape.matmul_params * t * shape.rows
    attention = 2.0 * shape.layers * shape.heads * shape.head_dim * t * t * shape.rows   # causal forward
    per_pass = dense + attention
    return shape.iterations * 3 * per_pass + (per_pass if shape.reference_forward else 0.0)


@dataclasses.dataclass(frozen=True)
class PolicyTime:
    """One policy's estimated phases on its sub-mesh (seconds per device; module doc)."""

    shape: RoundShape
    chip: Chip
    update: StepTime
    sampler: StepTime

    @property
    def prefill(self) -> StepTime:
        return self.sampler.without_open_loops()

    @property
    def decode_step(self) -> StepTime:
        loops = self.sampler.open_loops
        return loops[0].per_iteration if loops else StepTime()

    @property
    def micro_batch_seconds(self) -> float:
        return self.update.seconds / max(1, self.shape.micro_batches * self.shape.iterations)

    def decode_steps(self, mean: Optional[float] = None) -> int:
        """Decode steps of a round whose completions average ``mean`` tokens (None: all at the length)."""
        s = self.shape
        mean = s.completion_length if mean is None else min(float(mean), s.completion_length)
        return max(s.completion_length - 1, math.ceil(s.rows * max(mean - 1, 0) / max(s.slots, 1)))

    def sampler_seconds(self, mean: Optional[float] = None) -> float:
        return self.prefill.seconds + self.decode_steps(mean) * self.decode_step.seconds

    def round_seconds(self, mean: Optional[float] = None) -> float:
        return self.update.seconds + self.sampler_seconds(mean)

    def mfu(self) -> float:
        """Model FLOPs of the update over the sub-mesh's peak for the update's estimated time."""
        return model_flops(self.shape) / (self.update.seconds * self.chip.peak_flops * self.shape.devices or 1.0)

    def decode_roofline_fraction(self) -> float:
        """A decode step's HBM roofline (weights + average KV cache read, per device) over its estimated time."""
        s = self.shape
        cache = s.slots * (s.prompt_width + s.completion_length / 2) * s.kv_bytes_per_token / s.devices
        step = self.decode_step.seconds
        return (s.weight_bytes + cache) / self.chip.hbm_bytes_per_s / step if step else 0.0

    def tokens_per_second(self, mean: Optional[float] = None) -> tuple[float, float]:
        """(sampled, trained) tokens per second per device over a round whose completions average ``mean``."""
        s = self.shape
        mean = s.completion_length if mean is None else min(float(mean), s.completion_length)
        per = self.round_seconds(mean) * s.devices
        return s.rows * mean / per, s.rows * (s.prompt_width + mean) * s.iterations / per

    def shares(self, mean: Optional[float] = None) -> dict:
        """Fractions of the round in Pallas kernels, collectives and the rest."""
        whole = self.update + self.prefill + self.decode_step.times(self.decode_steps(mean))
        return whole.shares()

    def to_dict(self, mean: Optional[float] = None) -> dict:
        sampled, trained = self.tokens_per_second(mean)
        return {"estimate": "XLA:TPU cost model", "devices": self.shape.devices,
                "update_seconds": self.update.seconds, "update_micro_batch_seconds": self.micro_batch_seconds,
                "prefill_seconds": self.prefill.seconds, "decode_step_seconds": self.decode_step.seconds,
                "decode_slots": self.shape.slots, "decode_steps": self.decode_steps(None),
                "round_seconds": self.round_seconds(None),
                "decode_steps_at_mean": self.decode_steps(mean), "round_seconds_at_mean": self.round_seconds(mean),
                "mean_completion": mean, "sampled_tokens_per_s_per_device": sampled,
                "trained_tokens_per_s_per_device": trained, "update_mfu": self.mfu(),
                "decode_hbm_roofline_fraction": self.decode_roofline_fraction(), "shares": self.shares(mean),
                "update": self.update.to_dict(), "sampler": self.sampler.to_dict()}

    def lines(self, mean: Optional[float] = None) -> list[str]:
        s = self.shape
        sampled, trained = self.tokens_per_second(mean)
        sh = self.shares(mean)
        at_mean = "" if mean is None else (f"; at a mean completion of {mean:g} tokens: "
                                           f"{_secs(self.round_seconds(mean))} ({self.decode_steps(mean)} steps)")
        return [f"  {s.name}: update {_secs(self.update.seconds)} a round ({_secs(self.micro_batch_seconds)} per "
                f"micro-batch x {s.micro_batches} x mu {s.iterations}), MFU {self.mfu():.1%}; prefill "
                f"{_secs(self.prefill.seconds)}; decode step {_secs(self.decode_step.seconds)} at S = {s.slots} "
                f"({self.decode_roofline_fraction():.0%} of its HBM roofline)",
                f"    round {_secs(self.round_seconds())} at {s.completion_length} tokens "
                f"({self.decode_steps()} decode steps){at_mean}; per device {sampled:,.0f} sampled and "
                f"{trained:,.0f} trained tokens/s; time in Pallas kernels {sh['pallas']:.0%}, collectives "
                f"{sh['collective']:.0%}, the rest {sh['rest']:.0%}"]


def _secs(s: float) -> str:
    if s >= 3600:
        return f"{s / 3600:.2f} h"
    if s >= 60:
        return f"{s / 60:.1f} min"
    return f"{s:.3g} s" if s >= 1 else f"{s * 1e3:.3g} ms"


@dataclasses.dataclass(frozen=True)
class RoundTime:
    """The synchronous round: per policy its time and idle fraction; ``seconds`` the slowest device group's."""

    policies: tuple          # PolicyTime
    groups: tuple            # per policy: its device ids
    mean: Optional[float] = None

    def busy(self) -> dict:
        """Seconds each device works a round (policies sharing it run one after another)."""
        out: dict = {}
        for p, ids in zip(self.policies, self.groups):
            for d in ids:
                out[d] = out.get(d, 0.0) + p.round_seconds(self.mean)
        return out

    @property
    def seconds(self) -> float:
        return max(self.busy().values(), default=0.0)

    def idle(self) -> tuple:
        """Per policy: the fraction of the round its sub-mesh waits for the slowest."""
        busy, total = self.busy(), self.seconds or 1.0
        return tuple(1.0 - max(busy[d] for d in ids) / total for ids in self.groups)

    def to_dict(self) -> dict:
        return {"estimate": "XLA:TPU cost model", "round_seconds": self.seconds, "mean_completion": self.mean,
                "policies": {p.shape.name: {**p.to_dict(self.mean), "idle_fraction": i}
                             for p, i in zip(self.policies, self.idle())}}

    def lines(self) -> list[str]:
        out = [f"time per round (XLA:TPU's estimate from this machine, not a measurement): "
               f"{_secs(self.seconds)}, the slowest sub-mesh sets it"]
        for p, idle in zip(self.policies, self.idle()):
            out.extend(p.lines(self.mean))
            out[-1] += f"; its sub-mesh idles {idle:.0%} of the round"
        return out


def scaled_round_seconds(p: PolicyTime, devices: int, mean: Optional[float] = None) -> float:
    """``p``'s round predicted on a sub-mesh of ``devices`` from its compiled size (what MWRA compares before
    compiling the allocation it picks): the compute of every phase split over the devices (x n0 / n), the
    collectives by the ring's (n - 1) / n of the bytes -- where the compiled size is one device, the FSDP gathers
    that n > 1 adds: the weights three times in the update (forward, backward, gradients) and once per decode
    step."""
    n0, n = p.shape.devices, devices
    steps = p.decode_steps(mean)
    whole = p.update + p.prefill + p.decode_step.times(steps)
    compute = (whole.seconds - whole.collective) * n0 / n
    ring = lambda k: (k - 1) / k   # noqa: E731
    if n0 > 1:
        collective = whole.collective * ring(n) / ring(n0)
    else:
        collective = (3 + steps) * p.shape.weight_bytes * ring(n) / p.chip.ici_bytes_per_s
    return compute + collective


def round_time(policies: Sequence[PolicyTime], groups: Sequence[Sequence[int]],
               mean: Optional[float] = None) -> RoundTime:
    return RoundTime(policies=tuple(policies), groups=tuple(tuple(g) for g in groups), mean=mean)


__all__ = ["PolicyTime", "RoundShape", "RoundTime", "model_flops", "round_time", "scaled_round_seconds"]
