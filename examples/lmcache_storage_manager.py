"""Exploration script: a real LMCache 0.5.6 StorageManager with a serde'd fs L2.

CPU only. Builds a StorageManager from ``lmcache.v1.distributed.config.parse_args``
with an ``fs`` L2 adapter whose ``serde`` is a custom registered type, writes a few
KV chunks into L1, waits for the L2 store, deletes the chunks from L1, overwrites
the freed L1 memory, prefetches the chunks back from L2 and compares.

Scenarios (``--scenario``, default ``all``):

* ``identity``   custom serde, exact estimate -> round trip is bit exact.
* ``fp8``        built-in ``fp8`` serde -> lossy round trip (max abs error shown).
* ``margin``     custom serde whose estimate exceeds the bytes written (n < estimate):
                 store succeeds, but the fs adapter refuses the short file on load.
* ``reference``  the PyPI reference plugin (``lmcache_turbo_quant_serde``, type
                 ``tqai``): its ``serialize(src, dst)`` lacks ``key`` -> TypeError,
                 swallowed by AsyncSerdeProcessor; nothing reaches L2.
* ``reference_keyfix``  the reference serializer/deserializer with a ``key`` shim:
                 serialize now works, but it returns n < estimate, so the fs adapter
                 again refuses the short file on load (same failure as ``margin``).
* ``fault``      ``fault_inject`` (``gap_indices: [1]``) wrapping ``fs``, ``serde`` on
                 the outer dict: key 1 fails to load, so the prefix prefetch gets 1/3.
* ``fault_inner_serde``  ``fault_inject`` with ``serde`` only on the ``inner`` dict:
                 parsed but never applied (files are raw size, round trip bit exact).

Run:  python examples/lmcache_storage_manager.py [--small] [--scenario NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import torch

os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
warnings.filterwarnings("ignore", category=FutureWarning)  # google-* deps of lmcache

from lmcache.v1.distributed.api import (  # noqa: E402 (after the env/warning setup)
    GroupedObjectKeys,
    MemoryLayoutDesc,
    ObjectKey,
    PrefetchTaskSpec,
)
from lmcache.v1.distributed.config import parse_args
from lmcache.v1.distributed.serde import (
    AsyncSerdeProcessor,
    Deserializer,
    Serializer,
    get_registered_serde_types,
    register_serde_factory,
)
from lmcache.v1.distributed.storage_manager import StorageManager
from lmcache.v1.mp_observability.event import EventType
from lmcache.v1.mp_observability.event_bus import EventBusConfig, init_event_bus

MODEL = "demo-model"
SCENARIOS = (
    "identity", "fp8", "margin", "reference", "reference_keyfix", "fault", "fault_inner_serde",
)


# ---------------------------------------------------------------------------
# Custom serdes (the only thing a third-party plugin has to provide)
# ---------------------------------------------------------------------------


def _nbytes(layout: MemoryLayoutDesc) -> int:
    total = 0
    for shape, dtype in zip(layout.shapes, layout.dtypes, strict=True):
        n = dtype.itemsize
        for d in shape:
            n *= int(d)
        total += n
    return total


class IdentitySerializer(Serializer):
    """Copies the raw KV bytes; ``margin`` bytes of slack in the estimate."""

    def __init__(self, margin: int = 0) -> None:
        self.margin = margin

    def serialize(self, src, dst, key) -> int:  # src/dst: MemoryObj
        raw = src.tensor.contiguous().view(torch.uint8).flatten()
        dst.tensor.flatten()[: raw.numel()].copy_(raw)
        return raw.numel()  # AsyncSerdeProcessor calls dst.set_used_size(n)

    def estimate_serialized_size(self, layout_desc: MemoryLayoutDesc) -> int:
        return _nbytes(layout_desc) + self.margin


class IdentityDeserializer(Deserializer):
    def deserialize(self, src, dst, key) -> None:
        out = dst.tensor
        n = out.numel() * out.element_size()
        raw = src.tensor.flatten()[:n]  # src is the estimate-sized uint8 temp
        out.view(torch.uint8).flatten().copy_(raw)


def register_demo_serdes() -> None:
    if "demo_identity" not in get_registered_serde_types():
        register_serde_factory(
            "demo_identity",
            lambda kw: AsyncSerdeProcessor(
                IdentitySerializer(int(kw.get("margin", 0))),
                IdentityDeserializer(),
                max_workers=int(kw.get("max_workers", 1)),
            ),
        )


def register_reference_with_key_shim() -> None:
    """The reference plugin's classes, adapted to the 0.5.6 ``key`` argument."""
    if "tqai_keyfix" in get_registered_serde_types():
        return
    from lmcache_turbo_quant_serde._v1_codec import TqaiDeserializer, TqaiSerializer

    class S(TqaiSerializer):
        def serialize(self, src, dst, key):  # type: ignore[override]
            return super().serialize(src, dst)

    class D(TqaiDeserializer):
        def deserialize(self, src, dst, key):  # type: ignore[override]
            return super().deserialize(src, dst)

    register_serde_factory(
        "tqai_keyfix",
        lambda kw: AsyncSerdeProcessor(
            S(head_dim=int(kw.get("head_dim", 128)), bits=int(kw.get("bits", 4))), D()
        ),
    )


