"""Suite-wide settings.

On CI (``CI`` set in the environment) a missing test dependency is an error, not a
quiet skip: the `test` extra installs them all, so a skip there would hide a broken
set-up and leave its tests unrun.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

# import name -> what provides it (the `test`, `cli` and `lmcache` extras in pyproject.toml)
TEST_DEPENDENCIES = {
    "torch": "torch==2.13.0 (extra `lmcache`)",
    "lmcache": "lmcache==0.5.6 (extra `lmcache`)",
    "tqai": "tqai==0.6.1 (extra `test`)",
    "lmcache_turbo_quant_serde": "lmcache-turbo-quant-serde==0.1.0 (extra `test`)",
    "scipy": "scipy (extra `test`)",
    "safetensors": "safetensors (extra `test`)",
    "chex": "chex (extra `test`)",
    "hypothesis": "hypothesis (extra `test`)",
    "matplotlib": "matplotlib (extra `cli`)",
}


def missing_test_dependencies() -> list[str]:
    return [f"{name} ({why})" for name, why in TEST_DEPENDENCIES.items() if importlib.util.find_spec(name) is None]


def pytest_configure(config):
    if os.environ.get("CI") and (missing := missing_test_dependencies()):
        raise pytest.UsageError(
            "CI is set but test dependencies are missing, so their tests would be skipped: "
            + ", ".join(missing)
            + '. Install them with: pip install -e ".[cli,lmcache,test]"'
        )


def sweep(cases, fast: int = 1):
    """Parameter sets for ``pytest.mark.parametrize``: the first ``fast`` run in the
    quick subset (``-m "not slow"``), the rest are marked slow. Each case is one value,
    or a tuple for several argument names."""
    return [
        case if i < fast else pytest.param(*(case if isinstance(case, tuple) else (case,)), marks=pytest.mark.slow)
        for i, case in enumerate(cases)
    ]


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop JAX's compiled programs after each test module: a module's shapes rarely
    recur in the next, and keeping every program of ~900 tests held GBs of memory."""
    yield
    jax = sys.modules.get("jax")
    if jax is not None:
        jax.clear_caches()
