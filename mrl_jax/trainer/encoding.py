"""Host-side text <-> padded id arrays for one policy (numpy; no device work).

Prompts are formatted with the policy's ``PromptFormat`` (a ``prompt_template`` or the checkpoint's chat
template, see :mod:`mrl_jax.tokenization.chat`) and LEFT-padded (the sampler's layout); completions are RIGHT-padded, end
with a stop token when they ended (kept in the mask, stripped from the decoded text), and are encoded as a
*continuation* of the prompt (no SentencePiece dummy prefix), so a completion's ids spell exactly its text's
bytes — the boundary THL relies on: only the completion text crosses policies, each consumer puts its own
prompt ids in front.
"""

from __future__ import annotations

import itertools
from typing import Sequence

import numpy as np

from mrl_jax.tokenization.chat import PromptFormat, as_prompt_format
from mrl_jax.sampler import bucket_length
from mrl_jax.tokenization import Tokenizer

PROMPT_BUCKETS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048)


def encode_prompts(tokenizer: Tokenizer, template: str | PromptFormat, texts: Sequence[str], *,
                   max_len: int | None = None, max_width: int | None = None,
                   buckets: Sequence[int] = PROMPT_BUCKETS) -> tuple[np.ndarray, np.ndarray, int]:
    """Format, tokenize and LEFT-pad prompts -> ``(ids int32[P, Tp], mask bool[P, Tp], n_truncated)``.

    ``template``: a ``prompt_template`` string (a BOS is prepended when the tokenizer has one) or a
    ``PromptFormat`` (a chat format adds no BOS: its template writes it). Prompts longer than ``max_len`` keep
    their last ``max_len`` tokens (counted in ``n_truncated``). ``Tp`` is bucketed to bound recompiles, but at
    most ``max_width`` (the policy's prompt limit: a bucket never pushes a prompt past the model's positions).
    """
    seqs = as_prompt_format(template).encode(tokenizer, texts)
    n_truncated = 0
    if max_len is not None:
        n_truncated = sum(len(s) > max_len for s in seqs)
        seqs = [s[-max_len:] for s in seqs]
    longest = max(1, max(len(s) for s in seqs))
    width = bucket_length(longest, buckets)
    if max_width is not None:
        width = max(longest, min(width, max_width))
    pad = tokenizer.pad_id if tokenizer.pad_id is not None else 0
    ids = np.full((len(seqs), width), pad, np.int32)
    mask = np.zeros((len(seqs), width), bool)
    for row, s in enumerate(seqs):
        if s:
            ids[row, width - len(s):] = s
            mask[row, width - len(s):] = True
    return ids, mask, n_truncated


def encode_completions(tokenizer: Tokenizer, texts: Sequence[str], length: int, *,
                       ended: Sequence[bool] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Completion texts -> ``(ids int32[B, length], mask f32[B, length], truncated bool[B])``, right-padded.

    ``ended[b]`` (default True) appends EOS; a completion longer than ``length`` is cut and marked truncated.
    Special-token spellings inside a text stay plain text (a peer's text never injects a control token).
    """
    seqs = tokenizer.encode_batch(list(texts), continuation=True, parse_special=False)
    ended = [True] * len(seqs) if ended is None else list(ended)
    pad = tokenizer.pad_id if tokenizer.pad_id is not None else 0
    ids = np.full((len(seqs), length), pad, np.int32)
    mask = np.zeros((len(seqs), length), np.float32)
    truncated = np.zeros(len(seqs), bool)
    for row, (s, e) in enumerate(zip(seqs, ended)):
        if e and tokenizer.eos_id is not None:
            s = s + [tokenizer.eos_id]
        if len(s) > length:
            s, truncated[row] = s[:length], True
        ids[row, :len(s)] = s
        mask[row, :len(s)] = 1.0
    return ids, mask, truncated


def decode_completions(tokenizer: Tokenizer, tokens: np.ndarray, mask: np.ndarray,
                       stop_ids: Sequence[int] | None = None) -> tuple[list[str], list[list[int]]]:
    """Sampled ``tokens int32[B, N]`` with ``mask bool[B, N]`` -> (texts, content ids without stop token/pads).

    ``stop_ids``: the policy's stop set (``SamplingConfig.eos_ids``; default: the tokenizer's EOS); a row's
    last masked token is dropped when it is one of them (the sampler keeps it in the mask). The text is the
    exact bytes of the content tokens (``decode(continuation=True)``), so THL can align the sampled ids.
    """
    stops = {tokenizer.eos_id} if stop_ids is None else set(int(i) for i in stop_ids)
    stops.discard(None)
    tokens, mask = np.asarray(tokens), np.asarray(mask, dtype=bool)
    flat = tokens[mask].astype(np.int64)                # every row's masked tokens, concatenated
    if not flat.size:
        return [""] * tokens.shape[0], [[] for _ in range(tokens.shape[0])]
    n = mask.sum(axis=1)
    end = np.cumsum(n)                                  # one past each row's last masked token
    drop = (n > 0) & np.isin(flat[np.maximum(end - 1, 0)], list(stops))   # a final stop token is not content
    keep = np.ones(flat.size, dtype=bool)
    keep[(end - 1)[drop]] = False
    flat = flat[keep]
    off = np.concatenate([[0], np.cumsum(n - drop)])
    ids = flat.tolist()
    content = [ids[a:b] for a, b in itertools.pairwise(off.tolist())]
    # the exact bytes of the content tokens (``decode(continuation=True)``), each row decoded on its own
    boff = np.concatenate([[0], np.cumsum(tokenizer.byte_table.lengths[flat], dtype=np.int64)])[off]
    data = tokenizer.decode_bytes(flat)
    texts = [data[a:b].decode("utf-8", errors="replace") for a, b in itertools.pairwise(boff.tolist())]
    return texts, content