# ---------------------------------------------------------------------------
# Event bus: the only place serde/L2 failures become visible to a caller
# ---------------------------------------------------------------------------


class Events:
    """Collects L2 store completions and prefetch failures from the event bus."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.store_ok = 0
        self.store_failed = 0
        self.prefetch_failed: list[dict] = []
        bus = init_event_bus(EventBusConfig(enabled=True))  # before StorageManager()
        bus.subscribe(EventType.L2_STORE_COMPLETED, self._on_store)
        bus.subscribe(EventType.L2_PREFETCH_FAILED, self._on_prefetch_failed)
        bus.start()
        self.bus = bus

    def _on_store(self, ev) -> None:
        with self.lock:
            self.store_ok += int(ev.metadata["succeeded_count"])
            self.store_failed += int(ev.metadata["failed_count"])

    def _on_prefetch_failed(self, ev) -> None:
        with self.lock:
            self.prefetch_failed.append(
                {"reason": ev.metadata.get("reason"), "n": len(ev.metadata["keys"])}
            )

    def wait_stores(self, n: int, timeout: float = 60.0) -> tuple[int, int]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if self.store_ok + self.store_failed >= n:
                    return self.store_ok, self.store_failed
            time.sleep(0.01)
        raise TimeoutError(f"only {self.store_ok + self.store_failed}/{n} stores done")


# ---------------------------------------------------------------------------
# The round trip
# ---------------------------------------------------------------------------


def make_keys(n: int, tag: str) -> list[ObjectKey]:
    return [
        ObjectKey(chunk_hash=f"{tag}-{i}".encode().ljust(32, b"\0"), model_name=MODEL, kv_rank=0)
        for i in range(n)
    ]


def build_manager(adapter: dict, l1_gb: float) -> StorageManager:
    cfg = parse_args(
        [
            "--l1-size-gb", str(l1_gb),
            "--no-l1-use-lazy",
            "--eviction-policy", "LRU",
            "--l2-adapter", json.dumps(adapter),
        ]
    )
    return StorageManager(cfg)  # serde factory is looked up HERE, not in parse_args


def roundtrip(
    name: str, adapter: dict, shape: tuple[int, ...], n_chunks: int, l1_gb: float
) -> dict:
    events = Events()
    sm = build_manager(adapter, l1_gb)
    layout = MemoryLayoutDesc(shapes=[torch.Size(shape)], dtypes=[torch.bfloat16])
    keys = make_keys(n_chunks, name)
    g = torch.Generator().manual_seed(0)
    originals = [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in keys]
    try:
        # 1. write into L1: reserve_write -> fill obj.tensor -> finish_write.
        objs = sm.reserve_write(keys, layout)
        assert len(objs) == len(keys), "L1 reserve failed"
        for k, x in zip(keys, originals):
            objs[k].tensor.copy_(x)  # obj.tensor is a bf16 view of shape `shape`
        ptrs = {objs[k].tensor.data_ptr() for k in keys}
        sm.finish_write(keys)  # StoreController now pushes every key to every L2

        # 2. wait for the L2 store (serialize -> fs write) through the event bus.
        ok, failed = events.wait_stores(len(keys))
        l2_files = sorted(Path(_fs_dir(adapter)).glob("*.data"))
        sizes = sorted({p.stat().st_size for p in l2_files})

        # 3. drop from L1 and scribble over the freed memory with other keys.
        deleted, skipped = sm.delete_l1_keys(keys)
        junk = make_keys(n_chunks, name + "-junk")
        jobjs = sm.reserve_write(junk, layout)
        for o in jobjs.values():
            o.tensor.fill_(-7.0)
        reused = len(ptrs & {o.tensor.data_ptr() for o in jobjs.values()})
        sm.finish_write(list(jobjs))
        events.wait_stores(2 * len(keys))  # junk is stored to L2 as well

        # 4. prefetch back from L2 (lookup+lock -> load -> deserialize into L1).
        spec = PrefetchTaskSpec(
            key_groups=[GroupedObjectKeys(keys=keys, object_group_id=0, layout_desc=layout)]
        )
        handle = sm.submit_prefetch_task(spec, external_request_id=name)
        assert sm.wait_prefetch_status(handle, timeout=60.0), "prefetch timed out"
        res = sm.query_prefetch_status(handle)
        hits = res.hit_cells[0].popcount() if res is not None else 0
        l2_hits = res.l2_hit_count if res is not None else 0

        # 5. read and compare the prefetched objects (read locks held by prefetch).
        max_err = None
        exact = None
        if hits == len(keys):
            with sm.read_prefetched_results(keys) as got:
                assert got is not None
                errs = [
                    (o.tensor.float() - x.float()).abs().max().item()
                    for o, x in zip(got, originals)
                ]
                max_err = max(errs)
                exact = all(torch.equal(o.tensor, x) for o, x in zip(got, originals))
            sm.finish_read_prefetched(keys)
        else:
            # release the locks of whatever did come back
            hit_keys = [keys[i] for i in res.hit_cells[0].get_indices_list()] if res else []
            if hit_keys:
                sm.finish_read_prefetched(hit_keys)
        time.sleep(0.1)  # let the event bus drain
        return {
            "scenario": name,
            "l2_store_ok": ok,
            "l2_store_failed": failed,
            "l2_file_sizes": sizes,
            "l1_deleted": deleted,
            "l1_skipped": skipped,
            "freed_l1_blocks_overwritten": reused,
            "prefetch_hits": f"{hits}/{len(keys)} (from L2: {l2_hits})",
            "prefetch_failed_events": events.prefetch_failed,
            "bit_exact": exact,
            "max_abs_err": max_err,
        }
    finally:
        sm.close()
        events.bus.stop()


def _fs_dir(adapter: dict) -> str:
    if adapter["type"] == "fault_inject":
        return adapter["inner"]["base_path"]
    return adapter["base_path"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--small", action="store_true", help="[2, 4, 256, 256] chunks")
    p.add_argument("--chunks", type=int, default=3)
    p.add_argument(
        "--scenario",
        default="all",
        choices=("all", *SCENARIOS),
    )
    a = p.parse_args()
    shape = (2, 4, 256, 256) if a.small else (2, 32, 256, 1024)  # [2, L, T, H*D]
    l1_gb = 0.25 if a.small else 1.0
    register_demo_serdes()
    chosen = SCENARIOS if a.scenario == "all" else (a.scenario,)
    results = []
    for name in chosen:
        with tempfile.TemporaryDirectory(prefix=f"lmc-{name}-") as d:
            fs = {"type": "fs", "base_path": d}
            if name == "identity":
                adapter = {**fs, "serde": {"type": "demo_identity"}}
            elif name == "fp8":
                adapter = {**fs, "serde": {"type": "fp8"}}
            elif name == "margin":
                adapter = {**fs, "serde": {"type": "demo_identity", "margin": 4096}}
            elif name == "reference":
                import lmcache_turbo_quant_serde

                lmcache_turbo_quant_serde.register()  # registers type "tqai"
                adapter = {**fs, "serde": {"type": "tqai", "head_dim": 128, "bits": 4}}
            elif name == "reference_keyfix":
                register_reference_with_key_shim()
                adapter = {**fs, "serde": {"type": "tqai_keyfix", "head_dim": 128, "bits": 4}}
            elif name == "fault":  # the outer serde wraps FaultInject(fs)
                adapter = {
                    "type": "fault_inject",
                    "gap_indices": [1],
                    "inner": fs,
                    "serde": {"type": "demo_identity"},
                }
            else:  # fault_inner_serde: serde on the inner dict is parsed, never applied
                adapter = {"type": "fault_inject", "inner": {**fs, "serde": {"type": "fp8"}}}
            t0 = time.perf_counter()
            r = roundtrip(name, adapter, shape, a.chunks, l1_gb)
            r["seconds"] = round(time.perf_counter() - t0, 2)
            results.append(r)
            print(json.dumps(r), flush=True)
    raw = 1
    for s in shape:
        raw *= s
    print(f"chunk shape {list(shape)} bf16 = {raw * 2} bytes raw", file=sys.stderr)


if __name__ == "__main__":
    main()
