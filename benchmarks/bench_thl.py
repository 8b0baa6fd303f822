"""THL speed: align completions between two real tokenizers (host side, numpy).

Figures (``run(quick) -> dict``; ``python benchmarks/bench_thl.py [--quick]`` prints them as JSON):

* ``align_src_tokens_per_s``: source tokens aligned per second by ``align_batch`` given both token sequences
  (source ids as a padded rollout array, destination ids precomputed) — the alignment alone. Goal >= 10M/s.
  ``align_tokens_per_s`` counts source + destination tokens; ``align_src_tokens_per_cpu_s`` divides by the
  process CPU time instead of wall time (steadier on a shared machine; the alignment is single-threaded).
* ``retokenize_align_s`` vs ``encode_batch_s``: ``align_batch`` including the destination retokenization
  against the destination tokenizer's ``encode_batch`` of the same texts; ``overhead_ratio`` = their ratio
  (goal <= 1.2), best wall times of interleaved runs; ``overhead_ratio_cpu`` the same with process CPU time
  (the Rust encoder runs on all cores, the alignment on one).
* the residual metrics of the batch (bytes in 1:1 chunks, tokens per chunk, ...).

Texts: windows of the Python standard library's source (code and prose, deterministic for a given Python) plus
a multilingual share (CJK, emoji, accents, RTL), each about 256 source tokens. Tokenizers come from
``$MRL_SHARED_TOKENIZERS`` or ``../shared/tokenizers`` (default pair gpt2 -> mistral-7b-v0.1).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from mrl_jax import thl  # noqa: E402
from mrl_jax.tokenization import load_tokenizer  # noqa: E402

_MULTI = ["日本語のテキスト", "中文测试句子", "Привет, мир", "مرحبا بالعالم", "שלום עולם", "café naïve façade",
          "🙂 👍🏽 👨‍👩‍👧 🇫🇷", "e\u0301 n\u0303", "x² + y² = 3.14159", "\t\tindent\r\n", "12345678 + 90 = ?"]


def _tokenizers_dir() -> Path:
    env = os.environ.get("MRL_SHARED_TOKENIZERS")
    return Path(env) if env else REPO.parent / "shared" / "tokenizers"


def make_texts(n: int, src, tokens: int = 256, seed: int = 0) -> list[str]:
    """``n`` deterministic texts of about ``tokens`` ``src`` tokens (stdlib source windows, a multilingual share)."""
    chars = 6 * tokens
    rng = random.Random(seed)
    lib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in lib.glob("*.py") if p.stat().st_size > 20000)[:60]
    blob = "\n".join(p.read_text(encoding="utf-8", errors="replace") for p in files)
    texts = []
    for i in range(n):
        a = rng.randrange(0, max(len(blob) - chars, 1))
        t = blob[a: a + chars]
        if i % 4 == 0:  # a multilingual share
            words = t.split(" ")
            for _ in range(8):
                words.insert(rng.randrange(len(words) + 1), rng.choice(_MULTI))
            t = " ".join(words)
        texts.append(t)
    # cut each window to ~`tokens` source tokens (dropping a character split by the cut)
    ids = src.encode_batch(texts, continuation=True, parse_special=False)
    return [src.decode(x[:tokens], continuation=True).rstrip("\ufffd") for x in ids]


def _time(fn, repeat: int, cpu: list | None = None) -> tuple[float, object]:
    """Best wall time of ``repeat`` runs (and best process CPU time appended to ``cpu``)."""
    times, cpus, out = [], [], None
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        times.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    if cpu is not None:
        cpu.append(min(cpus))
    return min(times), out


def run(quick: bool = False, *, src_name: str = "gpt2", dst_name: str = "mistral-7b-v0.1") -> dict:
    folder = _tokenizers_dir()
    if not (folder / src_name).is_dir() or not (folder / dst_name).is_dir():
        return {"skipped": f"tokenizers {src_name}/{dst_name} not found under {folder}"}
    src, dst = load_tokenizer(folder / src_name), load_tokenizer(folder / dst_name)
    n = 512 if quick else 4096
    repeat = 2 if quick else 3
    texts = make_texts(n, src)
    # source tokens as a rollout delivers them: a padded int32 array + lengths, ~256 tokens each
    src_lists = src.encode_batch(texts, continuation=True, parse_special=False)
    lengths = np.array([len(s) for s in src_lists])
    T = int(lengths.max())
    src_pad = np.zeros((n, T), dtype=np.int32)
    src_pad[np.arange(T)[None, :] < lengths[:, None]] = np.concatenate([np.asarray(s) for s in src_lists])
    # warm up (byte tables, tokenizer variants, numpy)
    dst_lists = dst.encode_batch(texts[:8], continuation=True, parse_special=False)
    thl.align_batch(texts[:8], src, dst, src_pad[:8], src_lengths=lengths[:8], dst_ids_list=dst_lists)

    from mrl_jax.bench.load import section

    load_cm = section("thl_align")
    load = load_cm.__enter__()
    dst_lists = dst.encode_batch(texts, continuation=True, parse_special=False)
    # the destination's encode_batch and retokenize + align, interleaved (the machine's load drifts)
    enc_w, enc_c, full_w, full_c = [], [], [], []
    for _ in range(repeat + 2):
        t_e, _ = _time(lambda: dst.encode_batch(texts, continuation=True, parse_special=False), 1, enc_c)
        t_f, _ = _time(lambda: thl.align_batch(texts, src, dst, src_pad, src_lengths=lengths), 1, full_c)
        enc_w.append(t_e)
        full_w.append(t_f)
    t_enc, t_full = min(enc_w), min(full_w)
    t_enc_plain, _ = _time(lambda: dst.encode_batch(texts), repeat)
    cpu: list = []
    t_align, ba = _time(lambda: thl.align_batch(texts, src, dst, src_pad, src_lengths=lengths,
                                                dst_ids_list=dst_lists), repeat, cpu)
    t_lists, _ = _time(lambda: thl.align_batch(texts, src, dst, src_lists, dst_ids_list=dst_lists), repeat)
    # as rollouts deliver them: each completion ends with the source's EOS (a zero-byte special token)
    eos_pad = np.concatenate([src_pad, np.zeros((n, 1), dtype=np.int32)], axis=1)
    eos_pad[np.arange(n), lengths] = src.eos_id
    t_eos, _ = _time(lambda: thl.align_batch(texts, src, dst, eos_pad, src_lengths=lengths + 1,
                                             dst_ids_list=dst_lists), repeat)
    load_cm.__exit__(None, None, None)
    ns, nd = int(lengths.sum()), int(sum(len(d) for d in dst_lists))
    return {
        "pair": f"{src_name}->{dst_name}",
        "texts": n,
        "src_tokens": ns,
        "dst_tokens": nd,
        "mean_src_tokens": round(ns / n, 1),
        "align_s": round(t_align, 4),
        "align_src_tokens_per_s": round(ns / t_align),
        "align_tokens_per_s": round((ns + nd) / t_align),
        "align_cpu_s": round(cpu[0], 4),
        "align_src_tokens_per_cpu_s": round(ns / max(cpu[0], 1e-9)),
        "align_from_lists_s": round(t_lists, 4),
        "align_with_eos_s": round(t_eos, 4),
        "align_with_eos_src_tokens_per_s": round(ns / t_eos),
        "encode_batch_s": round(t_enc, 4),
        "encode_batch_default_s": round(t_enc_plain, 4),
        "retokenize_align_s": round(t_full, 4),
        "overhead_ratio": round(t_full / t_enc, 3),
        "overhead_ratio_cpu": round(min(full_c) / min(enc_c), 3),
        "goal_align_tokens_per_s": 10_000_000,
        "goal_overhead_ratio": 1.2,
        "residual": {k: (round(v, 4) if isinstance(v, float) else v) for k, v in ba.metrics.items()},
        "cpus": os.cpu_count(),
        "load_avg_1min": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "load": load,
        "contended": load["contended"],
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="512 texts instead of 4096")
    ap.add_argument("--src", default="gpt2")
    ap.add_argument("--dst", default="mistral-7b-v0.1")
    ap.add_argument("--wait-idle", type=float, default=0.0, metavar="SECONDS",
                    help="wait at most SECONDS for the machine to be quiet before timing")
    ap.add_argument("--idle-load", type=float, default=None, metavar="LOAD", help="quiet/contended threshold")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    from mrl_jax.bench import print_figures, run_recorded

    figures = run_recorded(lambda: run(args.quick, src_name=args.src, dst_name=args.dst), args.wait_idle,
                           args.idle_load)
    print_figures(figures, args.out)


if __name__ == "__main__":
    main()
