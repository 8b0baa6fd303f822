"""generate_live (the batch compacted to its live rows) against the static sampler: same key, same tokens."""
import jax
import numpy as np
import pytest
from flax import nnx

from mrl_jax import models
from mrl_jax.rollout import SamplingConfig, generate, left_pad
from mrl_jax.rollout_live import _segments, drive, generate_live, live_rollout, row_bucket

VOCAB = 61
PROMPTS = [[1, 5, 9, 14], [1, 22], [1, 3, 4, 5, 6, 7]]


@pytest.fixture(scope="module")
def llama():
    m = models.tiny_model("llama", VOCAB, seed=3, hidden_size=32, intermediate_size=64)
    g, p = nnx.split(m)
    p = jax.tree_util.tree_map(lambda x: x * 3.0, p)
    ids, mask = left_pad(PROMPTS, pad_id=0, length=8)
    return g, p, ids, mask


def test_row_bucket_and_segments():
    assert [row_bucket(n, 100) for n in (1, 4, 5, 9, 17, 33, 64, 65, 99)] == [1, 4, 5, 10, 20, 40, 64, 80, 100]
    assert all(n <= row_bucket(n, 1000) <= 1.25 * n for n in range(1, 1000))
    assert [row_bucket(n, 100, per_doubling=1) for n in (1, 3, 5, 9, 64, 65)] == [1, 4, 8, 16, 64, 100]
    assert [row_bucket(n, 12, 4) for n in (1, 5, 9, 11)] == [4, 8, 12, 12]   # whole rows per device
    cfg = SamplingConfig(max_new_tokens=40, cache_bucket=16)
    segs = _segments(40, cfg, 6)
    assert [s[0] for s in segs][0] == 1 and segs[-1][1] == 40
    assert all(b - a <= 6 and a < b for a, b, _ in segs)
    assert all(a == b for (_, a, _), (b, _, _) in zip(segs, segs[1:]))       # contiguous steps
    assert all(stop - 1 <= size for _, stop, size in segs)                    # inside the step's length bucket


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.9, top_k=12, min_p=0.05)],
                         ids=["plain", "filtered"])
def test_live_rows_equal_the_static_sampler_on_long_tailed_lengths(llama, kw):
    """Three EOS ids (~5 % a step): lengths from a few tokens to the limit; 3 prompts x G 4, segments of 5
    steps across three cache buckets. Tokens, masks, lengths and both log-probs equal the static sampler's,
    and fewer row-steps are computed than its B * max(lengths)."""
    g, p, ids, mask = llama
    cfg = SamplingConfig(max_new_tokens=40, pad_id=0, eos_id=(7, 19, 33), cache_bucket=16, **kw)
    key = jax.random.key(21)
    ref = jax.device_get(generate(g, p, ids, mask, key, cfg, num_samples=4))
    out, stats = generate_live(g, p, ids, mask, key, cfg, num_samples=4, segment=5)
    lengths = np.asarray(ref.lengths)
    assert lengths.min() < 10 and lengths.max() >= 20, lengths   # long-tailed: compaction has work to do
    for f in ("tokens", "mask", "lengths", "truncated"):
        np.testing.assert_array_equal(getattr(out, f), np.asarray(getattr(ref, f)), err_msg=f)
    np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-5)
    np.testing.assert_allclose(out.sampling_logprobs, ref.sampling_logprobs, atol=1e-5)
    assert stats["batch_sizes"][0] == 12 and min(stats["batch_sizes"]) < 12
    assert lengths.sum() <= stats["row_steps"] < 12 * lengths.max()


def test_greedy_single_sample(llama):
    g, p, ids, mask = llama
    cfg = SamplingConfig(max_new_tokens=12, greedy=True, pad_id=0, eos_id=(7, 19, 33, 40, 41))
    ref = jax.device_get(generate(g, p, ids, mask, jax.random.key(0), cfg))
    out, _ = generate_live(g, p, ids, mask, jax.random.key(0), cfg, segment=3)
    np.testing.assert_array_equal(out.tokens, np.asarray(ref.tokens))
    np.testing.assert_array_equal(out.lengths, np.asarray(ref.lengths))
    with pytest.raises(ValueError, match="segment"):
        generate_live(g, p, ids, mask, jax.random.key(0), cfg, segment=0)


