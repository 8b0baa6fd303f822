"""The slot sampler's cache (`mrl_jax.models.slot_cache`): its two layouts and the Pallas TPU paged attention
kernel (TPU interpret mode on the CPU) against a float64 softmax over each slot's entries [0, qpos]."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mrl_jax.models.slot_cache import PAGE, SlotCache, _paged_kernel, attend_slots


def _reference(q, keys, values, qpos, scale, softcap, window):
    """q [S, H, D], keys / values [S, C, K, D] (float64): each slot's query over entries [0, qpos]."""
    S, H, D = q.shape
    g = H // keys.shape[2]
    out = np.zeros((S, H, D))
    for s in range(S):
        lo = 0 if window is None else max(0, qpos[s] - window + 1)
        k, v = keys[s, lo:qpos[s] + 1], values[s, lo:qpos[s] + 1]
        for h in range(H):
            x = k[:, h // g] @ q[s, h] * scale
            x = x if softcap is None else softcap * np.tanh(x / softcap)
            p = np.exp(x - x.max())
            out[s, h] = p @ v[:, h // g] / p.sum()
    return out


def _filled(paged: bool, S: int, K: int, D: int, C: int, rng, T: int = 5):
    """A cache whose entries [0, T) (each slot's prompt, T tokens) came in through ``load`` and [T, C) through
    ``write`` (one step each, qpos advancing), and the same entries by position as float64 [S, C, K, D]."""
    keys, values = (rng.normal(size=(S, C, K, D)) for _ in range(2))
    cache = SlotCache.zeros(S, 1, K, D, T, C - T, jnp.float32, paged=paged)
    cache = cache.load(jnp.arange(S), (jnp.asarray(keys[:, :T].transpose(0, 2, 3, 1), jnp.float32),),
                       (jnp.asarray(values[:, :T].transpose(0, 2, 1, 3), jnp.float32),), jnp.full((S,), T, jnp.int32))
    for e in range(T, C):
        cache = cache.replace(qpos=jnp.full((S,), e, jnp.int32)).write(
            0, jnp.asarray(keys[:, e:e + 1], jnp.float32), jnp.asarray(values[:, e:e + 1], jnp.float32))
    return cache, keys, values


@pytest.mark.parametrize("paged", [False, True], ids=["heads", "pages"])
@pytest.mark.parametrize("window,softcap", [(None, None), (3, 5.0)])
def test_both_layouts_attend_over_each_slots_prefix(paged, window, softcap):
    """S 3 slots at positions 5 (the first generated entry), 6 and C - 1 (the last entry), GQA 4 query heads over
    2: a step's write lands at its slot's own entry and the output is the softmax over that slot's positions
    [0, qpos] only (the window reaching back into the prompt)."""
    rng = np.random.default_rng(0)
    S, K, H, D, C = 3, 2, 4, 8, 2 * PAGE
    cache, keys, values = _filled(paged, S, K, D, C - 1, rng)
    assert cache.length == (C if paged else C - 1)
    qpos = np.array([5, 6, C - 2])
    new_k, new_v, q = rng.normal(size=(S, 1, K, D)), rng.normal(size=(S, 1, K, D)), rng.normal(size=(S, 1, H, D))
    keys[np.arange(S), qpos], values[np.arange(S), qpos] = new_k[:, 0], new_v[:, 0]
    cache = cache.replace(qpos=jnp.asarray(qpos, jnp.int32))
    out, cache = attend_slots(jnp.asarray(q, jnp.float32), jnp.asarray(new_k, jnp.float32),
                              jnp.asarray(new_v, jnp.float32), cache.step_masks(None, window), 0.3, cache, 0,
                              softcap, impl="splash")
    ref = _reference(q[:, 0], keys, values, qpos, 0.3, softcap, window)
    np.testing.assert_allclose(np.asarray(out)[:, 0], ref, atol=1e-5)


@pytest.mark.parametrize("dtype,atol", [(jnp.float32, 2e-2), (jnp.bfloat16, 6e-2)])
def test_the_tpu_paged_kernel_equals_the_reference_in_interpret_mode(dtype, atol):
    """JAX's Pallas paged attention kernel (TPU interpret mode) over the pages layout: head dim 128 (the lanes it
    lowers for), GQA 4 over 2, soft-capping, 6 slots of 4 pages each at lengths 1, 17, a page boundary, the
    last entry. The kernel divides by an approximate reciprocal: ~1e-3 relative (a wrong page or length is O(1))."""
    import jax.experimental.pallas.tpu as pltpu

    rng = np.random.default_rng(1)
    S, K, H, D, C = 6, 2, 4, 128, 4 * PAGE
    cache, keys, values = _filled(True, S, K, D, C, rng)
    qpos = np.array([0, 16, PAGE - 1, PAGE, 40, C - 1])
    q = rng.normal(size=(S, 1, H, D))
    ks = cache._slot_major(cache.k[0]).astype(dtype)
    vs = cache._slot_major(cache.v[0]).astype(dtype)
    with pltpu.force_tpu_interpret_mode():
        out = jax.jit(lambda *a: _paged_kernel(*a, scale=D ** -0.5, softcap=4.0))(
            jnp.asarray(q, dtype), ks, vs, jnp.asarray(qpos + 1, jnp.int32))
    ref = _reference(q[:, 0], keys, values, qpos, D ** -0.5, 4.0, None)
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32))[:, 0], ref, atol=atol, rtol=atol)


