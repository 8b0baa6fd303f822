"""Tokenizers: load a Hugging Face ``tokenizer.json``, or train a small one, behind one ``Tokenizer`` class.

``load_tokenizer(path)`` wraps a local ``tokenizer.json`` (the Rust ``tokenizers`` library, no network) and
infers the BOS / EOS / PAD ids from the files next to it (``tokenizer_config.json``,
``special_tokens_map.json``, ``generation_config.json``, ``config.json``) or, failing those, from the usual
added-token spellings (``<|endoftext|>``, ``</s>``, ``<s>``, ``[SEP]``, ``<pad>`` ...).

``train_tokenizer(kind, corpus, vocab_size)`` builds the small tokenizers the embedded default needs, one per
algorithm family, deterministically and cached on disk:

========================  ===========================================================================
``"byte_bpe"``            GPT-2 / Qwen style: ByteLevel pre-tokenizer and decoder, digits split one by one
``"metaspace_bpe"``       Llama-2 / SentencePiece style: ``▁`` for spaces, dummy prefix, byte fallback
                          (``<0x00>`` .. ``<0xFF>``), digits split one by one
``"unigram"``             T5 style Unigram LM over Metaspace pieces, with byte fallback
``"wordpiece"``           BERT style WordPiece (``##`` continuations); whitespace is *not* preserved
``"char"``                one token per character (most frequent characters), byte fallback for the rest
========================  ===========================================================================

Special tokens of trained tokenizers: ``<pad>`` (0), ``<bos>`` (1), ``<eos>`` (2) (and ``<unk>`` (3) for the
kinds that need one).

Conventions of :class:`Tokenizer` (used by :mod:`mrl_jax.thl`):

* ``encode(text)`` never adds special tokens (no BOS/EOS); ``add_special_tokens=True`` runs the post-processor.
* ``encode(text, continuation=True)`` encodes ``text`` as the *continuation* of an earlier sequence: no
  SentencePiece dummy prefix (``"42"`` -> ``4 2``, not ``▁ 4 2``), so the ids spell exactly the bytes of
  ``text``. ``parse_special=False`` treats special-token spellings in ``text`` as plain text (a peer's text
  must never inject a control token).
* ``decode(ids)`` skips special tokens (as TRL/HF do for completions); ``decode(ids, continuation=True)``
  returns the exact bytes of the tokens (from the vocabulary table, no dummy-prefix strip, no cleanup).
* :attr:`Tokenizer.byte_table` maps every token id to the UTF-8 bytes it stands for (see :class:`ByteTable`).
"""

from mrl_jax.tokenization._bytes import HASH_BASE, ByteTable, build_byte_table, bytes_to_unicode, powers
from mrl_jax.tokenization._tokenizer import Tokenizer, load_tokenizer
from mrl_jax.tokenization._training import TRAINABLE_KINDS, train_tokenizer

__all__ = [
    "ByteTable",
    "HASH_BASE",
    "Tokenizer",
    "TRAINABLE_KINDS",
    "build_byte_table",
    "bytes_to_unicode",
    "load_tokenizer",
    "powers",
    "train_tokenizer",
]
