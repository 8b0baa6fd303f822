"""Live progress of the long verbs (``mrl demo``, ``train``, ``bandit``, ``bench``).

In a terminal: one ``rich`` line that updates (bar, done/total, elapsed, ETA, the key figures of the last
step). Elsewhere (CI, a log file): plain lines, at most one per step and at most one every
``min_interval`` seconds (the first, the last and compile steps are always printed). A step that compiles
is labelled so a slow first round does not look like a hang: before it runs when the caller knows
(``start(..., compile=True)``: round 0, first round of a new shape), and after it ran from JAX's own
compile-time events (``jax.monitoring``). The ETA leaves compile steps out (the time between steps —
evaluations, checkpoints — is in it).

    bar = Progress(total=40, title="train")
    bar.start("round 0", compile=True); ...; bar.done(round_figures(metrics))
    bar.close()
"""

from __future__ import annotations

import math
import sys
import time
from typing import IO, Any, Mapping

# (internal metric key, short name) shown per policy; then the first probe counter present
KEY_FIGURES = (("reward/mean", "reward"), ("reward/success_rate", "success"), ("kl", "kl"))
PROBE_COUNTERS = (("sgt/rows_fired", "sgt rows"), ("prp/ess", "prp ess"), ("xgrpo/adv_on_peer_solved", "xgrpo adv"),
                  ("replay/rows", "replay rows"))

_compile_s = [0.0]
_listening = [False]


def _on_duration(event: str, duration: float, **_: Any) -> None:
    if event.startswith("/jax/core/compile/"):
        _compile_s[0] += float(duration)


def compile_seconds() -> float:
    """Seconds this process has spent tracing, lowering and compiling with JAX (since first asked)."""
    if not _listening[0]:
        import jax.monitoring

        jax.monitoring.register_event_duration_secs_listener(_on_duration)
        _listening[0] = True
    return _compile_s[0]


