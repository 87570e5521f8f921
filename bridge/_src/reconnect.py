"""A RESP (Redis/Valkey) L2 adapter that reconnects after the server restarts.

LMCache 0.5.6's ``resp`` adapter is ``NativeConnectorL2Adapter`` over one
``lmcache.lmcache_redis.LMCacheRedisClient``, built once. That client opens its worker
connections when it is constructed and never opens them again: after the server
restarts, every later operation completes with ``ok=False`` ("socket writev failed",
"socket recv failed: connection closed"), so the same ``StorageManager`` reports every
store as failed and every lookup as a miss until the process restarts. The client has
no reconnect method and no timeout option (its methods: ``event_fd``, ``submit_batch_*``,
``drain_completions``, ``close``).

``{"type": "resp_reconnect", ...}`` (registered by :func:`register_adapter`, which
:func:`tq_jax.bridge.register` calls) takes every ``resp`` key (``host``, ``port``,
``num_workers``, ``username``, ``password``, ``max_capacity_gb``, and ``serde``,
``eviction`` as for any adapter) plus:

- ``reconnect_interval`` (seconds, default 1.0): the least time between two attempts;
- ``probe_timeout`` (seconds, default 2.0): how long an attempt waits for the server.

It is LMCache's own ``NativeConnectorL2Adapter``, unchanged, over a
:class:`ReconnectingClient`: a native-client stand-in that forwards each batch to the
current ``LMCacheRedisClient`` and numbers the batches itself. When a batch completes
with a connection error (its text names the socket or the connection:
:data:`CONNECTION_ERRORS`), the client is marked lost, and from then on, at most once per
``reconnect_interval``, it (1) sends ``PING`` on a plain socket (refused at once while
the server is down); when that is answered, (2) closes the old client, whose batches
still in flight complete as failed (its ``close`` drops them without a completion),
(3) builds a new ``LMCacheRedisClient`` and waits up to ``probe_timeout`` for
``2 * num_workers`` EXISTS batches through it, and only then (4) sends batches to it.
Between (2) and (4), and when (3) fails, batches fail at once. Step 3 matters: a client
built while the server is unreachable never completes anything, and in our runs a new
client built while the old one was still open sometimes had a dead worker connection.

What an operator sees: stores and loads fail (reported, never raised) while the server
is away, and work again within about ``reconnect_interval`` of its return, in the same
process; a server that is down when the adapter is built is the same case from the
start (:data:`DOWN_AT_START` is logged, and the first client is built when it answers); the adapter's status carries ``reconnects`` and ``connected``. A restarted
server is empty unless it persists: loads of earlier keys miss. A stalled server
(SIGSTOP) is not a connection error: batches wait for it, as with ``resp``.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from lmcache.v1.distributed.l2_adapters.config import (
    L2AdapterConfigBase,
    register_l2_adapter_type,
)
from lmcache.v1.distributed.l2_adapters.factory import register_l2_adapter_factory
from lmcache.v1.distributed.l2_adapters.native_connector_l2_adapter import NativeConnectorL2Adapter
from lmcache.v1.distributed.l2_adapters.resp_l2_adapter import RESPL2AdapterConfig
from lmcache.v1.platform import create_event_notifier

__all__ = [
    "CONNECTION_ERRORS",
    "TYPE_NAME",
    "ReconnectingClient",
    "ReconnectingRESPConfig",
    "ReconnectingRESPL2Adapter",
    "create_adapter",
    "is_connection_error",
    "ping",
    "register_adapter",
]

logger = logging.getLogger(__name__)

TYPE_NAME = "resp_reconnect"
# Substrings of the native client's error text that mean the connection is gone.
CONNECTION_ERRORS = ("socket", "connection", "broken pipe", "reset by peer", "eof")
PROBE_KEY = "tq_jax-reconnect-probe"  # only ever asked EXISTS; never written
DOWN_AT_START = (
    "RESP server %s:%d does not answer at start-up: serving without this L2 (every store fails and every lookup "
    "misses, so the engine computes) and connecting when it answers (tried every %gs). If it stays down, check "
    "its host and port."
)
_POLL_MS = 200


def is_connection_error(error: str) -> bool:
    """True when a failed batch's error text says the connection is lost.

    Examples:
        >>> is_connection_error("socket writev failed"), is_connection_error("OOM command not allowed")
        (True, False)
    """
    e = error.lower()
    return any(s in e for s in CONNECTION_ERRORS)


def ping(host: str, port: int, timeout: float) -> bool:
    """True when something at ``host:port`` answers ``PING`` with a RESP reply
    (``+PONG``, or an error such as ``-NOAUTH``: the server is up either way)."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.settimeout(timeout)
            s.sendall(b"PING\r\n")
            return s.recv(1)[:1] in (b"+", b"-")
    except OSError:
        return False


