"""THL — the Tokenizer Heterogeneity Layer: align one text's tokens across two vocabularies on common bytes.

A text produced by policy *j* (source, ids in *j*'s vocabulary) is retokenized for policy *i* (destination).
Both token sequences are laid on the UTF-8 bytes of the text; a **chunk** is a maximal span whose start and
end are token boundaries on *both* sides, i.e. the chunks are the intervals between consecutive common
boundaries. THL returns integer arrays (chunk id per source token, chunk id per destination token, chunk
count) so that on device per-token quantities move across vocabularies with ``jax.ops.segment_sum`` and
``jnp.take_along_axis`` (:func:`chunk_sum`, :func:`chunk_to_tokens`, :func:`chunk_logprob_ratio`).

Host side (numpy, vectorised over the whole batch — no per-token Python loop):

* **Byte spans come from the vocabulary**, never from ``offset_mapping``: each tokenizer has a table token id
  -> bytes (:class:`mrl_jax.tokenization.ByteTable`: GPT-2 byte map inverted, ``▁`` -> space, ``<0xNN>`` ->
  byte, also where the byte pieces are listed as added tokens, WordPiece ``##``). The spans of the *actual* ids (possibly non-canonical, e.g. a word sampled as
  several small tokens) are the cumulative sums of their byte lengths. Byte-level BPE splits a character over
  several tokens: alignment is on bytes, not characters.
* **Special tokens** (BOS/EOS/PAD, special added tokens, the unknown token) contribute zero bytes. A zero-byte
  token joins the chunk that starts at its position (the last chunk at the end of the text), except that
  leading (trailing) runs of special tokens present on *both* sides form a chunk of their own (e.g. BOS/BOS,
  EOS/EOS). A special token on one side only (BOS on the source only) joins the first chunk and is counted in
  the residual. Non-special added tokens (GPT-NeoX's runs of spaces) contribute their literal text.
* **Dummy prefix.** A SentencePiece (Metaspace) tokenizer, a ``Strip`` decoder or WordPiece may put a space
  before the first token that is not in the text. When the tokens' bytes equal ``" " + text`` that one byte
  is stripped from the first token with bytes (``residual["src_dummy_prefix"]``); a lone ``▁`` that was only
  the prefix becomes a zero-byte token.
* **Verification and residual.** Every token's bytes are checked against the text (a 64-bit polynomial hash
  of each token vs prefix hashes of the text). A side whose bytes differ from the text (normalizer:
  lowercasing, NFC/NFKC, whitespace collapsing; unknown tokens; a generation cut in the middle of a UTF-8
  character; wrong ``text``) is never aligned silently: its boundaries are mapped through the longest common
  subsequence of (token bytes, text bytes), boundaries inside changed regions are dropped (their tokens merge
  into one chunk), the chunks holding changed bytes get ``chunk_valid = False`` and the row is flagged
  (``src_roundtrip`` / ``dst_roundtrip``, ``normalized``, ``cut_mid_char``, ``src_unknown`` ...).
  Safety net: in those rows each chunk's source token bytes are compared with its destination token bytes (numpy,
  O(bytes)), and a chunk holding an unknown token (bytes unknown) is never valid; a chunk that fails is made
  invalid and counted in ``residual["byte_mismatch_chunks"]`` (0 when the tables and the mapping are right). In
  rows that round-trip on both sides every chunk lies between common token ends, so its bytes are the text's on
  both sides by construction. A zero-byte token in such a row stays with the text before it, or, after text the
  tokens do not spell, with that text (an unknown token with what it stands for). The residual also reports the
  bytes in 1:1 chunks and tokens per chunk on both sides; mask ``~chunk_valid`` in losses, and weigh how much of the text is not 1:1. WordPiece's space before a piece is a
  decoding convention: a chunk whose only difference is such a space stays valid (the row still reports
  ``*_roundtrip = False``). Rows that differ from the text take a per-row Python path (``difflib``, a few ms
  per 256-token text); rows that round-trip never do.
* Chunks are byte spans: two byte-level tokenizers that split the same character after the same byte have a
  chunk boundary inside that character.

Prompt vs completion. Only the **completion** text is shared; each consumer prepends its *own* prompt ids.
The completion is aligned standalone: its first byte is a boundary on both sides (chunk 0 starts there),
and its tokens for the consumer are ``dst.encode(completion, continuation=True, parse_special=False)`` —
**without** the SentencePiece dummy prefix, so that ``prompt_ids + dst_ids`` spells exactly prompt text +
completion text (with a dummy prefix a Llama/Mistral consumer would see an extra space after its prompt), and
with special-token spellings in a peer's text kept as plain text. This is the default of
:func:`align`/:func:`align_batch` (``continuation=True``); ``continuation=False`` aligns standalone texts
with the tokenizer's usual encoding (the dummy prefix is then stripped as above). The producer should share
``src.decode(completion_ids, continuation=True)`` (exact bytes, no dummy-prefix strip) or the ordinary
``src.decode(...)`` — both align; the former keeps a leading space that a Metaspace decoder would drop.
Its EOS (if sampled) may stay in ``src_ids``: it is a zero-byte special token in the last chunk (or in a
chunk of its own when the consumer appends its EOS to ``dst_ids`` too).

Public surface: :func:`align`, :class:`Alignment`, :func:`align_batch`, :class:`BatchAlignment`, and the
device functions :func:`chunk_sum`, :func:`chunk_mean`, :func:`chunk_to_tokens`, :func:`chunk_logprob_ratio`.
"""

from mrl_jax.thl._device import chunk_logprob_ratio, chunk_mean, chunk_sum, chunk_to_tokens
from mrl_jax.thl._host import Alignment, BatchAlignment, align, align_batch

__all__ = [
    "Alignment",
    "BatchAlignment",
    "align",
    "align_batch",
    "chunk_logprob_ratio",
    "chunk_mean",
    "chunk_sum",
    "chunk_to_tokens",
]