def _num(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def policy_figures(metrics: Mapping[str, Any]) -> str:
    """``reward 0.31 success 0.12 kl 0.002 sgt rows 3`` from one policy's round metrics."""
    parts = [f"{short} {_num(metrics[k]):.3g}" for k, short in KEY_FIGURES if k in metrics]
    parts += [f"{short} {_num(metrics[k]):.3g}" for k, short in PROBE_COUNTERS if k in metrics][:1]
    return " ".join(parts)


def round_figures(per_policy: Mapping[str, Mapping[str, Any]], eval_success: Mapping[str, float] | None = None) -> str:
    """Key figures of a round for every policy, ``name: ... | name: ...`` (+ the last eval success)."""
    text = " | ".join(f"{name}: {policy_figures(m)}" for name, m in per_policy.items())
    if eval_success:
        text += " | eval success " + " ".join(f"{n} {_num(v):.3f}" for n, v in eval_success.items())
    return text


def _clock(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    return f"{h}:{rem // 60:02d}:{rem % 60:02d}" if h else f"{rem // 60}:{rem % 60:02d}"


class Progress:
    """A progress display over ``total`` steps (see the module docstring)."""

    def __init__(self, total: int | None, *, title: str, unit: str = "round", stream: IO | None = None,
                 live: bool | None = None, min_interval: float = 5.0, enabled: bool = True,
                 auto_refresh: bool = True):
        """``total``: number of steps (None = unknown: no ETA); ``live``: force the updating line (True) or
        plain lines (False), default ``stream.isatty()``; ``auto_refresh=False``: the live line is redrawn
        only at ``start``/``done`` (no background thread, e.g. while benchmarks time things)."""
        self.auto_refresh = auto_refresh
        self.total = None if total is None else int(total)
        self.title, self.unit, self.min_interval = title, unit, float(min_interval)
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.live = bool(enabled and (live if live is not None else getattr(self.stream, "isatty", lambda: False)()))
        self.completed = 0
        self.durations: list[float] = []     # seconds of the steps that did not compile
        self._compile_steps_s = 0.0          # seconds of the steps that did
        self._t0 = time.perf_counter()
        self._step_t0 = self._t0
        self._step_compile0 = compile_seconds() if enabled else 0.0
        self._label, self._compile_expected = "", False
        self._last_print = -math.inf
        self._rich = self._task = None
        if self.live:
            self._start_rich()

    def _start_rich(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as RichProgress

        from rich.table import Column

        console = Console(file=self.stream, force_terminal=True)
        fixed = dict(no_wrap=True)   # the figures give way (cut with …) in a narrow terminal, not the rest
        room = max(console.width - 40 - len(self.title) - len(self.unit) - 24, 16)
        self._rich = RichProgress(TextColumn("[bold]{task.description}", table_column=Column(**fixed)),
                                  BarColumn(bar_width=20, table_column=Column(**fixed)),
                                  MofNCompleteColumn(table_column=Column(**fixed)),
                                  TimeElapsedColumn(table_column=Column(**fixed)),
                                  TextColumn("eta {task.fields[eta]}", table_column=Column(**fixed)),
                                  TextColumn("{task.fields[figures]}",
                                             table_column=Column(no_wrap=True, overflow="ellipsis", max_width=room)),
                                  console=console,
                                  redirect_stdout=True, redirect_stderr=True, auto_refresh=self.auto_refresh)
        self._rich.start()
        self._task = self._rich.add_task(self.title, total=self.total, eta="?", figures="")

    def eta_seconds(self, now: float | None = None) -> float:
        """Remaining steps × the wall time per step that did not compile — elapsed time less the compile
        steps, so the work between steps (evaluation, checkpoints, warm starts) counts; nan before one."""
        if not self.durations or self.total is None:
            return math.nan
        elapsed = (time.perf_counter() if now is None else now) - self._t0 - self._compile_steps_s
        return max(self.total - self.completed, 0) * max(elapsed, 0.0) / len(self.durations)

    def start(self, label: str, *, compile: bool = False) -> None:
        """A step begins; ``compile``: it will compile (first round of a shape) — said on the live line."""
        self._label, self._compile_expected = label, compile
        self._step_t0 = time.perf_counter()
        if not self.enabled:
            return
        self._step_compile0 = compile_seconds()
        if self._rich is not None:
            tail = " (compiling…)" if compile else ""
            self._rich.update(self._task, description=f"{self.title} {self.unit} {label}{tail}", refresh=True)

    def done(self, figures: str = "", *, label: str | None = None) -> bool:
        """The step ends with its key figures: advance; a plain line when due. Returns whether shown."""
        now = time.perf_counter()
        label = self._label if label is None else label
        self.completed += 1
        if not self.enabled:
            return False
        compiled = compile_seconds() - self._step_compile0
        step_s = now - self._step_t0
        is_compile = self._compile_expected or compiled > 0.5 * max(step_s, 1e-9)
        if is_compile:
            self._compile_steps_s += step_s
        else:
            self.durations.append(step_s)
        tag = f" (compile {compiled:.1f}s)" if is_compile else ""
        eta = _clock(self.eta_seconds(now))
        if self._rich is not None:
            self._rich.update(self._task, completed=self.completed, eta=eta,
                              description=f"{self.title} {self.unit} {label}{tag}", figures=figures, refresh=True)
            return True
        last = self.total is not None and self.completed >= self.total
        count = f"{self.completed}/{self.total}" if self.total is not None else f"{self.completed}"
        if is_compile or last or self.completed == 1 or now - self._last_print >= self.min_interval:
            self._last_print = now
            print(f"[{self.title}] {self.unit} {label}{tag} {count} | {figures} | "
                  f"elapsed {_clock(now - self._t0)} eta {eta}", file=self.stream, flush=True)
            return True
        return False

    def close(self, message: str | None = None) -> None:
        """Stop the live line (it stays on screen); ``message``: one final plain line."""
        if self._rich is not None:
            self._rich.stop()
            self._rich = None
        if self.enabled and message:
            print(f"[{self.title}] {message} (elapsed {_clock(time.perf_counter() - self._t0)})",
                  file=self.stream, flush=True)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["Progress", "compile_seconds", "policy_figures", "round_figures"]
