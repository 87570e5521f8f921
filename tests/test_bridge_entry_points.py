"""The bridge's entry points on a first run: without the ``lmcache`` extra, with a port taken,
and a quiet ``register()``.

"Without the extra" is simulated in a subprocess: a ``sitecustomize`` on its
``PYTHONPATH`` puts a finder first on ``sys.meta_path`` that refuses ``torch`` and
``lmcache`` (and their submodules) as a missing distribution would, with
``ModuleNotFoundError``. Everything else imports as installed.
"""

from __future__ import annotations

import logging
import os
import pathlib
import socket
import subprocess
import sys

import pytest

from conftest import free_port

REPO = pathlib.Path(__file__).resolve().parents[1]
INSTALL = 'pip install -e ".[lmcache]"'

BLOCKER = '''\
import sys


class _NoLmcacheExtra:
    """Refuses torch and lmcache as if they were not installed."""

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("torch", "lmcache"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _NoLmcacheExtra())
'''


def _env(*paths) -> dict:
    env = dict(os.environ, PYTHONWARNINGS="ignore", JAX_PLATFORMS="cpu")
    for name in ("LMCACHE_LOG_LEVEL", "LMCACHE_DISABLE_BANNER"):
        env.pop(name, None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (*map(str, paths), str(REPO), env.get("PYTHONPATH")) if p)
    return env


@pytest.fixture
def without_extra(tmp_path) -> dict:
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    return _env(tmp_path)


def _run(argv, env, cwd, timeout=120):
    return subprocess.run([sys.executable, *argv], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def test_the_simulation_hides_torch_and_lmcache_only(without_extra, tmp_path):
    r = _run(["-c", "import numpy, tq_jax.bridge\ntry:\n import torch\nexcept ModuleNotFoundError as e: print(e.name)"],
             without_extra, tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "torch", r.stderr


@pytest.mark.parametrize("argv,status", [
    (["-m", "tq_jax.bridge.launch", "server", "--l1-size-gb", "1"], 1),
    (["-m", "tq_jax.bridge.smoke", "--l2-adapter", '{"type": "fs", "base_path": "./tq-jax-kv"}'], 2),
])
def test_commands_without_the_extra_answer_in_one_line(without_extra, tmp_path, argv, status):
    r = _run(argv, without_extra, tmp_path)
    assert r.returncode == status, r.stderr
    assert r.stdout == ""
    (line,) = r.stderr.splitlines()  # one line, no traceback
    assert line.startswith("error: tq_jax.bridge needs the `lmcache` extra") and INSTALL in line, line


def test_register_without_the_extra_raises_one_line_import_error(without_extra, tmp_path):
    code = ("import tq_jax.bridge\n"
            "try:\n    tq_jax.bridge.register()\n"
            "except ImportError as e:\n    print(type(e).__name__, e.name, '|', e)")
    r = _run(["-c", code], without_extra, tmp_path)
    assert r.returncode == 0, r.stderr
    kind, name, _, message = r.stdout.strip().split(" ", 3)
    assert (kind, name) == ("ImportError", "lmcache")
    assert "\n" not in message and INSTALL in message and "'lmcache' is not installed" in message


# ----------------------------------------------------------------------------- with the extra


@pytest.mark.parametrize("configured", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_register_is_quiet_unless_logging_is_configured(tmp_path, configured):
    pytest.importorskip("lmcache")
    setup = "import logging; logging.basicConfig(level=logging.INFO)\n" if configured else ""
    r = _run(["-c", setup + "import tq_jax.bridge\nprint(tq_jax.bridge.register())"], _env(), tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "('tq_jax', 'tqai')"
    assert ("torch_dev=" in r.stderr) == configured, r.stderr[-3000:]  # LMCache's device-probe INFO line


def _in_use_records(lines):
    from tq_jax.bridge import launch

    lg = logging.getLogger("uvicorn.error")
    kept = []
    handler = logging.Handler()
    handler.emit = kept.append
    lg.addHandler(handler)
    try:
        with launch._ports_in_use() as seen:
            for text in lines:
                lg.error(text)
    finally:
        lg.removeHandler(handler)
    return seen, [r.getMessage() for r in kept]


def test_address_in_use_becomes_one_line_naming_the_flag():
    """uvicorn's two address-in-use records (LMCache 0.5.6, uvicorn 0.55) as they are logged."""
    zmq_tb = ("Traceback (most recent call last):\n  File \"mq.py\", line 616, in __init__\n"
              "zmq.error.ZMQError: Address already in use (addr='tcp://localhost:5555')\n")
    seen, kept = _in_use_records([zmq_tb, "Application startup failed. Exiting."])
    assert kept == [] and len(seen) == 1
    assert "request server cannot listen on localhost:5555" in seen[0] and seen[0].endswith("with --port N.")
    seen, kept = _in_use_records(["[Errno 98] error while attempting to bind on address ('127.0.0.1', 8080): "
                                  "address already in use", "Waiting for application shutdown."])
    assert kept == ["Waiting for application shutdown."] and len(seen) == 1
    assert "HTTP API cannot listen on 127.0.0.1:8080" in seen[0] and seen[0].endswith("with --http-port N.")
    seen, kept = _in_use_records(["Application startup failed. Exiting."])  # another cause: left as it is
    assert seen == [] and kept == ["Application startup failed. Exiting."]


@pytest.mark.slow
@pytest.mark.parametrize("taken", ["--port", "--http-port"])
def test_launcher_names_the_flag_when_a_port_is_taken(tmp_path, taken):
    pytest.importorskip("lmcache")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        ports = {"--port": free_port(), "--http-port": free_port(), taken: busy}
        argv = ["-m", "tq_jax.bridge.launch", "server", "--l1-size-gb", "0.05", "--eviction-policy", "LRU",
                "--host", "127.0.0.1", "--http-host", "127.0.0.1",
                *(str(a) for kv in ports.items() for a in kv)]
        r = _run(argv, _env(), tmp_path, timeout=180)
    assert r.returncode == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    last = r.stderr.splitlines()[-1]
    assert last.startswith("error: the ") and f"127.0.0.1:{busy}" in last and last.endswith(f"with {taken} N."), last


def _doc(*parts) -> str:
    return REPO.joinpath(*parts).read_text(encoding="utf-8")


def test_server_lines_show_both_ports():
    for text in (_doc("README.md"), _doc("docs", "bridge.md")):
        line = next(ln for ln in text.splitlines() if ln.startswith("python -m tq_jax.bridge.launch server"))
        assert "--port 5555" in line and "--http-port 8080" in line, line


def test_docs_sample_log_line_is_the_line_logged():
    """docs/bridge.md's start-up line (wrapped there) is what the bridge logs for the
    README's serde config."""
    pytest.importorskip("lmcache")
    import re

    import tq_jax
    from tq_jax.bridge import register
    from tq_jax.bridge._src import registry

    register()
    sample = re.search(r"\[\.\.\.\] tq_jax INFO: (tq_jax serde created: .*?)\n```", _doc("docs", "bridge.md"), re.S)
    o = registry.parse_options({"head_dim": 128})
    options = tq_jax.encode_options(bits=o.bits, seed=o.seed, **o.codec_options())
    line = registry.created_message(o, options, "cpu:0", paired="vllm-cpu")
    assert " ".join(sample.group(1).split()) == line
