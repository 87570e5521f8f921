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

``tools/fuzz_long.py`` runs the same kinds of cases at length (docs/hardening.md).
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
from tq_jax._src import codec, wire

FUZZ = settings(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
MIB = 1 << 20
I64_EDGES = [0, 1, 2, 7, 8, 255, 2**16, 2**31 - 1, 2**31, 2**32, 2**40, 2**62, 2**63 - 1, -1, -(2**31), -(2**63)]


# ----------------------------------------------------------------------------- corpus


def _x(shape, dtype="float32", seed=0, scale=1.0):
    a = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * scale
    return a.astype(jnp.dtype(dtype))


def qjl_blob(shape=(2, 3, 16), m=8, seed=7):
    """A valid v1 blob with the QJL residual (read-only support: tq_jax never writes one)."""
    rng = np.random.default_rng(seed)
    n_vec, n_el = math.prod(shape[:-1]), math.prod(shape)
    hdr = struct.pack("<4sBBBHi", b"TQ01", 1, 4, 1, m, seed) + struct.pack(f"<B{len(shape)}q", len(shape), *shape)
    hdr += bytes([7]) + b"float32"
    secs = (
        rng.integers(0, 256, (n_el * 4 + 7) // 8, dtype=np.uint8).tobytes(),
        rng.uniform(0.5, 2, n_vec).astype(np.float16).tobytes(),
        rng.integers(-1, 2, n_vec * m, dtype=np.int8).tobytes(),
        rng.uniform(0, 0.3, n_vec).astype(np.float16).tobytes(),
    )
    return b"".join([hdr] + [struct.pack("<q", len(s)) + s for s in secs])


@functools.lru_cache(maxsize=None)
def corpus() -> tuple:
    """Valid v1 and v2 blobs (name, bytes), small so that fuzzing stays fast."""
    return (
        ("v1-b2", tq_jax.dumps(_x((2, 3, 16)), bits=2)),
        ("v1-b3-f16", tq_jax.dumps(_x((3, 7), "float16"), bits=3)),
        ("v1-b4-bf16", tq_jax.dumps(_x((2, 2, 3, 2, 8), "bfloat16"), bits=4)),
        ("v1-b8", tq_jax.dumps(_x((4, 16)), bits=8)),
        ("v1-qjl", qjl_blob()),
        ("v2-k4v3-raw", tq_jax.dumps(_x((2, 4, 3, 16)), key_bits=4, value_bits=3, skip_first_layers=1)),
        ("v2-k8v2-crc", tq_jax.dumps(_x((2, 3, 2, 16), "bfloat16"), key_bits=8, value_bits=2,
                                     skip_last_layers=1, checksum=True)),
        ("v2-b1-hadamard", tq_jax.dumps(_x((2, 3, 24)), bits=1, rotation="hadamard")),
        ("v2-b5-nc-f32", tq_jax.dumps(_x((4, 16), "float16"), bits=5, norm_dtype="float32", norm_correction=True)),
        ("v2-b4-crc", tq_jax.dumps(_x((2, 3, 16)), bits=4, checksum=True)),
    )


def field_map(blob: bytes):
    """Offsets of a valid blob's header fields {name: (offset, fmt)} and section lengths."""
    return wire.field_offsets(blob)


def with_crc(b: bytearray) -> bytes:
    if len(b) >= 8:
        struct.pack_into("<I", b, len(b) - 4, zlib.crc32(bytes(b[:-4])))
    return bytes(b)


# ----------------------------------------------------------------------------- oracles


def traced_peak(fn):
    """(fn(), peak bytes tracemalloc saw while it ran)."""
    tracemalloc.start()
    try:
        out = fn()
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def table_allowance(h) -> int:
    """Bytes the decoder may spend building tables for header ``h`` (0 without vectors)."""
    if h.num_vectors == 0:
        return 0
    m = wire.dense_dim(h.dim, h.rotation)
    assert m <= wire.MAX_DENSE_DIM, h  # the parser refuses larger
    qjl = 16 * h.qjl_sketch_size * h.dim if h.use_qjl else 0
    return 80 * m * m + 16 * h.dim * 256 + qjl


def check_blob(blob: bytes):
    """Apply the oracles; return the decoded array or None if refused."""
    try:
        p = wire.parse(blob)
    except wire.WireError:
        for fn in (wire.peek_header, tq_jax.loads):
            try:
                fn(blob)
            except wire.WireError:
                pass
        return None
    assert wire.peek_header(blob) == p.header
    h = p.header
    bound = 3 * 32 * len(blob) + table_allowance(h) + 4 * MIB
    y, peak = traced_peak(lambda: tq_jax.loads(blob))
    assert tuple(y.shape) == h.shape and str(y.dtype) == h.dtype
    assert peak <= bound, (peak, bound, h)
    return y


# ----------------------------------------------------------------------------- strategies


@st.composite
def mutated(draw, base=None):
    """(blob, description): a corpus blob (or ``base``) with 1-4 mutations."""
    if base is None:
        name, base = draw(st.sampled_from(corpus()))
    else:
        name = "synth"
    fields, lengths, crc = field_map(base)
    b = bytearray(base)
    ops = draw(st.lists(st.sampled_from(["flip", "set", "truncate", "extend", "insert", "delete", "len", "field"]),
                        min_size=1, max_size=4))
    for op in ops:
        if not b:
            b = bytearray(b"TQ01")
        if op == "flip":
            i = draw(st.integers(0, len(b) * 8 - 1))
            b[i // 8] ^= 1 << (i % 8)
        elif op == "set":
            b[draw(st.integers(0, len(b) - 1))] = draw(st.sampled_from([0, 0xFF, 1, 0x80]) | st.integers(0, 255))
        elif op == "truncate":
            del b[draw(st.integers(0, len(b))):]
        elif op == "extend":
            b += draw(st.binary(min_size=1, max_size=40))
        elif op == "insert":
            i = draw(st.integers(0, len(b)))
            b[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            i = draw(st.integers(0, len(b) - 1))
            del b[i : i + draw(st.integers(1, 8))]
        elif op == "len" and lengths:
            off = draw(st.sampled_from(lengths))
            if off + 8 <= len(b):
                cur = struct.unpack_from("<q", b, off)[0]
                new = draw(st.sampled_from([cur + 1, cur - 1, 2 * cur, -cur] + I64_EDGES))
                struct.pack_into("<q", b, off, max(-(2**63), min(2**63 - 1, new)))
        elif op == "field":
            key = draw(st.sampled_from(sorted(fields)))
            off, fmt = fields[key]
            size = struct.calcsize(fmt)
            if off + size <= len(b):
                if fmt == "<q":
                    v = draw(st.sampled_from(I64_EDGES))
                elif fmt == "<i":
                    v = draw(st.integers(-(2**31), 2**31 - 1))
                else:
                    v = draw(st.sampled_from([0, 1, 2, 3, 5, 8, 9, 16, 17, 255]) | st.integers(0, 256**size - 1))
                    v %= 256**size
                struct.pack_into(fmt, b, off, v)
    if crc and draw(st.booleans()):
        b = bytearray(with_crc(b))
        ops.append("crc")
    return bytes(b), f"{name}: {'+'.join(ops)}"


@st.composite
def synthesized(draw):
    """A blob built valid from a random header: random indices, norms from random bits."""
    v2 = draw(st.booleans())
    d = draw(st.sampled_from([2, 3, 8, 16]))
    dtype = draw(st.sampled_from(["float32", "float16", "bfloat16"]))
    flags = rot = s0 = s1 = 0
    if v2:
        flags = draw(st.integers(0, 15))
        kv = bool(flags & wire.FLAG_KV)
        rot = draw(st.integers(0, 1))
        kb = draw(st.integers(1, 8))
        vb = draw(st.integers(1, 8)) if kv else kb
    else:
        kv, kb = False, draw(st.sampled_from(wire.READ_BITS_V1))
        vb = kb
    if kv:
        groups, layers = draw(st.integers(1, 2)), draw(st.integers(1, 3))
        s0 = draw(st.integers(0, layers))
        s1 = draw(st.integers(0, layers - s0))
        shape = (groups, layers) + tuple(draw(st.lists(st.integers(0, 2), min_size=0, max_size=2))) + (d,)
    else:
        shape = tuple(draw(st.lists(st.integers(0, 3), min_size=0, max_size=3))) + (d,)
    seed = draw(st.sampled_from([0, 1, -1]))
    if v2:
        prefix = struct.pack("<4sBBBBBHHi", b"TQ01", 2, flags, rot, kb, vb, s0, s1, seed)
    else:
        prefix = struct.pack("<4sBBBHi", b"TQ01", 1, kb, 0, 64, seed)
    parts = [prefix + struct.pack(f"<B{len(shape)}q", len(shape), *shape) + bytes([len(dtype)]) + dtype.encode()]

    def section(payload: bytes):
        parts.append(struct.pack("<q", len(payload)) + payload)

    norm_size = 4 if v2 and flags & wire.FLAG_NORMS_F32 else 2
    if kv:
        per_layer = math.prod(shape[2:-1])
        segs = [(kb if g == 0 else vb, (shape[1] - s0 - s1) * per_layer) for g in range(shape[0])]
        raw = shape[0] * (s0 + s1) * per_layer * d * (4 if dtype == "float32" else 2)
    else:
        segs, raw = [(kb, math.prod(shape[:-1]))], 0
    for bits, n in segs:
        section(draw(st.binary(min_size=(n * d * bits + 7) // 8, max_size=(n * d * bits + 7) // 8)))
        section(draw(st.binary(min_size=n * norm_size, max_size=n * norm_size)))
    if v2:
        section(draw(st.binary(min_size=raw, max_size=raw)))
        if flags & wire.FLAG_CHECKSUM:
            parts.append(struct.pack("<I", zlib.crc32(b"".join(parts))))
    return b"".join(parts)


# ----------------------------------------------------------------------------- fuzzing


@settings(FUZZ, max_examples=500)
@given(st.sampled_from([b"", b"TQ01", b"TQ01\x01", b"TQ01\x02", b"TQ01\x02\x01"]), st.binary(max_size=300))
def test_random_bytes_raise_only_wire_errors(prefix, tail):
    check_blob(prefix + tail)


@pytest.mark.slow
def test_every_truncation_and_extension_of_valid_blobs():
    for name, blob in corpus():
        assert check_blob(blob) is not None, name
        for n in range(len(blob)):
            with pytest.raises(wire.WireError):
                wire.parse(blob[:n])
            with pytest.raises(wire.WireError):
                tq_jax.loads(blob[:n])
        # Appended bytes: the CRC32 is read at the end, so a checksummed blob fails that.
        with pytest.raises(wire.ChecksumError if wire.peek_header(blob).checksum else wire.TrailingBytesError):
            wire.parse(blob + b"\0")


@pytest.mark.slow
@settings(FUZZ, max_examples=1200)
@given(mutated())
def test_mutated_blobs_raise_only_wire_errors_or_decode_to_their_shape(case):
    check_blob(case[0])


@pytest.mark.slow
@settings(FUZZ, max_examples=50)
@given(synthesized())
def test_structurally_valid_blobs_parse_and_decode(blob):
    y = check_blob(blob)
    assert y is not None, wire.peek_header(blob)


@settings(FUZZ, max_examples=400)
@given(synthesized().flatmap(mutated))
def test_mutated_synthesized_blobs(case):
    check_blob(case[0])


# ----------------------------------------------------------------------------- bridge


@pytest.fixture(scope="module")
def bridge():
    pytest.importorskip("torch")
    pytest.importorskip("lmcache")
    import torch

    from tq_jax.bridge._src import dlpack, serde

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


def merged(shape):
    return tuple(shape[:-2]) + (shape[-2] * shape[-1],) if len(shape) >= 2 else tuple(shape)


@pytest.mark.slow  # torch + LMCache MemoryObjs per example; tools/fuzz_long.py runs it at length
@settings(FUZZ, max_examples=400)
@given(case=mutated(), junk=st.binary(max_size=48))
def test_bridge_deserialize_under_mutation(bridge, case, junk):
    torch, dlpack, serde = bridge[:3]
    blob = case[0]
    try:
        h = wire.peek_header(blob)
        shape, dtype = merged(h.shape), {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(h.dtype, torch.float32)
    except wire.WireError:
        h, shape, dtype = None, (2, 3, 16), torch.float32
    if math.prod(shape) > 1 << 16 or not shape:
        return
    try:
        out = bridge_decode(bridge, blob + junk, shape, dtype)
    except wire.WireError:
        return
    except ValueError as e:
        assert str(e).startswith(serde.SHAPE_MISMATCH.split("{")[0]), e
        return
    # It decoded: the buffer's first blob (the header's length of it; LMCache buffers
    # may be longer) is valid, and the bridge wrote exactly what the core decodes.
    n = wire.blob_nbytes(h)
    want = np.asarray(tq_jax.loads((blob + junk)[:n])).reshape(shape)
    np.testing.assert_array_equal(dlpack.numpy_view(out).view(np.uint8), want.view(np.uint8))


# ----------------------------------------------------------------------------- claims


def _v1_header(shape, bits=2, dtype=b"float32", use_qjl=0, m=64, seed=0):
    return (struct.pack("<4sBBBHi", b"TQ01", 1, bits, use_qjl, m, seed)
            + struct.pack(f"<B{len(shape)}q", len(shape), *shape) + bytes([len(dtype)]) + dtype)


def _v1_blob(shape, bits=2, **kw):
    n_vec, n_el = math.prod(shape[:-1]), math.prod(shape)
    idx = (n_el * bits + 7) // 8
    return (_v1_header(shape, bits, **kw) + struct.pack("<q", idx) + b"\x55" * idx
            + struct.pack("<q", 2 * n_vec) + b"\x00\x3c" * n_vec)


def _peak_rss_reset() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM (Linux >= 4.0)
        return True
    except OSError:
        return False


def _vm_hwm_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


HUGE_CLAIMS = [
    ("2**40 vectors", _v1_header((1 << 40, 8)), wire.LimitError),
    ("2**41 coordinates", _v1_header((1 << 38, 8)), wire.LimitError),
    ("2**37 coordinates, declared", _v1_header((1 << 34, 8)) + struct.pack("<q", 1 << 35) + b"\0" * 64,
     wire.TruncatedError),
    ("2**63-1 entry", _v1_header((2**63 - 1, 8)), wire.LimitError),
    ("zero axis next to 2**62", _v1_blob((0, 1 << 62, 8)), wire.LimitError),
    ("head_dim 65536", _v1_header((1, 1 << 16)) + struct.pack("<q", 1 << 14) + b"\0" * 32, wire.LimitError),
    ("QJL m*d over the table limit", _v1_header((1, 1024), use_qjl=1, m=4096), wire.LimitError),
    ("v2 KV 2**40", struct.pack("<4sBBBBBHHi", b"TQ01", 2, 0x08, 0, 4, 2, 0, 0, 0)
     + struct.pack("<B4q", 4, 2, 1 << 20, 1 << 20, 128) + b"\x07float32", wire.LimitError),
]


@pytest.mark.parametrize("name,blob,error", HUGE_CLAIMS, ids=[c[0] for c in HUGE_CLAIMS])
def test_huge_claims_fail_before_any_allocation(name, blob, error):
    tq_jax.loads(_v1_blob((1, 8)))  # warm: imports and a compiled decode are not the claim's
    hwm_ok = _peak_rss_reset()
    rss0 = _vm_hwm_mib()
    def refuse():
        for fn in (wire.parse, tq_jax.loads):
            with pytest.raises(error):
                fn(blob)
        if error is not wire.TruncatedError:  # the claim is in the header itself
            with pytest.raises(error):
                wire.peek_header(blob)

    _, peak = traced_peak(refuse)
    assert peak < 256 * 1024, peak  # no buffer sized by the claim
    if hwm_ok:
        assert _vm_hwm_mib() - rss0 < 32, (rss0, _vm_hwm_mib())


# ----------------------------------------------------------------------------- regressions


def test_regression_zero_length_axis_beside_a_huge_one_is_a_limit_error():
    # Found by tools/fuzz_long.py: (0, 2**62, 8) holds no coordinate, passed the
    # element limit and escaped as numpy's "array is too big" ValueError.
    for shape in [(0, 1 << 62, 8), (1 << 62, 0, 8), (0, 2**63 - 1, 2**63 - 1, 8)]:
        with pytest.raises(wire.LimitError, match="MAX_ELEMENTS"):
            tq_jax.loads(_v1_blob(shape))
    y = tq_jax.loads(_v1_blob((0, 1 << 20, 8)))  # within the limit: an empty array
    assert y.shape == (0, 1 << 20, 8)


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
    # verify=False reads the header of the damaged blob; parsing it still refuses it
    assert wire.peek_header(bytes(bad), verify=False) == wire.parse(blob).header
    with pytest.raises(wire.ChecksumError):
        wire.parse(bytes(bad))


def test_regression_bridge_reads_checksummed_blob_from_a_longer_buffer(bridge):
    torch, dlpack = bridge[:2]
    x = _x((2, 3, 4, 2, 16))
    blob = tq_jax.dumps(x, bits=4, checksum=True)
    out = bridge_decode(bridge, blob + b"\xff" * 100, (2, 3, 4, 32), torch.float32)
    np.testing.assert_array_equal(dlpack.numpy_view(out), np.asarray(tq_jax.loads(blob)).reshape(2, 3, 4, 32))


def test_regression_blob_without_vectors_builds_no_tables():
    # Found by the fuzzer's memory oracle: a 54-byte blob of shape (0, 1024) built a
    # 1024x1024 Haar rotation (64 MiB traced; (0, 65536) would have asked ~270 GB).
    for blob in (_v1_blob((0, 1000), seed=99), _v1_header((0, 1000), use_qjl=1, m=64, seed=99)
                 + struct.pack("<q", 0) * 4):
        y, peak = traced_peak(lambda: tq_jax.loads(blob))
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


def test_regression_caches_keyed_by_header_fields_are_bounded():
    # Found by the long run's RSS samples: the device-table cache kept one entry per
    # (head_dim, bits, seed) a blob named, forever; a stream of blobs with fresh seeds
    # (or flipped seed bits, which v1 cannot detect) grew it without bound.
    from tq_jax._src import _lru, codebook, rotation

    # every module-level LRU of the codec and the layers below it (the device tables included)
    def module_lrus(*mods):
        return [v for m in mods for v in vars(m).values() if isinstance(v, _lru.LRU)]

    lrus = module_lrus(codec, codebook, rotation)
    assert codec.CACHES["device tables"] in lrus
    seeded = module_lrus(codec, rotation)  # the caches a seed keys (codebooks are keyed by dim, bits)
    bound = max(c.max_entries for c in seeded)
    blob = bytearray(tq_jax.dumps(_x((2, 8)), bits=2))
    for seed in range(bound + 20):
        struct.pack_into("<i", blob, 9, 1000 + seed)  # the v1 seed field, as a reader meets it
        tq_jax.loads(bytes(blob))
    assert rotation.CACHES["haar"].stats().evictions >= 20  # the seeds went through a bounded cache
    for cache in lrus:
        s = cache.stats()
        assert s.entries <= s.max_entries and (s.max_bytes is None or s.nbytes <= s.max_bytes), s


def test_regression_qjl_seed_that_no_writer_can_produce_is_refused_by_the_parser():
    # Found by tools/fuzz_long.py (first run): a v1 QJL blob whose seed + 999999 is
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
