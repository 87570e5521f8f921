"""TQ01 v2 log-coded norms (``norm_bits``) and the presets built on them: turbo-4, turbo-3.5, turbo-2.5.

Quality on a real model is measured by benchmarks/quality_lm.py (benchmarks/studies/quality-lm.md);
here: sizes, round trips, the norm grid's error bound, a golden blob, hostile input.
"""

import math
import struct
import zlib

import jax.numpy as jnp
import numpy as np
import pytest

import tq_jax
from tq_jax._src import norms as log_norms
from tq_jax._src import wire

from conftest import cosine

PRESET_BUDGET = {"turbo-4": 4.25, "turbo-3.5": 3.6, "turbo-2.5": 2.6}


def kv(shape, dtype=jnp.bfloat16, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape, np.float32)
    x *= np.exp(rng.standard_normal(shape[:-1] + (1,))).astype(np.float32)  # norms over ~2 decades
    return x.astype(dtype)




@pytest.mark.parametrize("name", sorted(PRESET_BUDGET))
@pytest.mark.parametrize("shape", [(2, 30, 256, 3, 64), (2, 32, 256, 8, 128)])
def test_preset_all_in_size_is_within_its_budget(name, shape):
    size = tq_jax.serialized_size(shape, "bfloat16", **tq_jax.PRESETS[name])
    assert size * 8 / math.prod(shape) <= PRESET_BUDGET[name]


@pytest.mark.parametrize("name", sorted(PRESET_BUDGET))
def test_preset_round_trips_with_exact_size(name):
    x = kv((2, 4, 32, 2, 64))
    blob = tq_jax.dumps(x, **tq_jax.PRESETS[name])
    assert len(blob) == tq_jax.serialized_size(x.shape, "bfloat16", **tq_jax.PRESETS[name])
    h = tq_jax.peek_header(blob)
    assert (h.version, h.norm_bits, h.rotation, h.checksum, h.norm_correction) == (2, 6, "hadamard", True, True)
    y = np.asarray(tq_jax.loads(blob))
    assert y.shape == x.shape and y.dtype == x.dtype
    kb, vb = h.bits, h.value_bits
    floor = {2: 0.93, 3: 0.975, 4: 0.99, 5: 0.997, 6: 0.999}
    assert cosine(y[0], x[0]).mean() >= floor[kb]
    assert cosine(y[1], x[1]).mean() >= floor[vb]