class ReconnectingClient:
    """The native client's interface over a replaceable ``LMCacheRedisClient``.

    Args:
        connect: builds a new native client (no arguments).
        host, port: where :func:`ping` probes before ``connect`` is called again.
        reconnect_interval: the least seconds between two reconnect attempts.
        probe_timeout: seconds to wait for the ping and for the new client's EXISTS.
        probe_batches: how many EXISTS batches a new client must answer before use.
    """

    def __init__(self, connect: Callable[[], Any], host: str, port: int, *,
                 reconnect_interval: float = 1.0, probe_timeout: float = 2.0, probe_batches: int = 16) -> None:
        self._connect, self.host, self.port = connect, host, port
        self.reconnect_interval, self.probe_timeout = reconnect_interval, probe_timeout
        self.probe_batches = probe_batches
        self._lock = threading.Lock()
        # A client built while the server is unreachable never completes anything: start
        # without one, failing every batch at once, and connect when the server answers.
        up = ping(host, port, probe_timeout)
        self._inner = connect() if up else None
        self._outstanding: dict[int, int] = {}  # the inner client's future id -> ours
        self._next_id = 1
        self._done: list[tuple] = []  # completions (our ids) not yet drained
        self._notifier = create_event_notifier()
        self.lost = not up  # a connection error seen (or none at start), no new client yet
        self.reconnects = 0
        self._next_attempt = 0.0
        if not up:
            logger.warning(DOWN_AT_START, host, port, reconnect_interval)
        self._stop = threading.Event()
        self._pump = threading.Thread(target=self._pump_loop, daemon=True, name="tq_jax-resp-reconnect")
        self._pump.start()

    # ------------------------------------------------------------- the native interface

    def event_fd(self) -> int:
        return self._notifier.fileno()

    def submit_batch_get(self, keys, views) -> int:
        return self._submit("submit_batch_get", keys, views)

    def submit_batch_set(self, keys, views) -> int:
        return self._submit("submit_batch_set", keys, views)

    def submit_batch_exists(self, keys) -> int:
        return self._submit("submit_batch_exists", keys)

    def submit_batch_delete(self, keys) -> int:
        return self._submit("submit_batch_delete", keys)

    def drain_completions(self) -> list[tuple]:
        """Completions since the last call: ``(future_id, ok, error, per-key bools|None)``."""
        self._notifier.consume()
        with self._lock:
            done, self._done = self._done, []
        return done

    def close(self) -> None:
        self._stop.set()
        self._pump.join(timeout=5)
        with self._lock:
            self._drop_inner("the adapter was closed")
        self._notifier.close()

    @property
    def connected(self) -> bool:
        return not self.lost

    # ------------------------------------------------------------- internals

    def _submit(self, method: str, *args) -> int:
        with self._lock:  # the pump translates completions under this lock, so ours is recorded first
            ours, self._next_id = self._next_id, self._next_id + 1
            if self._inner is None:  # between two clients: fail at once rather than wait
                self._done.append((ours, False, f"not connected to {self.host}:{self.port}: reconnecting", None))
                self._notifier.notify()
            else:
                self._outstanding[int(getattr(self._inner, method)(*args))] = ours
        return ours

    def _pump_loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                fd = None if self._inner is None else self._inner.event_fd()
            if fd is None:
                self._stop.wait(_POLL_MS / 1000)
            else:
                poller = select.poll()
                poller.register(fd, select.POLLIN)
                if poller.poll(_POLL_MS):
                    self._pump_once()
            if self.lost and time.monotonic() >= self._next_attempt:
                self._next_attempt = time.monotonic() + self.reconnect_interval
                self._try_reconnect()

    def _pump_once(self) -> None:
        with self._lock:
            if self._inner is not None:
                self._forward(self._inner.drain_completions())

    def _forward(self, comps) -> None:
        """Under the lock: the inner client's completions, renumbered, to the adapter."""
        out = []
        for fid, ok, error, bools in comps:
            ours = self._outstanding.pop(int(fid), None)
            if ours is None:
                continue  # our own probe's completion, or one from a client we replaced
            if not ok and not self.lost and is_connection_error(str(error)):
                self.lost = True
                self._next_attempt = 0.0
                logger.warning("RESP connection to %s:%d lost (%s); reconnecting when the server answers",
                               self.host, self.port, error)
            out.append((ours, bool(ok), str(error), bools))
        if out:
            self._done.extend(out)
            self._notifier.notify()

    def _strand(self, why: str) -> None:
        """Under the lock: every batch still on the current client completes as failed."""
        if self._outstanding:
            self._done.extend((ours, False, why, None) for ours in self._outstanding.values())
            self._outstanding.clear()
            self._notifier.notify()

    def _drop_inner(self, why: str) -> None:
        """Under the lock: closes the current client; its unfinished batches fail."""
        if self._inner is not None:
            self._forward(self._inner.drain_completions())  # what it did finish
            self._inner.close()  # drops its in-flight batches without a completion
            self._inner = None
        self._strand(why)

    def _try_reconnect(self) -> None:
        if not ping(self.host, self.port, self.probe_timeout):
            return
        with self._lock:  # the old client goes before a new one is built (see the module docstring)
            self._drop_inner("connection lost: the RESP client was rebuilt before this batch finished")
        new = self._connect()
        if not _answers(new, self.probe_timeout, self.probe_batches):
            new.close()
            return
        with self._lock:
            self._inner = new
            self.lost = False
            self.reconnects += 1
        logger.warning("RESP connection to %s:%d re-established (reconnect #%d)", self.host, self.port, self.reconnects)


