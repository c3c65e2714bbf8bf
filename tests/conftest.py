import pytest

from tests.harness import get_pool, shutdown_pools


@pytest.fixture(scope="session")
def dist_pools():
    """`dist_pools(n)` -> a live n-rank gloo pool (started once, replaced if it broke)."""
    yield get_pool
    shutdown_pools()
