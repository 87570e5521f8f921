"""TQ01 v2 trellis-coded indices (``trellis=True``, the ``turbo-4t`` preset).

Checked against independent statements: the Viterbi search against brute force over
every path, the decoder against a sequential numpy state machine written from
docs/TQ01-v2.md, a whole blob against a numpy decoder of the spec, the error against
Lloyd–Max's at the same bits, and a golden blob.
"""

import itertools
import struct
import zlib

import jax.numpy as jnp
import numpy as np
import pytest

import tq_jax
from tq_jax import kvcache
from tq_jax._src import codebook, rotation, trellis, wire

from conftest import cosine
from kvcache_helpers import D, H, dumps_kv, fill
from tq_jax._src.kvcache.reference import dense_attention


def unit(n, d, seed=0):
    y = np.random.default_rng(seed).standard_normal((n, d))
    return (y / np.linalg.norm(y, axis=-1, keepdims=True)).astype(np.float32)


def spec_levels(d, bits):
    """docs/TQ01-v2.md: subset j, index k -> scale * c_{bits+1}[4k + j]."""
    c = np.asarray(codebook.lloyd_max(d, bits + 1).centroids, np.float32)
    return (c * np.float32(trellis.SCALES[bits])).reshape(-1, 4).T


def spec_decode(codes, d, bits):
    """Sequential: the state is the last three branch bits, the newest in bit 0."""
    lv = spec_levels(d, bits)
    out = np.zeros(codes.shape, np.float32)
    for row in np.ndindex(codes.shape[:-1]):
        s = 0
        for t, c in enumerate(codes[row]):
            b = int(c) & 1
            parity = (s & 1) ^ ((s >> 2) & 1)
            out[row + (t,)] = lv[(s & 1) + 2 * (b ^ parity), int(c) >> 1]
            s = ((s << 1) | b) & 7
    return out


@pytest.mark.parametrize("bits", [2, 3, 5])
def test_lookup_is_the_sequential_state_machine(bits):
    codes = np.random.default_rng(bits).integers(0, 1 << bits, (5, 24)).astype(np.uint8)
    got = np.asarray(trellis.lookup(codes, bits))
    np.testing.assert_array_equal(got, spec_decode(codes, 24, bits))


@pytest.mark.parametrize("bits", [2, 4])
def test_viterbi_finds_the_least_error_path(bits):
    """Brute force: every branch-bit sequence of 8 coordinates, each coordinate then at
    the nearest level of its subset."""
    d = 8
    y = unit(6, d, seed=bits)
    lv = spec_levels(d, bits)
    got = np.asarray(trellis.quantize(y, bits))
    err = ((spec_decode(got, d, bits) - y) ** 2).sum(-1)
    for i in range(len(y)):
        best = np.inf
        for path in itertools.product((0, 1), repeat=d):
            s, e = 0, 0.0
            for t, b in enumerate(path):
                sub = lv[trellis.subset(s, b)]
                e += float(np.min((sub - y[i, t]) ** 2))
                s = ((s << 1) | b) & 7
            best = min(best, e)
        assert err[i] == pytest.approx(best, rel=1e-5, abs=1e-9)


@pytest.mark.parametrize("bits,gain_db", [(3, 1.2), (4, 1.2), (5, 1.2)])
def test_trellis_error_is_below_lloyd_max_at_the_same_bits(bits, gain_db):
    """A ``bits`` trellis against the ``bits`` Lloyd–Max codebook on Gaussian unit vectors:
    TCQ with 8 states gains over 1 dB (Marcellin & Fischer); the scalar codebook's error is
    the codebook's own expected value, computed in closed form."""
    d = 64
    y = unit(2048, d)
    mse = float(np.mean((np.asarray(trellis.lookup(trellis.quantize(y, bits), bits)) - y) ** 2))
    scalar = codebook.expected_mse(d, bits)
    assert 10 * np.log10(scalar / mse) >= gain_db


def test_levels_are_the_narrowed_doubled_codebook():
    for bits in trellis.BITS:
        np.testing.assert_array_equal(trellis.levels(64, bits), spec_levels(64, bits))
        assert np.all(np.diff(trellis.levels(64, bits), axis=1) > 0)
    assert tuple(trellis.BITS) == tuple(wire.TRELLIS_BITS)


def kv(shape, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape, np.float32)
    return x * np.exp(rng.standard_normal(shape[:-1] + (1,))).astype(np.float32)


def test_turbo_4t_has_turbo_4s_bytes_and_less_error():
    x = kv((2, 4, 64, 3, 64))
    plain, tcq = (tq_jax.dumps(x, options=p) for p in ("turbo-4", "turbo-4t"))
    assert len(tcq) == len(plain) == tq_jax.serialized_size(x.shape, "float32", options="turbo-4t")
    h = tq_jax.peek_header(tcq)
    assert h.trellis and not tq_jax.peek_header(plain).trellis
    assert tcq[5] == plain[5] | wire.FLAG_TRELLIS
    for g in (0, 1):
        e_plain = np.mean((np.asarray(tq_jax.loads(plain))[g] - x[g]) ** 2)
        e_tcq = np.mean((np.asarray(tq_jax.loads(tcq))[g] - x[g]) ** 2)
        assert e_tcq < 0.85 * e_plain


