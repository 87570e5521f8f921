"""One-command check that an L2 adapter config stores and loads KV through its serde.

Give it the same JSON as the server's ``--l2-adapter``::

    python -m tq_jax.bridge.smoke --l2-adapter '{"type": "fs", "base_path": "./tq-jax-kv",
        "serde": {"type": "tq_jax", "head_dim": 128}}'

It registers the tq_jax serde (as :mod:`tq_jax.bridge.launch` does), builds a real LMCache
``StorageManager`` from that JSON with LMCache's own config parser, writes one synthetic
KV chunk ``[2, layers, tokens, kv_heads * head_dim]`` (N(0, 1), seeded) into L1, waits
until the L2 store reports, deletes the chunk from L1 and overwrites the freed memory,
prefetches it back from L2 and compares. It prints the bytes stored per chunk, their
ratio to bf16, the mean per-vector cosine similarity and the times, then deletes the
chunk from L2 again (its key has model name ``tq_jax-smoke``, cache salt
``tq_jax-smoke`` and a random hash, so it cannot collide with real entries).

LMCache does not raise serde or adapter errors to the caller: ``AsyncSerdeProcessor``
logs them and reports a failed task. So every step is checked explicitly: the store
event's failed count, the prefetch hit count, the tensor's shape and dtype, and the
cosine against a floor for the configured bit width. Exit status: 0 all checks
passed, 1 a check failed (the reason is printed; LMCache's log above it has details),
2 the command line or the JSON is wrong, or the ``lmcache`` extra is not installed.

The stored size is what the adapter reports for the smoke key's cache salt (``fs``,
``mock`` and most adapters track it); an adapter that does not is reported with the
serde's size estimate instead (exact for tq_jax), and says so.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any, NamedTuple

from tq_jax.bridge._src import logs
from tq_jax.bridge._src.extra import missing_extra

__all__ = ["main"]

MODEL_NAME = "tq_jax-smoke"
CACHE_SALT = "tq_jax-smoke"
# Mean per-vector cosine floors by the smallest bit width: ~0.01 (less at high widths)
# below what N(0, 1) chunks measure (1..8 bits: 0.799, 0.941, 0.983, 0.9954, 0.9988,
# 0.99956, 0.99986, 0.99996). Any other serde (or none) must reach DEFAULT_FLOOR.
COSINE_FLOOR = {1: 0.78, 2: 0.93, 3: 0.975, 4: 0.99, 5: 0.995, 6: 0.998, 7: 0.999, 8: 0.9995}
DEFAULT_FLOOR = 0.9
DTYPES = ("bfloat16", "float16", "float32")


class SmokeError(RuntimeError):
    """A step of the round trip failed; the message says which and what to check."""


class StoreEvents:
    """Counts L2 store completions/failures and prefetch failures on LMCache's event bus.

    Must be created before the ``StorageManager`` (which caches the bus). ``stop()``
    turns the bus off again.
    """

    def __init__(self) -> None:
        from lmcache.v1.mp_observability.event import EventType
        from lmcache.v1.mp_observability.event_bus import EventBusConfig, init_event_bus

        self.lock = threading.Lock()
        self.store_ok = 0
        self.store_failed = 0
        self.prefetch_failed: list[dict] = []
        self.bus = init_event_bus(EventBusConfig(enabled=True))
        self.bus.subscribe(EventType.L2_STORE_COMPLETED, self._on_store)
        self.bus.subscribe(EventType.L2_PREFETCH_FAILED, self._on_prefetch_failed)
        self.bus.start()

    def _on_store(self, ev) -> None:
        with self.lock:
            self.store_ok += int(ev.metadata["succeeded_count"])
            self.store_failed += int(ev.metadata["failed_count"])

    def _on_prefetch_failed(self, ev) -> None:
        with self.lock:
            self.prefetch_failed.append(dict(ev.metadata))

    def counts(self) -> tuple[int, int]:
        """(succeeded, failed) L2 stores so far: a baseline for :meth:`wait_stores`."""
        with self.lock:
            return self.store_ok, self.store_failed

    def wait_stores(self, n: int, timeout: float = 120.0, since: tuple[int, int] = (0, 0)) -> tuple[int, int]:
        """Waits until ``n`` L2 stores have reported after ``since`` (a :meth:`counts`
        snapshot; default: since the bus started); returns (succeeded, failed) among them.

        Raises:
            TimeoutError: fewer than ``n`` reported within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ok, failed = self.counts()
            ok, failed = ok - since[0], failed - since[1]
            if ok + failed >= n:
                return ok, failed
            time.sleep(0.01)
        raise TimeoutError(
            f"only {ok + failed}/{n} L2 stores reported within {timeout:g} s: LMCache "
            f"could not submit the store (see its log above), or the adapter is slow or hung (is its "
            f"backend reachable?); raise --timeout to wait longer."
        )

    def stop(self) -> None:
        from lmcache.v1.mp_observability.event_bus import EventBusConfig, init_event_bus

        self.bus.stop()
        init_event_bus(EventBusConfig(enabled=False))


