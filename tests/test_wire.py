"""The TQ01 parser on handcrafted hostile input: one error type per cause."""

import struct

import numpy as np
import pytest

import tq_jax
from tq_jax._src import wire


def _blob(shape=(2, 3, 8), bits=4, dtype="float32", seed=7):
    x = np.random.default_rng(0).standard_normal(shape).astype(dtype)
    return tq_jax.dumps(x, bits=bits, seed=seed)


def _prefix(version=1, bits=4, use_qjl=0, qjl_m=64, seed=0, magic=b"TQ01"):
    return struct.pack("<4sBBBHi", magic, version, bits, use_qjl, qjl_m, seed)


def _header(shape=(2, 8), dtype=b"float32", **kw):
    return _prefix(**kw) + struct.pack(f"<B{len(shape)}q", len(shape), *shape) + bytes([len(dtype)]) + dtype


def test_valid_blob_parses_and_sizes_are_exact():
    b = _blob()
    p = wire.parse(b)
    assert p.header.shape == (2, 3, 8) and p.header.bits == 4 and p.header.seed == 7
    assert p.header.dtype == "float32" and not p.header.use_qjl
    assert len(b) == wire.blob_nbytes(wire.Header(bits=4, seed=7, shape=(2, 3, 8), dtype="float32"))
    assert p.indices[0].nbytes == 2 * 3 * 8 * 4 // 8 and p.norms[0].shape == (6,)
    assert wire.peek_header(b) == p.header


@pytest.mark.parametrize("n", [0, 1, 5, 12, 13, 20])
def test_truncated_prefix_or_header(n):
    with pytest.raises(wire.TruncatedError, match="truncated"):
        wire.parse(_blob()[:n])


def test_every_truncation_raises_only_wire_errors():
    b = _blob()
    for n in range(len(b)):
        with pytest.raises(wire.WireError):
            wire.parse(b[:n])


def test_bad_magic():
    with pytest.raises(wire.BadMagicError, match="TQ01"):
        wire.parse(b"TQ02" + _blob()[4:])


def test_unsupported_version():
    b = bytearray(_blob())
    b[4] = 9
    with pytest.raises(wire.UnsupportedVersionError, match="version 9"):
        wire.parse(bytes(b))


@pytest.mark.parametrize("bits", [0, 1, 5, 7, 9, 255])
def test_bad_bits(bits):
    b = bytearray(_blob())
    b[5] = bits
    with pytest.raises(wire.BadFieldError, match="bits"):
        wire.parse(bytes(b))


def test_bad_qjl_flag_and_sketch_limit():
    with pytest.raises(wire.BadFieldError, match="use_qjl"):
        wire.parse(_header(use_qjl=2))
    with pytest.raises(wire.LimitError, match="MAX_QJL_SKETCH"):
        wire.parse(_header(use_qjl=1, qjl_m=0))


def test_ndim_limits():
    with pytest.raises(wire.LimitError, match="MAX_NDIM"):
        wire.parse(_prefix() + bytes([0]))
    with pytest.raises(wire.LimitError, match="MAX_NDIM"):
        wire.parse(_prefix() + bytes([wire.MAX_NDIM + 1]) + b"\0" * 8 * 40)


def test_negative_shape_and_head_dim_limits():
    with pytest.raises(wire.BadFieldError, match="negative"):
        wire.parse(_header(shape=(-1, 8)))
    with pytest.raises(wire.LimitError, match="MAX_DIM"):
        wire.parse(_header(shape=(4, 1)))
    with pytest.raises(wire.LimitError, match="MAX_DIM"):
        wire.parse(_header(shape=(4, wire.MAX_DIM + 1)))


def test_huge_shape_fails_before_allocation():
    # 2**40 vectors of 8: refused by the element limit, not by a MemoryError.
    with pytest.raises(wire.LimitError, match="MAX_ELEMENTS"):
        wire.parse(_header(shape=(1 << 40, 8)))
    # Within the limit but far longer than the blob: the section check refuses it.
    h = _header(shape=(1 << 30, 8))
    with pytest.raises(wire.TruncatedError):
        wire.parse(h + struct.pack("<q", (1 << 33) // 2) + b"\0" * 64)


@pytest.mark.parametrize("dtype", [b"int8", b"float64", b"\xff\xfe", b""])
def test_bad_dtype(dtype):
    with pytest.raises(wire.BadFieldError, match="dtype"):
        wire.parse(_header(dtype=dtype) + b"\0" * 64)


def test_declared_section_length_mismatch():
    h = _header(shape=(2, 8))  # 16 coords at 4 bits -> 8 index bytes, 4 norm bytes
    with pytest.raises(wire.SectionLengthError, match="indices section declares 9"):
        wire.parse(h + struct.pack("<q", 9) + b"\0" * 9)
    with pytest.raises(wire.SectionLengthError, match="norms section declares -4"):
        wire.parse(h + struct.pack("<q", 8) + b"\0" * 8 + struct.pack("<q", -4))


def test_trailing_bytes():
    with pytest.raises(wire.TrailingBytesError, match="1 bytes after"):
        wire.parse(_blob() + b"\0")


def test_wire_errors_are_value_errors_and_loads_uses_parser():
    assert issubclass(wire.WireError, ValueError)
    with pytest.raises(wire.BadMagicError):
        tq_jax.loads(b"XXXX" + b"\0" * 40)


def test_non_bytes_input_is_a_type_error():
    with pytest.raises(TypeError):
        wire.parse(12345)
    with pytest.raises(TypeError):
        wire.parse(np.zeros(4, np.float32))


def test_accepts_uint8_array_and_memoryview():
    b = _blob()
    assert wire.parse(np.frombuffer(b, np.uint8)).header == wire.parse(memoryview(b)).header
