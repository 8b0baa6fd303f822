"""The one A/B tool: this checkout against a git revision, in ONE process, timed alternately.

    python benchmarks/ab.py --base 4b4674d [--case trl,rollout,update,see_add,round] [--quick] [--repeats 5]
                            [--tolerance 0.05] [--out FILE]

The base revision's ``mrl_jax/`` and ``benchmarks/`` are extracted (``git archive``) to a temporary folder and
imported beside this checkout's: each side's modules are swapped into ``sys.modules`` while that side runs, so
both live in the same process (same allocator, same thread pools, same load) and keep their own compiled
programs (a change of models, kernels or cache layout compares as a whole). Each case is a ``Case``: its work is
built once by this checkout's code (assets, prompts, keys, arrays), and each side runs its own library on it:

- ``trl``: ``bench_trl._run_ours`` (rollout + decode + reward + update per GRPO step), seconds per step;
- ``rollout``: one ``sampler.generate`` call of ``bench_rollout``'s fixed-length llama cases;
- ``slots``: the same cases through ``sampler.generate_slots`` at S = every row and S = a quarter of them;
- ``update``: ``learner.make_update_step`` on a Qwen2 (h 128, 4 layers, V 512), 8 prompts x 8 samples of 16 + 32
  ragged tokens, probe ``none`` and probe ``sgt`` with 32 peer slots (one filled per prompt); the loss must match;
- ``see_add``: ``see.add`` of 256 entries at the demo's SEE shape (capacity 2048), 10 % and 50 % successes; the
  buffers after five adds must be identical;
- ``round``: the demo's round by phase (two policies after 150 SFT steps, 32 prompts x 8, probe ``sgt+replay``):
  median seconds per phase over 10 rounds (3 with ``--quick``) of each side's own run, which trains on between
  passes.

The sides alternate (A B, then B A, ...) ``--repeats`` times and a side's figure is its minimum (the least
disturbed run). ``no_worse`` per figure: head <= base * (1 + tolerance); ``same_output``: the sides computed the
same thing where a case can tell (loss, buffers, tokens). TRL and ``transformers.generate`` are not run: they do
not change between revisions.

``--case behaviour`` compares whole runs instead (``behaviour.py``): every config of ``experiments/configs`` for 3
rounds, ``mrl demo --quick`` and ``mrl bandit --quick``, recorded by each side's library in its own processes, then
every record, summary and checkpoint leaf compared (``--rtol``, default 0: bit for bit; ``--only`` a subset).
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np


REPO = Path(__file__).resolve().parents[1]
ROOTS = ("mrl_jax", "benchmarks")


class Side:
    """One revision's ``mrl_jax`` + ``benchmarks`` modules, importable from ``root`` and swapped in by ``active``."""

    def __init__(self, name: str, root: Path):
        self.name, self.root, self.modules = name, Path(root), {}

    @contextlib.contextmanager
    def active(self):
        saved = {k: sys.modules.pop(k) for k in list(sys.modules) if k.split(".")[0] in ROOTS}
        sys.modules.update(self.modules)
        sys.path.insert(0, str(self.root))
        importlib.invalidate_caches()
        try:
            yield
        finally:
            sys.path.remove(str(self.root))
            self.modules = {k: sys.modules.pop(k) for k in list(sys.modules) if k.split(".")[0] in ROOTS}
            sys.modules.update(saved)

    def module(self, name: str, *older: str):
        """``name`` imported from this side (``older``: the names it had in earlier revisions, tried in turn)."""
        names = (name, *older)
        for i, name in enumerate(names):
            try:
                mod = importlib.import_module(name)
                break
            except ModuleNotFoundError as e:
                if e.name != name or i == len(names) - 1:
                    raise
        origin = Path(mod.__file__).resolve()
        if self.root.resolve() not in origin.parents:
            raise RuntimeError(f"ab: {name} of side {self.name} was imported from {origin}, not {self.root}")
        return mod


