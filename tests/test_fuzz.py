"""Hostile input: the TQ01 parser, the decoder and the bridge deserializer under fuzzing.

Hypothesis drives a few thousand cases (deterministic: ``derandomize=True``):
random bytes, every truncation of valid v1 and v2 blobs, mutations of them (bit
flips, byte sets, insertions, deletions, extensions, edited section-length fields,
edited header fields, with the CRC32 recomputed or not) and structure-aware blobs
built valid with random payloads. Oracles:

* only ``tq_jax.WireError`` subclasses escape ``parse``, ``peek_header``, ``loads``;
* a blob that parses decodes to exactly its header's shape and dtype;
* the traced peak of a decode stays under ``3 × 32 × len(blob)`` (the largest
  float32 output a blob of that length can describe: 8 one-bit coordinates per
  byte) plus the codec tables the header may name within ``wire.MAX_DENSE_DIM``,
  plus 4 MiB — never what the header claims;
* the bridge's ``TQJaxDeserializer`` raises only ``WireError`` or its documented
  shape-mismatch ``ValueError``, and otherwise writes exactly ``tq_jax.loads``.

``benchmarks/fuzz_long.py`` runs the same kinds of cases at length (docs/hardening.md).
The regression tests at the end cover each bug the fuzzing found.
"""

from __future__ import annotations

import functools
import math
import struct
import tracemalloc
import zlib

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tq_jax
from tq_jax import codec, wire