def _hand_parse(blob):
    """The sections of a KV blob without NORM_CODES, read by offsets (docs/TQ01-v2.md)."""
    _, _, flags, _, kb, vb, _, _, seed = struct.unpack_from("<4sBBBBBHHi", blob)
    ndim = blob[17]
    shape = struct.unpack_from(f"<{ndim}q", blob, 18)
    off = 18 + 8 * ndim
    off += 1 + blob[off]
    out = []
    for bits in (kb, vb):
        n = struct.unpack_from("<q", blob, off)[0]
        idx = np.frombuffer(blob, np.uint8, n, off + 8)
        off += 8 + n
        m = struct.unpack_from("<q", blob, off)[0]
        norms = np.frombuffer(blob, np.float32, m // 4, off + 8)
        off += 8 + m
        out.append((bits, idx, norms))
    return flags, seed, shape, out


def test_a_trellis_blob_decodes_as_the_spec_says():
    """Haar rotation and float32 norms, so every step is a few lines of numpy: unpack the
    LSB-first stream, run the state machine, normalise, un-rotate, scale."""
    x = kv((2, 2, 5, 2, 32), seed=4)
    blob = tq_jax.dumps(x, key_bits=5, value_bits=3, norm_dtype="float32", norm_correction=True, trellis=True)
    flags, seed, shape, segments = _hand_parse(blob)
    assert flags == wire.FLAG_TRELLIS | wire.FLAG_KV | wire.FLAG_NORMS_F32 | wire.FLAG_NORM_CORRECTION
    d = shape[-1]
    q = rotation.haar_rotation(d, seed).astype(np.float64)
    got = np.asarray(tq_jax.loads(blob, dtype=jnp.float32))
    for g, (bits, idx, norms) in enumerate(segments):
        stream = np.unpackbits(idx, bitorder="little")[: norms.size * d * bits].reshape(-1, bits)
        codes = (stream.astype(np.int64) << np.arange(bits)).sum(-1).reshape(-1, d)
        c = spec_decode(codes, d, bits).astype(np.float64)
        c /= np.linalg.norm(c, axis=-1, keepdims=True)
        want = (c @ q) * norms[:, None]
        np.testing.assert_allclose(got[g].reshape(-1, d), want, rtol=1e-4, atol=1e-5)
    assert cosine(got[0], x[0]).mean() > 0.995


def _golden_input():
    g, l, t, k = np.meshgrid(np.arange(2), np.arange(2), np.arange(3), np.arange(16), indexing="ij")
    return (np.sin(1 + 5 * g + 3 * l + 0.37 * k + 0.11 * t) * (1 + t + l)).astype(np.float32)


# turbo-4t on _golden_input(): K 5 bits, V 3 bits, trellis, hadamard, nc, 6-bit log norms, CRC32.
GOLDEN_TURBO_4T = (
    "54513031023b010503000000002a000000060402000000000000000200000000000000030000000000000010"
    "0000000000000007666c6f617433323c000000000000000c5e2c59be9372e49634cddd0c1fbe51f21495340e"
    "e20c1fc671f214d53cf421f3a4596d0d2babcad325e3e6414c8d0bebc2d325e3e6496d091b6bc31500000000"
    "000000f43f863ff5950840abf2df3f428d1b4001fa07e50f2400000000000000e9d870760559e94a7c770959"
    "a9ce743e993d1eb7eb41e78666a7cb88f6a65e378f89faa61500000000000000e920863f611c0a4099c2dd3f"
    "02121c4001fa07e50f000000000000000099bf1b2d"
)


def test_golden_turbo_4t_blob():
    blob = tq_jax.dumps(_golden_input(), options="turbo-4t")
    assert blob.hex() == GOLDEN_TURBO_4T
    # By hand: flags CHECKSUM|NC|KV|NORM_CODES|TRELLIS, hadamard, K5 V3, seed 42, norm_bits 6.
    assert blob[:18] == struct.pack("<4sBBBBBHHiB", b"TQ01", 2, 0x3B, 1, 5, 3, 0, 0, 42, 6)
    off = 18 + 1 + 4 * 8 + 1 + 7
    n_vec = 2 * 3
    norms = 2 * 8 + (n_vec * 6 + 7) // 8
    for name, n in (("K idx", n_vec * 16 * 5 // 8), ("K norms", norms), ("V idx", n_vec * 16 * 3 // 8),
                    ("V norms", norms), ("raw", 0)):
        assert struct.unpack_from("<q", blob, off)[0] == n, name
        off += 8 + n
    assert off + 4 == len(blob) and struct.unpack("<I", blob[-4:])[0] == zlib.crc32(blob[:-4])


@pytest.mark.parametrize("field,value", [(7, 8), (7, 1), (8, 8)])  # key_bits, value_bits
def test_parser_refuses_trellis_bits_outside_2_to_7(field, value):
    blob = bytearray(tq_jax.dumps(kv((2, 2, 3, 16)), key_bits=4, value_bits=3, trellis=True))
    blob[field] = value
    with pytest.raises(wire.BadFieldError, match="trellis"):
        wire.parse(bytes(blob))


def test_options_refuse_trellis_bits_it_cannot_code():
    with pytest.raises(ValueError, match="trellis=True takes key_bits and value_bits in 2..7"):
        tq_jax.encode_options(bits=8, trellis=True)
    with pytest.raises(ValueError, match="trellis"):
        tq_jax.CodecConfig(64, 1, trellis=True)


def test_v1_settings_with_trellis_write_version_2():
    x = kv((3, 64))
    blob = tq_jax.dumps(x, bits=4, trellis=True)
    h = tq_jax.peek_header(blob)
    assert (h.version, h.trellis, h.bits) == (2, True, 4)
    assert cosine(np.asarray(tq_jax.loads(blob)), x).mean() > 0.99


def test_row_api_round_trips_trellis_codes():
    cfg = tq_jax.CodecConfig(48, 3, rotation="hadamard", trellis=True)
    x = kv((7, 48))
    enc = tq_jax.encode(x, cfg)
    assert enc.packed.shape == (7, 48 * 3 // 8)
    y = np.asarray(tq_jax.decode(enc, cfg))
    blob_y = np.asarray(tq_jax.loads(tq_jax.dumps(x, bits=3, rotation="hadamard", norm_dtype="float32", trellis=True)))
    np.testing.assert_allclose(y, blob_y, rtol=1e-5, atol=1e-6)




def test_a_trellis_cache_attends_over_what_its_export_decodes_to():
    """Codes only, paged, GQA 2, ragged appends: attention over the cache's trellis codes
    equals float64 attention over the decoded blob, and the cache holds the codes dumps writes."""
    rng = np.random.default_rng(5)
    cache = kvcache.init(3, 48, H, D, options="turbo-4t", dtype=jnp.float32, page_size=16, block_tokens=16,
                         window=0, sinks=0)
    assert cache.config.trellis
    cache, ks, vs = fill(cache, rng, first=[16, 11, 16], second=[16, 16, 9])
    q = rng.standard_normal((3, 2, H * 2, D)).astype(np.float32)
    out = np.asarray(kvcache.attend(cache, q))
    for b in range(3):
        blob = kvcache.export(cache, seq=b)
        mine, theirs = wire.parse(blob), wire.parse(dumps_kv(ks[b], vs[b], cache.config))
        assert mine.header.trellis and theirs.header.trellis
        for got, want in zip(mine.indices, theirs.indices):  # the codes dumps writes (norms: nc folded in)
            np.testing.assert_array_equal(got, want)
        kv_dec = np.asarray(tq_jax.loads(blob, dtype=jnp.float32))
        ref = dense_attention(q[b], kv_dec[0, 0], kv_dec[1, 0])
        np.testing.assert_allclose(out[b], ref, rtol=1e-3, atol=1e-3 * np.abs(ref).max())


def test_a_turbo_4t_blob_loads_into_a_turbo_4t_cache_and_attends_as_its_values():
    rng = np.random.default_rng(6)
    k = rng.standard_normal((21, H, D)).astype(np.float32)
    v = rng.standard_normal((21, H, D)).astype(np.float32)
    blob = tq_jax.dumps(np.stack([k, v])[:, None], options="turbo-4t")
    cache = kvcache.init(1, 32, H, D, options="turbo-4t", dtype=jnp.float32, block_tokens=16, window=0, sinks=0)
    cache = kvcache.load(cache, blob)
    kv_dec = np.asarray(tq_jax.loads(blob, dtype=jnp.float32))
    q = rng.standard_normal((1, 2, H, D)).astype(np.float32)
    ref = dense_attention(q[0], kv_dec[0, 0], kv_dec[1, 0])
    np.testing.assert_allclose(np.asarray(kvcache.attend(cache, q))[0], ref, rtol=2e-3, atol=2e-3 * np.abs(ref).max())
    with pytest.raises(ValueError, match="trellis codes"):  # a scalar cache refuses trellis codes
        kvcache.load(kvcache.init(1, 32, H, D, options="turbo-4", window=0, sinks=0), blob)


@pytest.mark.parametrize("impl", ["pallas_tpu", "pallas_gpu"])
def test_the_pallas_kernels_refuse_a_trellis_cache_with_what_to_do(impl):
    cache = kvcache.init(1, 16, H, D, options="turbo-4t", window=0, sinks=0)
    with pytest.raises(ValueError, match="impl='auto' or impl='xla'"):
        kvcache.attend(cache, np.zeros((1, 1, H, D), np.float32), impl=impl)