def extract(rev: str, dest: Path, paths=ROOTS) -> Path:
    """``rev``'s ``paths`` (mrl_jax/ and benchmarks/) under ``dest`` (git archive of this repository)."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, *paths], check=True,
                             capture_output=True).stdout
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


class Case(NamedTuple):
    """An A/B workload: ``prepare(head, root, quick) -> work`` (built once, by this checkout's code) and
    ``measure(side, work) -> {figure: (seconds, output)}`` (one timed pass of ``side``'s library; ``output``: what
    both sides must compute alike, or None); ``close(work)`` releases what the passes kept open."""
    prepare: Callable
    measure: Callable
    close: Callable = lambda work: None


def _digest(arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(np.asarray(a)).tobytes())
    return h.hexdigest()[:16]


# ---- trl: bench_trl's GRPO step
def _trl_prepare(head: Side, root: Path, quick: bool) -> dict:
    with head.active():
        bt = head.module("benchmarks.bench_trl")
        tok, model_dir, _ = bt._build_assets(str(root))
        return {"tok": tok, "model_dir": model_dir, "plan": {"warmup": 2, "steps": 3} if quick else
                {"warmup": 3, "steps": 6}, "prompts": {n: bt._prompts(64, sh["prompt_tokens"], tok)
                                                       for n, sh in bt.SHAPES.items()}}


def _trl_measure(side: Side, work: dict) -> dict:
    with side.active():
        bt = side.module("benchmarks.bench_trl")
        return {f"trl_{n}": (float(bt._run_ours(work["tok"], work["model_dir"], work["plan"]["warmup"],
                                                work["plan"]["steps"], bt.SHAPES[n], p)["ours_s_per_step_min"]), None)
                for n, p in work["prompts"].items()}


# ---- rollout: bench_rollout's fixed-length llama cases
def _rollout_prepare(head: Side, root: Path, quick: bool) -> dict:
    with head.active():
        br = head.module("benchmarks.bench_rollout")
        cases = {}
        for fam, name in br.PLAN[bool(quick)]:
            if fam != "llama":
                continue
            spec = br.CASES[name]
            d = root / f"rollout_{name}"
            br._hf_model(fam, spec).save_pretrained(d, safe_serialization=True)
            ids, mask = br._prompts(spec, spec["vocab"])
            cases[name] = {"spec": spec, "dir": str(d), "ids": ids, "mask": mask}
    return cases


def _rollout_cases(side: Side, work: dict):
    """(name, graphdef, params, SamplingConfig, ids, mask, G) of each case, the model loaded by ``side``'s library
    (once per side)."""
    import jax
    from flax import nnx

    models, rollout = side.module("mrl_jax.models"), side.module("mrl_jax.sampler", "mrl_jax.rollout")
    for name, case in work.items():
        if side.name not in case:
            case[side.name] = nnx.split(models.from_pretrained(case["dir"]))
        s = case["spec"]
        cfg = rollout.SamplingConfig(max_new_tokens=s["new_tokens"], temperature=1.0, eos_id=None, pad_id=0)
        yield (name, *case[side.name], cfg, jax.numpy.asarray(case["ids"]), jax.numpy.asarray(case["mask"]),
               s.get("samples", 1))


def _timed(call):
    """(seconds of the second call, its output)."""
    call()
    t0 = time.perf_counter()
    r = call()
    return time.perf_counter() - t0, r


def _rollout_measure(side: Side, work: dict) -> dict:
    out = {}
    with side.active():
        import jax

        rollout = side.module("mrl_jax.sampler", "mrl_jax.rollout")
        for name, graphdef, params, cfg, ids, mask, g in _rollout_cases(side, work):
            extra = {"num_samples": g} if g > 1 else {}
            seconds, r = _timed(lambda: jax.block_until_ready(rollout.generate(graphdef, params, ids, mask,
                                                                               jax.random.key(0), cfg, **extra)))
            out[f"rollout_{name}"] = (seconds, _digest([r.tokens, r.mask]))
    return out


# ---- slots: the same cases through the slot sampler, S = every row and a quarter of the rows
def _slots_measure(side: Side, work: dict) -> dict:
    out = {}
    with side.active():
        import jax

        slots = side.module("mrl_jax.sampler", "mrl_jax.rollout_slots")
        for name, graphdef, params, cfg, ids, mask, g in _rollout_cases(side, work):
            rows = ids.shape[0] * g
            for s in (rows, max(1, rows // 4)):
                seconds, (r, _) = _timed(lambda: slots.generate_slots(graphdef, params, ids, mask, jax.random.key(0),
                                                                      cfg, num_samples=g, slots=s))
                out[f"slots_{name}_S{s}"] = (seconds, _digest([r.tokens, r.mask]))
    return out


# ---- update: the jitted update step, probe none and probe sgt with peer slots
UPDATE_SHAPE = dict(P=8, G=8, Tp=16, Tc=32, V=512, K=4)


def _update_prepare(head: Side, root: Path, quick: bool) -> dict:
    P, G, Tp, Tc, V, K = (UPDATE_SHAPE[k] for k in ("P", "G", "Tp", "Tc", "V", "K"))
    rs, n, S = np.random.RandomState(0), P * G, P * K
    lens = rs.randint(Tc // 2, Tc + 1, n)
    filled = np.zeros(S, bool)
    filled[::K] = True                                            # one filled peer slot per prompt
    pm = np.zeros((S, Tc), np.float32)
    pm[filled, :20] = 1
    return {"calls": 5 if quick else 20, "prompt_ids": rs.randint(3, V, (P, Tp)),
            "completion_ids": rs.randint(3, V, (n, Tc)), "completion_mask": np.arange(Tc)[None] < lens[:, None],
            "old_logp": rs.uniform(-7, -5, (n, Tc)), "rewards": rs.rand(n) < 0.3,
            "peer_ids": rs.randint(3, V, (S, Tc)), "peer_mask": pm, "filled": filled}


def _update_inputs(side: Side, w: dict):
    """(graphdef, params, rows, {probe: view}) built by ``side``'s library from the shared arrays."""
    import jax.numpy as jnp
    from flax import nnx

    P, G, Tp, Tc, V, K = (UPDATE_SHAPE[k] for k in ("P", "G", "Tp", "Tc", "V", "K"))
    models, see, rows_lib = side.module("mrl_jax.models"), side.module("mrl_jax.see"), side.module("mrl_jax.rows")
    graphdef, params = nnx.split(models.tiny_model("qwen2", V, hidden_size=128, num_layers=4, intermediate_size=384,
                                                   num_heads=4, num_kv_heads=2))
    n = P * G
    rows = rows_lib.own_rows(
        prompt_ids=jnp.asarray(w["prompt_ids"], jnp.int32), prompt_mask=jnp.ones((P, Tp), bool),
        completion_ids=jnp.asarray(w["completion_ids"], jnp.int32),
        completion_mask=jnp.asarray(w["completion_mask"], jnp.float32),
        old_logp=jnp.asarray(w["old_logp"], jnp.float32), ref_logp=jnp.zeros((n, Tc)),
        rewards=jnp.asarray(w["rewards"], jnp.float32), truncated=jnp.zeros((n,), bool))
    f, pm = w["filled"], w["peer_mask"]
    stats = np.zeros((P, 2, 4), np.float32)
    stats[:, 1] = [G, G / 2, G / 2, G / 2]
    sgt_view = see.empty_view(P, K, Tc, Tc, 2).replace(
        completion_ids=jnp.asarray(w["peer_ids"], jnp.int32), completion_mask=jnp.asarray(pm),
        row_kind=jnp.asarray(np.where(f, see.PEER, see.EMPTY), jnp.int32),
        dst_chunk=jnp.asarray(np.where(pm > 0, np.arange(Tc)[None], -1), jnp.int32),
        chunk_valid=jnp.asarray(pm > 0), src_chunk_logp=jnp.asarray(pm * -0.1),
        rewards=jnp.asarray(f, jnp.float32), source=jnp.asarray(np.where(f, 1, -1), jnp.int32),
        peer_stats=jnp.asarray(stats))
    return graphdef, params, rows, {"none": see.empty_view(P, 1, Tc, 1, 1), "sgt": sgt_view}


def _update_measure(side: Side, w: dict) -> dict:
    out = {}
    with side.active():
        import jax

        learner = side.module("mrl_jax.learner")
        if side.name not in w:
            graphdef, params, rows, views = _update_inputs(side, w)
            cfg = learner.GRPOConfig(num_generations=UPDATE_SHAPE["G"], max_completion_length=UPDATE_SHAPE["Tc"],
                                     beta=0.0, loss_type="grpo")
            opt = learner.make_optimizer(1e-6)
            w[side.name] = {p: (learner.make_update_step(graphdef, opt, p, cfg, donate=False), params,
                                opt.init(params), rows, v) for p, v in views.items()}
        for probe, (update, params, state, rows, view) in w[side.name].items():
            call = lambda: jax.block_until_ready(update(params, state, rows, view, jax.random.PRNGKey(0)))  # noqa: E731
            r = call()   # the compile, once per side (cached above for the other repeats)
            times = []
            for _ in range(w["calls"]):
                t0 = time.perf_counter()
                call()
                times.append(time.perf_counter() - t0)
            out[f"update_{probe}"] = (min(times), round(float(r[2]["loss"]), 6))
    return out


# ---- see_add: SEE insertion at the demo's shape
def _see_prepare(head: Side, root: Path, quick: bool) -> dict:
    rng, M = np.random.default_rng(0), 256

    def draw(succ):
        texts = ["".join(rng.choice(list("0123456789+= "), rng.integers(1, 20))) for _ in range(M)]
        ids = [list(rng.integers(0, 500, len(t))) for t in texts]
        return texts, rng.integers(0, 64, M), (rng.random(M) < succ).astype(np.float32), ids

    return {"calls": 5 if quick else 20, "draws": {succ: [draw(succ) for _ in range(6)] for succ in (0.1, 0.5)}}


def _see_measure(side: Side, w: dict) -> dict:
    out = {}
    with side.active():
        import jax

        see = side.module("mrl_jax.see")

        def experience(rnd, data):
            texts, pids, rewards, ids = data
            return see.make_experience(texts, pids, 0, rewards, src_ids=ids,
                                       src_logp=[np.zeros(len(i), np.float32) for i in ids], round=rnd, max_bytes=64,
                                       max_src_tokens=32)

        for succ, draws in w["draws"].items():
            key = (side.name, succ)
            if key not in w:
                add = jax.jit(see.add)
                buf, _ = add(see.init(2048, 64, 32, 2, 64, per_prompt_cap=16, tau=1.0), experience(0, draws[0]))
                w[key] = (add, jax.block_until_ready(buf), [experience(r, d) for r, d in enumerate(draws)])
            add, buf, exps = w[key]
            state, infos = buf, []
            for e in exps[1:]:
                state, info = add(state, e)
                infos.append(sorted((k, int(v)) for k, v in info.items()))
            times = []
            for i in range(w["calls"]):
                t0 = time.perf_counter()
                jax.block_until_ready(add(buf, exps[1 + i % 5]))
                times.append(time.perf_counter() - t0)
            out[f"see_add_{int(succ * 100)}pct_successes"] = (min(times), _digest(jax.tree.leaves(state)) + str(infos))
    return out


# ---- round: the demo's round split by phase (two policies after 150 SFT steps, 32 prompts x 8)
def _round_prepare(head: Side, root: Path, quick: bool) -> dict:
    return {"probe": "sgt+replay", "rounds": 3 if quick else 10, "stack": contextlib.ExitStack()}


def _round_measure(side: Side, w: dict) -> dict:
    """Median seconds per phase over ``rounds`` more rounds of ``side``'s trainer (each side keeps training its own
    run between passes; its first two rounds, with the compiles, are not timed)."""
    import statistics

    with side.active():
        if side.name not in w:
            demo, tasks = side.module("mrl_jax.demo"), side.module("mrl_jax.tasks")
            loop, run_lib = side.module("mrl_jax.trainer.loop"), side.module("mrl_jax.trainer.run")
            s = demo.DemoSettings.make(True, 1)
            run = run_lib.Run(demo.demo_config(w["probe"], dataclasses.replace(s, sft_steps=150, rounds=10_000)))
            scorer = w["stack"].enter_context(tasks.RewardScorer([tasks.task_reward(run.task)]))
            w[side.name] = (run.policies[0].name, loop.Trainer(run, scorer).rounds(run.initial_state()))
            for _ in range(2):
                next(w[side.name][1])
        name, rounds = w[side.name]
        rows = [next(rounds).metrics[name] for _ in range(w["rounds"])]
    phases = [k[5:] for k in rows[-1] if k.startswith("time/") and not k.split("/")[1].startswith(("rollout_", "update_"))]
    med = {ph: statistics.median(r.get(f"time/{ph}", 0.0) for r in rows) for ph in phases}
    return {**{f"round_{ph}": (v, None) for ph, v in med.items()}, "round_total": (sum(med.values()), None)}


CASES = {"trl": Case(_trl_prepare, _trl_measure), "rollout": Case(_rollout_prepare, _rollout_measure),
         "slots": Case(_rollout_prepare, _slots_measure),
         "update": Case(_update_prepare, _update_measure), "see_add": Case(_see_prepare, _see_measure),
         "round": Case(_round_prepare, _round_measure, lambda w: w["stack"].close())}


def run(base_rev: str, cases=("trl", "rollout"), quick: bool = False, repeats: int = 5,
        tolerance: float = 0.05) -> dict:
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise SystemExit(f"ab: unknown --case {unknown[0]!r}; choose from {', '.join(CASES)}")
    figures: dict = {}
    with tempfile.TemporaryDirectory(prefix="ab_") as tmp:
        tmp = Path(tmp)
        head, base = Side("head", REPO), Side("base", extract(base_rev, tmp / "base"))
        work = {c: CASES[c].prepare(head, tmp, quick) for c in cases}
        try:
            for rep in range(repeats):
                for side in ((head, base) if rep % 2 == 0 else (base, head)):
                    for c in cases:
                        for name, (seconds, output) in CASES[c].measure(side, work[c]).items():
                            f = figures.setdefault(name, {"head": [], "base": [], "out": {}})
                            f[side.name].append(seconds)
                            f["out"][side.name] = output
        finally:
            for c in cases:
                CASES[c].close(work[c])
    out = {"benchmark": "ab", "base": base_rev, "head": _head_rev(), "cases": list(cases), "quick": quick,
           "repeats": repeats, "tolerance": tolerance, "figures": {}}
    for name, f in figures.items():
        h, b = min(f["head"]), min(f["base"])
        same = None if f["out"].get("head") is None else f["out"]["head"] == f["out"].get("base")
        out["figures"][name] = {"head_s": h, "base_s": b, "head_over_base": h / b, "no_worse": h <= b * (1 + tolerance),
                                "same_output": same, "head_all": f["head"], "base_all": f["base"]}
    out["no_worse"] = all(f["no_worse"] for f in out["figures"].values())
    out["same_output"] = all(f["same_output"] is not False for f in out["figures"].values())
    return out


def behaviour(base_rev: str, records: Path, only=None, rtol: float = 0.0) -> dict:
    """Whole runs of both sides (``behaviour.record``: every config for 3 rounds, the demo, the bandit lab; each
    run in its own processes, on its own tree's library) and their differences beyond ``rtol``
    (``behaviour.compare``): ``{"base", "head", "rtol", "runs": {run: [differences]}, "same"}``."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import behaviour as record_lib

    with tempfile.TemporaryDirectory(prefix="ab_") as tmp:
        base_root = extract(base_rev, Path(tmp) / "base", ROOTS + ("experiments",))
        record_lib.record(records / "base", base_root, only)
        record_lib.record(records / "head", REPO, only)
    runs = record_lib.compare(records / "base", records / "head", rtol)
    return {"benchmark": "ab_behaviour", "base": base_rev, "head": _head_rev(), "rtol": rtol, "runs": runs,
            "same": not any(runs.values())}


def _head_rev() -> str:
    r = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "mrl_jax", "benchmarks"],
                           capture_output=True, text=True).stdout.strip()
    return r.stdout.strip() + ("+dirty" if dirty else "")


def table(r: dict) -> str:
    lines = [f"A/B head {r['head']} vs base {r['base']} (min of {r['repeats']} alternating runs, one process)",
             "| figure | head s | base s | head / base | no worse | same output |", "|---|---|---|---|---|---|"]
    for name, f in r["figures"].items():
        same = "–" if f["same_output"] is None else f["same_output"]
        lines.append(f"| {name} | {f['head_s']:.4f} | {f['base_s']:.4f} | {f['head_over_base']:.3f} | "
                     f"{f['no_worse']} | {same} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse
    import json

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="git revision to compare with (e.g. 4b4674d)")
    ap.add_argument("--case", default="trl,rollout", help=f"comma-separated timed cases ({', '.join(CASES)}), or "
                    "behaviour: whole runs of both sides compared value by value")
    ap.add_argument("--only", nargs="*", default=None, help="behaviour: config stems, demo, bandit (default: all)")
    ap.add_argument("--rtol", type=float, default=0.0, help="behaviour: relative tolerance (default 0: bit for bit)")
    ap.add_argument("--records", default=None, help="behaviour: keep both recordings here (default: a temp dir)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tolerance", type=float, default=0.05)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.case == "behaviour":
        with tempfile.TemporaryDirectory(prefix="ab_records_") as tmp:
            r = behaviour(args.base, Path(args.records or tmp).resolve(), args.only, args.rtol)
        for name, found in r["runs"].items():
            print(f"{name}: {'same' if not found else f'{len(found)} differences'}", file=sys.stderr)
            for line in found[:20]:
                print("   ", line, file=sys.stderr)
        text = json.dumps(r, indent=2)
        print(text)
        if args.out:
            Path(args.out).write_text(text + "\n")
        return 0 if r["same"] else 1
    r = run(args.base, args.case.split(","), args.quick, args.repeats, args.tolerance)
    print(table(r), file=sys.stderr)
    text = json.dumps(r, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if r["no_worse"] and r["same_output"] else 1


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.exit(main())