def build_manager(adapter: dict, l1_gb: float):
    """A ``StorageManager`` from LMCache's own config parser with one L2 adapter.

    L1 is allocated eagerly (``--no-l1-use-lazy``) with LRU eviction, as a server would.
    """
    from lmcache.v1.distributed.config import parse_args
    from lmcache.v1.distributed.storage_manager import StorageManager

    cfg = parse_args(
        [
            "--l1-size-gb", str(l1_gb),
            "--no-l1-use-lazy",
            "--eviction-policy", "LRU",
            "--l2-adapter", json.dumps(adapter),
        ]
    )  # fmt: skip
    return StorageManager(cfg)


class RoundTrip(NamedTuple):
    """What :func:`round_trip` saw; the first five fields unpack like the test helper's."""

    stores_ok: int
    stores_failed: int
    hits: int  # chunks the prefetch found (L1 or L2)
    l2_hits: int  # of those, chunks loaded from L2
    tensors: list  # decoded chunks, CPU copies (empty unless every chunk was found)
    store_s: float  # finish_write -> every L2 store reported
    load_s: float  # prefetch submitted -> prefetch done


def round_trip(sm, events: StoreEvents, keys, data, shape, dtype, *, timeout: float = 120.0) -> RoundTrip:
    """Writes ``data`` to L1, waits for the L2 stores, deletes the chunks from L1,
    overwrites the freed memory (so nothing can come back from L1), prefetches the
    chunks from L2 and returns what came back.

    Raises:
        SmokeError: L1 could not hold the chunks, or they could not be evicted.
        TimeoutError: a store or the prefetch did not finish within ``timeout``.
    """
    from lmcache.v1.distributed.api import GroupedObjectKeys, MemoryLayoutDesc, PrefetchTaskSpec

    lay = MemoryLayoutDesc(shapes=[shape], dtypes=[dtype])
    objs = sm.reserve_write(keys, lay)
    if len(objs) != len(keys):
        raise SmokeError(
            f"L1 could not reserve {len(keys)} chunk(s) of {list(shape)} {dtype}: raise --l1-size-gb "
            f"(L1 holds the chunk and the serde's temporary buffers)."
        )
    for k, x in zip(keys, data):
        objs[k].tensor.copy_(x)
    views = [objs[k].tensor for k in keys]  # views of the L1 memory, scribbled over below
    t0 = time.perf_counter()
    since = events.counts()
    sm.finish_write(keys)
    ok, failed = events.wait_stores(len(keys), timeout, since)
    store_s = time.perf_counter() - t0

    deleted, deadline = 0, time.monotonic() + 30
    while True:  # the store task releases its L1 read locks just after reporting
        d, skipped = sm.delete_l1_keys(keys)  # missing keys are a no-op
        deleted += d
        if not skipped or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    if deleted != len(keys):
        raise SmokeError(f"deleted {deleted}/{len(keys)} chunk(s) from L1: they stayed locked for 30 s.")
    for v in views:
        v.fill_(-7.0)  # a chunk read back from freed L1 memory would now be all -7
    del views

    spec = PrefetchTaskSpec(key_groups=[GroupedObjectKeys(keys=keys, object_group_id=0, layout_desc=lay)])
    t0 = time.perf_counter()
    handle = sm.submit_prefetch_task(spec)
    if not sm.wait_prefetch_status(handle, timeout=timeout):
        raise TimeoutError(f"the prefetch from L2 did not finish within {timeout:g} s; raise --timeout.")
    load_s = time.perf_counter() - t0
    res = sm.query_prefetch_status(handle)
    hits = res.hit_cells[0].popcount() if res is not None else 0
    l2_hits = res.l2_hit_count if res is not None else 0
    got = []
    if hits == len(keys):
        with sm.read_prefetched_results(keys) as back:
            if back is not None:
                got = [o.tensor.clone() for o in back]
        sm.finish_read_prefetched(keys)
    return RoundTrip(ok, failed, hits, l2_hits, got, store_s, load_s)


