"""Building blocks (Linear, Embed, norms) and the ``CausalLM`` base class with the shared public API."""
from __future__ import annotations

from typing import Optional, Tuple

import jax
import jax.numpy as jnp
from flax import nnx

from .attention import CausalMask, KVCache, PrefixMask, SampleCache, default_positions
from .slot_cache import SlotCache
from .config import ModelConfig

INIT_STD = 0.02  # HF initializer_range

# ``ModelConfig.remat`` -> what a decoder layer keeps for the backward (None: everything, no remat).
# "full" keeps only the layer's input (the layer is recomputed in the backward); "dots_saveable" keeps every
# matmul output; "dots_with_no_batch_dims_saveable" keeps the projections' and MLP's outputs, not attention's.
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def dense(x: jax.Array, w: jax.Array, *, transpose_w: bool = False, preferred_element_type=None) -> jax.Array:
    """x [..., din] @ w [din, dout] (w [dout, din] with transpose_w) -> [..., dout], as ONE 2-D matmul.

    The leading axes are flattened first: the weight gradient then contracts a single row axis. A
    [B, T, din] dot's backward contracts (B, T) and XLA:CPU transposes both operands for it (measured:
    the MLP's gradient 2.4x slower than with flattened rows, same FLOPs); on GPU/TPU the reshapes are free.
    """
    lead = x.shape[:-1]
    dims = (((1,), (1 if transpose_w else 0,)), ((), ()))
    y = jax.lax.dot_general(x.reshape(-1, x.shape[-1]), w, dims, preferred_element_type=preferred_element_type)
    return y.reshape(lead + (y.shape[-1],))


class Linear(nnx.Module):
    """y = x @ kernel (+ bias); kernel: [in, out] (HF nn.Linear weight transposed; GPT-2 Conv1D as is)."""

    def __init__(self, din: int, dout: int, *, use_bias: bool, cfg: ModelConfig, rngs: nnx.Rngs):
        pd = cfg.jnp_param_dtype
        self.kernel = nnx.Param(INIT_STD * jax.random.normal(rngs.params(), (din, dout), jnp.float32).astype(pd))
        self.bias = nnx.Param(jnp.zeros((dout,), pd)) if use_bias else None
        self.dtype = cfg.jnp_dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        y = dense(x.astype(self.dtype), self.kernel[...].astype(self.dtype))
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y


class Embed(nnx.Module):
    """embedding: [num, dim]."""

    def __init__(self, num: int, dim: int, *, cfg: ModelConfig, rngs: nnx.Rngs):
        self.embedding = nnx.Param(
            INIT_STD * jax.random.normal(rngs.params(), (num, dim), jnp.float32).astype(cfg.jnp_param_dtype))
        self.dtype = cfg.jnp_dtype

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.embedding[...], ids, axis=0).astype(self.dtype)

    def attend(self, h: jax.Array) -> jax.Array:
        """f32 logits h @ embedding.T (tied head)."""
        return dense(h.astype(self.dtype), self.embedding[...].astype(self.dtype), transpose_w=True,
                     preferred_element_type=jnp.float32)


class RMSNorm(nnx.Module):
    """HF LlamaRMSNorm: statistics in float32, ``scale * x_normed.astype(dtype)``."""

    def __init__(self, dim: int, *, cfg: ModelConfig):
        self.scale = nnx.Param(jnp.ones((dim,), cfg.jnp_param_dtype))
        self.eps = cfg.norm_eps
        self.dtype = cfg.jnp_dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.scale[...].astype(self.dtype) * xf.astype(self.dtype)


