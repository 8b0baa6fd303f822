"""The ``mrl`` command: parses arguments and calls one library function per verb.

Every verb writes ``summary.json`` in ``--out``; only ``train`` writes a run directory's own files: the other
verbs given one as ``--out`` write into a folder of their name in it (``RUN/eval/``, ``RUN/plan/``). Heavy
imports happen inside the verbs so ``mrl --help`` is instant.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def _add_out(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, type=Path,
                   help="output directory; created if missing; summary.json and the artefacts go here")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mrl",
        description="Mutual Reinforcement Learning for heterogeneous LLM policies (JAX/Flax).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Each verb writes summary.json in --out; an --out that holds a run of `mrl train` is written only "
               "by train: the other verbs write into OUT/VERB/ there. `mrl VERB --help` explains a verb's options.",
    )
    parser.add_argument("--no-compile-cache", action="store_true",
                        help="do not use JAX's persistent compilation cache (default: on, in "
                        "$XDG_CACHE_HOME/mrl_jax/jax_cache; env MRL_COMPILATION_CACHE=<dir> moves it, =0 turns it off)")
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    demo = sub.add_parser("demo", help="embedded default: none/xgrpo/prp/sgt on tiny heterogeneous policies",
                          description="Build two tiny heterogeneous policies (different families, sizes and "
                          "tokenizer algorithms), warm-start each on a different part of a synthetic fact table, run "
                          "the same RL budget under every probe and several seeds, evaluate on held-out prompts. "
                          "Writes summary.json, summary.md (table), success.png (held-out success per skill over "
                          "rounds) and curves.png (training reward).")
    _add_out(demo)
    demo.add_argument("--quick", action="store_true", help="smaller budget (fewer rounds and seeds), ~3 minutes on CPU")
    demo.add_argument("--seeds", type=int, default=None, help="number of seeds (default: 3, or 1 with --quick)")
    demo.add_argument("--rounds", type=int, default=None,
                      help="RL rounds of every run (default: 40, or 20 with --quick); the rest of the budget unchanged")
    demo.add_argument("--probes", default=None,
                      help="comma-separated probe specs to compare (default: none,xgrpo,prp,sgt,sgt+replay)")

    train = sub.add_parser("train", help="an MRL run from a YAML config",
                           description="Run MRL rounds for the policies of a YAML config (see experiments/). "
                           "Checkpoints, metrics.jsonl, TensorBoard events and samples go to --out.")
    train.add_argument("--config", required=True, type=Path, help="YAML run config (see `mrl config-help`)")
    _add_out(train)
    train.add_argument("--resume", action="store_true",
                       help="continue from the last complete checkpoint in --out (same config)")
    train.add_argument("--coordinator", default=None,
                       help="multi-host: coordinator address host:port for jax.distributed.initialize "
                       "(or env MRL_COORDINATOR); omit for a single process")
    train.add_argument("--num-processes", type=int, default=None, help="multi-host: number of processes")
    train.add_argument("--process-id", type=int, default=None, help="multi-host: this process's index")
    train.add_argument("--topology", default=None, metavar="NAME",
                       help="first compile the run for this TPU slice, as `mrl plan` does, and stop if it does not "
                       "fit (sets mwra.topology)")

    plan = sub.add_parser("plan", help="every policy compiled for a TPU topology from this machine: memory per chip",
                          description="Build the run of --config abstractly (no weights), plan its devices on the TPU "
                          "slice --topology, compile every policy's update and sampler with XLA:TPU (libtpu; no TPU "
                          "needed, nothing allocated) and report per policy and chip: params, optimizer state, "
                          "reference, update and sampler peaks against the chip's HBM, a verdict, the computed fixes "
                          "of a misfit, the attention path and each compile's time. Exit 0: fits; 1: does not fit.")
    plan.add_argument("--config", required=True, type=Path, help="YAML run config (see `mrl config-help`)")
    plan.add_argument("--topology", required=True, metavar="NAME",
                      help="a TPU slice: v5e-8, v5p-16, v6e-8, v4-8, ... or a topology string such as v5e:2x4")
    plan.add_argument("--mean-completion", type=float, default=None, metavar="N",
                      help="also estimate the round at completions of N tokens on average (long tails: the update "
                      "still pads to the completion length)")
    plan.add_argument("--out", type=Path, default=None,
                      help="also write summary.json (the plan as data) and plan.txt (the report) here (in OUT/plan/ "
                      "when OUT holds a run)")

    ev = sub.add_parser("eval", help="held-out success per policy of a run's latest checkpoint, or of an "
                        "exported model directory (--model)")
    ev.add_argument("--config", required=True, type=Path, help="the run's YAML config (or its config.json)")
    ev.add_argument("--samples", type=int, default=None, metavar="K",
                    help="K sampled completions per held-out prompt: avg@K, pass@k (k = 1, 2, 4, ..., K), maj@K and "
                         "the population metrics (default: the config's eval_samples)")
    ev.add_argument("--temperature", type=float, default=None,
                    help="sampling temperature of --samples (default: the config's eval_temperature)")
    ev.add_argument("--run", type=Path, default=None,
                    help="the run directory holding checkpoints/ (default: --out; summary.json then goes to OUT/eval/, "
                    "beside the run's own files); read under its lock: refused while a train writes there")
    ev.add_argument("--model", type=Path, default=None,
                    help="evaluate this directory of `mrl export` (HF or PEFT adapter) instead of a run's checkpoint")
    ev.add_argument("--policy", default=None,
                    help="with --model: the config policy whose prompt format and sampling to use (default: the only one)")

    ex = sub.add_parser("export", help="a run's trained policy as a Hugging Face (or PEFT adapter) directory",
                        description="Write policy NAME of run RUN at checkpoint ROUND (default: latest) into --out: "
                        "config.json + model.safetensors + tokenizer files + generation_config.json, which "
                        "transformers loads with the same logits; for a LoRA policy a PEFT adapter directory "
                        "(adapter_config.json + adapter_model.safetensors), or the merged model with --merge-lora. "
                        "The run directory is only read.")
    ex.add_argument("--run", required=True, type=Path, help="the run directory (--out of `mrl train`)")
    ex.add_argument("--policy", required=True, help="name of the policy to export (policies[i].name)")
    ex.add_argument("--out", required=True, type=Path, help="directory to write (must be empty unless --force)")
    ex.add_argument("--checkpoint", type=int, default=None, help="round of the checkpoint (default: the latest)")
    ex.add_argument("--merge-lora", action="store_true", help="LoRA policy: write base + adapters merged")
    ex.add_argument("--force", action="store_true", help="replace the contents of a non-empty --out")
    _add_out(ev)

    bandit = sub.add_parser("bandit", help="the contextual-bandit analysis (stability-support plane)",
                            description="Exact and Monte Carlo analysis of the probes on a heterogeneous "
                            "contextual bandit. Writes summary.json, summary.md, plane.png and curves.png.")
    _add_out(bandit)
    bandit.add_argument("--quick", action="store_true",
                        help="small settings, about 2 minutes on 2 CPU cores (1.5 with a warm compilation cache)")
    bandit.add_argument("--seed", type=int, default=0, help="base random seed")

    bench = sub.add_parser("bench", help="benchmarks of every piece (see benchmarks/RESULTS.md); `mrl bench probes`: "
                           "the probe comparison (mrl_jax.bench.probes)")
    bench.add_argument("which", nargs="?", choices=["probes"], default=None,
                       help="probes: compare probes on the same work (PROBES.md, probes.json, figures in --out)")
    bench.add_argument("--probes", default=None, help="with `probes`: comma-separated probe specs (built-ins, chains, "
                       "pkg.mod:factory[:k=v]); default: the built-ins and two chains")
    bench.add_argument("--tasks", default=None, help="with `probes`: comma-separated tasks, facts and/or reasoning "
                       "(default both)")
    bench.add_argument("--jobs", type=int, default=1, help="with `probes`: cells trained at once, one process each")
    _add_out(bench)
    bench.add_argument("--quick", action="store_true", help="small shapes, a couple of minutes on CPU")
    bench.add_argument("--only", default=None, help="comma-separated subset of benchmarks to run")
    bench.add_argument("--wait-idle", type=float, default=0.0, metavar="SECONDS",
                       help="first wait up to SECONDS for the 1-minute load average to fall below --idle-load "
                       "(figures taken above it are marked contended)")
    bench.add_argument("--idle-load", type=float, default=None, metavar="LOAD",
                       help="the idle threshold (default 0.5 on this machine's core count; see mrl_jax.bench.load)")

    report = sub.add_parser("report", help="plots and a markdown summary of a run directory",
                            description="Read a run directory of `mrl train` (metrics.jsonl, groups.jsonl, "
                            "samples.jsonl, summary.json; also while it runs or after it was killed) and write PNG "
                            "plots (reward/success, KL, entropy, clip ratios, each probe's counters, the "
                            "complementarity matrix), summary.md and report.json into --out.")
    report.add_argument("run", type=Path, help="the run directory (--out of `mrl train`)")
    _add_out(report)

    sub.add_parser("config-help", help="print every run-config key with its type, default and meaning")
    return parser


def _write_summary(out: Path, summary: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))


def _demo(args) -> dict:
    from mrl_jax.demo import run_demo

    probes = args.probes.split(",") if args.probes else None
    settings = None
    if args.rounds is not None:
        import dataclasses

        from mrl_jax.demo import DemoSettings

        settings = dataclasses.replace(DemoSettings.make(args.quick, args.seeds), rounds=args.rounds)
    return run_demo(args.out, quick=args.quick, num_seeds=args.seeds, probes=probes, settings=settings)


def _train(args) -> dict:
    from mrl_jax.trainer import train_from_yaml

    if args.topology:
        show_plan_progress()
    return train_from_yaml(args.config, args.out, resume=args.resume, coordinator=args.coordinator,
                           num_processes=args.num_processes, process_id=args.process_id, topology=args.topology)


def show_plan_progress(stream=None) -> None:
    """The memory plan's compile lines (logger ``mrl_jax.plan``) on ``stream`` (default stderr) as
    ``mrl plan: [m:ss] <line>``: a real-shape plan compiles for minutes, and says what it compiles."""
    import logging

    t0 = time.monotonic()

    class Elapsed(logging.Formatter):
        def format(self, record):
            s = int(time.monotonic() - t0)
            return f"mrl plan: [{s // 60}:{s % 60:02d}] {record.getMessage()}"

    logger = logging.getLogger("mrl_jax.plan")
    if any(getattr(h, "mrl_plan", False) for h in logger.handlers):
        return
    class Current(logging.StreamHandler):
        def emit(self, record):
            self.stream = stream or sys.stderr   # stderr as it is now (a test's capture replaces it per test)
            super().emit(record)

    handler = Current(stream or sys.stderr)
    handler.setFormatter(Elapsed())
    handler.mrl_plan = True
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def _plan(args) -> int:
    from mrl_jax.configs import ConfigError
    from mrl_jax.trainer.config import load_run_config
    from mrl_jax.trainer.tpu_plan import plan_for_topology

    if args.mean_completion is not None and not args.mean_completion >= 1:
        raise ConfigError(f"--mean-completion: the mean completion is a token count >= 1, got {args.mean_completion:g}")
    show_plan_progress()
    report = plan_for_topology(load_run_config(args.config), args.topology, mean_completion=args.mean_completion)
    print(report)
    if args.out is not None:
        _write_summary(args.out, report.to_dict())
        (args.out / "plan.txt").write_text(str(report) + "\n")
        print(f"wrote {args.out / 'summary.json'}")
    return 0 if report.fits else 1


def _eval(args) -> dict:
    if args.model is not None:
        from mrl_jax.export import evaluate_exported

        return evaluate_exported(args.config, args.model, args.policy)
    from mrl_jax.trainer import evaluate_from_yaml

    return evaluate_from_yaml(args.config, args.run, samples=args.samples, temperature=args.temperature)


def _export(args) -> int:
    from mrl_jax.export import export_policy

    summary = export_policy(args.run, args.policy, args.out, checkpoint=args.checkpoint, merge_lora=args.merge_lora,
                            force=args.force)
    print(json.dumps(summary, indent=2))  # no summary.json: --out is the model directory
    return 0


def _bandit(args) -> dict:
    from mrl_jax.bandit import run as run_bandit

    return run_bandit(str(args.out), quick=args.quick, seed=args.seed)


def _bench(args) -> dict:
    from mrl_jax.bench import run_benchmarks, run_probes

    if args.which == "probes":
        return run_probes(args.out, quick=args.quick, probes=args.probes.split(",") if args.probes else None,
                          tasks=args.tasks.split(",") if args.tasks else None, jobs=args.jobs)
    only = args.only.split(",") if args.only else None
    return run_benchmarks(args.out, quick=args.quick, only=only, wait_idle_s=args.wait_idle, idle_load=args.idle_load)


def _report(args) -> dict | int:
    from mrl_jax.report import write_report

    if args.out.resolve() == args.run.resolve():
        print("mrl report: --out must not be the run directory (its summary.json would be replaced)", file=sys.stderr)
        return 2
    return write_report(args.run, args.out)


def _config_help(args) -> int:
    from mrl_jax.configs import describe
    from mrl_jax.trainer.config import RunConfig

    print("\n".join(describe(RunConfig)))
    return 0


# each verb returns its summary (written to --out/summary.json) or an exit code (nothing written)
VERBS = {"demo": _demo, "train": _train, "plan": _plan, "eval": _eval, "export": _export, "bandit": _bandit,
         "bench": _bench, "report": _report, "config-help": _config_help}


def _failure(verb: str, e: Exception) -> int:
    """The one line and exit code of an expected failure: 2 = bad input (config, files), 3 = a run stopped."""
    from mrl_jax.configs import ConfigError
    from mrl_jax.tasks import JsonlFormatError, RewardFailure
    from mrl_jax.trainer.loop import TrainingStopped

    if isinstance(e, (TrainingStopped, RewardFailure)):
        print(f"mrl {verb}: run stopped: {e}", file=sys.stderr)
        return 3
    kind = ("config error: " if isinstance(e, ConfigError) else
            "task file error: " if isinstance(e, JsonlFormatError) else "")
    print(f"mrl {verb}: {kind}{e}", file=sys.stderr)
    return 2


def _bad_arguments(args) -> str | None:
    """The one-line error of a flag value no verb can use (checked before any work), or None."""
    out = getattr(args, "out", None)
    if out is not None and out.exists() and not out.is_dir():
        return f"--out {out} is a file, not a directory; give a directory (created if missing)"
    if args.verb == "demo" and args.rounds is not None and args.rounds < 1:
        return f"--rounds {args.rounds}: must be >= 1"
    if args.verb == "eval" and args.samples is not None and args.samples < 0:
        return f"--samples {args.samples}: must be >= 0 (0 = greedy only; K > 0 = K sampled completions per prompt)"
    if args.verb == "eval" and args.temperature is not None and not args.temperature > 0:
        return f"--temperature {args.temperature}: must be > 0 (the sampling temperature of --samples)"
    return None


# the verbs whose --out, when it holds a run, becomes OUT/<verb>/ (train writes the run; export refuses one)
BESIDE_RUN = ("demo", "eval", "plan", "bandit", "bench", "report")


def _beside_run(args) -> str | None:
    """``eval``'s --run defaulted to --out, then an --out holding a run of ``train`` moved to ``OUT/<verb>/``
    (`run_lock.beside_run`), so no verb but ``train`` writes over a run's files; the one-line error of a moved
    --out that is a file, or None. ``report --out RUN`` of its own run is left to ``_report`` to refuse."""
    from mrl_jax.trainer.run_lock import beside_run

    if args.verb == "eval" and args.run is None:
        args.run = args.out
    out = getattr(args, "out", None)
    if args.verb not in BESIDE_RUN or out is None:
        return None
    if args.verb == "report" and out.resolve() == args.run.resolve():
        return None
    args.out = beside_run(out, args.verb)
    if args.out.exists() and not args.out.is_dir():
        return f"--out {out} holds a run, and {args.out} (where {args.verb} writes beside it) is a file; move it"
    return None


def _closed_loop(exc) -> bool:
    return isinstance(exc, RuntimeError) and "Event loop is closed" in str(exc)


def _quiet_libraries() -> None:
    """Library chatter kept off the screen (once per process): absl / orbax warnings, and the asyncio
    ``Event loop is closed`` reports of the event loops orbax leaves behind after a failed restore."""
    import logging
    import threading

    logging.getLogger("absl").setLevel(logging.ERROR)
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    if getattr(sys.unraisablehook, "mrl_quiet", False):
        return
    unraisable, in_thread = sys.unraisablehook, threading.excepthook

    def quiet_unraisable(u):
        if not _closed_loop(u.exc_value):
            unraisable(u)

    def quiet_thread(a):
        if not _closed_loop(a.exc_value):
            in_thread(a)

    quiet_unraisable.mrl_quiet = True
    sys.unraisablehook, threading.excepthook = quiet_unraisable, quiet_thread


def _interrupted(args, argv: list[str], e: KeyboardInterrupt) -> int:
    """Ctrl-C: one line, no traceback (``train``: where it stopped and the command that continues it); exit 130
    (128 + SIGINT, as a shell reports it)."""
    import shlex

    line = str(e) or "interrupted"
    if args.verb == "train":
        resumable = args.resume or (str(e) and "no checkpoint was complete" not in str(e))
        cmd = [a for a in argv if a != "--resume"] + (["--resume"] if resumable else [])
        line += f"; {'resume' if resumable else 'start it again'} with: mrl {shlex.join(cmd)}"
    print(f"mrl {args.verb}: {line}", file=sys.stderr)
    return 130


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    bad = _bad_arguments(args)
    if bad:
        print(f"mrl {args.verb}: {bad}", file=sys.stderr)
        return 2
    _quiet_libraries()
    from mrl_jax.mwra.tpu import quiet_default_backend

    quiet_default_backend()   # libtpu installed, no TPU here: no TPU init errors, no second lost at start
    if args.verb != "config-help":  # before any compile: later runs load compiled programs from disk
        from mrl_jax.compile_cache import enable as enable_compile_cache

        # `mrl plan` reports each compile's time: a program loaded from the cache would say nothing
        enable_compile_cache(disabled=args.no_compile_cache or args.verb == "plan")
    from mrl_jax.configs import ConfigError
    from mrl_jax.export import ExportError
    from mrl_jax.models import CheckpointError as ModelFileError
    from mrl_jax.models.lora import LoRAError
    from mrl_jax.tasks import JsonlFormatError, RewardFailure
    from mrl_jax.trainer.checkpoint import CheckpointError
    from mrl_jax.trainer.loop import TrainingStopped

    expected = (ConfigError, CheckpointError, ModelFileError, FileNotFoundError, JsonlFormatError, ExportError,
                LoRAError, TrainingStopped, RewardFailure)
    bad = _beside_run(args)
    if bad:
        print(f"mrl {args.verb}: {bad}", file=sys.stderr)
        return 2
    try:
        summary = VERBS[args.verb](args)
    except expected as e:
        return _failure(args.verb, e)
    except KeyboardInterrupt as e:
        return _interrupted(args, argv, e)
    if isinstance(summary, int):
        return summary
    _write_summary(args.out, summary)
    print(f"wrote {args.out / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