def mean_cosine(a, b, dim: int) -> float:
    """Mean per-vector cosine similarity of two tensors over vectors of length ``dim``."""
    a = a.float().reshape(-1, dim)
    b = b.float().reshape(-1, dim)
    cos = (a * b).sum(1) / (a.norm(dim=1) * b.norm(dim=1)).clamp_min(1e-30)
    return float(cos.mean())


# ----------------------------------------------------------------------------- command line


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tq_jax.bridge.smoke",
        description=(
            "Store one synthetic KV chunk through the L2 adapter (and its serde) that --l2-adapter "
            "describes, load it back through a real LMCache StorageManager, and report the stored "
            "bytes, the ratio to bf16 and the cosine similarity. Exit 0 when every check passes."
        ),
    )
    p.add_argument("--l2-adapter", required=True, metavar="JSON",
                   help="the adapter JSON exactly as in the server's --l2-adapter (serde included)")
    p.add_argument("--layers", type=int, default=32, help="layers L of the chunk (default 32)")
    p.add_argument("--tokens", type=int, default=256, help="tokens per chunk (LMCache's chunk size; default 256)")
    p.add_argument("--kv-heads", type=int, default=8, help="KV heads (default 8)")
    p.add_argument("--head-dim", type=int, default=None,
                   help="head size (default: the serde's head_dim, else 128)")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="KV dtype (default bfloat16)")
    p.add_argument("--l1-size-gb", type=float, default=None,
                   help="L1 size for the check (default: 4 chunks, at least 0.05)")
    p.add_argument("--min-cosine", type=float, default=None,
                   help="fail below this mean cosine (default: by the serde's smallest bit width)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the store and the load")
    p.add_argument("-v", "--verbose", action="store_true", help="show LMCache's INFO lines and warnings")
    return p


def _adapter_spec(text: str) -> dict:
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"--l2-adapter is not valid JSON ({e}): pass the adapter dict exactly as in the server's "
            f"--l2-adapter, in single quotes for the shell."
        ) from None
    if not isinstance(spec, dict) or not isinstance(spec.get("type"), str):
        raise ValueError(
            f"--l2-adapter must be a JSON object with a string \"type\" (e.g. {{\"type\": \"fs\", "
            f"\"base_path\": \"./tq-jax-kv\", \"serde\": {{...}}}}), got {text!r}."
        )
    return spec