@pytest.mark.parametrize("norm_bits", [2, 4, 6, 8])
@pytest.mark.parametrize(
    "shape,opts",
    [
        ((2, 3, 8, 2, 32), dict(key_bits=4, value_bits=3)),
        ((2, 5, 4, 16), dict(key_bits=3, value_bits=3, skip_first_layers=1, skip_last_layers=1)),
        ((7, 3, 64), dict(bits=4)),  # no KV layout: a group per index of the first two axes
        ((9, 32), dict(bits=2)),  # 2-D: one group
    ],
)
def test_log_norms_are_within_half_a_step(norm_bits, shape, opts):
    x = kv(shape, jnp.float32, seed=norm_bits)
    blob = tq_jax.dumps(x, norm_bits=norm_bits, norm_correction=True, **opts)
    assert len(blob) == tq_jax.serialized_size(shape, "float32", norm_bits=norm_bits, norm_correction=True, **opts)
    p = wire.parse(blob)
    y = np.asarray(tq_jax.loads(blob))
    for (g, _, lo, hi, _), codes in zip(p.header.segments(), p.norms):
        assert isinstance(codes, wire.NormCodes)
        part = x if g is None else x[g, lo:hi]
        rec = y if g is None else y[g, lo:hi]
        groups = p.header.norm_groups(codes.count)
        assert groups == (1 if len(shape) < 3 else codes.count // math.prod(shape[2:-1]))
        n = np.linalg.norm(part.reshape(groups, -1, shape[-1]), axis=-1)
        n_hat = np.linalg.norm(rec.reshape(groups, -1, shape[-1]), axis=-1)  # nc: decoded norm = stored norm
        half_step = (codes.ranges[:, 1] - codes.ranges[:, 0]) / (2 * (2**norm_bits - 2))
        err = np.abs(np.log(n_hat / n)).max(1)
        assert (err <= half_step + 1e-4).all(), (err, half_step)


def test_zero_vectors_and_constant_norms():
    x = kv((2, 2, 4, 16), jnp.float32)
    x[0, 1, 2] = 0  # code 0: an exact zero
    x[1, 0] = 3.0 / 4  # a layer whose vectors all have norm 3: lo == hi
    y = np.asarray(tq_jax.loads(tq_jax.dumps(x, bits=3, norm_bits=4, norm_correction=True)))
    np.testing.assert_array_equal(y[0, 1, 2], 0)
    np.testing.assert_allclose(np.linalg.norm(y[1, 0], axis=-1), 3.0, rtol=1e-5)
    ranges, codes = log_norms.encode_log_norms(np.zeros(6, np.float32), 2, 5)
    np.testing.assert_array_equal(ranges, 0)
    np.testing.assert_array_equal(log_norms.decode_log_norms(ranges, codes, 5, 6), 0)


def test_codes_pack_lsb_first():
    ranges, codes = log_norms.encode_log_norms(np.exp(np.array([0, 1, 2, 3], np.float32)), 1, 3)
    # ln n = 0..3 on a 6-step grid: codes 1, 3, 5, 7. LSB-first, bit i of the stream is
    # bit i % 3 of code i // 3: stream bits 100 110 101 111 -> bytes 0b01011001, 0b1111.
    assert codes.tolist() == [0b01011001, 0b1111]
    np.testing.assert_allclose(log_norms.decode_log_norms(ranges, codes, 3, 4), np.exp([0, 1, 2, 3]), rtol=1e-6)


def test_bad_options_and_inputs_say_what_is_wrong():
    x = kv((2, 2, 4, 16))
    with pytest.raises(ValueError, match="`norm_bits` must be an int in 2..8, got 1"):
        tq_jax.dumps(x, bits=3, norm_bits=1)
    with pytest.raises(ValueError, match="`norm_bits` must be an int in 2..8, got 9"):
        tq_jax.dumps(x, bits=3, norm_bits=9)
    with pytest.raises(ValueError, match="norm_dtype='float32' both say"):
        tq_jax.dumps(x, bits=3, norm_bits=6, norm_dtype="float32")
    bad = np.asarray(x, np.float32)
    bad[0, 0, 0, 0] = np.inf
    with pytest.raises(ValueError, match="non-finite L2 norm"):
        tq_jax.dumps(bad, bits=3, norm_bits=6)


def test_existing_modes_do_not_change():
    x = kv((2, 3, 8, 2, 16))
    for opts in (dict(bits=4), dict(key_bits=4, value_bits=3, rotation="hadamard", norm_correction=True)):
        blob = tq_jax.dumps(x, **opts)
        assert tq_jax.peek_header(blob).norm_bits == 0
        assert blob == tq_jax.dumps(x, norm_bits=0, **opts)
        assert not blob[5] & wire.FLAG_NORM_CODES or blob[4] == 1


def _golden_input():
    g, l, t, k = np.meshgrid(np.arange(2), np.arange(3), np.arange(4), np.arange(16), indexing="ij")
    x = (np.sin(1 + 5 * g + 3 * l + 0.37 * k + 0.11 * t) * (1 + t + l)).astype(np.float32)
    x[1, 2, 3] = 0
    return x


# turbo-2.5 on _golden_input(): K 3 bits, V 2 bits, hadamard, nc, 6-bit log norms, CRC32.
GOLDEN_TURBO = (
    "54513031021b010302000000002a000000060402000000000000000300000000000000040000000000000010"
    "0000000000000007666c6f617433324800000000000000a2cdb9ec33359bcdd9ec43319bcdd9e443319b4dda"
    "e353319db24612daca9d324613ccca5c322613ccce6432261bbcce624db9ed2535624db9ed253562cdb9ec33"
    "35a3cdd9ec33352100000000000000f43f863f9d921a40abf2df3f2267294043520a40559f35400128ff4107"
    "ffc1f6fe300000000000000098629f749862af3498626f34d8726f3467dd608b679d608b679d508b679d90cb"
    "98229f7498229f7498629f74555555552100000000000000e920863fcacd1c4099c2dd3ff3b52a40d3460840"
    "1cd429400128ff0107ff01f9030000000000000000dc51d198"
)


def test_golden_turbo_blob():
    blob = tq_jax.dumps(_golden_input(), **tq_jax.PRESETS["turbo-2.5"])
    assert blob.hex() == GOLDEN_TURBO
    # By hand: 17-byte prefix (flags CHECKSUM|NC|KV|NORM_CODES), norm_bits, shape, dtype.
    assert blob[:18] == struct.pack("<4sBBBBBHHiB", b"TQ01", 2, 0x1B, 1, 3, 2, 0, 0, 42, 6)
    off = 18 + 1 + 4 * 8 + 1 + 7
    n_vec = 3 * 4  # 3 layers x 4 tokens per group
    norms = 3 * 8 + (n_vec * 6 + 7) // 8  # a float32 (lo, hi) per layer + 6-bit codes
    for name, n in (("K idx", n_vec * 16 * 3 // 8), ("K norms", norms), ("V idx", n_vec * 16 * 2 // 8),
                    ("V norms", norms), ("raw", 0)):
        assert struct.unpack_from("<q", blob, off)[0] == n, name
        if name == "V norms":  # the zero vector (V, layer 2, token 3) has code 0: the top 6 bits
            codes = np.frombuffer(blob[off + 8 + 24 : off + 8 + n], np.uint8)
            assert codes[-1] >> 2 == 0
        off += 8 + n
    assert off + 4 == len(blob) and struct.unpack("<I", blob[-4:])[0] == zlib.crc32(blob[:-4])
    y = np.asarray(tq_jax.loads(blob))
    assert cosine(y[0], _golden_input()[0]).mean() > 0.95
    np.testing.assert_array_equal(y[1, 2, 3], 0)


def _plain_blob(**extra):
    return bytearray(tq_jax.dumps(kv((2, 3, 4, 16), jnp.float32), key_bits=3, value_bits=2, norm_bits=6, **extra))


def test_hostile_norm_bits_field():
    blob = _plain_blob()
    assert blob[17] == 6
    for value in (0, 1, 9, 255):
        bad = bytearray(blob)
        bad[17] = value
        with pytest.raises(wire.BadFieldError, match="norm_bits"):
            wire.parse(bytes(bad))
    bad = bytearray(blob)
    bad[5] |= wire.FLAG_NORMS_F32
    with pytest.raises(wire.BadFieldError, match="NORMS_F32 and NORM_CODES"):
        wire.parse(bytes(bad))
    bad = bytearray(blob)
    bad[5] &= ~wire.FLAG_NORM_CODES  # the norm_bits byte is then read as ndim, sizes disagree
    with pytest.raises(wire.WireError):
        wire.parse(bytes(bad))
    for n in range(len(blob)):
        with pytest.raises(wire.WireError):
            wire.parse(bytes(blob[:n]))
    with pytest.raises(wire.WireError):
        wire.parse(bytes(blob) + b"\0")


@pytest.mark.parametrize("lo,hi", [(np.nan, 1.0), (0.0, np.inf), (2.0, 1.0), (0.0, 89.0), (-np.inf, 0.0)])
def test_hostile_norm_ranges(lo, hi):
    blob = _plain_blob()
    fields, lengths, _ = wire.field_offsets(bytes(blob))
    assert fields["norm_bits"] == (17, "<B")
    k_norms = lengths[1] + 8  # the K norms section: ranges first
    struct.pack_into("<ff", blob, k_norms + 8, lo, hi)  # layer 1's range
    with pytest.raises(wire.BadFieldError, match="log-norm range"):
        tq_jax.loads(bytes(blob))


def test_mutated_header_and_norm_sections_raise_only_wire_errors():
    blob = bytes(_plain_blob())
    clean_shape = tq_jax.peek_header(blob).shape
    _, lengths, _ = wire.field_offsets(blob)
    hot = list(range(lengths[2])) + list(range(lengths[1], lengths[1] + 8 + 24))  # header, K norms
    rng = np.random.default_rng(1)
    for _ in range(600):
        bad = bytearray(blob)
        for pos in rng.choice(hot, size=rng.integers(1, 4)):
            bad[pos] = rng.integers(256)
        try:
            y = tq_jax.loads(bytes(bad))
        except wire.WireError:
            continue
        assert y.shape == clean_shape  # a mutation that parses decodes to the blob's own shape


def test_preset_options_in_the_bridge():
    registry = pytest.importorskip("tq_jax.bridge._src.registry")
    o = registry.parse_options({"preset": "turbo-3.5", "head_dim": 64})
    assert o.codec_options()["norm_bits"] == 6 and o.codec_options()["key_bits"] == 4
    with pytest.raises(ValueError, match="norm_bits"):
        registry.parse_options({"norm_bits": 1})
