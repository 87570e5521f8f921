"""Concurrency: the serde under LMCache's AsyncSerdeProcessor, and dumps/loads from threads.

The codec's shared mutable state is its caches: bounded ``tq_jax._src._lru.LRU`` tables
(codebooks, rotations), ``codec._device_cache`` (device copies of the tables, a
bounded tq_jax._src._lru.LRU) and JAX's compiled-program caches. Each test runs its concurrent
part *first*, with a head_dim and seed no other test uses, so that the caches are
filled by racing threads; the serial run afterwards is the reference, and every byte
and every decoded value must agree.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import jax.numpy as jnp
import numpy as np
import pytest

import tq_jax
from tq_jax._src import codec

from conftest import LMCACHE_WARNINGS  # noqa: E402

pytestmark = LMCACHE_WARNINGS

# (head_dim, heads, layers): unique head_dims so the caches start cold for these tests.
SERDE_HEAD_DIM, SERDE_HEADS, SERDE_LAYERS = 24, 2, 2
SERDE_SEED = 90210


def _tensor(shape, dtype, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32).astype(dtype)


# ----------------------------------------------------------------------------- LMCache


@pytest.fixture(scope="module")
def lmc():
    torch = pytest.importorskip("torch")
    pytest.importorskip("lmcache")
    from lmcache.v1.distributed.serde import SerdeConfig, create_serde_processor

    from tq_jax.bridge._src import dlpack
    from tq_jax.bridge import register

    from bridge_util import byte_obj, key, layout, make_obj, wait

    register()
    return torch, SerdeConfig, create_serde_processor, dlpack, byte_obj, key, layout, make_obj, wait


@pytest.mark.slow
def test_async_serde_processor_mixed_tasks_bit_identical_to_serial(lmc):
    torch, SerdeConfig, create_serde_processor, dlpack, byte_obj, key, layout, make_obj, wait = lmc
    dtypes = [torch.bfloat16, torch.float32]
    rng = np.random.default_rng(0)
    # v1 by name: its values are not bound to a key, so the blobs written under "pre" keys load under others
    cfg = {"max_workers": 4, "head_dim": SERDE_HEAD_DIM, "bits": 3, "seed": SERDE_SEED, "format": "v1"}
    proc = create_serde_processor(SerdeConfig("tq_jax", cfg))
    serial = create_serde_processor(SerdeConfig("tq_jax", dict(cfg, max_workers=1)))
    hidden = SERDE_HEADS * SERDE_HEAD_DIM

    def kv(i):
        t = int(rng.integers(1, 65))  # a chunk of 1..64 tokens
        dt = dtypes[int(rng.integers(len(dtypes)))]
        obj = make_obj([(2, SERDE_LAYERS, t, hidden)], [dt])
        obj.tensor.copy_(torch.from_numpy(_tensor((2, SERDE_LAYERS, t, hidden), np.float32, 1000 + i)).to(dt))
        return obj

    def size(obj):
        return proc.estimate_serialized_size(layout(obj.get_shapes(), obj.get_dtypes()))

    # Blobs for the deserialize tasks, written by a separate batch of objects.
    pre = [kv(i) for i in range(80)]
    pre_dst = [byte_obj(size(o)) for o in pre]
    t = proc.submit_serialize(pre, pre_dst, [key(i, "pre") for i in range(len(pre))])
    assert wait(proc.query_serialize_result, t) is True

    # Tasks of 1-3 objects, serialize and deserialize interleaved, all in flight.
    srcs = [kv(200 + i) for i in range(100)]
    ser_dst = [byte_obj(size(o)) for o in srcs]
    de_out = [make_obj(o.get_shapes(), o.get_dtypes()) for o in pre]
    for o in de_out:
        o.tensor.fill_(-7)
    tasks, i_s, i_d = [], 0, 0
    while i_s < len(srcs) or i_d < len(pre):
        n = int(rng.integers(1, 4))
        if i_s < len(srcs) and (i_d >= len(pre) or rng.random() < 0.5):
            sl = slice(i_s, min(i_s + n, len(srcs)))
            tasks.append(("ser", proc.submit_serialize(srcs[sl], ser_dst[sl], [key(j, "s") for j in range(sl.start, sl.stop)])))
            i_s = sl.stop
        else:
            sl = slice(i_d, min(i_d + n, len(pre)))
            tasks.append(("de", proc.submit_deserialize(pre_dst[sl], de_out[sl], [key(j, "d") for j in range(sl.start, sl.stop)])))
            i_d = sl.stop
    assert len(tasks) >= 60
    for kind, tid in tasks:
        q = proc.query_serialize_result if kind == "ser" else proc.query_deserialize_result
        assert wait(q, tid) is True, (kind, tid)
    # ... and once more as one task per object (4 workers, 180 single-object tasks).
    ser_dst2 = [byte_obj(size(o)) for o in srcs]
    de_out2 = [make_obj(o.get_shapes(), o.get_dtypes()) for o in pre]
    singles = [("ser", proc.submit_serialize([s], [d], [key(j, "s2")])) for j, (s, d) in enumerate(zip(srcs, ser_dst2))]
    singles += [("de", proc.submit_deserialize([b], [o], [key(j, "d2")])) for j, (b, o) in enumerate(zip(pre_dst, de_out2))]
    for kind, tid in singles:
        q = proc.query_serialize_result if kind == "ser" else proc.query_deserialize_result
        assert wait(q, tid) is True, (kind, tid)
    assert len(tasks) + len(singles) >= 200

    # Serial reference: one worker, one object at a time, after the caches are warm.
    for j, (s, d_par, d_par2) in enumerate(zip(srcs, ser_dst, ser_dst2)):
        ref = byte_obj(size(s))
        tid = serial.submit_serialize([s], [ref], [key(j, "r")])
        assert wait(serial.query_serialize_result, tid) is True
        n = size(s)
        want = bytes(ref.tensor.numpy()[:n])
        assert bytes(d_par.tensor.numpy()[:n]) == want, j
        assert bytes(d_par2.tensor.numpy()[:n]) == want, j
        # The bytes are the core's offline encode of the per-head shape.
        if j % 50 == 0:
            x = dlpack.numpy_view(s.tensor).reshape(*s.get_shapes()[0][:-1], SERDE_HEADS, SERDE_HEAD_DIM)
            assert tq_jax.dumps(x, bits=3, seed=SERDE_SEED, norm_dtype="float16") == want
    for j, (b, got, got2) in enumerate(zip(pre_dst, de_out, de_out2)):
        ref = make_obj(got.get_shapes(), got.get_dtypes())
        tid = serial.submit_deserialize([b], [ref], [key(j, "rd")])
        assert wait(serial.query_deserialize_result, tid) is True
        assert torch.equal(ref.tensor.view(torch.uint8), got.tensor.view(torch.uint8)), j
        assert torch.equal(ref.tensor.view(torch.uint8), got2.tensor.view(torch.uint8)), j
    proc.close()
    serial.close()
    assert len(codec._device_cache) <= codec._DEVICE_CACHE_SIZE


# ----------------------------------------------------------------------------- threads


# (shape, dtype, options): v1 and v2, haar and hadamard, every bit width, fresh seeds.
THREAD_CASES = [
    ((3, 5, 40), jnp.bfloat16, dict(bits=4, seed=7001)),
    ((2, 3, 7, 40), jnp.float16, dict(key_bits=4, value_bits=2, skip_first_layers=1, seed=7002)),
    ((9, 40), jnp.float32, dict(bits=1, rotation="hadamard", checksum=True, seed=7003)),
    ((2, 2, 11, 40), jnp.bfloat16, dict(key_bits=8, value_bits=5, rotation="hadamard", norm_correction=True,
                                        norm_dtype="float32", seed=7004)),
    ((4, 40), jnp.float32, dict(bits=6, seed=7005)),
    ((1, 3, 4, 40), jnp.float32, dict(bits=7, skip_last_layers=2, checksum=True, seed=7006)),
    ((5, 40), jnp.float16, dict(bits=3, seed=7001)),  # same seed/dim as case 0, other bits
    ((6, 2, 40), jnp.float32, dict(bits=2, seed=7003, rotation="hadamard")),
]


def _round_trip(i: int):
    shape, dtype, opts = THREAD_CASES[i % len(THREAD_CASES)]
    x = _tensor(shape, dtype, i % len(THREAD_CASES))
    blob = tq_jax.dumps(x, **opts)
    y = np.asarray(tq_jax.loads(blob))
    z = np.empty(shape, np.float32)
    tq_jax.load_into(blob, z)
    return blob, y, z


@pytest.mark.slow
def test_threads_call_dumps_and_loads_concurrently():
    n = 4 * len(THREAD_CASES)
    barrier = threading.Barrier(8)

    def work(i):
        if i < 8:
            barrier.wait()  # the first eight start together, on cold caches
        return _round_trip(i)

    with ThreadPoolExecutor(8) as pool:
        concurrent = list(pool.map(work, range(n)))
    for i, (blob, y, z) in enumerate(concurrent):
        ref_blob, ref_y, ref_z = _round_trip(i)
        assert blob == ref_blob, i
        np.testing.assert_array_equal(y.view(np.uint8), ref_y.view(np.uint8))
        np.testing.assert_array_equal(z, ref_z)
        # The same case from different threads gave the same bytes.
        assert blob == concurrent[i % len(THREAD_CASES)][0]


def test_device_table_cache_under_contention():
    """Many threads ask for the same new tables at once: one entry, identical arrays."""
    cfg = codec.CodecConfig(dim=56, bits=5, seed=31337)
    barrier = threading.Barrier(8)

    def get(_):
        barrier.wait()
        return codec.device_tables(cfg)

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(get, range(8)))
    assert all(g is got[0] for g in got)  # every thread holds the cached entry
    key = (56, 5, 31337, "haar", False, None)  # dim, bits, seed, rotation, trellis, device
    assert codec._device_cache.get(key) is got[0]
    # Evicting under contention: many distinct keys from many threads, bounded result.
    cfgs = [codec.CodecConfig(dim=56, bits=2, seed=s) for s in range(codec._DEVICE_CACHE_SIZE + 40)]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(codec.device_tables, cfgs))
    assert len(codec._device_cache) <= codec._DEVICE_CACHE_SIZE
