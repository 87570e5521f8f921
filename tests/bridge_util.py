"""Helpers for the LMCache bridge tests: real MemoryObjs, keys, event-bus counters."""

from __future__ import annotations

import time

import torch
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.memory_management import MemoryObjMetadata, TensorMemoryObj

from tq_jax.bridge.smoke import StoreEvents, build_manager, mean_cosine, round_trip  # noqa: F401

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


# One implementation for the tests and the operator's smoke test (tq_jax.bridge.smoke).
Events = StoreEvents


def store_evict_prefetch(sm, events: Events, keys, data, shape, dtype=torch.bfloat16):
    """Writes `data` to L1, waits for the L2 store, deletes from L1, scribbles over the
    freed memory, prefetches from L2 and returns (stores ok, stores failed, prefetch hits,
    L2 hits, [decoded tensors as CPU copies])."""
    return tuple(round_trip(sm, events, keys, data, torch.Size(shape), dtype))[:5]
