"""Sampling from one decode step's logits: :class:`SamplingConfig` (temperature / top-k / top-p / min-p / greedy, EOS,
which log-probs to report) and the pure functions :func:`sample_step`, :func:`categorical`, :func:`nucleus_mask`
that both samplers call inside their decode loops (:func:`sample_rows`, with each step's uniforms drawn up front by
:func:`row_uniforms`: row b's stream ``fold_in(key, b)``, whatever slot or device it runs on).

Behaviour log-probs (``Rollout.logprobs``) -- which distribution (``SamplingConfig.logprobs_of``):

* ``"tempered"`` (DEFAULT): ``log_softmax(logits / temperature)[token]`` WITHOUT top-k / top-p / min-p
  filtering. This is what TRL's GRPO trainer recomputes for pi_old / pi_theta (it divides the logits by
  ``temperature`` and takes the full-vocabulary log-softmax), so the GRPO ratio pi_theta / pi_old
  compares like with like when the learner uses the same temperature. With ``temperature == 0``
  (greedy) the temperature used here is 1; ``greedy=True`` with a temperature > 0 keeps that
  temperature for the log-probs.
* ``"sampling"``: the log-prob under the distribution actually sampled from (tempered AND top-k/top-p/min-p
  filtered, renormalised); 0 for greedy (a point mass). Use it for exact importance weights of the
  sampler itself.
* ``"raw"``: ``log_softmax(logits)[token]``, the temperature-1 unfiltered model distribution.

Whatever ``logprobs_of`` says, :func:`sample_rows` also returns the ``"sampling"`` log-prob (the sampler's
second output, ``Rollout.sampling_logprobs``): the behaviour density an importance weight of these samples
needs when a filter is on (PRP's peer ratio).
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["SamplingConfig", "categorical", "nucleus_mask", "sample_rows", "sample_step", "sample_with_uniforms",
           "row_uniforms"]

_LOGPROBS_OF = ("tempered", "sampling", "raw")


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How to sample. Frozen and hashable: it is a static argument of the samplers' jitted programs.

    Attributes:
      max_new_tokens: N, the completion length: tokens sampled per row, token 0 from the prefill (TRL's
        ``max_completion_length``). >= 1.
      temperature: logits are divided by it before sampling. 0 means greedy.
      top_k: keep the k most likely tokens (0 = off). Applied after temperature, before top_p.
      top_p: nucleus sampling: keep the smallest set of most likely tokens whose (renormalised) mass
        reaches top_p (1.0 = off). Applied after top_k, as in ``transformers``.
      min_p: keep the tokens whose probability is >= min_p times the most likely one's (0.0 = off;
        ``transformers``' MinPLogitsWarper, applied after top_p; the ratio does not depend on the earlier
        filters' renormalisation).
      greedy: argmax decoding (temperature / top_k / top_p ignored for the choice).
      eos_id: end-of-sequence id, or a tuple of ids (any of them stops the row), or None (never stop).
      pad_id: id written after a row has stopped.
      logprobs_of: which distribution ``Rollout.logprobs`` refers to: "tempered" (default; TRL's
        convention: logits / temperature, no top-k/top-p filtering), "sampling" (the filtered
        distribution actually sampled from) or "raw" (temperature 1, unfiltered). See module docstring.
      stop_early: with an eos_id, exit the decode loop as soon as every row has stopped
        (``lax.while_loop``). False: always run max_new_tokens steps (``lax.fori_loop``).
      vocab_size: ids >= vocab_size are never chosen (0 = every id): the embedding rows a checkpoint has beyond its
        tokenizer's vocabulary (released Phi-3: 32064 rows, 32011 tokens; Qwen2.5: 151936, 151665), which decode
        to nothing. The choice and the "sampling" log-probs exclude them; "tempered" / "raw" keep the full
        vocabulary (what the learner scores).
      cache_bucket: the smallest length bucket of the generated part of the cache
        (:func:`mrl_jax.sampler.oracle.gen_buckets`); each further bucket doubles it and adds one decode loop to
        the compiled program (compile time), so the default keeps generations of <= 65 tokens in one loop. The slot sampler's cache is cut in parts
        at the same doubling (:func:`mrl_jax.models.slot_cache.spans`): a decode step reads the parts up to its
        slots' furthest position.
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    greedy: bool = False
    eos_id: int | tuple[int, ...] | None = None
    pad_id: int = 0
    logprobs_of: str = "tempered"
    stop_early: bool = True
    cache_bucket: int = 64
    vocab_size: int = 0

    def __post_init__(self):
        if isinstance(self.eos_id, (list, tuple, np.ndarray)):
            eos = tuple(int(e) for e in self.eos_id)
            object.__setattr__(self, "eos_id", eos if eos else None)
        elif self.eos_id is not None:
            object.__setattr__(self, "eos_id", int(self.eos_id))
        if int(self.max_new_tokens) < 1:
            raise ValueError(f"SamplingConfig.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not (self.temperature >= 0.0 and math.isfinite(self.temperature)):
            raise ValueError(f"SamplingConfig.temperature must be a finite number >= 0, got {self.temperature}")
        if int(self.top_k) < 0:
            raise ValueError(f"SamplingConfig.top_k must be >= 0 (0 = off), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"SamplingConfig.top_p must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p < 1.0):
            raise ValueError(f"SamplingConfig.min_p must be in [0, 1) (0 = off), got {self.min_p}")
        if self.logprobs_of not in _LOGPROBS_OF:
            raise ValueError(f"SamplingConfig.logprobs_of must be one of {_LOGPROBS_OF}, got {self.logprobs_of!r}")
        if self.pad_id is None:
            raise ValueError("SamplingConfig.pad_id must be an int (the tokenizer's pad id, or eos if none)")
        if int(self.cache_bucket) < 1:
            raise ValueError(f"SamplingConfig.cache_bucket must be >= 1, got {self.cache_bucket}")
        if int(self.vocab_size) < 0:
            raise ValueError(f"SamplingConfig.vocab_size must be >= 0 (0 = every id), got {self.vocab_size}")
        object.__setattr__(self, "vocab_size", int(self.vocab_size))
        object.__setattr__(self, "cache_bucket", int(self.cache_bucket))
        object.__setattr__(self, "max_new_tokens", int(self.max_new_tokens))
        object.__setattr__(self, "top_k", int(self.top_k))
        object.__setattr__(self, "pad_id", int(self.pad_id))
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))
        object.__setattr__(self, "min_p", float(self.min_p))

    @property
    def is_greedy(self) -> bool:
        return bool(self.greedy) or self.temperature == 0.0

    @property
    def filters(self) -> bool:
        """True when top-k, top-p, min-p or a vocabulary cut change the tempered distribution (sampled, not
        greedy)."""
        return not self.is_greedy and (self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0 or self.vocab_size > 0)

    @property
    def eos_ids(self) -> tuple[int, ...]:
        if self.eos_id is None:
            return ()
        return self.eos_id if isinstance(self.eos_id, tuple) else (self.eos_id,)



def nucleus_mask(probs: jax.Array, top_p: float) -> jax.Array:
    """bool[B, V]: the top-p nucleus of each row of ``probs`` (f32[B, V], rows sum to 1).

    Keeps token v iff the mass of tokens strictly more likely than v is < top_p (the smallest set of
    most likely tokens reaching top_p; the most likely token is always kept) -- the sorted-cumulative
    rule of ``transformers``' TopPLogitsWarper, computed WITHOUT a sort: a 31-step bisection on the
    float32 bit pattern of the threshold (non-negative floats order like their int32 bits), each step
    one masked row-sum. O(31 * V) elementwise work, no O(V log V) sort of the full vocabulary.
    Ties at the threshold are all kept (a sort would keep an arbitrary subset of them).
    """
    bits = jax.lax.bitcast_convert_type(probs.astype(jnp.float32), jnp.int32)
    lo = jnp.zeros(probs.shape[:-1], jnp.int32)  # invariant: mass(p >= lo) >= top_p
    hi = jnp.max(bits, axis=-1) + 1  # invariant: mass(p >= hi) < top_p (empty set)

    def body(_, lohi):
        lo, hi = lohi
        mid = lo + (hi - lo) // 2
        mass = jnp.sum(jnp.where(bits >= mid[..., None], probs, 0.0), axis=-1)
        ok = mass >= top_p
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo, hi = jax.lax.fori_loop(0, 31, body, (lo, hi))
    return bits >= lo[..., None]


def _take(x: jax.Array, idx: jax.Array) -> jax.Array:
    return jnp.take_along_axis(x, idx[..., None], axis=-1)[..., 0]


def _argmax(x: jax.Array) -> jax.Array:
    """int32 argmax over the last axis (first maximum), as two plain reductions.

    Same result as ``jnp.argmax`` for finite inputs; XLA:CPU's variadic (value, index) reduce behind
    ``jnp.argmax`` is ~6x slower than max + min at [16, 8192].
    """
    v = x.shape[-1]
    m = jnp.max(x, axis=-1, keepdims=True)
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.minimum(jnp.min(jnp.where(x == m, iota, v), axis=-1), v - 1)


def _logprob_at(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """log_softmax(logits)[tokens] without materialising the log-softmax."""
    return _take(logits, tokens) - jax.nn.logsumexp(logits, axis=-1)


_BLOCK = 128


def _first_above(cum: jax.Array, u: jax.Array, mass: jax.Array) -> jax.Array:
    """Index of the first entry of ``cum`` (non-decreasing, [..., n]) that exceeds ``u`` [..., 1];
    if rounding puts u at/above the total, the last entry with positive ``mass``."""
    n = cum.shape[-1]
    iota = jax.lax.broadcasted_iota(jnp.int32, cum.shape, cum.ndim - 1)
    first = jnp.sum((cum <= u).astype(jnp.int32), axis=-1)
    last_pos = jnp.max(jnp.where(mass > 0, iota, 0), axis=-1)
    return jnp.where(first < n, jnp.minimum(first, last_pos), last_pos)


def categorical(key: jax.Array, logits: jax.Array) -> jax.Array:
    """Exact sample from softmax(logits) over the last axis: int32[...] (``-inf`` logits never drawn).

    Two-level inverse CDF (:func:`_inverse_cdf`) with 2 uniforms per row. ``jax.random.categorical``
    (Gumbel-max) needs one random number per vocabulary entry; at [16, 8192] on CPU this is ~10x faster, and
    on GPU it reads [B, V] once.
    """
    return _inverse_cdf(jax.random.uniform(key, (2, *logits.shape[:-1], 1), jnp.float32), logits)[0]


def _inverse_cdf(u: jax.Array, logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """:func:`categorical` with its uniforms given, ``u: f32[2, ..., 1]`` in [0, 1): ``u[0]`` picks a block of
    128 tokens by its mass, ``u[1]`` a token inside the block. Returns (tokens int32[...], ``logsumexp(logits)``
    f32[...] from the same max and masses, so a log-prob needs no second pass over the vocabulary)."""
    *lead, v = logits.shape
    nb = -(-v // _BLOCK)
    m = jnp.max(logits, axis=-1, keepdims=True)
    p = jnp.exp(logits - m)  # f32, max entry 1, -inf -> 0
    if nb * _BLOCK != v:
        p = jnp.pad(p, [(0, 0)] * len(lead) + [(0, nb * _BLOCK - v)])
    p = p.reshape(*lead, nb, _BLOCK)
    block_mass = jnp.sum(p, axis=-1)  # [..., nb]
    cb = jnp.cumsum(block_mass, axis=-1)
    blk = _first_above(cb, u[0] * cb[..., -1:], block_mass)
    pb = jnp.take_along_axis(p, blk[..., None, None], axis=-2)[..., 0, :]  # [..., BLOCK]
    cw = jnp.cumsum(pb, axis=-1)
    tok = (blk * _BLOCK + _first_above(cw, u[1] * cw[..., -1:], pb)).astype(jnp.int32)
    return tok, m[..., 0] + jnp.log(cb[..., -1])


def sample_step(logits: jax.Array, key: jax.Array, config: SamplingConfig) -> tuple[jax.Array, jax.Array]:
    """Sample one token per row. logits: f32[B, V] -> (tokens int32[B], logprobs f32[B]).

    Order as in ``transformers``: temperature, then top-k, then top-p (on the renormalised top-k).
    logprobs follow ``config.logprobs_of`` (module docstring).
    """
    u = None if config.is_greedy else jax.random.uniform(key, (2, logits.shape[0], 1), jnp.float32)
    return sample_with_uniforms(logits, u, config)


def sample_with_uniforms(logits: jax.Array, u, config: SamplingConfig) -> tuple[jax.Array, jax.Array]:
    """:func:`sample_step` with the row's uniforms given (``u: f32[2, B, 1]``; None when greedy)."""
    return sample_rows(logits, u, config)[:2]


