"""The suite's own guard (`support.release_compiled_programs`): a worker that has compiled many XLA:CPU programs
clears JAX's caches before its mapped memory regions reach the kernel's limit, past which a compile segfaults; and
the order the files run in (tests/conftest.py: the longest first, so no worker ends on one alone)."""
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import support


@pytest.mark.skipif(support.mapped_regions() is None, reason="needs /proc/self/maps (Linux)")
def test_compiled_programs_are_released_past_the_budget():
    f = jax.jit(lambda x: jnp.sin(x) * 3.0 + x)
    for n in range(1, 9):   # eight programs, ~100 regions each on XLA:CPU
        f(jnp.ones((n, 7)))
    held = support.mapped_regions()
    assert f._cache_size() == 8
    assert not support.release_compiled_programs(held + 10_000) and f._cache_size() == 8   # under budget: kept
    assert support.release_compiled_programs(0)
    assert f._cache_size() == 0 and support.mapped_regions() < held   # the programs and their regions are gone
    assert 0 < support.map_budget() <= support.map_budget(1.0)


def test_the_longest_files_run_first_then_the_most_tests_and_each_file_keeps_its_order(monkeypatch):
    import conftest

    monkeypatch.setattr(conftest, "LONGEST_FILES", ("test_b.py", "test_a.py"))
    tests = Path("tests")
    names = ["a::1", "a::2", "c::1", "d::1", "d::2", "e::2", "e::1", "b::1"]
    items = [types.SimpleNamespace(path=tests / f"test_{n[0]}.py", name=n) for n in names]
    conftest.pytest_collection_modifyitems(None, items)
    assert [i.name for i in items] == ["b::1", "a::1", "a::2", "d::1", "d::2", "e::2", "e::1", "c::1"]
    config = types.SimpleNamespace(option=types.SimpleNamespace(loadscopereorder=True))
    conftest.pytest_configure(config)
    assert config.option.loadscopereorder is False   # xdist hands the files out in that order


def test_every_longest_file_is_a_test_file_here():
    import conftest

    here = Path(conftest.__file__).parent
    assert len(set(conftest.LONGEST_FILES)) == len(conftest.LONGEST_FILES)
    assert [f for f in conftest.LONGEST_FILES if not (here / f).is_file()] == []   # a renamed file is renamed there
