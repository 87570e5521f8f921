"""Bit packing: stored golden bytes and the bit-stream definition (no peer needed), and
the real reference, ``tqai.packing``, where it is installed."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tq_jax._src.packing import pack, pack_planes, packed_nbytes, plane_count, plane_order, unpack, unpack_groups

# Produced by running the reference (docs/TQ01.md, "Packing"); LSB-first bit stream.
GOLDEN = [
    (2, [1, 2, 3, 0, 3], [57, 3]),
    (3, [1, 2, 3, 4, 5, 6, 7, 0, 5], [209, 88, 31, 5]),
    (4, [1, 2, 3], [33, 3]),
    (6, [1, 63, 5, 33, 7], [193, 95, 132, 7]),
    (8, [0, 255, 7], [0, 255, 7]),
    # 1, 5, 7 bits follow the same rule: index i occupies bits [i*b, (i+1)*b).
    (1, [1, 0, 1, 1, 0, 0, 0, 1, 1], [0b10001101, 0b1]),
    (5, [31, 1], [0b00111111, 0b00]),
    (7, [1, 127], [0b10000001, 0b00111111]),
]


@pytest.mark.parametrize("bits,indices,packed", GOLDEN)
def test_golden_bytes(bits, indices, packed):
    got = np.asarray(pack(np.array(indices, np.uint8), bits)).tolist()
    assert got == packed
    back = np.asarray(unpack(np.array(packed, np.uint8), bits, len(indices))).tolist()
    assert back == indices


def _bitstream_reference(indices, bits):
    """Independent expectation: the bit-at-a-time definition of the stream."""
    n = len(indices)
    out = np.zeros(packed_nbytes(n, bits), np.uint8)
    for i, v in enumerate(indices):
        for k in range(bits):
            if (int(v) >> k) & 1:
                pos = i * bits + k
                out[pos // 8] |= 1 << (pos % 8)
    return out


def _check_roundtrip(idx, bits):
    packed = np.asarray(pack(idx, bits))
    assert packed.dtype == np.uint8 and packed.shape == (packed_nbytes(len(idx), bits),)
    np.testing.assert_array_equal(packed, _bitstream_reference(idx, bits))
    np.testing.assert_array_equal(np.asarray(unpack(packed, bits, len(idx))), idx)


@pytest.mark.parametrize("bits", range(1, 9))
def test_roundtrip_and_definition_every_width(bits):
    """One length per width that is not a whole number of bytes at any width (quick tier)."""
    _check_roundtrip(np.random.default_rng(bits).integers(0, 2**bits, 37).astype(np.uint8), bits)


# Every width at many lengths: each length compiles pack/unpack afresh (seconds in all).
@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(bits=st.integers(1, 8), data=st.data())
def test_roundtrip_and_definition(bits, data):
    n = data.draw(st.integers(1, 70))
    _check_roundtrip(np.array(data.draw(st.lists(st.integers(0, 2**bits - 1), min_size=n, max_size=n)), np.uint8), bits)


@pytest.mark.slow
@settings(max_examples=100, deadline=None)
@given(bits=st.sampled_from([2, 3, 4, 6, 8]), n=st.integers(1, 300), seed=st.integers(0, 2**31))
def test_matches_tqai(bits, n, seed):
    tqai_packing = pytest.importorskip("tqai.packing")  # only this test needs the peer
    idx = np.random.default_rng(seed).integers(0, 2**bits, n).astype(np.uint8)
    np.testing.assert_array_equal(np.asarray(pack(idx, bits)), tqai_packing.pack(idx, bits))
    np.testing.assert_array_equal(
        np.asarray(unpack(tqai_packing.pack(idx, bits), bits, n)), tqai_packing.unpack(tqai_packing.pack(idx, bits), bits, (n,))
    )


@pytest.mark.parametrize("bits", range(1, 9))
def test_batched_rows_pack_independently(bits):
    rng = np.random.default_rng(bits)
    idx = rng.integers(0, 2**bits, (3, 5, 13)).astype(np.uint8)
    rows = np.asarray(pack(idx, bits))
    assert rows.shape == (3, 5, packed_nbytes(13, bits))
    for r in np.ndindex(3, 5):
        np.testing.assert_array_equal(rows[r], _bitstream_reference(idx[r], bits))
    np.testing.assert_array_equal(np.asarray(unpack(rows, bits, 13)), idx)


@pytest.mark.parametrize("bits", range(1, 9))
def test_no_uint64_in_program(bits):
    jaxpr = str(jax.make_jaxpr(lambda a: unpack(pack(a, bits), bits, 37))(jnp.zeros(37, jnp.uint8)))
    assert "u64" not in jaxpr and "i64" not in jaxpr


def test_bad_bits_and_short_input():
    with pytest.raises(ValueError, match="1..8"):
        pack(np.zeros(4, np.uint8), 9)
    with pytest.raises(ValueError, match="need 2 bytes"):
        unpack(np.zeros(1, np.uint8), 4, 3)


# ----------------------------------------------------------------------------- planes


def _check_planes(idx, bits):
    # Independent expectation: pack() of the same indices in natural order.
    rows, n = idx.shape
    g = plane_count(bits)
    order = plane_order(n, bits)
    planes = idx[:, order].reshape(rows, g, n // g)
    assert planes[0, 1 % g, 0] == idx[0, 1 % g]  # plane i starts with natural index i
    packed = np.asarray(pack(idx, bits))
    np.testing.assert_array_equal(np.asarray(pack_planes(planes, bits)), packed)
    # and those bytes read back grouped in natural order
    np.testing.assert_array_equal(np.asarray(unpack_groups(packed, bits, n)).reshape(rows, n), idx)


@pytest.mark.parametrize("bits", range(1, 9))
def test_planes_pack_to_the_natural_bytes_every_width(bits):
    """Two rows of three plane groups per width (quick tier)."""
    n = plane_count(bits) * 3
    _check_planes(np.random.default_rng(bits).integers(0, 2**bits, (2, n)).astype(np.uint8), bits)


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(bits=st.integers(1, 8), data=st.data())
def test_planes_pack_to_the_natural_bytes(bits, data):
    n = plane_count(bits) * data.draw(st.integers(1, 40))
    rows = data.draw(st.integers(1, 3))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    _check_planes(rng.integers(0, 2**bits, size=(rows, n)).astype(np.uint8), bits)


def test_plane_count_is_the_smallest_byte_aligned_group():
    for bits in range(1, 9):
        g = plane_count(bits)
        assert (g * bits) % 8 == 0 and all((k * bits) % 8 for k in range(1, g))


def test_planes_refuse_unaligned_rows():
    with pytest.raises(ValueError, match="multiple of 8"):
        plane_order(12, 3)
    with pytest.raises(ValueError, match="shape"):
        pack_planes(np.zeros((4, 3), np.uint8), 4)
    with pytest.raises(ValueError, match="unpack_groups"):
        unpack_groups(np.zeros((5,), np.uint8), 4, 12)


@pytest.mark.slow
def test_unpack_groups_is_unpack_in_natural_order():
    # every width: 5 and 7 bits read two words per group, shifting lanes out of both
    rng = np.random.default_rng(4)
    for bits in range(1, 9):
        g = plane_count(bits)
        for n in sorted({g, 16, 8 * g, 128}):
            idx = rng.integers(0, 2**bits, (3, 5, n)).astype(np.uint8)
            got = np.asarray(unpack_groups(pack(idx, bits), bits, n))
            assert got.shape == (3, 5, n // g, g)
            np.testing.assert_array_equal(got.reshape(idx.shape), idx)
    with pytest.raises(ValueError, match="whole"):
        unpack_groups(np.zeros((2, 5), np.uint8), 3, 13)
