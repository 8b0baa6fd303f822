"""The test suite's support library: the tiny two-policy config, fault-injecting rewards, ``train`` in a child
process with kill hooks, and the comparisons of run directories (records, checkpoints). Used by the tests (tests/ is
on their path: ``import support``) and by ``tests/soak.py``.

    python tests/support.py child SPEC.json     # what `run_child` starts: one train run, exit 0 / 3 / 4
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TINY_CONFIG = REPO / "experiments" / "configs" / "tiny_two_policy.yaml"
TIME_KEYS = ("time/", "time_s", "hung_threads")  # wall-clock figures: excluded when comparing runs


# ------------------------------------------------------------------------------------------ set-up
def compile_cache_dir() -> str | None:
    """The persistent XLA compilation cache the child processes of the tests (and the modules using the
    ``jax_compile_cache`` fixture) share: ``MRL_TEST_XLA_CACHE``, a directory per run of the suite by default
    (tests/conftest.py); None (no persistent cache) when it is unset or ``off``. Its entries are written whole
    (`mrl_jax.compile_cache.AtomicFileCache`): written in place by JAX, two suite runs with it on segfaulted in
    ``deserialize_executable`` (a worker loading an entry another process was writing)."""
    path = os.environ.get("MRL_TEST_XLA_CACHE", "")
    return None if path.lower() in ("", "0", "off", "false", "no", "none") else path


def free_port() -> int:
    """A TCP port free on this machine now (for a coordinator of a multi-process test run)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    """A child process's environment for the tests' cache (`compile_cache_dir`; empty when it is off): the ``mrl``
    verbs and `enable_compile_cache` turn it on there."""
    path = compile_cache_dir()
    return {} if path is None else {"MRL_COMPILATION_CACHE": path}


def enable_compile_cache():
    """Turn the tests' persistent compilation cache on in this process (also after jax already compiled something)
    as ``mrl`` does (`mrl_jax.compile_cache.enable`: entries written whole) when `compile_cache_dir` names one;
    returns a function that restores the previous settings."""
    path = compile_cache_dir()
    if path is None:
        return lambda: None
    import jax
    from jax._src import compilation_cache as cc

    from mrl_jax import compile_cache

    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")
    before = {n: getattr(jax.config, n) for n in names}
    compile_cache.enable(path)
    cc.reset_cache()   # the cache decides once per process whether it is used: make it decide again

    def restore():
        for n, v in before.items():
            jax.config.update(n, v)
        cc.reset_cache()
    return restore


def mapped_regions() -> int | None:
    """Memory regions this process maps (Linux ``/proc/self/maps``; None elsewhere)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


def map_budget(fraction: float = 0.5) -> int:
    """``fraction`` of the kernel's limit on a process's mapped regions (``vm.max_map_count``, 65530 by default)."""
    try:
        limit = int(Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        limit = 65530
    return int(limit * fraction)


def release_compiled_programs(budget: int) -> bool:
    """Clear JAX's caches (and the slot sampler's programs, whose first-call state goes with them) when this
    process maps more than ``budget`` regions: XLA:CPU maps each compiled program's code into ~100 regions for as
    long as a cache holds it, and past ``vm.max_map_count`` the next compile fails to allocate and segfaults (a
    suite worker compiles thousands of programs). Returns whether it cleared them."""
    regions = mapped_regions()
    if regions is None or regions <= budget:
        return False
    import jax

    from mrl_jax.sampler import rounds

    jax.clear_caches()
    rounds._PROGRAMS.clear()
    return True


# experiments/configs/families.yaml's budget shrunk (tests/test_fresh_clone.py runs it from a clean clone,
# tests/test_families_export.py trains and exports it): the two runs compile the same qwen3 / gemma3 programs,
# which the second loads from the suite's compilation cache
FAMILIES_QUICK = {"rounds": 2, "prompts_per_round": 2, "num_generations": 2, "checkpoint_every": 1, "eval_every": 1,
                  "eval_prompts": 2}
FAMILIES_QUICK_TOKENS = 4   # every policy's sampling.max_new_tokens


def families_quick(raw: dict) -> dict:
    """A copy of families.yaml's ``raw`` config dict at `FAMILIES_QUICK`'s budget (everything else as written)."""
    raw = copy.deepcopy(raw)
    raw.update(FAMILIES_QUICK)
    for pol in raw["policies"]:
        pol["sampling"]["max_new_tokens"] = FAMILIES_QUICK_TOKENS
    return raw


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
def one_device_policy(cfg, tokenizer, model, index: int = 0):
    """``(Policy, params)`` of ``cfg.policies[index]`` on ``model`` (its adapters added) as a Run builds it, on a
    one-device placement (the first device)."""
    import jax

    from mrl_jax.trainer.placement import make_placement
    from mrl_jax.trainer.policy import add_lora, build_policy

    spec = cfg.policies[index]
    n = len(cfg.policies)
    placement = make_placement(cfg, [1] * n, [1.0] * n, jax.devices()[:1])
    built = build_policy(index, spec, tokenizer, add_lora(spec, model, seed=cfg.seed * 1000 + index), cfg, placement)
    return built.policy(slot_width=0, slots=spec.sampling.slots), built.params


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
              kill_after_save: int | None = None, timeout_s: float = 900.0,
              cache_dir: str | Path | None = None) -> dict:
    """``train`` in a fresh Python process; optionally SIGKILL it from outside ``kill_delay_s`` after the
    checkpoint of a round >= ``kill_after_round`` is complete (so it dies computing a later round or writing
    its checkpoint), or from inside: in a checkpoint write (``kill_in_save``) or as soon as the checkpoint of
    that round is complete (``kill_after_save``). ``cache_dir``: the child's persistent compilation cache (for
    children run one after another, as a user's ``mrl`` runs share theirs). Returns ``{"returncode", "killed",
    "wall_s", "stderr"}`` (returncode -9: killed)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    spec = {"config": config, "out": str(out), "resume": resume, "rewards": rewards, "kill_in_save": kill_in_save,
            "kill_after_save": kill_after_save}
    spec_path = out.parent / f".{out.name}.child.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, JAX_PLATFORMS="cpu", **compile_cache_env())
    if cache_dir is not None:
        env["MRL_TEST_XLA_CACHE"] = str(cache_dir)
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


def max_difference(xs, ys) -> float:
    """The largest |x - y| over paired arrays (bool leaves, e.g. an optimizer state's flags, compared as 0 / 1)."""
    import numpy as np

    return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)))) for x, y in zip(xs, ys))


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


if __name__ == "__main__":
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    if sys.argv[1:2] != ["child"] or len(sys.argv) != 3:
        sys.exit("usage: python tests/support.py child SPEC.json")
    sys.exit(child_main(sys.argv[2]))