def _min_p(vals: jax.Array, min_p: float) -> jax.Array:
    """``vals`` (scaled logits, ``-inf`` = filtered) with the tokens below min_p x the top probability at -inf."""
    if min_p <= 0.0:
        return vals
    return jnp.where(vals >= jnp.max(vals, axis=-1, keepdims=True) + math.log(min_p), vals, -jnp.inf)


def sample_rows(logits: jax.Array, u, config: SamplingConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`sample_with_uniforms` plus the ``"sampling"`` log-prob: (tokens int32[B], logprobs f32[B] per
    ``config.logprobs_of``, sampling_logprobs f32[B] under the filtered distribution sampled from; 0 greedy)."""
    logits = logits.astype(jnp.float32)
    vocab = logits.shape[-1]
    cut = 0 < config.vocab_size < vocab
    allowed = jnp.where(jnp.arange(vocab) < config.vocab_size, logits, -jnp.inf) if cut else logits
    if config.is_greedy:
        tok = _argmax(allowed)
        zero = jnp.zeros(tok.shape, jnp.float32)
        if config.logprobs_of == "sampling":
            return tok, zero, zero
        t = 1.0 if config.logprobs_of == "raw" or config.temperature == 0.0 else config.temperature
        return tok, _logprob_at(logits / t, tok), zero

    tempered = logits / config.temperature
    scaled = allowed / config.temperature
    unfiltered = not cut and not 0 < config.top_k < vocab and config.top_p >= 1.0 and config.min_p <= 0.0
    if 0 < config.top_k < vocab:
        vals, idx = jax.lax.top_k(scaled, config.top_k)  # [B, k], sorted descending
        if config.top_p < 1.0:
            probs = jax.nn.softmax(vals, axis=-1)
            before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly before each (sorted) entry
            keep = (before < config.top_p).at[..., 0].set(True)
            vals = jnp.where(keep, vals, -jnp.inf)
        vals = _min_p(vals, config.min_p)
        choice, log_z = _inverse_cdf(u, vals)
        tok = _take(idx, choice).astype(jnp.int32)
        filtered_lp = _take(vals, choice) - log_z
    else:
        filtered = scaled
        if config.top_p < 1.0:
            keep = nucleus_mask(jax.nn.softmax(scaled, axis=-1), config.top_p)
            filtered = jnp.where(keep, scaled, -jnp.inf)
        filtered = _min_p(filtered, config.min_p)
        tok, log_z = _inverse_cdf(u, filtered)
        filtered_lp = _take(filtered, tok) - log_z   # log-prob under the distribution sampled from

    if config.logprobs_of == "raw":
        return tok, _logprob_at(logits, tok), filtered_lp
    if config.logprobs_of == "sampling" or unfiltered:   # unfiltered: that distribution is the tempered one
        return tok, filtered_lp, filtered_lp
    return tok, _logprob_at(tempered, tok), filtered_lp   # "tempered" after a filter


def row_uniforms(key: jax.Array, rows: int, steps: int) -> jax.Array:
    """f32[B, N, 2]: the sampling uniforms of row b at each of its N steps, drawn from the row's own key
    ``fold_in(key, b)``: a row's numbers depend neither on the number of rows nor on where the row runs."""
    return jax.vmap(lambda b: jax.random.uniform(jax.random.fold_in(key, b), (steps, 2), jnp.float32))(
        jnp.arange(rows, dtype=jnp.int32))

