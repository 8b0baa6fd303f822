"""A/B of ``see.add`` in one process: the package at a git revision (``old_tree``) against the working tree.

    python benchmarks/ab_see_add.py REV

The demo's SEE shape (capacity 2048, per-prompt cap 16, 64-byte texts), 256 new entries per add, 10 % and 50 %
of them successes. Both sides insert the same experience into the same buffers; ``identical`` checks every leaf
of the resulting buffers and every info count. 20 interleaved timed calls per side after the compile.
"""
import importlib
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jax  # noqa: E402
import numpy as np  # noqa: E402

import mrl_jax.see as new  # noqa: E402
from old_tree import import_old_package  # noqa: E402

M = 256   # new entries per add
rng = np.random.default_rng(0)


def draw(succ_frac: float):
    texts = ["".join(rng.choice(list("0123456789+= "), rng.integers(1, 20))) for _ in range(M)]
    rewards = (rng.random(M) < succ_frac).astype(np.float32)
    ids = [list(rng.integers(0, 500, len(t))) for t in texts]
    return texts, rewards, ids, rng.integers(0, 64, M)


def experience(S, rnd: int, data):
    texts, rewards, ids, pids = data
    return S.make_experience(texts, pids, 0, rewards, src_ids=ids, src_logp=[np.zeros(len(i), np.float32) for i in ids],
                             round=rnd, max_bytes=64, max_src_tokens=32)


def main(rev: str) -> None:
    old = importlib.import_module(import_old_package(rev).__name__ + ".see")
    for succ in (0.1, 0.5):
        data = [draw(succ) for _ in range(6)]
        sides = {}
        for name, S in (("old", old), ("new", new)):
            add = jax.jit(S.add)
            see, _ = add(S.init(2048, 64, 32, 2, 64, per_prompt_cap=16, tau=1.0), experience(S, 0, data[0]))
            sides[name] = (add, jax.block_until_ready(see), [experience(S, r, data[r]) for r in range(6)])
        (add_a, a, ea), (add_b, b, eb) = sides["old"], sides["new"]
        for k in range(1, 6):
            (a, ia), (b, ib) = add_a(a, ea[k]), add_b(b, eb[k])
        same = all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
        same &= all(int(ia[k]) == int(ib[k]) for k in ia)
        times = {"old": [], "new": []}
        load0 = os.getloadavg()[0]
        for i in range(20):
            for name in ("old", "new") if i % 2 == 0 else ("new", "old"):
                add, see, exps = sides[name]
                t0 = time.perf_counter()
                jax.block_until_ready(add(see, exps[1 + i % 5]))
                times[name].append(time.perf_counter() - t0)
        to, tn = times["old"], times["new"]
        print(f"successes {succ:.0%}: identical {same}; old {min(to) * 1e3:.2f} ms, new {min(tn) * 1e3:.2f} ms; "
              f"old / new {min(to) / min(tn):.2f}x min, {np.median(to) / np.median(tn):.2f}x median; "
              f"load {load0:.2f} -> {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "HEAD")
