"""Soak test of ``mrl train``: many rounds of a tiny two-policy run under randomly injected faults.

Faults: reward calls that raise, hang past their time limit, return NaN or a string (decided per item by a
stable hash of (seed, prompt id, completion), so a resumed run sees exactly the faults an uninterrupted one
saw), and real ``SIGKILL`` s of the training process -- at a random point after a round was logged (often
inside the checkpoint write that follows it) or deliberately *inside* orbax's checkpoint write (after the
arrays were written, before the atomic rename). After every kill the run is resumed with ``--resume``
semantics (``train(..., resume=True)``) until it completes.

Reported: rounds completed, kills and restarts, reward faults survived (by kind), whether anything was lost
(metrics rows contiguous -- every round of every policy exactly once --, every kept checkpoint loadable), and
whether the final checkpoint and the metrics equal those of an uninterrupted run with the same faults
(bit-identical arrays, records equal except wall times).

    python benchmarks/soak.py [--quick] [--rounds N] [--kills K] [--out DIR]   # prints the figures as JSON
    from benchmarks import soak; soak.run(quick=True) -> dict

Not part of CI (minutes). The machinery here (fault rewards, the child process with its kill hooks, the
run comparisons) is reused by tests/test_reliability.py.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TINY_CONFIG = REPO / "experiments" / "configs" / "tiny_two_policy.yaml"
TIME_KEYS = ("time/", "time_s", "hung_threads")  # wall-clock figures: excluded when comparing runs


# ------------------------------------------------------------------------------------------ set-up
def compile_cache_dir() -> str:
    """A persistent XLA compilation cache shared by the tests, the soak and their child processes (a fresh
    jit of the same computation in another ``train`` call or process then loads instead of compiling)."""
    default = os.path.join(tempfile.gettempdir(), f"mrl_jax_xla_cache_{os.getuid()}")
    return os.environ.get("MRL_TEST_XLA_CACHE") or default


def forced_devices_env(devices: int, base: dict | None = None) -> dict:
    """``base`` (default ``os.environ``) for a child process on ``devices`` forced CPU devices: XLA_FLAGS keeps
    its other flags, JAX_PLATFORMS=cpu, the repo first on PYTHONPATH."""
    env = dict(os.environ if base is None else base)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def compile_cache_env() -> dict:
    return {"JAX_COMPILATION_CACHE_DIR": compile_cache_dir(), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}


def enable_compile_cache():
    """Turn the persistent compilation cache on in this process (also after jax already compiled something);
    returns a function that restores the previous settings."""
    import jax

    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")
    before = {n: getattr(jax.config, n) for n in names}

    def apply(values):
        for n, v in values.items():
            jax.config.update(n, v)
        try:  # the cache decides once per process whether it is used; make it decide again
            from jax._src import compilation_cache as cc

            cc.reset_cache()
        except Exception:  # noqa: BLE001 -- private API; without it the run is only slower
            pass

    apply(dict(zip(names, (compile_cache_dir(), 0.0, -1))))
    return lambda: apply(before)


def tiny_config(**overrides: Any) -> dict:
    """The tiny two-policy config as a dict, with ``overrides`` (dotted keys: ``policies.0.probes``)."""
    import yaml

    cfg = yaml.safe_load(TINY_CONFIG.read_text())
    for key, value in overrides.items():
        node, parts = cfg, key.split(".")
        for part in parts[:-1]:
            node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
        if isinstance(node, list):
            node[int(parts[-1])] = value
        else:
            node[parts[-1]] = value
    return cfg


def to_run_config(cfg: dict):
    from mrl_jax.configs import from_dict
    from mrl_jax.trainer.config import RunConfig

    return from_dict(RunConfig, copy.deepcopy(cfg))


# ----------------------------------------------------------------------------------- fault rewards
def _uniform(*parts: Any) -> float:
    """A stable uniform [0, 1) from its arguments (same in every process: no Python hash seed)."""
    digest = hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0 ** 64


def digit_reward(prompt, completion: str) -> float:
    """Shaped reward with signal even for random tiny models: the fraction of digit characters in the
    completion, 1.0 when the completion is exactly the answer."""
    if completion.strip() == getattr(prompt, "answer", None):
        return 1.0
    if not completion:
        return 0.0
    return 0.9 * sum(c.isdigit() for c in completion) / len(completion)


class FaultyReward:
    """``digit_reward`` with injected faults; which item fails is a stable function of (seed, prompt id,
    completion) unless ``fail_after_calls`` is set (then every call after that many fails: a broken reward).
    Calls are counted in order (a scorer calls one policy's batch after the other's, P*G calls each).

    Kinds: ``raise`` (ValueError), ``nan``, ``string`` (returns "0.5"), ``hang`` (sleeps ``hang_s``, past the
    time limit), ``huge`` (returns ``huge`` -- e.g. 3e38: the rewards of a group overflow float32 and the loss
    becomes non-finite).
    """

    def __init__(self, *, seed: int = 0, p: dict | None = None, hang_s: float = 1.0,
                 fail_after_calls: int | None = None,
                 huge: float = 3e38, huge_calls: tuple[int, int, int] | None = None, huge_from_call: int = 0):
        self.seed, self.p, self.hang_s = seed, dict(p or {}), hang_s
        self.fail_after_calls, self.huge, self.huge_calls = fail_after_calls, huge, huge_calls
        self.huge_from_call = huge_from_call
        self.calls = 0
        self._lock = threading.Lock()
        self.__name__ = "faulty"

    def kind(self, prompt, completion: str) -> str | None:
        u = _uniform(self.seed, getattr(prompt, "id", prompt), completion)
        acc = 0.0
        for kind, prob in sorted(self.p.items()):
            acc += prob
            if u < acc:
                return kind
        return None

    def __call__(self, prompt, completion: str):
        with self._lock:
            n = self.calls
            self.calls += 1
        if self.fail_after_calls is not None and n >= self.fail_after_calls:
            raise RuntimeError(f"reward backend unavailable (call {n})")
        if self.huge_calls is not None and n >= self.huge_from_call:
            period, start, stop = self.huge_calls  # calls n with start <= n % period < stop
            if start <= n % period < stop:
                return self.huge
        kind = self.kind(prompt, completion)
        if kind == "raise":
            raise ValueError(f"injected failure for prompt {getattr(prompt, 'id', '?')}")
        if kind == "nan":
            return float("nan")
        if kind == "string":
            return "0.5"
        if kind == "hang":
            time.sleep(self.hang_s)
        return digit_reward(prompt, completion)


def reward_specs(spec: dict | None) -> list | None:
    """RewardSpecs from a JSON-able description ``{"faulty": {...FaultyReward kwargs}, "timeout_s": .., "high": ..}``
    (``None`` or ``{}``: the task's own verifier)."""
    if not spec:
        return None
    from mrl_jax.tasks import RewardSpec

    kw = dict(spec.get("faulty", {}))
    if "huge_calls" in kw and kw["huge_calls"] is not None:
        kw["huge_calls"] = tuple(kw["huge_calls"])
    return [RewardSpec(FaultyReward(**kw), name="faulty", timeout_s=spec.get("timeout_s", 0.5),
                       high=spec.get("high", 1.0))]


# ---------------------------------------------------------------------------------- child process
def install_kill_in_save(round_index: int) -> None:
    """SIGKILL this process inside orbax's write of the checkpoint of ``round_index``: after the arrays and
    metadata are in the temporary directory, before the rename that makes the checkpoint complete."""
    from orbax.checkpoint._src.handlers import composite_checkpoint_handler as cch

    original = cch.CompositeCheckpointHandler.save

    def save(self, directory, *args, **kwargs):
        out = original(self, directory, *args, **kwargs)
        step = Path(str(directory)).name.split(".")[0]
        if step == str(round_index):
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    cch.CompositeCheckpointHandler.save = save


def install_kill_after_save(round_index: int) -> None:
    """SIGKILL this process right after the checkpoint of ``round_index`` is complete (renamed into place),
    before anything else of that round runs."""
    from mrl_jax.trainer.checkpoint import RunCheckpointer

    original = RunCheckpointer.save

    def save(self, index, *args, **kwargs):
        original(self, index, *args, **kwargs)
        if index == round_index:
            os.kill(os.getpid(), signal.SIGKILL)

    RunCheckpointer.save = save


def child_main(spec_path: str) -> int:
    """Run (or resume) one ``train`` as described by the JSON file ``spec_path``; exit 0 / 3 (RewardFailure) /
    4 (TrainingStopped)."""
    spec = json.loads(Path(spec_path).read_text())
    enable_compile_cache()
    if spec.get("kill_in_save") is not None:
        install_kill_in_save(int(spec["kill_in_save"]))
    if spec.get("kill_after_save") is not None:
        install_kill_after_save(int(spec["kill_after_save"]))
    from mrl_jax.tasks import RewardFailure
    from mrl_jax.trainer import TrainingStopped, train

    try:
        train(to_run_config(spec["config"]), spec["out"], resume=spec.get("resume", False),
              reward_specs=reward_specs(spec.get("rewards")), progress=False)
    except RewardFailure as e:
        print(f"RewardFailure: {e}", file=sys.stderr)
        return 3
    except TrainingStopped as e:
        print(f"TrainingStopped: {e}", file=sys.stderr)
        return 4
    return 0


def run_child(config: dict, out: str | Path, *, resume: bool = False, rewards: dict | None = None,
              kill_in_save: int | None = None, kill_after_round: int | None = None, kill_delay_s: float = 0.0,
              kill_after_save: int | None = None, timeout_s: float = 900.0) -> dict:
    """``train`` in a fresh Python process; optionally SIGKILL it from outside ``kill_delay_s`` after the
    checkpoint of a round >= ``kill_after_round`` is complete (so it dies computing a later round or writing
    its checkpoint), or from inside: in a checkpoint write (``kill_in_save``) or as soon as the checkpoint of
    that round is complete (``kill_after_save``). Returns ``{"returncode", "killed",
    "wall_s", "stderr"}`` (returncode -9: killed)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    spec = {"config": config, "out": str(out), "resume": resume, "rewards": rewards, "kill_in_save": kill_in_save,
            "kill_after_save": kill_after_save}
    spec_path = out.parent / f".{out.name}.child.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, JAX_PLATFORMS="cpu", **compile_cache_env())
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    stderr_path = out.parent / f".{out.name}.child.stderr"
    t0 = time.perf_counter()
    with open(stderr_path, "w") as err:
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "child", str(spec_path)],
                                env=env, stdout=subprocess.DEVNULL, stderr=err, cwd=str(REPO))
        killed = False
        try:
            if kill_after_round is not None:
                while proc.poll() is None and time.perf_counter() - t0 < timeout_s:
                    if newest_checkpoint_dir(out) >= kill_after_round:
                        time.sleep(kill_delay_s)
                        if proc.poll() is None:
                            os.kill(proc.pid, signal.SIGKILL)
                            killed = True
                        break
                    time.sleep(0.02)
            proc.wait(timeout=max(1.0, timeout_s - (time.perf_counter() - t0)))
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    return {"returncode": proc.returncode, "killed": killed or proc.returncode == -signal.SIGKILL,
            "wall_s": time.perf_counter() - t0, "stderr": stderr_path.read_text()[-4000:]}


# ------------------------------------------------------------------------------------ inspection
def read_jsonl(path: str | Path) -> list[dict]:
    """Records of a JSONL file; a line torn by a kill is skipped."""
    from mrl_jax.trainer.metrics import RunLog

    return RunLog.read_records(path)


def newest_checkpoint_dir(out: str | Path) -> int:
    """The newest *complete* checkpoint directory's round by a cheap directory listing (-1: none)."""
    try:
        names = os.listdir(Path(out) / "checkpoints")
    except OSError:
        return -1
    return max((int(n) for n in names if n.isdigit()), default=-1)


def last_logged_round(out: str | Path) -> int:
    records = read_jsonl(Path(out) / "metrics.jsonl")
    return max((int(r["round"]) for r in records), default=-1)


def training_records(out: str | Path) -> list[dict]:
    """metrics.jsonl records of the training rounds (evaluation rows, policy ``name/eval``, left out)."""
    return [r for r in read_jsonl(Path(out) / "metrics.jsonl") if not str(r.get("policy", "")).endswith("/eval")]


def contiguity_problems(records: list[dict], policies: list[str], rounds: int) -> list[str]:
    """Every (round, policy) for round < ``rounds`` exactly once, in round order; the problems found."""
    problems = []
    seen: dict[tuple, int] = {}
    for rec in records:
        key = (int(rec["round"]), rec["policy"])
        seen[key] = seen.get(key, 0) + 1
    for r in range(rounds):
        for p in policies:
            n = seen.get((r, p), 0)
            if n != 1:
                problems.append(f"round {r} policy {p}: {n} records")
    extra = sorted(k for k in seen if k[0] >= rounds or k[1] not in policies)
    problems += [f"unexpected record {k}" for k in extra]
    order = [int(rec["round"]) for rec in records]
    if order != sorted(order):
        problems.append("records are not in round order")
    return problems


def strip_times(record: dict) -> dict:
    return {k: v for k, v in record.items() if not any(t in k for t in TIME_KEYS)}


def checkpoint_leaves(out: str | Path, round_index: int | None = None) -> tuple[list, dict]:
    """``([(path, np.ndarray)], meta)`` of a run's checkpoint (latest by default), template-free."""
    import jax

    from mrl_jax.trainer.checkpoint import RunCheckpointer

    ckpt = RunCheckpointer(out)
    try:
        tree, meta = ckpt.read(round_index)
    finally:
        ckpt.close()
    return [(jax.tree_util.keystr(k), v) for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]], meta


