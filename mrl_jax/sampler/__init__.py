"""The sampler: a policy's completions of a round's prompts, with their behaviour log-probs.

    from mrl_jax.sampler import SamplingConfig, generate_slots, left_pad
    ids, mask = left_pad(tok.encode_batch(prompts), pad_id=tok.pad_id)            # int32[P, Tp], bool[P, Tp]
    out, stats = generate_slots(graphdef, params, ids, mask, key, cfg, num_samples=G, slots=S)   # Rollout [B, N]

Modules, one concept each:

* :mod:`~mrl_jax.sampler.sampling`: one decode step's token choice (:class:`SamplingConfig`: temperature / top-k /
  top-p / min-p, which log-probs) and each row's uniforms (:func:`row_uniforms`);
* :mod:`~mrl_jax.sampler.batch`: the inputs and output (:func:`left_pad`, :func:`bucket_length`, :class:`Rollout`);
* :mod:`~mrl_jax.sampler.slots`: the slot sampler's state and steps, a round as one program;
* :mod:`~mrl_jax.sampler.ladder`: the slot counts (rungs) a round decodes in and what rows cost there;
* :mod:`~mrl_jax.sampler.rounds`: a round launched (:func:`launch` -> :class:`Launched`) and read (:func:`read`);
* :mod:`~mrl_jax.sampler.oracle`: the static sampler (:func:`generate`), all rows at once: the slot sampler's test
  oracle (same key, same tokens and log-probs), not what the library samples with.
"""
from mrl_jax.sampler.batch import DEFAULT_BUCKETS, Rollout, bucket_length, left_pad
from mrl_jax.sampler.ladder import (SHORT, Ladder, graph_token, ladder_row_steps, min_row_steps, paged_layout, ragged,
                                    rungs, slot_count)
from mrl_jax.sampler.oracle import gen_buckets, generate, sample
from mrl_jax.sampler.rounds import Launched, drive, generate_slots, launch, read, round_program
from mrl_jax.sampler.sampling import SamplingConfig, row_uniforms, sample_rows
from mrl_jax.sampler.slots import admit_count, shares_prompts

__all__ = ["SamplingConfig", "row_uniforms", "sample_rows", "Rollout", "left_pad", "bucket_length", "DEFAULT_BUCKETS",
           "generate", "sample", "gen_buckets", "Launched", "launch", "read", "drive", "generate_slots",
           "round_program", "admit_count", "shares_prompts", "SHORT", "Ladder", "rungs", "ragged",
           "slot_count", "paged_layout", "graph_token", "min_row_steps", "ladder_row_steps"]