def _stop_set(tokens: np.ndarray) -> tuple:
    """(EOS ids, first, never) read off an EOS-free sample: the first token of row ``first`` (a row that ends at
    step 0) and a few later tokens of other rows, none of which occurs in row ``never`` (a row that never ends)."""
    never = min(range(len(tokens)), key=lambda r: len(set(tokens[r])))
    avoid = set(tokens[never].tolist())
    first = next(r for r in range(len(tokens)) if int(tokens[r, 0]) not in avoid)
    stops = {int(tokens[first, 0])} | {int(t) for t in tokens[:, 4::6].ravel()}
    return tuple(sorted(stops - avoid)), first, never


@pytest.mark.parametrize("g,segment", [(3, 4), (1, 7)], ids=["prefix_G3_seg4", "joint_G1_seg7"])
def test_awkward_shapes_equal_the_static_sampler(llama, g, segment):
    """Rows ending at step 0, rows never ending, left-padded prompts of 2..6 tokens, P * G (9 or 3) not a multiple
    of the segment, the prompt-once-per-group prefix layout (G 3) and the joint one (G 1), min-p filtering: the
    live sampler's tokens, masks, lengths and truncation equal the static sampler's, log-probs within 1e-5; two
    live samplers driven together (and a finished Rollout passed through) give what each gives alone."""
    gd, p, ids, mask = llama
    base = dict(max_new_tokens=23, pad_id=0, cache_bucket=8, temperature=0.8, min_p=0.02)
    key = jax.random.key(5)
    free = jax.device_get(generate(gd, p, ids, mask, key, SamplingConfig(**base), num_samples=g)).tokens
    stops, first, never = _stop_set(np.asarray(free))
    cfg = SamplingConfig(eos_id=stops, **base)
    ref = jax.device_get(generate(gd, p, ids, mask, key, cfg, num_samples=g))
    assert ref.lengths[first] == 1 and ref.truncated[never] and not ref.truncated.all(), ref.lengths
    out, stats = generate_live(gd, p, ids, mask, key, cfg, num_samples=g, segment=segment)
    for f in ("tokens", "mask", "lengths", "truncated"):
        np.testing.assert_array_equal(getattr(out, f), np.asarray(getattr(ref, f)), err_msg=f)
    np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-5)
    np.testing.assert_allclose(out.sampling_logprobs, ref.sampling_logprobs, atol=1e-5)
    assert stats["row_steps"] >= int(np.asarray(ref.lengths).sum())
    other = live_rollout(gd, p, ids[:2], mask[:2], jax.random.key(6), cfg, num_samples=g, segment=segment)
    st: list = []
    both = drive([live_rollout(gd, p, ids, mask, key, cfg, num_samples=g, segment=segment), other, ref], st)
    alone, _ = generate_live(gd, p, ids[:2], mask[:2], jax.random.key(6), cfg, num_samples=g, segment=segment)
    np.testing.assert_array_equal(both[0].tokens, out.tokens)
    np.testing.assert_array_equal(both[1].tokens, alone.tokens)
    assert both[2] is ref and st[2] is None and st[0] == stats


def test_on_a_mesh_equals_the_static_sampler_on_one_device(tmp_path):
    """On 4 forced CPU devices (3 prompts padded to 4, 12 rows; FSDP-sharded params) and on 3 (9 rows), under
    ``transfer_guard("disallow")``: the real rows' tokens equal the 1-device static sampler's, every compacted
    batch splits over the devices."""
    import subprocess
    import sys
    from pathlib import Path

    from benchmarks import soak
    import worker_result

    result = tmp_path / "live.result.json"
    env = worker_result.env_for(dict(soak.forced_devices_env(4), **soak.compile_cache_env()), result)
    worker = Path(__file__).with_name("live_worker.py")
    proc = subprocess.run([sys.executable, str(worker)], env=env, capture_output=True, text=True, timeout=600,
                          cwd=str(worker.parents[1]))
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = worker_result.read(result, proc.stdout)
    assert r["devices"] == 4 and min(r["lengths"]) < 21 and max(r["lengths"]) > 8, r["lengths"]
    for d, c in r["cases"].items():
        assert c["tokens_equal"] and c["mask_equal"] and c["truncated_equal"], (d, c)
        assert c["logprob_diff"] <= 1e-5 and c["sampling_logprob_diff"] <= 1e-5, (d, c)
        assert all(s % int(d) == 0 for s in c["batch_sizes"]) and min(c["batch_sizes"]) < c["batch_sizes"][0], c
    assert r["cases"]["4"]["sharded_params"] > 0   # (no dim of the tiny model divides by 3)
