"""The static sampler, the slot sampler's test oracle: one jitted program of prefill + ``lax`` decode loops over
all B = P * G rows at once (temperature / top-k / top-p / min-p, per-row EOS). The slot sampler
(:mod:`mrl_jax.sampler.rounds`) gives its tokens and log-probs for every slot count; the library samples with that
one, the tests and benchmarks compare against this one.

The one entry point is :func:`generate`::

    graphdef, params = nnx.split(model)
    cfg = SamplingConfig(max_new_tokens=256, temperature=1.0, top_p=0.95, eos_id=tok.eos_id, pad_id=tok.pad_id)
    ids, mask = left_pad(tok.encode_batch(prompts), pad_id=tok.pad_id, buckets=(64, 128, 256))
    out = generate(graphdef, params, ids, mask, key, cfg)   # Rollout(tokens, logprobs, sampling_logprobs, mask, ...)
    out = generate(graphdef, params, ids, mask, key, cfg, num_samples=G)   # [P * G, N], prompt-major

How it works (all on device, no host sync inside the loop):

* one ``jax.jit`` program per (graphdef, prompt shape, params shapes/dtypes, :class:`SamplingConfig`);
  :func:`bucket_length` / :func:`left_pad` bound the prompt shapes, so a run compiles a handful of times.
* ``num_samples=G``: the P prompts are prefilled ONCE (``model.prefill_shared``) and each prompt's
  keys/values are shared by its G samples; rows are prompt-major (row p * G + g) and equal, with the
  same key, those of ``generate(np.repeat(ids, G, 0), np.repeat(mask, G, 0), ...)``.
* the cache (:class:`mrl_jax.models.SampleCache`) is allocated inside the program (a memset, no host
  transfer): per layer, the prompt part [P, K, Tp, D] and the generated part [P * G, K, Lg, D], heads-major
  so that the decode step's attention matmuls read it in place (the stacked [L, B, S, K, D] layout made
  XLA copy-transpose every layer's whole cache at every step). With G = 1 there is nothing to share: the
  prompt fills the first Tp slots of one [B, K, Tp + Lg, D] block per layer, and each step attends over that
  one block. It is a loop carry written with ``lax.dynamic_update_slice``, so XLA aliases the buffers across
  iterations.
* the generated part grows in length buckets (:func:`gen_buckets`: 64, 128, ..., N - 1): one decode
  loop per bucket, each attending over its bucket only, not over ``max_new_tokens`` at every step.
* the LM head is applied to the last prompt position only; each decode step runs one
  ``model.decode_step`` on ``[B, 1]`` per generated token, then samples.
  With an ``eos_id`` the loops are ``lax.while_loop``s that stop as soon as every row has emitted EOS
  (``stop_early=True``); otherwise fixed-trip ``lax.fori_loop``s.
* randomness: the caller passes a fresh key per call. Row b = p * G + g (prompt p, sample g) has its own stream
  ``fold_in(key, b)`` (:func:`row_uniforms`), and its uniforms of every step are drawn from it at
  once, before the loop (the decode step holds no PRNG work). A row's noise is a function of (key, p, g)
  only, never of the batch size or of the row's device: appending padding prompts, or sharding the rows
  over any number of devices, leaves the real rows' samples unchanged.

Behaviour log-probs (``Rollout.logprobs``, ``SamplingConfig.logprobs_of``) and the sampling rules: see
:mod:`mrl_jax.sampler.sampling`. Outputs after a row's EOS are ``pad_id`` tokens with ``mask=False`` and ``logprobs=0``;
the EOS token itself is kept with ``mask=True``.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from mrl_jax.sampler.batch import Rollout
from mrl_jax.sampler.sampling import SamplingConfig, row_uniforms, sample_rows

__all__ = ["generate", "sample", "trace_count", "gen_buckets"]


# Incremented every time `generate` is traced (python side effect; runs only while tracing).
_TRACES = 0


def trace_count() -> int:
    """How many times :func:`generate` has been traced (compiled) in this process."""
    return _TRACES


def gen_buckets(max_new_tokens: int, smallest: int = 64) -> tuple[int, ...]:
    """Length buckets of the generated part of the cache: decode step i (1 <= i < N) attends over the
    first bucket >= i, so early steps do not read ``max_new_tokens`` slots. Doubling from ``smallest``
    (``SamplingConfig.cache_bucket``), the last one N - 1 (token N - 1 is sampled, never fed); () for N == 1."""
    need = max_new_tokens - 1
    out, b = [], smallest
    while b < need:
        out.append(b)
        b *= 2
    return tuple(out) + ((need,) if need > 0 else ())


def _record(i, tok, lp, done, tokens, logps, out_mask, pad, eos):
    """Write step i's token (pad after a row stopped) and its two log-probs (lp f32[2, B]) into the [B, N]
    (logps: [2, B, N]) outputs; update ``done``."""
    live = ~done
    tok = jnp.where(live, tok, pad)
    lp = jnp.where(live, lp, 0.0)
    tokens = jax.lax.dynamic_update_slice(tokens, tok[:, None], (0, i))
    logps = jax.lax.dynamic_update_slice(logps, lp[:, :, None], (0, 0, i))
    out_mask = jax.lax.dynamic_update_slice(out_mask, live[:, None], (0, i))
    if eos is not None:
        done = done | jnp.any(tok[:, None] == eos[None, :], axis=-1)
    return tok, done, tokens, logps, out_mask


def _decode_loop(model, cache, carry, prompt_len, uniforms, config, pad, eos):
    """Decode steps 1..N-1, one loop per length bucket (the cache grows between them).

    carry: (tok [B], done [B], tokens/out_mask [B, N], logps [2, B, N]); step i feeds token i-1 at generated slot
    i-1 and samples token i with ``uniforms[i]`` (f32[N, 2, B, 1]; None when greedy). Returns the final carry.
    """
    n = config.max_new_tokens

    def body(i, state):
        cache, tok, done, tokens, logps, out_mask = state
        pos = (prompt_len + i - 1)[:, None]
        logits, cache = model.decode_step(tok[:, None], pos, cache, i - 1)
        u = None if uniforms is None else jax.lax.dynamic_index_in_dim(uniforms, i, keepdims=False)
        tok, lp, slp = sample_rows(logits[:, -1], u, config)
        lp = jnp.stack([lp, slp])
        return (cache,) + _record(i, tok, lp, done, tokens, logps, out_mask, pad, eos)

    state, start = (cache,) + tuple(carry), 1
    for size in gen_buckets(n, config.cache_bucket):
        end = min(size + 1, n)  # steps [start, end) write generated slots < size
        state = (state[0].grow(size),) + state[1:]
        if eos is not None and config.stop_early:
            def cond(s, end=end):
                return (s[0] < end) & ~jnp.all(s[1][2])

            _, state = jax.lax.while_loop(cond, lambda s: (s[0] + 1, body(s[0], s[1])),
                                          (jnp.int32(start), state))
        else:
            state = jax.lax.fori_loop(start, end, body, state)
        start = end
    return state[1:]


@functools.partial(jax.jit, static_argnums=(0, 5), static_argnames=("num_samples",))
def generate(graphdef, params, prompt_ids: jax.Array, prompt_mask: jax.Array, key: jax.Array,
             config: SamplingConfig, *, num_samples: int = 1) -> Rollout:
    """Sample ``config.max_new_tokens`` tokens after each LEFT-padded prompt, ``num_samples`` times.

    Args:
      graphdef, params: ``nnx.split(model)`` (graphdef is static: one compile per architecture).
      prompt_ids: int32[P, Tp], left-padded. Every row needs >= 1 real token (its last column).
      prompt_mask: bool[P, Tp], True on real tokens.
      key: a PRNG key, fresh for every call; row b samples from ``fold_in(key, b)`` (:func:`row_uniforms`), so
        prompts appended after the P prompts (padding) do not change the first P * G rows' samples.
      config: :class:`SamplingConfig` (static).
      num_samples: G (static). Each prompt is prefilled ONCE and its cache shared by its G samples;
        the rows are prompt-major (row p * G + g), the same rows (and, with the same key, the same
        samples) as ``generate(np.repeat(prompt_ids, G, 0), np.repeat(prompt_mask, G, 0), ...)``.
    Returns: :class:`Rollout` with arrays of shape [P * G, N], N = ``config.max_new_tokens``.
    """
    global _TRACES
    _TRACES += 1

    if prompt_ids.ndim != 2 or prompt_mask.shape != prompt_ids.shape:
        raise ValueError(f"generate: prompt_ids and prompt_mask must both be [B, Tp], got "
                         f"{prompt_ids.shape} and {prompt_mask.shape}")
    if not isinstance(config, SamplingConfig):
        raise TypeError(f"generate: config must be a SamplingConfig, got {type(config).__name__}")
    if int(num_samples) < 1:
        raise ValueError(f"generate: num_samples must be >= 1, got {num_samples}")
    model = nnx.merge(graphdef, params)
    p, tp = prompt_ids.shape
    g, n = int(num_samples), config.max_new_tokens
    mcfg = getattr(model, "config", None)
    if getattr(mcfg, "family", None) == "gpt2" and tp + n > mcfg.max_position_embeddings:
        raise ValueError(f"generate: prompt length {tp} + max_new_tokens {n} exceeds GPT-2's "
                         f"{mcfg.max_position_embeddings} learned positions")
    pad = jnp.int32(config.pad_id)
    eos = jnp.asarray(config.eos_ids, jnp.int32) if config.eos_ids else None

    pmask = prompt_mask.astype(bool)
    positions = jnp.maximum(jnp.cumsum(pmask.astype(jnp.int32), axis=-1) - 1, 0)
    buckets = gen_buckets(n, config.cache_bucket)
    h, cache = model.prefill_shared(prompt_ids.astype(jnp.int32), positions, pmask, num_rows=p * g,
                                    gen_len=buckets[0] if buckets else 1)
    logits = jnp.repeat(model.head(h).astype(jnp.float32), g, axis=0)  # [B, V], B = P * G
    prompt_len = jnp.repeat(jnp.sum(pmask, axis=-1, dtype=jnp.int32), g)  # generated token i at len + i

    b = p * g
    tokens = jnp.full((b, n), pad, jnp.int32)
    logps = jnp.zeros((2, b, n), jnp.float32)   # [logprobs, sampling_logprobs]
    out_mask = jnp.zeros((b, n), bool)
    # every step's uniforms drawn before the loop ([N, 2, B, 1], step i reads [i]): a per-step key derivation
    # would put a small PRNG program (on CPU a rolled loop of tiny ops) in every decode step
    uniforms = None if config.is_greedy else row_uniforms(key, b, n).transpose(1, 2, 0)[..., None]
    tok, lp, slp = sample_rows(logits, None if uniforms is None else uniforms[0], config)
    carry = _record(0, tok, jnp.stack([lp, slp]), jnp.zeros((b,), bool), tokens, logps, out_mask, pad, eos)
    if n > 1:
        carry = _decode_loop(model, cache, carry, prompt_len, uniforms, config, pad, eos)
    _, done, tokens, logps, out_mask = carry
    return Rollout(
        tokens=tokens,
        logprobs=logps[0],
        sampling_logprobs=logps[1],
        mask=out_mask,
        lengths=jnp.sum(out_mask, axis=-1, dtype=jnp.int32),
        truncated=~done,
    )


def sample(model: nnx.Module, prompt_ids, prompt_mask, key, config: SamplingConfig, *,
           num_samples: int = 1) -> Rollout:
    """Convenience: ``generate(*nnx.split(model), ...)``."""
    graphdef, params = nnx.split(model)
    return generate(graphdef, params, jnp.asarray(prompt_ids), jnp.asarray(prompt_mask), key, config,
                    num_samples=num_samples)
