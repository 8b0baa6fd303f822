"""The sampler's inputs and output: prompts left-padded to a few widths, and the :class:`Rollout` both samplers
return.

    ids, mask = left_pad(tok.encode_batch(prompts), pad_id=tok.pad_id)   # int32[P, Tp], bool[P, Tp]
    bucket_length(37)                                                    # 64: Tp of a 37-token prompt

Names: P prompts, G samples per prompt (``num_samples``), B = P * G rows (row p * G + g: prompt p, sample g),
Tp the prompt ids' width (their columns, left-padded), N = ``SamplingConfig.max_new_tokens`` the completion length.
"""
from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from flax import struct

__all__ = ["Rollout", "bucket_length", "left_pad", "DEFAULT_BUCKETS"]

DEFAULT_BUCKETS: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


@struct.dataclass
class Rollout:
    """Sampler output. N = max_new_tokens.

    tokens: int32[B, N] generated ids (pad_id after the row stopped).
    logprobs: f32[B, N] behaviour log-probs (see ``SamplingConfig.logprobs_of``; 0 where mask is False).
    sampling_logprobs: f32[B, N] log-probs under the distribution sampled from (tempered, then top-k / top-p /
      min-p filtered and renormalised; 0 for greedy and where mask is False): the density of an importance
      weight of these samples.
    mask: bool[B, N] True for generated tokens up to AND including the EOS.
    lengths: int32[B] number of True entries of mask.
    truncated: bool[B] True when the row never emitted EOS within N tokens.
    """

    tokens: jax.Array
    logprobs: jax.Array
    sampling_logprobs: jax.Array
    mask: jax.Array
    lengths: jax.Array
    truncated: jax.Array



def bucket_length(n: int, buckets: Sequence[int] = DEFAULT_BUCKETS) -> int:
    """Smallest bucket >= n; beyond the largest bucket, the next multiple of the largest bucket.

    Padding sequence lengths up to a few sizes bounds the number of compilations of jitted steps.
    """
    n = int(n)
    if n < 0:
        raise ValueError(f"bucket_length: n must be >= 0, got {n}")
    bs = sorted(int(b) for b in buckets)
    if not bs or bs[0] <= 0:
        raise ValueError(f"bucket_length: buckets must be positive ints, got {buckets}")
    for b in bs:
        if n <= b:
            return b
    top = bs[-1]
    return -(-n // top) * top


def left_pad(
    seqs: Sequence[Sequence[int]],
    pad_id: int,
    *,
    length: int | None = None,
    buckets: Sequence[int] | None = DEFAULT_BUCKETS,
    batch_size: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Left-pad token lists into ``(ids int32[B, T], mask bool[B, T])`` (numpy, host side).

    T = ``length`` if given, else ``bucket_length(max len, buckets)`` (or the max len when buckets is
    None). ``batch_size`` pads the batch with all-pad rows holding one ``pad_id`` token marked real
    (so every row has >= 1 real token); slice them off the outputs. Sequences longer than T keep their
    last T tokens.
    """
    if not seqs and not batch_size:
        raise ValueError("left_pad: no sequences")
    if any(len(s) == 0 for s in seqs):
        raise ValueError("left_pad: every prompt needs at least one token (e.g. BOS)")
    longest = max((len(s) for s in seqs), default=1)
    if length is None:
        length = bucket_length(longest, buckets) if buckets else longest
    b = max(len(seqs), batch_size or 0)
    ids = np.full((b, length), pad_id, dtype=np.int32)
    mask = np.zeros((b, length), dtype=bool)
    for i, s in enumerate(seqs):
        s = list(s)[-length:]
        ids[i, length - len(s):] = s
        mask[i, length - len(s):] = True
    mask[len(seqs):, -1] = True
    return ids, mask