def checkpoint_rounds(out: str | Path) -> list[int]:
    from mrl_jax.trainer.checkpoint import RunCheckpointer

    ckpt = RunCheckpointer(out)
    try:
        return ckpt.all_rounds()
    finally:
        ckpt.close()


def compare_runs(a: str | Path, b: str | Path, round_index: int | None = None) -> dict:
    """Do two run directories hold the same final state and metrics? ``{"arrays_equal", "different_arrays",
    "metrics_equal", "different_records"}`` (arrays bit for bit, ``np.array_equal``; records without times)."""
    import numpy as np

    la, ma = checkpoint_leaves(a, round_index)
    lb, mb = checkpoint_leaves(b, round_index)
    diff = [pa for (pa, va), (pb, vb) in zip(la, lb) if pa != pb or va.dtype != vb.dtype or not np.array_equal(va, vb)]
    if len(la) != len(lb):
        diff.append(f"{len(la)} vs {len(lb)} arrays")
    ra = [strip_times(r) for r in training_records(a)]
    rb = [strip_times(r) for r in training_records(b)]
    bad = [i for i, (x, y) in enumerate(zip(ra, rb)) if json.dumps(x, sort_keys=True) != json.dumps(y, sort_keys=True)]
    if len(ra) != len(rb):
        bad.append(-1)
    return {"arrays_equal": not diff and ma == mb, "different_arrays": diff[:10], "metrics_equal": not bad,
            "different_records": bad[:10], "num_arrays": len(la), "num_records": len(ra)}


