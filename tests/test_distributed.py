"""tq_jax._src.distributed: joining a jax.distributed job through jax's public API.

The multi-process tests start fresh Python processes (jax.distributed needs one per
member), so they are slow; the byte-identity of distributed compress/decompress runs
is tested in test_multidevice.py.
"""

import ast
import inspect
import json
import os
import subprocess
import sys

import jax
import pytest

from tq_jax._src import distributed

from conftest import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 180




def _env() -> dict:
    return dict(os.environ, JAX_PLATFORMS="cpu")


def test_single_process_without_a_coordinator_is_none():
    assert not jax.distributed.is_initialized()
    assert distributed.initialize() is None
    assert not jax.distributed.is_initialized()  # nothing was started


def test_private_jax_is_read_in_one_place():
    """Only ``_coordination_client`` may import from ``jax._src`` (jax has no public
    accessor for the coordination client); everything else uses public jax."""
    tree = ast.parse(inspect.getsource(distributed))
    allowed = {
        id(node)
        for fn in ast.walk(tree)
        if isinstance(fn, ast.FunctionDef) and fn.name == "_coordination_client"
        for node in ast.walk(fn)
    }
    private = [
        (node.lineno, ast.unparse(node))
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        and any(
            name.startswith("jax._src")
            for name in ([node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names])
        )
        and id(node) not in allowed
    ]
    assert not private, private
    assert "_src" not in inspect.getsource(distributed.initialize)


_MEMBER = r"""
import json, sys
import jax
from tq_jax._src import batch, distributed

port, pid = sys.argv[1], int(sys.argv[2])
c = distributed.initialize(f"127.0.0.1:{port}", 2, pid, timeout_s=120)
again = distributed.initialize(f"127.0.0.1:{port}", 2, pid, timeout_s=120)  # joined: used as is
out = {"index": c.index, "count": c.count, "again": [again.index, again.count], "run": c.run != again.run}
out["agree"] = c.agree("hello", lambda: f"p{c.index}")

def fail_on_1():
    if c.index == 1:
        raise ValueError("boom")
    return "fine"

try:
    c.agree("fail", fail_on_1)
except Exception as e:
    out["error"] = [isinstance(e, batch.BatchError), str(e)]

class Usage(Exception):  # a caller's own error type, written for a person
    pass

def fail_on_1_with(exc):
    def fn():
        if c.index == 1:
            raise exc
        return "fine"
    return fn

out["plain"] = []
for i, (exc, plain_errors) in enumerate(
    [(Usage("bad flag"), ()), (Usage("bad flag"), (Usage,)), (batch.BatchError("bad input"), ())]
):
    try:
        c.agree(f"plain{i}", fail_on_1_with(exc), plain_errors)
    except Exception as e:
        out["plain"].append(str(e))
print(json.dumps(out))
"""


@pytest.mark.slow
def test_two_processes_agree_and_share_a_failure():
    port = free_port()
    procs = [
        subprocess.Popen([sys.executable, "-c", _MEMBER, str(port), str(pid)], cwd=ROOT, env=_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for pid in range(2)
    ]
    outs = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=TIMEOUT)
            assert p.returncode == 0, stderr[-3000:]
            outs.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for pid, out in enumerate(outs):
        assert out["index"] == pid and out["count"] == 2 and out["again"] == [pid, 2] and out["run"]
        assert out["agree"] == ["p0", "p1"]
    # the failing process re-raises its own error; the other names it
    assert outs[1]["error"] == [False, "boom"]
    assert outs[0]["error"] == [True, "process 1 of 2 failed: ValueError: boom"]
    # BatchError and the caller's plain_errors are shared by message alone
    assert outs[0]["plain"] == [
        "process 1 of 2 failed: Usage: bad flag",
        "process 1 of 2 failed: bad flag",
        "process 1 of 2 failed: bad input",
    ]
    assert outs[1]["plain"] == ["bad flag", "bad flag", "bad input"]


@pytest.mark.slow
def test_a_one_process_job_is_none():
    code = (
        "import sys, jax; from tq_jax.batch import initialize; "
        "c = initialize(f'127.0.0.1:{sys.argv[1]}', 1, 0); "
        "assert c is None and jax.distributed.is_initialized(), c; print('ok')"
    )
    got = subprocess.run([sys.executable, "-c", code, str(free_port())], cwd=ROOT, env=_env(),
                         capture_output=True, text=True, timeout=TIMEOUT)
    assert got.returncode == 0 and got.stdout.split()[-1] == "ok", got.stderr[-3000:]
