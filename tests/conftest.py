"""Shared pytest fixtures, and the order the files run in."""
import collections
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite compiles hundreds of small, different XLA programs and runs most for milliseconds: LLVM at -O0
# halves XLA:CPU's compile time (the HLO passes, hence the programs and their numerics, are unchanged).
# Child processes inherit it. Set --xla_backend_optimization_level yourself to test another level.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
# The `mrl` verbs the tests call do not share ~/.cache/mrl_jax/jax_cache. The tests' own persistent compilation cache
# (tests/support.py `compile_cache_dir`) is a directory per run of the suite (MRL_TEST_XLA_CACHE=DIR names another,
# =off none), read by the child processes the tests start (a killed run, its resume and the uninterrupted run compile
# the same programs) and by the modules that ask for it (`jax_compile_cache`), not by every test: most tests compile
# programs no other process builds (on for every test, in JAX's bounded cache, whose every write reads the whole
# directory: 3,204 s of tests against 2,680 s without).
os.environ.setdefault("MRL_COMPILATION_CACHE", "off")
if "MRL_TEST_XLA_CACHE" not in os.environ:   # the xdist workers inherit the controller's
    os.environ["MRL_TEST_XLA_CACHE"] = tempfile.mkdtemp(prefix="mrl-test-xla-")
    os.environ["MRL_TEST_XLA_CACHE_OWNER"] = str(os.getpid())
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # the tests of benchmarks/ import them; tests/support.py is the suite's own library
    sys.path.insert(0, str(REPO))


def pytest_sessionfinish(session, exitstatus):
    """The run's own compilation cache removed by the process that made it."""
    if os.environ.get("MRL_TEST_XLA_CACHE_OWNER") == str(os.getpid()):
        shutil.rmtree(os.environ["MRL_TEST_XLA_CACHE"], ignore_errors=True)


# The files that take longest on the 2-core CI machine (end-to-end runs, child processes, many sampler programs),
# roughly longest first. `--dist loadfile` hands a worker the next file of the collected order when it has two tests left; xdist's
# own order (the files with the most tests first) left these, with few tests each, for the end, where one worker
# ran the last of them alone. Here they go first (longest first), then the others as xdist orders them.
LONGEST_FILES = ("test_fresh_clone.py", "test_placement.py", "test_bench_probes.py", "test_trainer.py",
                 "test_rollout_slots.py", "test_reliability.py", "test_memory_plan.py", "test_mwra.py",
                 "test_failures.py", "test_lora.py", "test_families_export.py", "test_demo.py", "test_lost_process.py",
                 "test_tpu_compile.py")


def pytest_configure(config):
    """xdist keeps the order `pytest_collection_modifyitems` gives (its own reordering by test count off)."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """The files of ``LONGEST_FILES`` first, in that order, then the others with the most tests first (xdist's
    order); each file's tests keep their order."""
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    count = collections.Counter(item.path for item in items)
    items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), -count[item.path], str(item.path)))


def _shared_tokenizers() -> Path:
    env = os.environ.get("MRL_SHARED_TOKENIZERS")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "shared" / "tokenizers"


@pytest.fixture(scope="session")
def shared_tokenizers_dir() -> Path:
    """Folder of real Hugging Face tokenizer.json files (../shared/tokenizers); skips when absent."""
    path = _shared_tokenizers()
    if not path.is_dir():
        pytest.skip(f"real tokenizers not available at {path} (set MRL_SHARED_TOKENIZERS)")
    return path


@pytest.fixture(scope="session")
def fresh_clone(tmp_path_factory):
    """This checkout as a user's fresh clone, installed as the README installs it (tests/installs.py): run a
    documented command with ``fresh_clone.run("mrl demo --quick --out runs/demo")``. Its commands use the run's
    compilation cache (`support.compile_cache_dir`): they load what other tests' processes compiled (the same
    programs: JAX's cache key drops source locations, so a clone's programs are the checkout's)."""
    import support
    from installs import FreshClone, clean_clone

    base = tmp_path_factory.mktemp("fresh")
    cache = support.compile_cache_dir()
    return FreshClone(clean_clone(REPO, base / "clone"), base, cache=None if cache is None else Path(cache))


@pytest.fixture(autouse=True)
def _bounded_compiled_programs():
    """After each test, JAX's caches cleared once this worker maps more than half the kernel's limit of memory
    regions (`support.release_compiled_programs`: XLA:CPU keeps ~100 per compiled program; a worker past the limit
    segfaulted in its next compile)."""
    yield
    import support

    support.release_compiled_programs(support.map_budget())


@pytest.fixture(scope="module")
def jax_compile_cache():
    """JAX's persistent compilation cache for one module (restored afterwards): the trainer-level modules
    compile the same tiny-config computations. Use with ``pytestmark = pytest.mark.usefixtures("jax_compile_cache")``."""
    import support

    restore = support.enable_compile_cache()
    yield
    restore()


if os.environ.get("MRL_TEST_COMPILE_REPORT"):
    # MRL_TEST_COMPILE_REPORT=FILE: one JSON line per test -- XLA programs this process compiled during it and their
    # seconds (child processes not counted) -- to find the tests that pay for compiles (the suite's time).
    @pytest.fixture(autouse=True)
    def _compile_report(request):
        import json

        from mrl_jax.trainer.compile_stats import CompileCounter

        with CompileCounter() as cc:
            yield
        with open(os.environ["MRL_TEST_COMPILE_REPORT"], "a") as f:
            f.write(json.dumps({"test": request.node.nodeid, **cc.summary()}) + "\n")