RUN_RECORD_FILES = ("metrics.jsonl", "samples.jsonl", "groups.jsonl")


def record_differences(a: str | Path, b: str | Path) -> dict:
    """``{file: [first differing record indices]}`` over every JSONL file a run writes (metrics with the
    held-out eval rows, samples, groups), records compared without wall-clock figures; {} = the same."""
    out = {}
    for name in RUN_RECORD_FILES:
        ra = [json.dumps(strip_times(r), sort_keys=True) for r in read_jsonl(Path(a) / name)]
        rb = [json.dumps(strip_times(r), sort_keys=True) for r in read_jsonl(Path(b) / name)]
        bad = [i for i, (x, y) in enumerate(zip(ra, rb)) if x != y] + ([f"{len(ra)} vs {len(rb)} records"]
                                                                      if len(ra) != len(rb) else [])
        if bad:
            out[name] = bad[:10]
    return out


def fault_totals(out: str | Path) -> dict:
    """Sum over the metrics records of every reward failure counter (``reward/<name>/<kind>``) and skips."""
    totals: dict[str, float] = {}
    for rec in training_records(out):
        for k, v in rec.items():
            if k.startswith("reward/") and k.rsplit("/", 1)[-1] in ("errors", "timeouts", "nonfinite", "bad_type",
                                                                   "out_of_range"):
                totals[k.rsplit("/", 1)[-1]] = totals.get(k.rsplit("/", 1)[-1], 0) + float(v)
            if k == "skipped":
                totals["skipped_updates"] = totals.get("skipped_updates", 0) + float(v)
    return totals


