"""``mrl bench``: the benchmarks' harness, the machine load beside every figure, and the probe comparison.

- :mod:`~mrl_jax.bench.harness` -- ``mrl bench [--quick] [--only NAME,...]``: runs the ``benchmarks/bench_<name>.py``
  scripts of a source checkout and gathers their figures; ``script_main`` is the command line they share.
- :mod:`~mrl_jax.bench.load` -- the machine's load around each timed section (a figure taken under load is
  marked ``contended``) and a bounded wait for quiet.
- :mod:`~mrl_jax.bench.probes` -- ``mrl bench probes``: every probe on the same work
  (:mod:`~mrl_jax.bench.probe_workloads`), its report (:mod:`~mrl_jax.bench.probe_report`); part of the wheel.
"""

from mrl_jax.bench.harness import available, environment, print_figures, run_benchmarks, run_recorded, script_main
from mrl_jax.bench.probes import run_probes

__all__ = ["available", "environment", "print_figures", "run_benchmarks", "run_probes", "run_recorded", "script_main"]
