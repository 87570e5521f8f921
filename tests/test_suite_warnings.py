"""The suite's own output stays quiet: LMCache's import-time warnings are filtered where
they happen, at collection (conftest's ``LMCACHE_IMPORT_FILTERS``, added to the ini's
filterwarnings), not only inside the tests of the modules that import it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULE = "tests/test_bridge_registry.py"  # imports LMCache at module level
WARNING = "`LoggingHandler` in `opentelemetry-sdk` is deprecated"


def _collect(*extra: str) -> str:
    pytest.importorskip("lmcache")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", MODULE, *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_collecting_a_module_that_imports_lmcache_warns_nothing():
    out = _collect()
    assert "warnings summary" not in out and WARNING not in out, out[-3000:]
    # the control: the warning is really raised while collecting (a command-line filter
    # overrides the ini's), so the first assertion holds because of the filter
    assert WARNING in _collect("-W", "default::DeprecationWarning")