def _answers(client: Any, timeout: float, batches: int) -> bool:
    """True when ``client`` completes ``batches`` EXISTS batches, submitted at once (so
    that they spread over its worker connections), all ok within ``timeout`` seconds."""
    waiting = {int(client.submit_batch_exists([PROBE_KEY])) for _ in range(batches)}
    poller = select.poll()
    poller.register(client.event_fd(), select.POLLIN)
    deadline = time.monotonic() + timeout
    while waiting and (left := deadline - time.monotonic()) > 0:
        if poller.poll(int(left * 1000) + 1):
            for f, ok, _err, _bools in client.drain_completions():
                if not ok:
                    return False
                waiting.discard(int(f))
    return not waiting


class ReconnectingRESPConfig(RESPL2AdapterConfig):
    """``resp``'s config plus ``reconnect_interval`` and ``probe_timeout`` (seconds, > 0)."""

    def __init__(self, *args, reconnect_interval: float = 1.0, probe_timeout: float = 2.0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reconnect_interval = reconnect_interval
        self.probe_timeout = probe_timeout

    @classmethod
    def from_dict(cls, d: dict) -> ReconnectingRESPConfig:
        own = {}
        for name in ("reconnect_interval", "probe_timeout"):
            if name in d:
                v = d[name]
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                    raise ValueError(
                        f"{TYPE_NAME}: {name} must be a positive number of seconds, got {v!r}; "
                        f"e.g. {{\"{name}\": 1.0}}."
                    )
                own[name] = float(v)
        base = RESPL2AdapterConfig.from_dict({k: v for k, v in d.items() if k not in own})
        return cls(base.host, base.port, base.num_workers, base.username, base.password, base.max_capacity_gb, **own)

    @classmethod
    def help(cls) -> str:
        return (
            RESPL2AdapterConfig.help().replace("RESP L2 adapter", "RESP L2 adapter with reconnect (resp_reconnect)", 1)
            + "\n- reconnect_interval (float): least seconds between reconnect attempts after "
            "a connection error (default 1.0, >0)\n- probe_timeout (float): seconds an attempt "
            "waits for the server to answer (default 2.0, >0)"
        )


class ReconnectingRESPL2Adapter(NativeConnectorL2Adapter):
    """LMCache's native-connector adapter over a :class:`ReconnectingClient`; its
    status adds ``reconnects`` and ``connected``."""

    def report_status(self) -> dict[str, Any]:
        status = super().report_status()
        status.update(reconnects=self._client.reconnects, connected=self._client.connected)
        return status


def create_adapter(config: L2AdapterConfigBase, l1_memory_desc: Any = None) -> ReconnectingRESPL2Adapter:
    """LMCache's factory for ``resp_reconnect`` (the environment defaults as ``resp``'s)."""
    from lmcache.lmcache_redis import LMCacheRedisClient

    assert isinstance(config, ReconnectingRESPConfig)
    host = config.host or os.environ.get("LMCACHE_RESP_HOST", "")
    port = config.port or int(os.environ.get("LMCACHE_RESP_PORT", "0"))
    user = config.username or os.environ.get("LMCACHE_RESP_USERNAME", "")
    password = config.password or os.environ.get("LMCACHE_RESP_PASSWORD", "")
    client = ReconnectingClient(
        lambda: LMCacheRedisClient(host, port, config.num_workers, user, password), host, port,
        reconnect_interval=config.reconnect_interval, probe_timeout=config.probe_timeout,
        probe_batches=2 * config.num_workers,
    )
    logger.info("created %s L2 adapter: %s:%d (workers=%d, reconnect_interval=%gs)",
                TYPE_NAME, host, port, config.num_workers, config.reconnect_interval)
    return ReconnectingRESPL2Adapter(client, max_capacity_gb=config.max_capacity_gb, type_name=TYPE_NAME)


_registered = False


def register_adapter() -> None:
    """Registers the ``resp_reconnect`` L2 adapter type with LMCache (idempotent).

    Raises:
        ValueError: another adapter already holds the type name.
    """
    global _registered
    if _registered:
        return
    try:
        register_l2_adapter_type(TYPE_NAME, ReconnectingRESPConfig)
    except ValueError as e:
        raise ValueError(
            f"L2 adapter type {TYPE_NAME!r} is already registered by another adapter ({e}); tq_jax "
            f"cannot register its reconnecting RESP adapter under that name."
        ) from e
    register_l2_adapter_factory(TYPE_NAME, create_adapter)
    _registered = True
