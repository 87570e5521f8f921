"""A real ``redis-server`` for the tests: loopback only, its own temp dir, nothing left behind.

``redis_server`` (a pytest fixture, function scope) starts Debian's ``redis-server`` on a
free port of 127.0.0.1 with persistence off (``--save '' --appendonly no``) in a fresh
temp dir and yields a :class:`RedisServer`; at the end it stops the server and asserts
that neither the process nor the temp dir is left; ``module_redis_server`` is the same,
one server for a test module (for tests that never stop, restart or fill it). A test
that needs the server is skipped, with the reason, when the binary is absent, unless
``CI`` is set: then the missing server fails it (``.ci/run`` installs it), as for the
other test dependencies.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time

import pytest
from conftest import free_port

BINARY = "redis-server"
HOST = "127.0.0.1"  # never any other address
MISSING = (
    "redis-server is not installed, so the tests against a real Redis cannot run: install it "
    "(Debian/Ubuntu: apt-get install -y redis-server; .ci/run does this when it is missing)."
)


def require_binary() -> str:
    """The server's path; skips the test (fails it with ``CI`` set) when it is absent."""
    path = shutil.which(BINARY)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(MISSING + " CI is set, so this is an error rather than a skip.")
        pytest.skip(MISSING)
    return path


class PortTaken(RuntimeError):
    """The server exited at start: another process holds its port."""


class RedisServer:
    """One ``redis-server`` process on ``127.0.0.1:port``; restartable on the same port."""

    def __init__(self, binary: str, *, maxmemory: str | None = None) -> None:
        self.binary = binary
        self.dir = tempfile.mkdtemp(prefix="tq_jax-redis-")
        self.maxmemory = maxmemory
        self.proc: subprocess.Popen | None = None
        for attempt in range(3):  # a port free a moment ago can be taken before the server binds it
            self.port = free_port()
            try:
                self.start()
                break
            except PortTaken:
                if attempt == 2:
                    raise

    def start(self) -> None:
        """Starts an empty server (persistence off) and waits until it answers, as itself:
        ``INFO``'s process id is this server's, never another's on the same port.

        Raises:
            PortTaken: the server exited at start (its port was in use).
        """
        args = [self.binary, "--bind", HOST, "--port", str(self.port), "--dir", self.dir,
                "--save", "", "--appendonly", "no", "--protected-mode", "yes", "--loglevel", "warning"]
        if self.maxmemory:
            args += ["--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise PortTaken(f"redis-server exited at start (code {self.proc.returncode}): {HOST}:{self.port} in use?")
            try:
                if int(self.client(timeout=0.5).info("server")["process_id"]) == self.proc.pid:
                    return
            except Exception:  # noqa: BLE001 - not up yet
                pass
            time.sleep(0.02)
        if self.proc.poll() is not None:
            raise PortTaken(f"redis-server exited at start (code {self.proc.returncode}): {HOST}:{self.port} in use?")
        raise RuntimeError(f"redis-server did not answer on {HOST}:{self.port} within 10 s")

    def client(self, timeout: float = 5):
        import redis

        return redis.Redis(host=HOST, port=self.port, socket_timeout=timeout, socket_connect_timeout=timeout)

    def kill(self) -> None:
        """SIGKILL: the server dies with whatever it held (nothing persists)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop_signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a stopped server cannot act on SIGTERM
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def leftovers(self) -> list[str]:
        """What the server left behind: a live process or its temp dir."""
        left = []
        if self.proc is not None and self.proc.poll() is None:
            left.append(f"redis-server pid {self.proc.pid}")
        if os.path.exists(self.dir):
            left.append(f"temp dir {self.dir}")
        return left


def _server(maxmemory=None):
    server = RedisServer(require_binary(), maxmemory=maxmemory)
    try:
        yield server
    finally:
        server.close()
        assert not server.leftovers(), f"the redis fixture left {server.leftovers()} behind"


@pytest.fixture
def redis_server():
    """A fresh, empty ``redis-server`` on a free loopback port (see the module docstring)."""
    yield from _server()


@pytest.fixture(scope="module")
def module_redis_server():
    """As :func:`redis_server`, one server for the whole test module."""
    yield from _server()


@pytest.fixture
def small_redis_server():
    """As :func:`redis_server`, at ``maxmemory`` 4 MiB with ``allkeys-lru`` eviction."""
    yield from _server(maxmemory="4mb")