@pytest.mark.parametrize("at", [[0, 3, 9], [2, 15, 38], [39, 16, 8]], ids=["all-in-part-0", "spread", "last-entry"])
def test_the_heads_layout_in_parts_reads_the_parts_up_to_the_furthest_slot(at):
    """A prompt of T = 11 columns in front of n = 40 generated entries cut at spans(40, 8) = 10, 20, 40 (parts of
    21, 10, 20 columns): each step's write landing in its slot's own part only (slots at different parts), and the
    step reading the parts up to the furthest slot (one part when every slot is in the first, all three with a
    slot at the last entry) equal the reference over positions [0, qpos]."""
    from mrl_jax.models.slot_cache import spans

    rng = np.random.default_rng(2)
    S, K, H, D, n, T = 3, 2, 4, 8, 40, 11
    assert spans(n, 8) == (10, 20, 40) and spans(543) == (136, 272, 543) and spans(30) == (30,)
    keys, values = (rng.normal(size=(S, T + n, K, D)) for _ in range(2))   # by position
    cache = SlotCache.zeros(S, 1, K, D, T, n, jnp.float32, span=8)
    assert [x.shape[3] for x in cache.k[0]] == [21, 10, 20] and cache.length == T + n and cache.width == T
    cache = cache.load(jnp.arange(S), (jnp.asarray(keys[:, :T].transpose(0, 2, 3, 1), jnp.float32),),
                       (jnp.asarray(values[:, :T].transpose(0, 2, 1, 3), jnp.float32),), jnp.full((S,), T, jnp.int32))
    for e in range(n):   # slot s writes generated entry (e + 7 s) mod n: the slots in different parts
        pos = T + (e + 7 * np.arange(S)) % n
        new_k, new_v = rng.normal(size=(S, 1, K, D)), rng.normal(size=(S, 1, K, D))
        keys[np.arange(S), pos], values[np.arange(S), pos] = new_k[:, 0], new_v[:, 0]
        cache = cache.replace(qpos=jnp.asarray(pos, jnp.int32)).write(0, jnp.asarray(new_k, jnp.float32),
                                                                      jnp.asarray(new_v, jnp.float32))
    qpos = T + np.asarray(at)
    new_k, new_v, q = rng.normal(size=(S, 1, K, D)), rng.normal(size=(S, 1, K, D)), rng.normal(size=(S, 1, H, D))
    keys[np.arange(S), qpos], values[np.arange(S), qpos] = new_k[:, 0], new_v[:, 0]
    cache = cache.replace(qpos=jnp.asarray(qpos, jnp.int32))
    mask = cache.step_masks(None)
    assert int(mask.span) == int(np.searchsorted([10, 20, 40], max(at), side="right"))
    out, cache = jax.jit(lambda q, k, v, c: attend_slots(q, k, v, c.step_masks(None), 0.3, c, 0))(
        jnp.asarray(q, jnp.float32), jnp.asarray(new_k, jnp.float32), jnp.asarray(new_v, jnp.float32), cache)
    np.testing.assert_allclose(np.asarray(out)[:, 0], _reference(q[:, 0], keys, values, qpos, 0.3, None, None),
                               atol=1e-5)
    stored = np.concatenate([np.asarray(x) for x in cache.k[0]], -1).transpose(0, 3, 1, 2)   # [S, T + n, K, D]
    np.testing.assert_allclose(stored, keys, atol=1e-6)


