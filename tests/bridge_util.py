"""Helpers for the LMCache bridge tests: real MemoryObjs, keys, event-bus counters."""

from __future__ import annotations

import json
import threading
import time

import torch
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.memory_management import MemoryObjMetadata, TensorMemoryObj

ALIGN = 4096  # LMCache's default --l1-align-bytes


def make_obj(shapes, dtypes, *, align: int = ALIGN) -> TensorMemoryObj:
    """A real TensorMemoryObj over fresh `align`-aligned memory (no allocator)."""
    shapes = [torch.Size(s) for s in shapes]
    dtypes = list(dtypes)
    n = sum(s.numel() * d.itemsize for s, d in zip(shapes, dtypes))
    raw = torch.empty(n + align, dtype=torch.uint8)
    off = -raw.data_ptr() % align
    meta = MemoryObjMetadata(shapes[0], dtypes[0], 0, n, 1, shapes=shapes, dtypes=dtypes)
    return TensorMemoryObj(raw[off : off + n], meta, None)


def byte_obj(nbytes: int) -> TensorMemoryObj:
    return make_obj([(nbytes,)], [torch.uint8])


def layout(shapes, dtypes) -> MemoryLayoutDesc:
    return MemoryLayoutDesc(shapes=[torch.Size(s) for s in shapes], dtypes=list(dtypes))


def key(i: int, tag: str = "t") -> ObjectKey:
    return ObjectKey(chunk_hash=f"{tag}-{i}".encode().ljust(32, b"\0"), model_name="m", kv_rank=0)


def wait(query, task_id, timeout: float = 120.0):
    """Polls an AsyncSerdeProcessor query_* until the task reports True/False."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = query(task_id)
        if r is not None:
            return r
        time.sleep(0.002)
    raise TimeoutError(f"serde task {task_id} did not finish in {timeout}s")


def mean_cosine(a: torch.Tensor, b: torch.Tensor, dim: int) -> float:
    """Mean per-vector cosine similarity over vectors of length `dim`."""
    a = a.float().reshape(-1, dim)
    b = b.float().reshape(-1, dim)
    cos = (a * b).sum(1) / (a.norm(dim=1) * b.norm(dim=1)).clamp_min(1e-30)
    return float(cos.mean())


class Events:
    """Counts L2 store completions/failures and prefetch failures from LMCache's event bus.

    Must be created before the StorageManager (which caches the bus).
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

    def wait_stores(self, n: int, timeout: float = 120.0) -> tuple[int, int]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if self.store_ok + self.store_failed >= n:
                    return self.store_ok, self.store_failed
            time.sleep(0.01)
        raise TimeoutError(f"only {self.store_ok + self.store_failed}/{n} L2 stores completed")

    def stop(self) -> None:
        from lmcache.v1.mp_observability.event_bus import EventBusConfig, init_event_bus

        self.bus.stop()
        init_event_bus(EventBusConfig(enabled=False))


def build_manager(adapter: dict, l1_gb: float):
    """A StorageManager from LMCache's own config parser, one L2 adapter."""
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


def store_evict_prefetch(sm, events: Events, keys, data, shape, dtype=torch.bfloat16):
    """Writes `data` to L1, waits for the L2 store, deletes from L1, scribbles over the
    freed memory, prefetches from L2 and returns (stores ok, stores failed, prefetch hits,
    L2 hits, [decoded tensors as CPU copies])."""
    from lmcache.v1.distributed.api import GroupedObjectKeys, PrefetchTaskSpec

    lay = layout([shape], [dtype])
    objs = sm.reserve_write(keys, lay)
    assert len(objs) == len(keys), "L1 reserve failed"
    for k, x in zip(keys, data):
        objs[k].tensor.copy_(x)
    views = [objs[k].tensor for k in keys]  # keep views of the L1 memory
    sm.finish_write(keys)
    ok, failed = events.wait_stores(len(keys))

    deleted, deadline = 0, time.monotonic() + 30
    while True:  # the store task releases its L1 read locks just after reporting
        d, skipped = sm.delete_l1_keys(keys)  # missing keys are a no-op
        deleted += d
        if not skipped or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert deleted == len(keys), f"deleted {deleted}/{len(keys)} from L1"
    for v in views:
        v.fill_(-7.0)  # overwrite the freed L1 memory in place
    del views

    spec = PrefetchTaskSpec(key_groups=[GroupedObjectKeys(keys=keys, object_group_id=0, layout_desc=lay)])
    handle = sm.submit_prefetch_task(spec)
    assert sm.wait_prefetch_status(handle, timeout=120.0), "prefetch timed out"
    res = sm.query_prefetch_status(handle)
    hits = res.hit_cells[0].popcount() if res is not None else 0
    l2_hits = res.l2_hit_count if res is not None else 0
    got = []
    if hits == len(keys):
        with sm.read_prefetched_results(keys) as objs_back:
            assert objs_back is not None
            got = [o.tensor.clone() for o in objs_back]
        sm.finish_read_prefetched(keys)
    return ok, failed, hits, l2_hits, got