FUZZ = settings(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
MIB = 1 << 20
I64_EDGES = [0, 1, 2, 7, 8, 255, 2**16, 2**31 - 1, 2**31, 2**32, 2**40, 2**62, 2**63 - 1, -1, -(2**31), -(2**63)]


def _x(shape, dtype="float32", seed=0, scale=1.0):
    a = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * scale
    return a.astype(jnp.dtype(dtype))


def _v1_header(shape, bits=2, dtype=b"float32", use_qjl=0, m=64, seed=0):
    return (struct.pack("<4sBBBHi", b"TQ01", 1, bits, use_qjl, m, seed)
            + struct.pack(f"<B{len(shape)}q", len(shape), *shape) + bytes([len(dtype)]) + dtype)


def _v1_blob(shape, bits=2, **kw):
    n_vec, n_el = math.prod(shape[:-1]), math.prod(shape)
    idx = (n_el * bits + 7) // 8
    return (_v1_header(shape, bits, **kw) + struct.pack("<q", idx) + b"\x55" * idx
            + struct.pack("<q", 2 * n_vec) + b"\x00\x3c" * n_vec)


def test_regression_blob_without_vectors_builds_no_tables():
    # Found by the fuzzer's memory oracle: a 54-byte blob of shape (0, 1024) built a
    # 1024x1024 Haar rotation (64 MiB traced; (0, 65536) would have asked ~270 GB).
    for blob in (_v1_blob((0, 1000), seed=99), _v1_header((0, 1000), use_qjl=1, m=64, seed=99)
                 + struct.pack("<q", 0) * 4):
        tracemalloc.start()
        try:
            y = tq_jax.loads(blob)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert y.shape == (0, 1000) and peak < MIB, peak


def test_regression_dense_rotation_is_limited():
    # Found with the memory oracle: a 16 KiB blob with head_dim 65536 asked the decoder
    # for a 65536x65536 Haar rotation. Readers and writers hold the dense factor to
    # MAX_DENSE_DIM (the Hadamard rotation's dense factor is head_dim's odd part).
    assert wire.MAX_DENSE_DIM == 1024
    for d in (1025, 2048, 1 << 16):
        with pytest.raises(wire.LimitError, match="MAX_DENSE_DIM"):
            wire.peek_header(_v1_header((1, d)))
        with pytest.raises(ValueError, match="MAX_DENSE_DIM"):
            tq_jax.serialized_size((1, d), "float32", 4)
    with pytest.raises(ValueError, match="MAX_DENSE_DIM"):
        tq_jax.dumps(np.ones((1, 1025 * 2), np.float32), bits=4, rotation="hadamard")
    assert tq_jax.serialized_size((1, 4096), "float32", 4, rotation="hadamard") > 0
    h = tq_jax.peek_header(tq_jax.dumps(np.ones((1, 4096), np.float32), bits=4, rotation="hadamard"))
    assert h.dim == 4096 and wire.dense_dim(4096, "hadamard") == 1


def test_regression_zero_length_axis_beside_a_huge_one_is_a_limit_error():
    # Found by benchmarks/fuzz_long.py: (0, 2**62, 8) holds no coordinate, passed the
    # element limit and escaped as numpy's "array is too big" ValueError.
    for shape in [(0, 1 << 62, 8), (1 << 62, 0, 8), (0, 2**63 - 1, 2**63 - 1, 8)]:
        with pytest.raises(wire.LimitError, match="MAX_ELEMENTS"):
            tq_jax.loads(_v1_blob(shape))
    y = tq_jax.loads(_v1_blob((0, 1 << 20, 8)))  # within the limit: an empty array
    assert y.shape == (0, 1 << 20, 8)


@pytest.fixture(scope="module")
def bridge():
    pytest.importorskip("torch")
    pytest.importorskip("lmcache")
    import torch

    from tq_jax.bridge import dlpack, serde

    from bridge_util import byte_obj, make_obj

    return torch, dlpack, serde, byte_obj, make_obj


def bridge_decode(bridge, data: bytes, shape, dtype):
    """Runs TQJaxDeserializer on ``data`` into a fresh KV object of ``shape``/``dtype``."""
    torch, dlpack, serde, byte_obj, make_obj = bridge
    src = byte_obj(max(1, len(data)))
    if data:
        src.tensor[: len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dst = make_obj([shape], [dtype])
    dst.tensor.fill_(-7)
    serde.TQJaxDeserializer().deserialize(src, dst, None)
    return dst.tensor


def test_regression_checksummed_blob_followed_by_other_bytes():
    # Found by the fuzzer's bridge check: peek_header verified a v2 CRC32 at the end of
    # the *buffer*, so a checksummed blob in a longer LMCache buffer (or blobs back to
    # back) was reported corrupt. The CRC sits at the header-implied end of the blob.
    x = _x((2, 3, 4, 16))
    blob = tq_jax.dumps(x, key_bits=4, value_bits=3, checksum=True)
    for tail in (b"", b"\0", b"junk" * 40, blob):
        assert wire.peek_header(blob + tail) == wire.parse(blob).header
    assert wire.peek_header(blob[:60]).shape == x.shape  # a header-only peek of the first bytes
    bad = bytearray(blob)
    bad[-10] ^= 1
    with pytest.raises(wire.ChecksumError):
        wire.peek_header(bytes(bad) + b"junk")
    with pytest.raises(wire.ChecksumError):
        wire.parse(bytes(bad))


def test_regression_bridge_reads_checksummed_blob_from_a_longer_buffer(bridge):
    torch, dlpack = bridge[:2]
    x = _x((2, 3, 4, 2, 16))
    blob = tq_jax.dumps(x, bits=4, checksum=True)
    out = bridge_decode(bridge, blob + b"\xff" * 100, (2, 3, 4, 32), torch.float32)
    np.testing.assert_array_equal(dlpack.numpy_view(out), np.asarray(tq_jax.loads(blob)).reshape(2, 3, 4, 32))


def test_regression_caches_keyed_by_header_fields_are_bounded():
    # Found by the long run's RSS samples: the device-table cache kept one entry per
    # (head_dim, bits, seed) a blob named, forever; a stream of blobs with fresh seeds
    # (or flipped seed bits, which v1 cannot detect) grew it without bound.
    x = _x((2, 8))
    for seed in range(codec._DEVICE_CACHE_SIZE + 20):
        tq_jax.loads(tq_jax.dumps(x, bits=2, seed=1000 + seed))
    assert len(codec._device_cache) <= codec._DEVICE_CACHE_SIZE
    from tq_jax import codebook

    assert codebook._lloyd_max.cache_info().maxsize is not None


def test_regression_qjl_seed_that_no_writer_can_produce_is_refused_by_the_parser():
    # Found by benchmarks/fuzz_long.py (first run): a v1 QJL blob whose seed + 999999 is
    # negative parsed, then loads() refused it (numpy cannot seed the QJL matrix). The
    # parser, the one place that validates, now refuses it; seed -999999 still decodes.
    for seed, ok in ((-1_000_000, False), (-(2**31), False), (-999_999, True)):
        blob = _v1_qjl_blob(seed)
        if ok:
            assert tq_jax.loads(blob).shape == (2, 16)
        else:
            for fn in (wire.peek_header, wire.parse, tq_jax.loads):
                with pytest.raises(wire.BadFieldError, match="QJL"):
                    fn(blob)


def _v1_qjl_blob(seed, shape=(2, 16), m=4):
    n_vec, n_el = math.prod(shape[:-1]), math.prod(shape)
    idx, nrm, sk, rn = (n_el * 2 + 7) // 8, 2 * n_vec, n_vec * m, 2 * n_vec
    return (_v1_header(shape, use_qjl=1, m=m, seed=seed)
            + b"".join(struct.pack("<q", n) + b"\x01" * n for n in (idx, nrm, sk, rn)))
