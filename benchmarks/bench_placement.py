"""MWRA in ``mrl train`` (issue 13): plans for real model shapes, and the tiny run's round time on 1 vs 8 devices.

    python benchmarks/bench_placement.py [--quick]     # prints JSON

* ``plans``: `mrl_jax.mwra.plan` for Qwen2.5-0.5B + SmolLM2-1.7B + Llama-3.1-8B (nominal parameter counts,
  equal tokens per round, so cost ~ parameters) on 8 and on 16 devices of 80 GB: devices per policy and the
  estimated per-device training memory (16 B/param + the default activation estimate, over the mesh).
* ``rounds``: ``mrl train`` of experiments/configs/tiny_two_policy.yaml (costs 1:3, ``mwra.min_size: 0`` so
  the leaves really are FSDP-sharded) in a subprocess with 1 and with 8 forced CPU devices: median wall time
  of the rounds after the first (compiles), the share of it spent staging inputs host->device (``time/stage``)
  and reading rollouts device->host, and the 1-minute load average before and after (the machine is shared:
  ``contended`` when it exceeds 0.5). Forced CPU devices share the host's cores: expect no speed-up.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY_CONFIG = REPO / "experiments" / "configs" / "tiny_two_policy.yaml"
MODELS = {"Qwen2.5-0.5B": 494_032_768, "SmolLM2-1.7B": 1_711_376_384, "Llama-3.1-8B": 8_030_261_248}
GB80 = 80 * 10 ** 9


class _Dev:
    def __init__(self, i):
        self.id, self.process_index, self.platform = i, 0, "gpu (80 GB, modelled)"


def plans() -> dict:
    from mrl_jax import mwra

    out = {}
    counts = list(MODELS.values())
    for n in (8, 16):
        p = mwra.plan(counts, [_Dev(i) for i in range(n)], counts, list(MODELS), memory_bytes=GB80)
        out[f"{n}x80GB"] = {
            "table": str(p),
            "policies": {q.name: {"devices": list(q.device_ids),
                                  "memory_GB_per_device": round(q.memory_bytes_per_device / 1e9, 2)}
                         for q in p.policies},
            "max_device_memory_GB": round(max(p.device_memory_bytes.values()) / 1e9, 2),
        }
    return out


_CHILD = r"""
import sys
sys.path.insert(0, {repo!r})
import yaml
from mrl_jax import compile_cache
from mrl_jax.configs import from_dict
from mrl_jax.trainer.config import RunConfig
from mrl_jax.trainer.loop import train
compile_cache.enable()   # as the `mrl` verbs: MRL_COMPILATION_CACHE moves it or turns it off
cfg = yaml.safe_load(open({config!r}))
cfg["rounds"], cfg["mwra"], cfg["report_to"] = {rounds}, {{"min_size": 0}}, ["jsonl"]
cfg["policies"][0]["cost"], cfg["policies"][1]["cost"] = 1.0, 3.0
train(from_dict(RunConfig, cfg), sys.argv[1], progress=False)
"""


def _round_figures(out: Path) -> dict:
    from mrl_jax.trainer.round import ROUND_PHASES

    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    by_round: dict = {}
    for r in rows:
        by_round.setdefault(r["round"], []).append(r)
    totals, stage, read = [], [], []
    for k in sorted(by_round)[1:]:   # round 0 compiles
        rs = by_round[k]
        t = sum(rs[0].get(f"time/{p}", 0.0) for p in ROUND_PHASES)
        totals.append(t)
        stage.append(rs[0].get("time/stage", 0.0) / t)
        read.append(sum(r["time/rollout_ready"] - r["time/rollout_read"] for r in rs) / t)
    return {"round_s_median": statistics.median(totals), "round_s_all": totals,
            "stage_share": statistics.median(stage), "rollout_read_share": statistics.median(read)}


def rounds(quick: bool = False) -> dict:
    n_rounds = 4 if quick else 8
    res = {}
    for devices in (1, 8):
        with tempfile.TemporaryDirectory() as tmp:
            env = dict(os.environ, JAX_PLATFORMS="cpu",
                       XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
            load0 = os.getloadavg()[0]
            child = _CHILD.format(repo=str(REPO), config=str(TINY_CONFIG), rounds=n_rounds)
            subprocess.run([sys.executable, "-c", child, tmp], env=env, check=True, capture_output=True, text=True,
                           timeout=1200)
            load1 = os.getloadavg()[0]
            fig = _round_figures(Path(tmp))
            fig.update({"load1_before": load0, "load1_after": load1, "contended": max(load0, load1) > 0.5,
                        "rounds_timed": n_rounds - 1})
            res[f"{devices}_devices"] = fig
    return res


def run(quick: bool = False) -> dict:
    return {"plans": plans(), "rounds": rounds(quick)}


if __name__ == "__main__":
    print(json.dumps(run("--quick" in sys.argv), indent=2))
