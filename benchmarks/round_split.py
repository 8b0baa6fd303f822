"""Phase split of demo-shaped rounds: the demo's two policies after 150 SFT steps, 32 prompts x 8, 12 rounds;
medians of rounds 2-11 per phase (``time/<phase>``), their shares, and the 1-minute load average before and after.

    python benchmarks/round_split.py [PROBE]        # default sgt+replay; prints one JSON line

Before/after comparisons: run it once per tree (``PYTHONPATH=<worktree>``), each in its own process. The rounds
start once the warm start's load has decayed below 0.5 (at most 5 minutes).
"""
import dataclasses
import json
import os
import statistics
import sys
import time

from mrl_jax.demo import DemoSettings, demo_config
from mrl_jax.tasks import RewardScorer, task_reward
from mrl_jax.trainer.loop import Trainer
from mrl_jax.trainer.run import Run

probe = sys.argv[1] if len(sys.argv) > 1 else "sgt+replay"
s = dataclasses.replace(DemoSettings.make(True, 1), sft_steps=150, rounds=12)
run = Run(demo_config(probe, s))
state = run.initial_state()
for _ in range(60):   # let the warm start's load decay before timing rounds
    if os.getloadavg()[0] < 0.5:
        break
    time.sleep(5)
rows = []
load0 = os.getloadavg()[0]
with RewardScorer([task_reward(run.task)]) as scorer:
    trainer = Trainer(run, scorer)
    trainer.add_hook(lambda info: rows.append(info.metrics[run.policies[0].name]))
    for info in trainer.rounds(state):
        pass
load1 = os.getloadavg()[0]
phases = [k[5:] for k in rows[-1] if k.startswith("time/") and not k.split("/")[1].startswith(("rollout_", "update_"))]
med = {p: statistics.median(r.get(f"time/{p}", 0.0) for r in rows[2:]) for p in phases}
tot = sum(med.values())
print(json.dumps({"probe": probe, "median_s": {k: round(v, 4) for k, v in med.items()}, "round_s": round(tot, 4),
                  "share": {k: round(v / tot, 4) for k, v in med.items()}, "load_before": load0, "load_after": load1}))
