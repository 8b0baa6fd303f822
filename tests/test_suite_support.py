"""The suite's own guard (`support.release_compiled_programs`): a worker that has compiled many XLA:CPU programs
clears JAX's caches before its mapped memory regions reach the kernel's limit, past which a compile segfaults."""
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