class LayerNorm(nnx.Module):
    """LayerNorm with statistics in float32."""

    def __init__(self, dim: int, *, cfg: ModelConfig):
        self.scale = nnx.Param(jnp.ones((dim,), cfg.jnp_param_dtype))
        self.bias = nnx.Param(jnp.zeros((dim,), cfg.jnp_param_dtype))
        self.eps = cfg.norm_eps
        self.dtype = cfg.jnp_dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
        y = (xf - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(self.dtype)


# Rows per chunk of the MLP when ``ModelConfig.remat`` is set: the [rows, intermediate] activations of one
# chunk are live at a time, forward and backward (at 16 x 4352 tokens of a 4864-wide MLP: 1.3 GB per f32
# array unchunked).
MLP_CHUNK_ROWS = 4096


def row_chunked(fn, x: jax.Array, chunk: int) -> jax.Array:
    """``fn(x)`` for a row-wise ``fn`` on x [N, D], computed ``chunk`` rows at a time (``lax.map`` of
    ``jax.checkpoint(fn)``: the backward recomputes one chunk's intermediates at a time). N <= chunk or
    chunk 0: ``fn(x)``."""
    N = x.shape[0]
    if chunk <= 0 or N <= chunk:
        return fn(x)
    n = -(-N // chunk)
    xs = jnp.pad(x, ((0, n * chunk - N), (0, 0))).reshape(n, chunk, x.shape[1])
    ys = jax.lax.map(jax.checkpoint(fn), xs)
    return ys.reshape(n * chunk, ys.shape[-1])[:N]


def mlp_chunk(cfg: ModelConfig) -> int:
    """Rows per MLP chunk: `MLP_CHUNK_ROWS` with rematerialisation on, else 0 (unchunked)."""
    return MLP_CHUNK_ROWS if cfg.remat != "none" else 0


def activation(name: str):
    if name == "silu":
        return jax.nn.silu
    if name == "gelu":
        return lambda x: jax.nn.gelu(x, approximate=False)
    return lambda x: jax.nn.gelu(x, approximate=True)  # gelu_new / gelu_pytorch_tanh


def _remat_scan(layers: list, policy, x, positions, mask, cache_index):
    """x [N, D] through ``layers`` (one graphdef, one mask), cache-free, each under ``jax.checkpoint(policy)``.

    Several layers run as a ``lax.scan`` over their stacked params: the backward recomputes a layer inside the
    loop body, so what is kept between layers is x alone (a Python loop of checkpointed calls leaves the
    recompute to XLA's scheduler, and XLA:CPU merges it with the forward: no saving)."""
    graphdef = nnx.graphdef(layers[0])

    def body(x, state):
        return nnx.merge(graphdef, state)(x, positions, mask, cache=None, layer=0, cache_index=cache_index)[0]

    body = jax.checkpoint(body, policy=policy)
    states = [nnx.state(layer) for layer in layers]
    if len(states) == 1:
        return body(x, states[0])
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *states)
    return jax.lax.scan(lambda c, st: (body(c, st), None), x, stacked)[0]


class CausalLM(nnx.Module):
    """Shared public API. Subclasses define ``embed(ids, positions)``, ``layers`` (nnx.List of blocks with
    ``__call__(x, positions, mask, cache, layer, cache_index) -> (x, cache)``, x the residual stream as rows
    [B*T, D] and positions int32[B, T]), ``final_norm`` and
    ``head(h)``."""

    config: ModelConfig

    # -- to implement
    def embed(self, input_ids: jax.Array, positions: jax.Array) -> jax.Array:
        raise NotImplementedError

    def final_norm(self, x: jax.Array) -> jax.Array:
        raise NotImplementedError

    def head(self, h: jax.Array) -> jax.Array:
        """f32 logits [..., V] from hidden states [..., D] (tied or untied head)."""
        raise NotImplementedError

    def _masks(self, kv_mask, cache_index, T, cache=None):
        windows = {self.config.layer_window(i) for i in range(self.config.num_layers)}
        if isinstance(cache, (SampleCache, SlotCache)):
            return {w: cache.step_masks(cache_index, w) for w in windows}
        return {w: CausalMask(kv_mask=kv_mask, offset=cache_index, num_queries=T, window=w) for w in windows}

    def _layers(self, x, positions, masks: dict, cache, cache_index):
        """Every decoder layer over the rows x [N, D]; layer i gets ``masks[layer_window(i)]``. Without a cache
        and with ``config.remat`` set, runs of consecutive layers with one structure and one window go through
        :func:`_remat_scan` (the sampler passes a cache: never rematerialised)."""
        policy = REMAT_POLICIES[self.config.remat]
        if cache is not None or policy is None:
            for i, layer in enumerate(self.layers):
                x, cache = layer(x, positions, masks[self.config.layer_window(i)], cache=cache, layer=i,
                                 cache_index=cache_index)
            return x, cache
        keys = [(nnx.graphdef(layer), self.config.layer_window(i)) for i, layer in enumerate(self.layers)]
        start = 0
        for i in range(1, len(keys) + 1):
            if i == len(keys) or keys[i] != keys[start]:
                x = _remat_scan(list(self.layers)[start:i], policy, x, positions, masks[keys[start][1]], cache_index)
                start = i
        return x, None

    def _run(self, input_ids, positions, kv_mask, cache: Optional[KVCache], cache_index):
        B, T = input_ids.shape
        # the residual stream as rows [B*T, D]: norms, projections and MLPs are 2-D (see ``dense``); only
        # attention sees [B, T, heads, head_dim]. Measured on CPU: the layer's gradient 1.4x faster.
        x = self.embed(input_ids, positions).reshape(B * T, -1)
        x, cache = self._layers(x, positions, self._masks(kv_mask, cache_index, T, cache), cache, cache_index)
        return self.final_norm(x).reshape(B, T, -1), cache

    # -- public API
    def hidden(self, input_ids: jax.Array, *, positions: Optional[jax.Array] = None,
               attention_mask: Optional[jax.Array] = None) -> jax.Array:
        """[B, T, D] hidden states after the final norm (compute dtype).

        attention_mask: bool/int[B, T], 1 = real token (key padding); positions default to
        cumsum(mask) - 1 clipped at 0, so left-padded rows work."""
        input_ids = jnp.asarray(input_ids, jnp.int32)
        B, T = input_ids.shape
        if positions is None:
            positions = default_positions(input_ids, attention_mask)
        kv_mask = jnp.ones((B, T), bool) if attention_mask is None else jnp.asarray(attention_mask).astype(bool)
        h, _ = self._run(input_ids, jnp.asarray(positions, jnp.int32), kv_mask, None, 0)
        return h

    def hidden_prefix(self, prompt_ids: jax.Array, prompt_mask: jax.Array, completion_ids: jax.Array,
                      completion_mask: jax.Array) -> Tuple[jax.Array, jax.Array]:
        """Hidden states of P prompts each followed by M completions, every prompt computed ONCE:
        (last prompt position [P, D], completions [P*M, Tc, D]) — equal to ``hidden`` on the rows
        [prompt_p ++ completion_b] (b = p*M + m) at those positions; gradients of the M completions sum
        into their prompt.

        prompt_ids int32[P, Tp] (left-padded), prompt_mask bool[P, Tp], completion_ids int32[P*M, Tc],
        completion_mask [P*M, Tc] (1 = real token; positions follow it as in ``hidden``)."""
        P, Tp = prompt_ids.shape
        B, Tc = completion_ids.shape
        pm = jnp.asarray(prompt_mask).astype(bool)
        cm = jnp.asarray(completion_mask) > 0
        plen = jnp.repeat(jnp.sum(pm, axis=1, dtype=jnp.int32), B // P)
        p_pos = default_positions(prompt_ids, pm)
        c_pos = jnp.maximum(plen[:, None] + jnp.cumsum(cm.astype(jnp.int32), axis=1) - 1, 0)
        ids = jnp.concatenate([jnp.asarray(prompt_ids, jnp.int32).reshape(-1),
                               jnp.asarray(completion_ids, jnp.int32).reshape(-1)])[None]
        pos = jnp.concatenate([p_pos.reshape(-1), c_pos.reshape(-1)])[None]
        windows = {self.config.layer_window(i) for i in range(self.config.num_layers)}
        masks = {w: PrefixMask.build(pm, cm, w) for w in windows}
        x = self.embed(ids, pos).reshape(ids.shape[1], -1)
        x, _ = self._layers(x, pos, masks, None, 0)
        h = self.final_norm(x)
        return h[: P * Tp].reshape(P, Tp, -1)[:, -1], h[P * Tp:].reshape(B, Tc, -1)

    def __call__(self, input_ids: jax.Array, *, positions: Optional[jax.Array] = None,
                 attention_mask: Optional[jax.Array] = None) -> jax.Array:
        """f32 logits [B, T, V]."""
        return self.head(self.hidden(input_ids, positions=positions, attention_mask=attention_mask))

    def init_cache(self, batch_size: int, max_len: int, dtype=None) -> KVCache:
        """Zeroed KVCache [num_layers, batch_size, max_len, num_kv_heads, head_dim] in the compute dtype."""
        c = self.config
        return KVCache.zeros(c.num_layers, batch_size, max_len, c.num_kv_heads, c.head_dim,
                             dtype=c.jnp_dtype if dtype is None else dtype)

    def decode_hidden(self, input_ids: jax.Array, positions: jax.Array, cache: KVCache, cache_index,
                      kv_mask: jax.Array) -> Tuple[jax.Array, KVCache]:
        """Like ``decode`` but returns final-norm hidden states [B, T, D] (apply ``head`` to the rows you need,
        e.g. only the last prompt position after prefill)."""
        return self._run(jnp.asarray(input_ids, jnp.int32), jnp.asarray(positions, jnp.int32),
                         jnp.asarray(kv_mask).astype(bool), cache, jnp.asarray(cache_index, jnp.int32))

    def decode(self, input_ids: jax.Array, positions: jax.Array, cache: KVCache, cache_index,
               kv_mask: jax.Array) -> Tuple[jax.Array, KVCache]:
        """Cached step: writes the T new k/v at slots [cache_index, cache_index + T) and attends to slot s iff
        kv_mask[b, s] (validity of slots AFTER writing) and s <= cache_index + t. Prefill = decode of the
        whole (left-padded) prompt at cache_index 0. Returns (f32 logits [B, T, V], new cache).
        input_ids, positions: int32[B, T]; kv_mask: bool[B, S]; cache_index: int32 scalar (may be traced);
        the caller must keep cache_index + T <= S."""
        h, cache = self.decode_hidden(input_ids, positions, cache, cache_index, kv_mask)
        return self.head(h), cache

    # -- the sampler's prompt-shared cache (mrl_jax.sampler.oracle)
    def prefill_shared(self, input_ids: jax.Array, positions: jax.Array, prompt_mask: jax.Array, *,
                       num_rows: int, gen_len: int) -> Tuple[jax.Array, SampleCache]:
        """Prefill P prompts ONCE: (final-norm hidden state of the last prompt position [P, D], SampleCache
        whose generated part has ``num_rows`` (= P * G) rows and ``gen_len`` slots).

        input_ids, positions: int32[P, Tp]; prompt_mask: bool[P, Tp] (left padding False)."""
        P, Tp = input_ids.shape
        kv = self.init_cache(P, Tp)
        h, kv = self.decode_hidden(input_ids, positions, kv, 0, prompt_mask)
        cache = SampleCache.from_prefill(kv, prompt_mask, num_rows, gen_len)
        return h[:, -1], cache

    def decode_step(self, input_ids: jax.Array, positions: jax.Array, cache: SampleCache,
                    gen_index) -> Tuple[jax.Array, SampleCache]:
        """One token per row over a SampleCache: input_ids, positions int32[B, 1]; the new k/v go to
        generated slot ``gen_index`` (int32 scalar, may be traced). Returns (f32 logits [B, 1, V], cache)."""
        h, cache = self._run(jnp.asarray(input_ids, jnp.int32), jnp.asarray(positions, jnp.int32), None, cache,
                             jnp.asarray(gen_index, jnp.int32))
        return self.head(h), cache