# -------------------------------------------------------------------------------------------- soak
SOAK_FAULTS = {"raise": 0.04, "nan": 0.03, "string": 0.02, "hang": 0.004}


def _can_resume(out: Path) -> bool:
    """Resume when a complete checkpoint exists; a run killed before its first one is begun again (its records
    deleted, as ``--resume`` then advises)."""
    if out.exists() and checkpoint_rounds(out):
        return True
    for name in RUN_RECORD_FILES:
        (out / name).unlink(missing_ok=True)
    return False


def run(quick: bool = True, *, rounds: int | None = None, kills: int | None = None, out: str | Path | None = None,
        seed: int = 0, compare: bool = True) -> dict:
    """Soak a tiny two-policy run; see the module docstring. ``quick``: a few rounds and one kill."""
    enable_compile_cache()
    rounds = rounds or (6 if quick else 40)
    kills = kills if kills is not None else (1 if quick else 8)
    rng = random.Random(seed)
    base = Path(out) if out else Path(tempfile.mkdtemp(prefix="mrl_soak_"))
    base.mkdir(parents=True, exist_ok=True)
    config = tiny_config(rounds=rounds, checkpoint_every=1, keep_checkpoints=3, eval_prompts=8,
                         max_reward_failures=10_000)
    rewards = {"faulty": {"seed": seed, "p": SOAK_FAULTS, "hang_s": 1.0}, "timeout_s": 0.5}
    policies = [p["name"] for p in config["policies"]]
    soaked = base / "soak"
    t0 = time.perf_counter()
    # kill plan: distinct rounds; alternately inside orbax's write of that round's checkpoint and from
    # outside at a random moment after that round's checkpoint is complete
    kill_rounds = sorted(rng.sample(range(0, rounds - 1), min(kills, rounds - 1)))
    plan = [("in_save" if i % 2 == 0 else "after_checkpoint", r) for i, r in enumerate(kill_rounds)]
    events, restarts = [], 0
    for kind, r in plan:
        if newest_checkpoint_dir(soaked) >= r:
            continue
        res = run_child(config, soaked, resume=_can_resume(soaked), rewards=rewards,
                        kill_in_save=r if kind == "in_save" else None,
                        kill_after_round=r if kind == "after_checkpoint" else None, kill_delay_s=rng.uniform(0.0, 0.3))
        restarts += 1
        events.append({"kind": kind, "round": r, "returncode": res["returncode"], "killed": res["killed"],
                       "checkpoint_after": (checkpoint_rounds(soaked) or [None])[-1],
                       "wall_s": round(res["wall_s"], 1)})
        if not res["killed"]:
            raise RuntimeError(f"soak child did not die as planned: {res}")
    final = run_child(config, soaked, resume=_can_resume(soaked), rewards=rewards)
    restarts += 1
    if final["returncode"] != 0:
        raise RuntimeError(f"soak run failed after its restarts: {final['stderr']}")
    records = training_records(soaked)
    problems = contiguity_problems(records, policies, rounds)
    loadable, unloadable = [], []
    for r in checkpoint_rounds(soaked):
        try:
            checkpoint_leaves(soaked, r)
            loadable.append(r)
        except Exception as e:  # noqa: BLE001
            unloadable.append(f"{r}: {e}")
    report = {
        "rounds": rounds, "rounds_completed": last_logged_round(soaked) + 1, "kills": sum(e["killed"] for e in events),
        "kills_in_checkpoint_write": sum(e["killed"] and e["kind"] == "in_save" for e in events),
        "process_starts": restarts, "events": events,
        "reward_faults_survived": fault_totals(soaked),  # in the kept records (rounds redone after a kill: once)
        "metrics_rows_contiguous": not problems, "contiguity_problems": problems[:10],
        "checkpoints_kept": loadable, "checkpoints_unloadable": unloadable,
        "summary_written": (soaked / "summary.json").exists(),
        "soak_wall_s": round(time.perf_counter() - t0, 1),
    }
    if compare:  # an uninterrupted run with the same (deterministic) faults must end in the same place
        t1 = time.perf_counter()
        ref = run_child(config, base / "uninterrupted", rewards=rewards)
        if ref["returncode"] != 0:
            raise RuntimeError(f"uninterrupted reference run failed: {ref['stderr']}")
        report["equal_to_uninterrupted"] = compare_runs(soaked, base / "uninterrupted")
        report["record_differences"] = record_differences(soaked, base / "uninterrupted")
        report["uninterrupted_wall_s"] = round(time.perf_counter() - t1, 1)
    report["lost_anything"] = bool(problems or unloadable or not report["summary_written"])
    if compare:
        eq = report["equal_to_uninterrupted"]
        report["same_as_uninterrupted"] = bool(eq["arrays_equal"] and eq["metrics_equal"]
                                               and not report["record_differences"])
    report["out"] = str(base)
    return report


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["child"]:
        return child_main(argv[1])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few rounds and one kill")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--kills", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="working directory (default: a new temporary one)")
    ap.add_argument("--no-compare", action="store_true", help="skip the uninterrupted reference run")
    args = ap.parse_args(argv)
    report = run(args.quick, rounds=args.rounds, kills=args.kills, out=args.out, seed=args.seed,
                 compare=not args.no_compare)
    print(json.dumps(report, indent=2))
    return 0 if not report["lost_anything"] and report.get("same_as_uninterrupted", True) else 1


if __name__ == "__main__":
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    sys.exit(main())
