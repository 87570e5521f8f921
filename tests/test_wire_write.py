"""wire's write API (Sections, pieces, write_into): the exact inverse of parse."""

import zlib

import numpy as np
import pytest

import tq_jax
from tq_jax._src import wire

RNG = np.random.default_rng(0)


def _join(header, sections) -> bytes:
    return b"".join(wire.pieces(header, sections))


def _assert_same_sections(p: wire.Parsed, s: wire.Sections) -> None:
    assert len(p.indices) == len(s.indices) == len(p.norms) == len(s.norms)
    for got, chunks in zip(p.indices, s.indices):
        assert got.tobytes() == b"".join(bytes(memoryview(c).cast("B")) for c in chunks)
    for got, want in zip(p.norms, s.norms):
        if isinstance(want, wire.NormCodes):
            assert isinstance(got, wire.NormCodes)
            assert got.bits == want.bits and got.count == want.count
            np.testing.assert_array_equal(got.ranges, np.asarray(want.ranges, np.float32))
            np.testing.assert_array_equal(got.codes, want.codes)
        else:
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(got, want)
    assert p.raw.tobytes() == b"".join(bytes(memoryview(r).cast("B")) for r in s.raw)


def _v1():
    h = wire.Header(bits=3, seed=-5, shape=(2, 3, 8), dtype="bfloat16")
    n_vec = 6
    idx = RNG.integers(0, 256, (n_vec * 8 * 3 + 7) // 8, dtype=np.uint8)
    chunks = [idx[:5], bytes(idx[5:11]), memoryview(idx[11:].tobytes())]
    return h, wire.Sections([chunks], [RNG.random(n_vec).astype(np.float16)])


def _v2_kv(checksum=True, norm_dtype="float32"):
    shape = (2, 5, 3, 2, 16)  # groups, layers, tokens, heads, head_dim
    h = wire.Header(
        bits=4, seed=11, shape=shape, dtype="float16", version=wire.VERSION_2, value_bits=2,
        kv_layout=True, skip_first=1, skip_last=2, rotation="hadamard", norm_dtype=norm_dtype,
        norm_correction=True, checksum=checksum,
    )
    idx, nrm = [], []
    for _, bits, _, _, n_vec in h.segments():
        stream = RNG.integers(0, 256, (n_vec * 16 * bits + 7) // 8, dtype=np.uint8)
        idx.append([stream[:3], stream[3:]])
        nrm.append(RNG.random(n_vec).astype(norm_dtype))
    per_layer = 3 * 2 * 16 * 2
    raw = [RNG.integers(0, 256, per_layer * n, dtype=np.uint8) for n in (1, 2, 1, 2)]
    return h, wire.Sections(idx, nrm, tuple(raw))


def _v2_codes():
    shape = (2, 4, 3, 32)
    h = wire.Header(
        bits=3, seed=1, shape=shape, dtype="float32", version=wire.VERSION_2, value_bits=2,
        kv_layout=True, rotation="hadamard", norm_correction=True, checksum=True, norm_bits=6,
    )
    idx, nrm = [], []
    for _, bits, _, _, n_vec in h.segments():
        idx.append([RNG.integers(0, 256, (n_vec * 32 * bits + 7) // 8, dtype=np.uint8)])
        groups = h.norm_groups(n_vec)
        lo = RNG.normal(size=groups).astype(np.float32)
        ranges = np.stack([lo, lo + 1.5], axis=1)
        codes = RNG.integers(0, 256, (n_vec * 6 + 7) // 8, dtype=np.uint8)
        nrm.append(wire.NormCodes(ranges, codes, 6, n_vec))
    return h, wire.Sections(idx, nrm)


@pytest.mark.parametrize("make", [_v1, _v2_kv, lambda: _v2_kv(False, "float16"), _v2_codes])
def test_parse_of_pieces_returns_the_sections(make):
    h, s = make()
    blob = _join(h, s)
    assert len(blob) == wire.blob_nbytes(h)
    p = wire.parse(blob)
    assert p.header == wire._canonical(h)
    _assert_same_sections(p, s)
    assert _join(p.header, wire.Sections.from_parsed(p)) == blob


def test_checksum_trailer_is_crc32_of_the_rest():
    h, s = _v2_kv()
    blob = _join(h, s)
    assert int.from_bytes(blob[-4:], "little") == zlib.crc32(blob[:-4])
    h2, s2 = _v2_kv(checksum=False)
    assert len(_join(h2, s2)) == len(blob) - 4


def test_v1_qjl_sections_round_trip():
    h = wire.Header(bits=4, seed=3, shape=(3, 8), dtype="float32", use_qjl=True, qjl_sketch_size=16)
    s = wire.Sections(
        [[RNG.integers(0, 256, 12, dtype=np.uint8)]], [RNG.random(3).astype(np.float16)],
        sketch=RNG.integers(-128, 128, (3, 16), dtype=np.int8), residual_norms=RNG.random(3).astype(np.float16),
    )
    p = wire.parse(_join(h, s))
    np.testing.assert_array_equal(p.sketch, s.sketch)
    np.testing.assert_array_equal(p.residual_norms, s.residual_norms)
    with pytest.raises(ValueError, match="QJL"):
        wire.pieces(h, s._replace(sketch=None))
    with pytest.raises(ValueError, match="QJL"):
        wire.pieces(h._replace(use_qjl=False), s)


def test_pieces_are_zero_copy_views():
    h, s = _v2_kv()
    out = wire.pieces(h, s)
    chunk = s.indices[0][1]
    assert any(isinstance(p, memoryview) and np.shares_memory(np.asarray(p), chunk) for p in out)
    assert any(isinstance(p, memoryview) and np.shares_memory(np.asarray(p), s.raw[0]) for p in out)


@pytest.mark.parametrize(
    "mutate, section",
    [
        (lambda s: s._replace(indices=[s.indices[0][:-1]] + s.indices[1:]), "indices group 0"),
        (lambda s: s._replace(indices=s.indices[:1] + [s.indices[1] + [b"\0"]]), "indices group 1"),
        (lambda s: s._replace(norms=[s.norms[0][:-1]] + s.norms[1:]), "norms group 0"),
        (lambda s: s._replace(raw=s.raw[:-1]), "raw layers"),
    ],
)
def test_wrong_length_section_is_refused(mutate, section):
    h, s = _v2_kv()
    with pytest.raises(wire.SectionLengthError, match=f"the {section} section holds"):
        wire.pieces(h, mutate(s))


def test_wrong_length_v1_indices_and_norm_codes_are_refused():
    h, s = _v1()
    with pytest.raises(wire.SectionLengthError, match="indices"):
        wire.pieces(h, s._replace(indices=[s.indices[0] + [b"x"]]))
    h, s = _v2_codes()
    nc = s.norms[1]
    with pytest.raises(wire.SectionLengthError, match="norms group 1"):
        wire.pieces(h, s._replace(norms=[s.norms[0], nc._replace(codes=nc.codes[:-1])]))
    with pytest.raises(ValueError, match=r"ranges have shape"):
        wire.pieces(h, s._replace(norms=[s.norms[0], nc._replace(ranges=nc.ranges[:-1])]))
    with pytest.raises(ValueError, match="norm_bits"):
        wire.pieces(h, s._replace(norms=[s.norms[0], nc._replace(bits=5)]))


def test_wrong_norm_kind_count_and_dtype_are_refused():
    h, s = _v2_kv()  # float32 norms
    with pytest.raises(ValueError, match="astype"):
        wire.pieces(h, s._replace(norms=[n.astype(np.float16) for n in s.norms]))
    with pytest.raises(ValueError, match="2 segment"):
        wire.pieces(h, s._replace(indices=s.indices[:1]))
    with pytest.raises(TypeError, match="NormCodes"):
        wire.pieces(h._replace(norm_bits=6, norm_dtype="float16"), s)
    h, s = _v2_codes()
    with pytest.raises(TypeError, match="ndarray"):
        wire.pieces(h._replace(norm_bits=0), s)


def test_headers_the_parser_or_version_refuses_are_refused():
    h, s = _v1()
    with pytest.raises(ValueError, match="parser refuses"):
        wire.pieces(h._replace(bits=5), s)  # version 1 has no 5-bit width
    with pytest.raises(ValueError, match="cannot carry"):
        wire.pieces(h._replace(checksum=True), s)  # version 1 has no checksum
    with pytest.raises(ValueError, match="version-1 blob has no raw"):
        wire.pieces(h, s._replace(raw=(b"\0",)))


def test_write_into_fills_a_preallocated_buffer():
    h, s = _v2_kv()
    ps = wire.pieces(h, s)
    want = b"".join(ps)
    out = bytearray(len(want) + 3)
    assert wire.write_into(ps, memoryview(out)) == len(want)
    assert bytes(out[: len(want)]) == want and out[len(want) :] == b"\0\0\0"
    arr = np.zeros(len(want), np.uint8)
    assert wire.write_into(ps, arr) == len(want) and arr.tobytes() == want
    with pytest.raises(ValueError, match="needs"):
        wire.write_into(ps, bytearray(len(want) - 1))
    with pytest.raises(TypeError, match="read-only"):
        wire.write_into(ps, bytes(len(want)))


def test_seed32_and_dtype_name():
    assert wire.seed32(-5) == -5 and wire.seed32(2**32 + 42) == 42 and wire.seed32(2**31) == -(2**31)
    assert wire.dtype_name(np.float16) == "float16" and wire.dtype_name("torch.bfloat16") == "bfloat16"
    with pytest.raises(ValueError, match="dtype must be one of"):
        wire.dtype_name("int8")


GOLDEN = [
    dict(bits=4),
    dict(bits=3, seed=-7),
    dict(bits=4, options=None, norm_dtype="float32"),
    dict(key_bits=4, value_bits=2, skip_first_layers=1, skip_last_layers=1, rotation="hadamard",
         norm_dtype="float32", norm_correction=True, checksum=True),
    dict(key_bits=4, value_bits=3, rotation="hadamard", norm_correction=True, norm_bits=6, checksum=True),
    dict(bits=2, rotation="hadamard", norm_bits=4),
]


# Quick tier: every option set in float32, bfloat16 with raw layers (raw bfloat16 bytes).
@pytest.mark.parametrize("dtype,kw", [
    pytest.param(dtype, kw, id=f"{dtype}-kw{i}",
                 marks=() if dtype == "float32" or "skip_first_layers" in kw else pytest.mark.slow)
    for dtype in ("float32", "bfloat16") for i, kw in enumerate(GOLDEN)
])
def test_dumps_bytes_are_rebuilt_exactly_from_parsed_sections(dtype, kw):
    """Golden round trip: dumps' blob == pieces(parse(blob)) byte for byte."""
    import ml_dtypes

    kw = {k: v for k, v in kw.items() if k != "options"}
    x = np.random.default_rng(1).standard_normal((2, 4, 3, 2, 16)).astype(np.float32)
    x = x.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32)
    blob = tq_jax.dumps(x, **kw)
    p = wire.parse(blob)
    ps = wire.pieces(p.header, wire.Sections.from_parsed(p))
    assert b"".join(ps) == blob
    out = bytearray(len(blob))
    assert wire.write_into(ps, out) == len(blob) and bytes(out) == blob
    # the writer's own header (before parsing) is accepted and gives the same bytes
    writer = tq_jax.encode_options(**kw).header(x.shape, dtype, norm_dtype=p.header.norm_dtype)
    assert _join(writer, wire.Sections.from_parsed(p)) == blob


# ----------------------------------------------------------------------------- property


def _random_sections(h: wire.Header, rng) -> wire.Sections:
    idx, nrm = [], []
    for _, bits, _, _, n_vec in h.segments():
        stream = rng.integers(0, 256, (n_vec * h.dim * bits + 7) // 8, dtype=np.uint8)
        cut = int(rng.integers(0, len(stream) + 1))
        idx.append([stream[:cut], stream[cut:].tobytes()])
        if h.norm_bits:
            groups = h.norm_groups(n_vec)
            lo = rng.uniform(-5, 5, groups).astype(np.float32)
            ranges = np.stack([lo, lo + rng.uniform(0, 3, groups).astype(np.float32)], axis=1)
            codes = rng.integers(0, 256, (n_vec * h.norm_bits + 7) // 8, dtype=np.uint8)
            nrm.append(wire.NormCodes(ranges, codes, h.norm_bits, n_vec))
        else:
            nrm.append(rng.random(n_vec).astype(h.norm_dtype))
    raw = (rng.integers(0, 256, h.raw_nbytes(), dtype=np.uint8),) if h.raw_nbytes() else ()
    sk = rn = None
    if h.use_qjl:
        sk = rng.integers(-1, 2, (h.num_vectors, h.qjl_sketch_size), dtype=np.int8)
        rn = rng.random(h.num_vectors).astype(np.float16)
    return wire.Sections(idx, nrm, raw, sk, rn)


def _headers():
    from hypothesis import strategies as st

    dims = st.sampled_from([2, 8, 12, 16, 24])
    dtypes = st.sampled_from(wire.DTYPES)
    seeds = st.integers(-(2**31), 2**31 - 1)
    v1 = st.builds(
        lambda bits, seed, lead, d, dtype, qjl, m: wire.Header(
            bits, max(seed, -999_999) if qjl else seed, (*lead, d), dtype, qjl, m if qjl else 64
        ),
        st.sampled_from(wire.READ_BITS_V1), seeds, st.lists(st.integers(0, 3), max_size=3), dims, dtypes,
        st.booleans(), st.integers(1, 8),
    )

    def v2(kb, vb, seed, layers, rest, d, dtype, rot, nd, nc, ck, nb, kv, s0, s1):
        shape = (2, layers, *rest, d) if kv else (layers, *rest, d)
        s0, s1 = (min(s0, layers), min(s1, max(layers - s0, 0))) if kv else (0, 0)
        return wire.Header(
            kb, seed, shape, dtype, version=wire.VERSION_2, value_bits=vb if kv else kb, kv_layout=kv,
            skip_first=s0, skip_last=s1, rotation=rot, norm_dtype="float16" if nb else nd,
            norm_correction=nc, checksum=ck, norm_bits=nb,
        )

    v2s = st.builds(
        v2, st.integers(1, 8), st.integers(1, 8), seeds, st.integers(0, 4), st.lists(st.integers(0, 3), max_size=2),
        dims, dtypes, st.sampled_from(tuple(wire.ROTATION_CODES)), st.sampled_from(wire.NORM_DTYPES),
        st.booleans(), st.booleans(), st.sampled_from([0, *wire.NORM_BITS]), st.booleans(),
        st.integers(0, 2), st.integers(0, 2),
    )
    return st.one_of(v1, v2s)


def test_property_pieces_and_parse_are_inverse():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=150, deadline=None, derandomize=True)
    @given(_headers(), st.integers(0, 2**32 - 1))
    def check(h, seed):
        s = _random_sections(h, np.random.default_rng(seed))
        blob = _join(h, s)
        assert len(blob) == wire.blob_nbytes(h)
        p = wire.parse(blob)
        assert p.header == wire._canonical(h) and wire.peek_header(blob) == p.header
        _assert_same_sections(p, s)
        if h.use_qjl:
            np.testing.assert_array_equal(p.sketch, s.sketch)
            np.testing.assert_array_equal(p.residual_norms, s.residual_norms)
        assert _join(p.header, wire.Sections.from_parsed(p)) == blob

    check()
