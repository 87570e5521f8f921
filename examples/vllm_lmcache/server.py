"""An LMCache multi-process server with the tq_jax serde, started through the launcher.

``LMCacheServer`` runs ``python -m tq_jax.bridge.launch server ...`` in a child process
with the flags vLLM's ``LMCacheMPConnector`` needs (docs/vllm.md says why each):

* ``--port`` / ``--http-port``: the ZMQ port vLLM connects to and LMCache's HTTP API
  (8080 unless given);
* ``--supported-transfer-mode auto``: vLLM's CPU worker asks for engine-driven transfer;
  LMCache's default serves only server-driven (CUDA IPC) transfer, and
  ``register_kv_caches`` then waits for ``lmcache.mp.mq_timeout``;
* ``--shm-name NAME --no-l1-use-lazy``: engine-driven transfer through a shared-memory
  pool instead of pickled tensors over ZMQ (LMCache disables it by default; SHM needs
  L1 allocated up front);
* ``--l2-adapter`` with ``"serde": {"type": "tq_jax", ...}``.

The server's log goes to a file; :meth:`LMCacheServer.lines` reads it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

READY = "Uvicorn running on"


def free_port() -> int:
    """A TCP port free on the loopback interface now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fs_adapter(base_path: str | Path, serde: dict) -> dict:
    """An ``fs`` L2 adapter spec storing through the tq_jax serde."""
    return {"type": "fs", "base_path": str(base_path), "serde": {"type": "tq_jax", **serde}}


def resp_adapter(host: str, port: int, serde: dict) -> dict:
    """A Redis (``resp``) L2 adapter spec storing through the tq_jax serde."""
    return {"type": "resp", "host": host, "port": int(port), "serde": {"type": "tq_jax", **serde}}


class LoggedChild:
    """A child process that logs to ``self.log_path``, started by ``start()`` and ended by
    ``stop()``; a context manager over the two."""

    log_path: Path

    def lines(self) -> list[str]:
        """The log so far."""
        try:
            return self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return []

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.lines()[-n:])

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class LMCacheServer(LoggedChild):
    """``lmcache server`` with one L2 adapter, in a child process of ``python``.

    Args:
        adapter: the L2 adapter spec (:func:`fs_adapter`, :func:`resp_adapter`).
        log_path: where the server's stdout and stderr go.
        l1_size_gb: LMCache's L1 (host memory) size.
        python: the interpreter (default: this one).
        shm: transfer KV to and from vLLM through shared memory (else pickled over ZMQ).
    """

    def __init__(self, adapter: dict, log_path: str | Path, *, l1_size_gb: float = 1.0, python: str | None = None,
                 chunk_size: int = 256, port: int | None = None, http_port: int | None = None, shm: bool = True) -> None:
        self.adapter = adapter
        self.log_path = Path(log_path)
        self.l1_size_gb = l1_size_gb
        self.python = python or sys.executable
        self.chunk_size = chunk_size
        self.shm = shm
        self.port = port or free_port()
        self.http_port = http_port or free_port()
        self.proc: subprocess.Popen | None = None

    def command(self) -> list[str]:
        return [
            self.python, "-m", "tq_jax.bridge.launch", "server",
            "--host", "localhost", "--port", str(self.port), "--http-port", str(self.http_port),
            "--supported-transfer-mode", "auto",
            *(["--shm-name", f"tq-jax-lmcache-{self.port}", "--no-l1-use-lazy"] if self.shm else []),
            "--chunk-size", str(self.chunk_size),
            "--l1-size-gb", str(self.l1_size_gb), "--eviction-policy", "LRU",
            "--l2-adapter", json.dumps(self.adapter),
        ]

    def start(self, timeout: float = 180.0) -> "LMCacheServer":
        """Starts the server and waits until its HTTP API answers.

        Raises:
            RuntimeError: it exited or did not come up within ``timeout`` seconds (the
                message ends with its last log lines).
        """
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"LMCache server exited with status {self.proc.returncode}:\n{self.tail()}")
            if self._healthy():
                return self
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"LMCache server did not start within {timeout:.0f} s:\n{self.tail()}")

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/healthcheck", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def clear_l1(self) -> None:
        """Empties L1 (LMCache's ``POST /cache/clear``); L2 keeps what it holds."""
        req = urllib.request.Request(f"http://127.0.0.1:{self.http_port}/cache/clear", data=b"{}", method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            if r.status != 200:
                raise RuntimeError(f"clearing L1 answered HTTP {r.status}")

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout`` seconds; the whole process group."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def kill(self) -> None:
        """SIGKILL to the whole process group: the server dies as in a crash, without its
        shutdown (L1 and anything not yet written to L2 are lost)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def restart(self) -> "LMCacheServer":
        """A new server process on the same ports and L2 (L1 starts empty)."""
        self.stop()
        return self.start()
