import os

# Megatron-Core wraps some activations (squared_relu, ...) in torch.compile. On a 2-core CI box
# the first Inductor C++ build in each spawned rank can take minutes (CI once timed out a
# 2-rank case inside `cpu_vec_isa.check_build`); the tests compare eager numerics, so compile
# is switched off for this process and the ranks it spawns.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import pytest

from tests.harness import get_pool, shutdown_pools


@pytest.fixture(scope="session")
def dist_pools():
    """`dist_pools(n)` -> a live n-rank gloo pool (started once, replaced if it broke)."""
    yield get_pool
    shutdown_pools()
