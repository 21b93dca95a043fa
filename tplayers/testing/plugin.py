"""The pytest plugin (entry point `pytest11: tplayers`), loaded wherever tplayers is installed:

- fixture `tplayers_pool`: one session-wide `WorkerPool` of local gloo ranks (world size from env
  `TPLAYERS_POOL_WORLD`, default 8), started on first use; `check_parallel` uses it by default;
- marker `@pytest.mark.tplayers`: a multi-rank test on that pool (it requests the fixture);
- hypothesis profiles "tplayers" (fixed examples, no deadline: ranks are slow to start) and
  "tplayers-random" (fresh examples), for `pytest --hypothesis-profile tplayers`; example counts
  scale with env `TPLAYERS_EXAMPLES_SCALE` through `tplayers.testing.examples(n)`.

Importing this module imports neither torch nor the pool: pytest loads it in every session.
"""

import os

import pytest

POOL_WORLD_ENV = "TPLAYERS_POOL_WORLD"
_pools: dict = {}  # world size -> WorkerPool, shared by the fixture and check_parallel


def pool_world() -> int:
    return int(os.environ.get(POOL_WORLD_ENV, "8"))


def session_pool(world: int = 1):
    """The session's pool (at least `world` ranks): the plugin's if it serves, else one started
    now and closed at exit."""
    size = max(world, pool_world())
    for existing, pool in _pools.items():
        if existing >= world:
            return pool
    from tplayers.testing.pool import WorkerPool

    pool = _pools[size] = WorkerPool(world_size=size)
    import atexit

    atexit.register(pool.__exit__)
    return pool


def pytest_configure(config):
    config.addinivalue_line("markers", "tplayers: a multi-rank test on the tplayers worker pool (tplayers_pool)")
    try:
        from hypothesis import HealthCheck, settings
    except ImportError:  # hypothesis is only needed by the strategies
        return
    quiet = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
    settings.register_profile("tplayers", deadline=None, derandomize=True, print_blob=True, suppress_health_check=quiet)
    settings.register_profile("tplayers-random", deadline=None, print_blob=True, suppress_health_check=quiet)


def pytest_collection_modifyitems(items):
    for item in items:
        if item.get_closest_marker("tplayers") and "tplayers_pool" not in getattr(item, "fixturenames", ()):
            item.fixturenames.append("tplayers_pool")


@pytest.fixture(scope="session")
def tplayers_pool():
    """Local gloo ranks shared by every multi-rank test of the session (see the module docstring)."""
    pool = session_pool(pool_world())
    yield pool
    pool.__exit__(None, None, None)
    _pools.clear()