def _serde_of(spec: dict) -> tuple[str | None, dict]:
    serde = spec.get("serde")
    if serde is None:
        return None, {}
    if not isinstance(serde, dict) or not isinstance(serde.get("type"), str):
        raise ValueError(f"the adapter's \"serde\" must be an object with a string \"type\", got {serde!r}.")
    return serde["type"], {k: v for k, v in serde.items() if k != "type"}


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the smoke test; returns the exit status (0 ok, 1 a check failed, 2 bad input)."""
    args = _parser().parse_args(argv)
    try:
        spec = _adapter_spec(args.l2_adapter)
        serde_type, serde_kwargs = _serde_of(spec)
        for name in ("layers", "tokens", "kv_heads"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}.")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    logs.show_bridge_logs()
    with logs.quiet_lmcache(args.verbose, restore=False):  # a report, not a server log
        try:
            import torch  # noqa: F401  (the lmcache extra, checked before anything runs)

            from tq_jax.bridge._src import registry  # noqa: F401
        except ImportError as e:
            if (line := missing_extra(e)) is None:
                raise
            print(f"error: {line}", file=sys.stderr)
            return 2
        return _run(args, spec, serde_type, serde_kwargs)


def _run(args: argparse.Namespace, spec: dict, serde_type: str | None, serde_kwargs: dict) -> int:
    import torch

    from tq_jax.bridge._src import registry

    names = registry.register()
    ours = serde_type in names
    head_dim = args.head_dim
    floor = args.min_cosine
    if ours:
        try:
            opts = registry.parse_options(serde_kwargs)  # the errors the server would raise
        except (TypeError, ValueError) as e:
            print(f"error: the adapter's tq_jax serde options are invalid: {e}", file=sys.stderr)
            return 2
        head_dim = head_dim or opts.head_dim
        codec = opts.codec_options()
        bits = min(codec.get("key_bits") or opts.bits, codec.get("value_bits") or opts.bits)
        floor = COSINE_FLOOR[bits] if floor is None else floor
    head_dim = head_dim or 128
    floor = DEFAULT_FLOOR if floor is None else floor

    dtype = getattr(torch, args.dtype)
    shape = torch.Size((2, args.layers, args.tokens, args.kv_heads * head_dim))
    raw_bytes = shape.numel() * dtype.itemsize
    bf16_bytes = shape.numel() * 2
    l1_gb = args.l1_size_gb or max(0.05, math.ceil(4 * raw_bytes / 2**30 * 100) / 100)
    if serde_type is None:
        serde_name = "none: chunks are stored as raw bytes"
    else:
        serde_name = f"{serde_type!r}, " + ("the tq_jax serde" if ours else "not the tq_jax serde")
    print(f"adapter: {spec['type']}, serde: {serde_name}")
    print(f"chunk: {list(shape)} {args.dtype}, {raw_bytes:,} bytes; L1 {l1_gb:g} GB")

    from lmcache.v1.distributed.api import ObjectKey

    key = ObjectKey(chunk_hash=uuid.uuid4().bytes * 2, model_name=MODEL_NAME, kv_rank=0, cache_salt=CACHE_SALT)
    data = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    events = StoreEvents()
    sm = None
    try:
        try:
            sm = build_manager(spec, l1_gb)
        except Exception as e:  # noqa: BLE001 - any config error LMCache raises, reported as such
            raise SmokeError(
                f"LMCache could not build a StorageManager from --l2-adapter: {type(e).__name__}: {e}"
            ) from e
        try:  # LMCache would log this error at the store and never report the task
            estimate = _estimate(sm, shape, dtype)
        except Exception as e:  # noqa: BLE001 - whatever the serde raises
            raise SmokeError(f"the serde refuses a {list(shape)} {args.dtype} chunk: {type(e).__name__}: {e}") from e
        usage_before = sm.get_usage_bytes_by_cache_salt().get(CACHE_SALT, 0)
        rt = round_trip(sm, events, [key], [data], shape, dtype, timeout=args.timeout)
        stored = sm.get_usage_bytes_by_cache_salt().get(CACHE_SALT, 0) - usage_before
        how = "reported by the adapter"
        if stored <= 0:
            stored, how = estimate, "the serde's estimate; the adapter reports no usage"
        _check(rt, events, shape, dtype)
        cos = mean_cosine(data, rt.tensors[0], head_dim)
        if stored:
            print(f"stored: {stored:,} bytes per chunk ({how}): {100 * stored / bf16_bytes:.1f} % of bf16, "
                  f"{bf16_bytes / stored:.2f}x smaller")
        print(f"store {1e3 * rt.store_s:.0f} ms (the first includes compiling the codec), load "
              f"{1e3 * rt.load_s:.0f} ms; mean cosine {cos:.4f} (floor {floor:g})")
        if not cos >= floor:
            raise SmokeError(
                f"mean cosine {cos:.4f} is below {floor:g}: the chunk came back wrong. Check head_dim (the "
                f"model's head size) and that no other serde answers to {serde_type!r}."
            )
    except (SmokeError, TimeoutError) as e:
        print(f"FAILED: {e}")
        return 1
    finally:
        if sm is not None:
            for _desc, adapter in sm.l2_adapters():
                try:
                    adapter.delete([key])  # leave nothing behind in the real store
                except Exception:  # noqa: BLE001 - best effort
                    pass
            sm.close()
        events.stop()
    print("OK")
    return 0


def _estimate(sm, shape, dtype) -> int:
    from lmcache.v1.distributed.api import MemoryLayoutDesc

    for _desc, adapter in sm.l2_adapters():
        serde = getattr(adapter, "_serde", None)  # SerdeL2AdapterWrapper's processor
        if serde is not None:
            return int(serde.estimate_serialized_size(MemoryLayoutDesc(shapes=[shape], dtypes=[dtype])))
    return 0


def _check(rt: RoundTrip, events: StoreEvents, shape, dtype) -> None:
    if rt.stores_failed or not rt.stores_ok:
        raise SmokeError(
            "the L2 store failed (LMCache logged the serde's or adapter's error above; rerun with -v "
            "for its full log)."
        )
    if rt.hits != 1 or rt.l2_hits != 1 or not rt.tensors:
        raise SmokeError(
            f"the chunk was stored but did not load back from L2 (hits {rt.hits}, L2 hits {rt.l2_hits}, "
            f"prefetch failure reasons {[ev.get('reason') for ev in events.prefetch_failed]}): the adapter "
            f"or the deserializer refused it (see LMCache's log above)."
        )
    got: Any = rt.tensors[0]
    if tuple(got.shape) != tuple(shape) or got.dtype != dtype:
        raise SmokeError(f"the chunk came back as {list(got.shape)} {got.dtype}, expected {list(shape)} {dtype}.")
    if bool((got == -7).all()):
        raise SmokeError("the chunk came back as the overwritten L1 memory, not from L2.")


if __name__ == "__main__":
    sys.exit(main())
