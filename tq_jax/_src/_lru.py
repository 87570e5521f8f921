"""One bounded, thread-safe LRU cache for tq_jax's module-level tables.

Caches in tq_jax are keyed by plain hashable values (``(dim, seed)``, ``(dim, bits)``,
``(dim, bits, seed, rotation, device)``) that a decoder reads from an untrusted header,
so every one is bounded twice: by entry count *and* by the total ``nbytes`` of the
arrays it holds (a stream of blobs naming fresh seeds at ``MAX_DENSE_DIM`` would
otherwise pin 4 MiB per seed, forever). Values are filled only from concrete values:
a ``jax.core.Tracer`` anywhere in a value (or key) is refused with a ``TypeError``,
because a tracer kept in a module cache breaks the next trace and every later eager
call (``UnexpectedTracerError``).

Constructor::

    LRU(name, max_entries, max_bytes=None)

* ``name``: what the cache holds, for error messages and :meth:`LRU.stats`.
* ``max_entries``: most entries kept (>= 1); the least recently used go first.
* ``max_bytes``: most bytes kept (None: entry count only), counted by :func:`nbytes`
  (``.nbytes`` of every array reachable through tuples, lists and dict values:
  numpy arrays, ``jax.Array``\\ s, NamedTuples of them). A single value larger than
  ``max_bytes`` is returned but not stored.

Use::

    _TABLES = LRU("rotation tables", max_entries=64, max_bytes=64 << 20)
    value = _TABLES.get_or_create((dim, seed), lambda: build(dim, seed))
    @_TABLES.memoize  # or: results of a function, keyed by its arguments
    def build(dim, seed): ...
    _TABLES.stats()   # Stats(entries, nbytes, max_entries, max_bytes, hits, misses, evictions)
    _TABLES.clear()

``get_or_create`` builds outside the lock (two threads may build the same key at once;
the first stored wins and both callers get that one object, so ``is`` holds between
calls while the entry stays cached). This module imports neither jax nor torch: it
recognises tracers only when jax is already imported (no tracer can exist otherwise).
"""

from __future__ import annotations

import collections
import functools
import sys
import threading
from typing import Callable, Hashable, NamedTuple

__all__ = ["LRU", "Stats", "nbytes"]

_MISSING = object()


class Stats(NamedTuple):
    """A cache's counters at one moment (public, for tests and monitoring)."""

    name: str
    entries: int
    nbytes: int
    max_entries: int
    max_bytes: int | None
    hits: int
    misses: int
    evictions: int


def _is_tracer(x) -> bool:
    jax = sys.modules.get("jax")
    return jax is not None and isinstance(x, jax.core.Tracer)


def _leaves(value):
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, (tuple, list)):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
        else:
            yield v


def nbytes(value) -> int:
    """Bytes held by ``value``: the sum of ``.nbytes`` over its array leaves (tuples,
    lists and dict values are walked; scalars and other objects count 0)."""
    total = 0
    for leaf in _leaves(value):
        if isinstance(leaf, (str, bytes, int, float, complex, bool)) or leaf is None:
            continue
        n = getattr(leaf, "nbytes", None)
        if n is not None:
            try:
                total += int(n)
            except (TypeError, ValueError):
                pass
    return total


class LRU:
    """A bounded least-recently-used map (see the module docstring for the contract)."""

    def __init__(self, name: str, max_entries: int, max_bytes: int | None = None):
        if not isinstance(max_entries, int) or isinstance(max_entries, bool) or max_entries < 1:
            raise ValueError(f"LRU {name!r}: max_entries must be an int >= 1, got {max_entries!r}.")
        if max_bytes is not None and (not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 0):
            raise ValueError(f"LRU {name!r}: max_bytes must be None or an int >= 0, got {max_bytes!r}.")
        self.name = name
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._data: collections.OrderedDict = collections.OrderedDict()  # key -> (value, nbytes)
        self._nbytes = 0
        self._hits = self._misses = self._evictions = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key) -> bool:
        with self._lock:
            return key in self._data

    def get(self, key: Hashable, default=None):
        """The value stored under ``key`` (now the most recently used), or ``default``."""
        with self._lock:
            hit = self._data.get(key, _MISSING)
            if hit is _MISSING:
                self._misses += 1
                return default
            self._hits += 1
            self._data.move_to_end(key)
            return hit[0]

    def put(self, key: Hashable, value):
        """Store ``value`` under ``key`` unless a value is already there; return the
        stored value (the earlier one if any, else ``value``), evicting least recently
        used entries until both bounds hold.

        Raises:
            TypeError: ``key`` or ``value`` holds a ``jax.core.Tracer``, or ``key`` is
                unhashable.
        """
        if any(_is_tracer(leaf) for leaf in _leaves(value)) or any(_is_tracer(k) for k in _leaves(key)):
            raise TypeError(
                f"tq_jax internal error: refusing to cache a JAX tracer in the {self.name} cache "
                f"(key {key!r}). Caches are filled from concrete values only: build the entry "
                f"from numpy inputs, outside jit/vmap tracing or under jax.ensure_compile_time_eval."
            )
        size = nbytes(value)
        with self._lock:
            hit = self._data.get(key, _MISSING)
            if hit is not _MISSING:
                self._data.move_to_end(key)
                return hit[0]
            if self.max_bytes is not None and size > self.max_bytes:
                return value  # larger than the whole cache: returned, never stored
            self._data[key] = (value, size)
            self._nbytes += size
            while len(self._data) > self.max_entries or (
                self.max_bytes is not None and self._nbytes > self.max_bytes
            ):
                _, (_, old) = self._data.popitem(last=False)
                self._nbytes -= old
                self._evictions += 1
            return value

    def get_or_create(self, key: Hashable, factory: Callable[[], object]):
        """``get(key)``, or ``put(key, factory())`` on a miss (built outside the lock)."""
        hit = self.get(key, _MISSING)
        if hit is not _MISSING:
            return hit
        return self.put(key, factory())

    def memoize(self, fn: Callable) -> Callable:
        """``fn`` with its results kept here, keyed by its name and positional
        arguments (which must be hashable): one cache can serve several functions."""

        @functools.wraps(fn)
        def cached(*args):
            return self.get_or_create((fn.__name__, *args), lambda: fn(*args))

        return cached

    def clear(self) -> None:
        """Drop every entry (counters of hits/misses/evictions are kept)."""
        with self._lock:
            self._data.clear()
            self._nbytes = 0

    def stats(self) -> Stats:
        with self._lock:
            return Stats(
                self.name, len(self._data), self._nbytes, self.max_entries, self.max_bytes,
                self._hits, self._misses, self._evictions,
            )

    def keys(self) -> list:
        """The keys, least recently used first (a snapshot)."""
        with self._lock:
            return list(self._data)

    def __repr__(self) -> str:
        s = self.stats()
        return f"LRU({s.name!r}, entries={s.entries}/{s.max_entries}, nbytes={s.nbytes}/{s.max_bytes})"
