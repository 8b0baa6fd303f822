"""SEE — Shared Experience Exchange: an immutable pytree buffer of typed experience + per-consumer views.

    see = see_lib.init(capacity=4096, max_bytes=256, max_src_tokens=64, num_policies=2, num_prompts=1000)
    exp = see_lib.make_experience(texts, prompt_index, source=0, rewards=r, src_ids=ids, src_logp=lp, round=t)
    see, info = jax.jit(see_lib.add)(see, exp)        # pure: the old buffer is unchanged
    view = see_lib.build_view(see, consumer=1, prompt_index=batch_pids, align_batch=fn, ...)   # host
    # fn(texts, sources, src_ids) -> ViewAlignment (ViewAlignment.from_batches of thl.align_batch results)

Typed records (flax.struct dataclasses of fixed-capacity arrays + a write pointer):
- ``RolloutRecord`` (data level): prompt id, source policy, completion text (UTF-8 bytes [cap, max_bytes]
  + length + 32-bit hash), reward, truncated flag, round, the source's own token ids and behaviour
  log-probs (``src_ids``/``src_logp`` [cap, max_src_tokens]). Decision: log-probs are stored per *source
  token*; their per-THL-chunk aggregate depends on the consumer's tokenizer, so ``make_view`` sums them
  per chunk for each consumer (``src_chunk_logp``).
- ``SuccessRecord``: same fields, only verified successes (reward >= tau); its own capacity, so successes
  outlive the rollout ring.
- ``GroupStats`` (value level): a fixed table indexed directly by prompt id [num_prompts, N, 4] with
  (count, sum r, sum r^2, number of successes), cumulative (``total``) and for the latest round of each
  (prompt, policy) cell (``latest`` + ``latest_round``). Prompt ids outside [0, num_prompts) are not
  counted (``info["stats_dropped"]``). Stats count every sample, duplicates included.
Capacity/eviction: a ring pointer overwrites the oldest slot in ring order; when a prompt already holds
``per_prompt_cap`` records, the new one replaces that prompt's oldest record instead.
Multiplicity: the rollout ring keeps every sample, repeats included (a peer that samples "42" four times
contributes four rows): PRP estimates an expectation under the peer's policy and dropping repeats would
bias it towards novel outputs. De-duplication belongs to the success archive only: a success with the same
(source, prompt id, text length, text hash) as an archived one is not archived again.
Byte budget: a text longer than ``max_bytes`` is cut, marked ``truncated`` and never archived as a success
(``info["texts_cut"]`` counts them), so no consumer is taught a cut text as a verified answer.
``add`` is a ``lax.while_loop`` over the kept new entries: one compile per (buffer, experience) shape.

Modules: ``_records`` (the records, the buffer, ``make_experience``, ``add``), ``_views`` (the per-consumer views).
"""

from mrl_jax.rows import ARCHIVE, EMPTY, OWN_ARCHIVE, PEER  # the row kinds (defined once, in mrl_jax.rows)
from mrl_jax.see._records import (SEE, Experience, GroupStats, RolloutRecord,
                                  SeeView, SuccessRecord, add, decode_text, init, make_experience, text_hash)
from mrl_jax.see._views import (PeerSelection, ViewAlignment, build_view, empty_view, make_view, peer_stats,
                               select_peers, ViewShape)

__all__ = [
    "ARCHIVE", "EMPTY", "OWN_ARCHIVE", "PEER", "SEE", "Experience", "GroupStats", "PeerSelection", "RolloutRecord",
    "SeeView",
    "SuccessRecord", "ViewAlignment", "ViewShape", "add", "build_view", "decode_text", "empty_view", "init", "make_experience",
    "make_view", "peer_stats", "select_peers", "text_hash",
]
