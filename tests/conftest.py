"""Shared pytest fixtures."""
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite compiles hundreds of small, different XLA programs and runs most for milliseconds: LLVM at -O0
# halves XLA:CPU's compile time (the HLO passes, hence the programs and their numerics, are unchanged).
# Child processes inherit it. Set --xla_backend_optimization_level yourself to test another level.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
# No persistent compilation cache shared between the xdist workers and their child processes: the `mrl` verbs the
# tests call would share ~/.cache/mrl_jax/jax_cache, and a worker segfaulted loading an entry another process wrote
# (MRL_TEST_XLA_CACHE=DIR turns the tests' own cache on: tests/support.py `compile_cache_dir`).
os.environ.setdefault("MRL_COMPILATION_CACHE", "off")
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # the tests of benchmarks/ import them; tests/support.py is the suite's own library
    sys.path.insert(0, str(REPO))
if os.environ.get("MRL_TEST_XLA_CACHE"):   # every process of the run (workers, children) shares the tests' cache
    from support import compile_cache_env

    os.environ.update(compile_cache_env())


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
    documented command with ``fresh_clone.run("mrl demo --quick --out runs/demo")``."""
    from installs import FreshClone, clean_clone

    base = tmp_path_factory.mktemp("fresh")
    return FreshClone(clean_clone(REPO, base / "clone"), base)


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

        from mrl_jax.compile_stats import CompileCounter

        with CompileCounter() as cc:
            yield
        with open(os.environ["MRL_TEST_COMPILE_REPORT"], "a") as f:
            f.write(json.dumps({"test": request.node.nodeid, **cc.summary()}) + "\n")
