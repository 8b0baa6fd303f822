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

    python tests/soak.py [--quick] [--rounds N] [--kills K] [--out DIR]   # prints the figures as JSON
    import soak; soak.run(quick=True) -> dict                               # tests/ on the path, as for the tests

Not part of CI (minutes); not collected by pytest (no ``test_`` prefix). It lives beside its machinery (fault
rewards, the child process with its kill hooks, the run comparisons: ``tests/support.py``).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

from support import (REPO, RUN_RECORD_FILES, checkpoint_leaves, checkpoint_rounds, compare_runs, contiguity_problems,
                     enable_compile_cache, fault_totals, last_logged_round, newest_checkpoint_dir, record_differences,
                     run_child, tiny_config, training_records)

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