@pytest.mark.parametrize("at", [0, 4, 19])
@pytest.mark.parametrize("window,softcap", [(None, None), (4, 5.0)])
def test_shared_prompts_attend_as_each_slots_own_copy_and_move_out_with_it(window, softcap, at):
    """P 2 prompts x G 3 slots sharing the prompt store (prompt 1 shorter than the store: its last entries are
    junk a slot must not see), generated entries in three parts (spans(20, 4)), the live slots at generated entry
    ``at`` (the first, a part's end, the last: shared prompts keep every slot at one entry), one slot free:
    each live slot's step writes its entry and equals the reference over its own copy of its prompt then its
    generated entries (sliding window and soft-cap crossing the prompt's end). ``take`` moves 3 of the slots (and
    an empty one) out unshared: each one's prompt in front of its generated entries, and the same step over them
    gives the same output."""
    from mrl_jax.models.slot_cache import spans

    rng = np.random.default_rng(3)
    P, G, K, H, D, Tc, n = 2, 3, 2, 4, 8, 7, 20
    S, plen = P * G, np.array([7, 3])
    store_k, store_v = rng.normal(size=(P, Tc, K, D)), rng.normal(size=(P, Tc, K, D))
    gen_k, gen_v = rng.normal(size=(S, n, K, D)), rng.normal(size=(S, n, K, D))
    store = dict(pk=(jnp.asarray(store_k.transpose(0, 2, 3, 1), jnp.float32),),
                 pv=(jnp.asarray(store_v.transpose(0, 2, 1, 3), jnp.float32),))
    base = np.repeat(plen, G)
    cache = SlotCache.zeros(S, 1, K, D, Tc, n, jnp.float32, span=4, group=G).replace(
        plen=jnp.asarray(base, jnp.int32), **store)
    assert spans(n, 4) == (5, 10, 20) and cache.length == n and cache.ends == (5, 10, 20)
    for e in range(n):   # every slot writes its generated entry e at position plen + e
        cache = cache.replace(qpos=jnp.asarray(base + e, jnp.int32)).write(
            0, jnp.asarray(gen_k[:, e:e + 1], jnp.float32), jnp.asarray(gen_v[:, e:e + 1], jnp.float32))
    qpos = base + at   # every slot at entry ``at``: slot 5's row has ended, it steps with the others
    at = np.array([at] * (S - 1) + [-1])   # slot 5 free
    new_k, new_v, q = rng.normal(size=(S, 1, K, D)), rng.normal(size=(S, 1, K, D)), rng.normal(size=(S, 1, H, D))
    live = at >= 0
    gen_k[live, at[live]], gen_v[live, at[live]] = new_k[live, 0], new_v[live, 0]
    full_k, full_v = (np.zeros((S, Tc + n, K, D)) for _ in range(2))   # each slot's own copy, by position
    for s in range(S):
        p, t = s // G, plen[s // G]
        full_k[s, :t], full_v[s, :t] = store_k[p, :t], store_v[p, :t]
        full_k[s, t:t + n], full_v[s, t:t + n] = gen_k[s], gen_v[s]
    args = (jnp.asarray(q, jnp.float32), jnp.asarray(new_k, jnp.float32), jnp.asarray(new_v, jnp.float32))

    def step(c):
        return jax.jit(lambda q, k, v, c: attend_slots(q, k, v, c.step_masks(None, window), 0.3, c, 0, softcap))(
            *args, c)

    cache = cache.replace(qpos=jnp.asarray(qpos, jnp.int32))
    masks = cache.step_masks(None)
    assert int(masks.span) == int(np.searchsorted([5, 10, 20], at.max(), side="right"))
    assert int(cache.shared_entry) == at.max() and masks.visible.shape == (1, n)   # one row of columns for all
    out, cache = step(cache)
    ref = _reference(q[:, 0], full_k, full_v, qpos, 0.3, softcap, window)
    np.testing.assert_allclose(np.asarray(out)[live, 0], ref[live], atol=1e-5)
    stored = np.concatenate([np.asarray(x) for x in cache.k[0]], -1).transpose(0, 3, 1, 2)   # [S, n, K, D]
    np.testing.assert_allclose(stored[live], gen_k[live], atol=1e-6)   # each live slot's entry, no other column

    keep = np.array([1, 4, 2, S])   # S: an empty slot
    moved = cache.take(jnp.asarray(keep[None], jnp.int32))
    assert moved.group == 0 and moved.pk == () and moved.width == Tc and moved.ends == (Tc + 5, Tc + 10, Tc + 20)
    np.testing.assert_array_equal(np.asarray(moved.qpos), np.append(qpos[keep[:3]], 0))
    np.testing.assert_array_equal(np.asarray(moved.plen), np.append(base[keep[:3]], 0))
    columns = np.concatenate([np.asarray(x) for x in moved.k[0]], -1).transpose(0, 3, 1, 2)   # [4, Tc + n, K, D]
    np.testing.assert_allclose(columns[:3, :Tc], store_k[keep[:3] // G], atol=1e-6)
    np.testing.assert_allclose(columns[:3, Tc:], gen_k[keep[:3]], atol=1e-6)
    args = tuple(x[jnp.asarray(np.append(keep[:3], 0))] for x in args)
    again, _ = step(moved)
    np.testing.assert_allclose(np.asarray(again)[:3], np.asarray(out)[keep[:3]], atol=1e-5)
