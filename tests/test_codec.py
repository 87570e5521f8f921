"""The jit codec: quality against theory, edge values, jit/vmap use, compilation counts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tq_jax
from tq_jax._src import _kernels as kernels  # the kernels alone, through their own names
from tq_jax._src import blob, codebook, codec, packing
from tq_jax._src import rotation as rotation_mod

from conftest import cosine, sweep

W1 = (2, 32, 256, 8, 128)  # one LLaMA-3-8B LMCache chunk, per head




@pytest.fixture(scope="module")
def w1():
    return np.random.default_rng(0).standard_normal(W1, np.float32).astype(jnp.bfloat16)


# Quick tier: 4 bits; test_numerics.test_every_bit_width checks every width against theory.
@pytest.mark.parametrize("bits,floor", sweep([(4, 0.9950), (3, 0.9826), (2, 0.9400)]))
def test_quality_on_gaussian_w1(w1, bits, floor):
    out = tq_jax.loads(tq_jax.dumps(w1, bits=bits))
    assert out.dtype == jnp.bfloat16 and out.shape == W1
    assert cosine(out, w1).mean() >= floor


# Quick tier: 1 and 4 bits to 2 %; test_numerics.test_every_bit_width checks every width to 10 %.
@pytest.mark.parametrize("bits", sweep([1, 4, 2, 3, 5], fast=2))
def test_unit_vector_mse_matches_lloyd_max_theory(bits):
    d, n = 128, 16384
    x = np.random.default_rng(bits).standard_normal((n, d)).astype(np.float32)
    u = x / np.linalg.norm(x, axis=1, keepdims=True)
    cfg = tq_jax.CodecConfig(d, bits)
    u_hat = np.asarray(tq_jax.decode(tq_jax.encode(u, cfg), cfg))
    mse = np.mean((u_hat - u) ** 2)  # rotation is orthogonal: same MSE as in rotated space
    theory = codebook.expected_mse(d, bits)
    assert abs(mse / theory - 1) <= 0.02, (mse, theory)


@pytest.mark.parametrize("bits", range(1, 9))
def test_indices_are_nearest_centroid(bits):
    # Independent expectation: argmin |y - c| on the rotated unit vectors (small batch).
    d = 64
    x = np.random.default_rng(bits).standard_normal((64, d)).astype(np.float32)
    t = codec.tables(tq_jax.CodecConfig(d, bits))
    y = (x / (np.linalg.norm(x, axis=1, keepdims=True) + 1e-10)) @ t.rotation.dense.T
    want = np.abs(y[..., None] - t.centroids).argmin(-1)
    idx, _ = kernels.encode_indices(x, t.rotation, t.boundaries, None if t.grid is None else t.grid)
    assert (np.asarray(idx) == want).mean() >= 0.999


# Quick tier: the ends of both quantizers (binary search up to 4 bits, grid from 5).
@pytest.mark.parametrize("bits", sweep([1, 4, 5, 8, 2, 3, 6, 7], fast=4))
def test_quantizer_counts_boundaries_strictly_below(bits):
    # Independent expectation: numpy's searchsorted (side="left" counts b < y), on
    # random values, every boundary itself, its float32 neighbours (bar subnormals), ±0, ±inf
    # and NaN.
    t = codec.tables(tq_jax.CodecConfig(64, bits))
    b = t.boundaries
    y = np.concatenate(
        [
            np.random.default_rng(bits).normal(0, 0.15, 4000).astype(np.float32),
            b,
            np.nextafter(b, np.float32(np.inf)),
            np.nextafter(b, np.float32(-np.inf)),
            np.array([0.0, -0.0] + ([np.inf, -np.inf] if bits <= 4 else []), np.float32),
        ]
    )  # (wider codebooks send non-finite coordinates to cell 0: their vector's norm is non-finite)
    y = y[~((y != 0) & (np.abs(y) < np.finfo(np.float32).tiny))]  # XLA's CPU flushes subnormals to zero
    got = np.asarray(kernels.quantize(jnp.asarray(y), jnp.asarray(b), None if t.grid is None else t.grid))
    np.testing.assert_array_equal(got, np.searchsorted(b, y, side="left"))
    if bits <= 4:
        assert np.asarray(kernels.quantize(jnp.float32(np.nan), jnp.asarray(b), t.grid)) == 0


# Quick tier: (64, 4) Haar. Unaligned rows such as (12, 3) run the natural pipeline itself;
# Hadamard rows are the group kernels (quick in the two group tests below).
@pytest.mark.parametrize("rotation", sweep(["haar", "hadamard"]))
@pytest.mark.parametrize("dim,bits", sweep([(64, 4), (12, 3), (96, 3), (128, 2), (80, 6), (64, 1)]))
def test_row_kernels_equal_the_natural_order_pipeline(dim, bits, rotation):
    # The planar kernels (indices never in natural order) against encode_indices +
    # pack / unpack + decode_indices; (12, 3) has unaligned rows (the natural path).
    cfg = tq_jax.CodecConfig(dim, bits, rotation=rotation)
    t = codec.device_tables(cfg)
    x = np.random.default_rng(dim * bits).standard_normal((300, dim)).astype(np.float32)
    idx, norms = jax.jit(lambda x: kernels.encode_indices(x, t.rotation, t.boundaries, t.grid))(x)
    rows, norms2 = jax.jit(lambda x: kernels.encode_rows(x, t, bits))(x)
    natural = np.asarray(packing.pack(idx, bits))
    assert (np.asarray(rows) == natural).mean() >= 0.999  # a tie may round the other way
    np.testing.assert_array_equal(np.asarray(norms2), np.asarray(norms))
    unpacked = packing.unpack(natural, bits, dim)
    want = jax.jit(lambda i, n: kernels.decode_indices(i, n, t.rotation, t.centroids, jnp.float32))(unpacked, norms)
    got = jax.jit(lambda r, n: kernels.decode_rows(r, n, t, bits, jnp.float32))(natural, norms)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=2e-5 * float(np.abs(want).max()))


@pytest.mark.parametrize("dim,bits", sweep([(16, 4), (32, 7), (112, 5), (128, 3), (128, 8)]))
def test_group_kernel_equals_the_natural_order_pipeline(dim, bits):
    # The Hadamard group kernel (planes per 16-group, outer factor as sums) against
    # encode_indices + pack, with two batch axes; each group fills 2*bits bytes.
    t = codec.device_tables(tq_jax.CodecConfig(dim, bits, rotation="hadamard"))
    assert kernels.grouped(dim, t.rotation)
    x = np.random.default_rng(dim + bits).standard_normal((3, 50, dim)).astype(np.float32)
    idx, norms = jax.jit(lambda x: kernels.encode_indices(x, t.rotation, t.boundaries, t.grid))(x)
    groups, norms2 = jax.jit(lambda x: kernels.encode_groups(x, t, bits))(x)
    assert groups.shape == (3, 50, dim // 16, 2 * bits)
    natural = np.asarray(packing.pack(idx, bits))
    assert (np.asarray(groups).reshape(natural.shape) == natural).mean() >= 0.999  # ties may round apart
    np.testing.assert_array_equal(np.asarray(norms2), np.asarray(norms))


@pytest.mark.parametrize("nc", [False, True])
@pytest.mark.parametrize("dim,bits", sweep([(128, 4), (80, 3), (16, 4), (48, 1), (112, 5), (96, 6), (128, 7), (128, 8)]))
def test_group_decode_is_decode_rows_bit_for_bit(dim, bits, nc):
    # The group decoder (16-groups, norm correction through a per-vector codebook)
    # against decode_rows (whole rows, the rotation's own matrices): the same sums in
    # the same order, so the same bits; every width (5 and 7 bits read two words). Op by
    # op on purpose: jitted, XLA fuses each program its own way, and at 128 dims, 8 bits
    # with nc one of the 10,240 bf16 values differs (a cancelling sum rounds apart).
    t = codec.device_tables(tq_jax.CodecConfig(dim, bits, rotation="hadamard"))
    x = np.random.default_rng(dim * bits).standard_normal((2, 40, dim)).astype(np.float32)
    rows, norms = kernels.encode_rows(jnp.asarray(x), t, bits)
    want = np.asarray(kernels.decode_rows(rows, norms, t, bits, jnp.bfloat16, nc))
    got = np.asarray(kernels.decode_groups(rows, norms, t, bits, jnp.bfloat16, nc))
    assert got.shape == (2, 40, dim // 16, 16)
    np.testing.assert_array_equal(got.reshape(want.shape).view(np.uint16), want.view(np.uint16))
    if nc:  # rescaled to unit length before the norms: each row's norm is its stored norm
        unit = np.asarray(kernels.decode_rows(rows, jnp.ones_like(norms), t, bits, jnp.float32, True))
        np.testing.assert_allclose(np.linalg.norm(unit, axis=-1), 1.0, rtol=2e-6)


def test_bfloat16_cast_rounds_like_astype():
    # The decoders' integer round-to-nearest-even against ml_dtypes' conversion: random
    # float32 bit patterns (NaNs and infinities among them), every tie, the largest
    # finite values (which round to inf). Subnormals are left out: XLA's CPU flushes them.
    rng = np.random.default_rng(11)
    bits = np.concatenate([
        rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32),
        (rng.integers(0, 2**16, 20_000).astype(np.uint32) << 16) | 0x8000,
        np.array([0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F800001, 0xFFC00001, 0, 0x80000000], np.uint32),
    ])
    v = bits.view(np.float32)
    v = v[~((np.abs(v) < np.finfo(np.float32).tiny) & (v != 0))]
    got = np.asarray(jax.jit(lambda a: kernels.cast(a, jnp.bfloat16))(v))
    with np.errstate(invalid="ignore"):  # NaN in, NaN out
        want = v.astype(jnp.bfloat16)
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


def test_zero_vectors_decode_to_exact_zeros():
    x = np.random.default_rng(1).standard_normal((4, 6, 64)).astype(np.float32)
    x[1, 2] = 0
    x[3] = 0
    for bits in (2, 4, 8):
        out = np.asarray(tq_jax.loads(tq_jax.dumps(x, bits=bits)))
        assert np.all(out[1, 2] == 0) and np.all(out[3] == 0)
        assert np.all(np.isfinite(out))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_vector_stays_non_finite_and_isolated(bad):
    x = np.random.default_rng(2).standard_normal((5, 64)).astype(np.float32)
    clean = np.asarray(tq_jax.loads(tq_jax.dumps(x, bits=4)))
    x[2, 7] = bad
    out = np.asarray(tq_jax.loads(tq_jax.dumps(x, bits=4)))
    assert not np.all(np.isfinite(out[2]))
    others = [0, 1, 3, 4]
    np.testing.assert_array_equal(out[others], clean[others])


def test_norm_overflow_is_an_error_with_the_facts():
    x = np.random.default_rng(3).standard_normal((10, 64)).astype(np.float32)
    x[[2, 5]] *= 1e5
    with pytest.raises(tq_jax.NormOverflowError, match=r"2 of 10 vectors.*largest: .*version 2"):
        tq_jax.dumps(x, bits=4, norm_dtype="float16")
    buf = bytearray(tq_jax.serialized_size(x.shape, "float32", 4))
    with pytest.raises(tq_jax.NormOverflowError):
        tq_jax.dump_into(x, buf, bits=4, norm_dtype="float16")
    assert buf == bytearray(len(buf))  # nothing written
    # The default ("auto") keeps them: float32 norms, version 2, nothing lost.
    b = tq_jax.dumps(x, bits=4)
    assert tq_jax.parse(b).header.version == 2 and tq_jax.parse(b).header.norm_dtype == "float32"
    assert cosine(tq_jax.loads(b), x).min() > 0.98
    with pytest.raises(ValueError, match="overflow float16"):
        tq_jax.dump_into(x, bytearray(tq_jax.serialized_size(x.shape, "float32", 4)), bits=4)


# Quick tier: Haar. Hadamard under jit and vmap runs quick in test_jit_orders, its matrix
# against numpy in test_v2's structured-rotation test.
@pytest.mark.parametrize("rotation", sweep(["haar", "hadamard"]))
def test_jit_parity_and_user_jit_vmap(rotation):
    cfg = tq_jax.CodecConfig(64, 3, seed=9, rotation=rotation)
    x = jnp.asarray(np.random.default_rng(4).standard_normal((3, 5, 64)), jnp.float32)
    t = codec.tables(cfg)
    # Un-jitted private implementation vs the jitted public function.
    with jax.disable_jit():
        idx, norms = kernels.encode_indices(x, t.rotation, t.boundaries, t.grid)
        eager = tq_jax.encode(x, cfg)
    jitted = tq_jax.encode(x, cfg)
    np.testing.assert_array_equal(np.asarray(eager.packed), np.asarray(jitted.packed))
    np.testing.assert_allclose(np.asarray(eager.norms), np.asarray(jitted.norms), rtol=1e-6)
    # Independent expectation: numpy's rotation, boundary count and LSB-first packing.
    xn = np.asarray(x, np.float64).reshape(-1, 64)
    rot = t.rotation.dense if rotation == "haar" else rotation_mod.structured_rotation(64, 9).dense()
    y = (xn / (np.linalg.norm(xn, axis=1, keepdims=True) + 1e-10)) @ np.asarray(rot, np.float64).T
    want_idx = np.searchsorted(t.boundaries.astype(np.float64), y, side="left")
    got_idx = np.asarray(packing.unpack(jitted.packed, 3, 64)).reshape(-1, 64)
    assert (got_idx == want_idx).mean() >= 0.999
    bitplanes = (want_idx[..., None] >> np.arange(3)) & 1  # LSB first, index after index
    want_rows = np.packbits(bitplanes.reshape(len(want_idx), -1).astype(np.uint8), axis=1, bitorder="little")
    got_rows = np.asarray(jitted.packed).reshape(-1, 24)
    agree = (got_idx == want_idx).all(1)
    np.testing.assert_array_equal(got_rows[agree], want_rows[agree])
    np.testing.assert_allclose(np.asarray(jitted.norms).reshape(-1), np.linalg.norm(xn, axis=1), rtol=1e-6)
    # Inside the user's own jit and vmap.
    roundtrip = jax.jit(lambda a: tq_jax.decode(tq_jax.encode(a, cfg), cfg, jnp.bfloat16))
    out = roundtrip(x)
    assert out.dtype == jnp.bfloat16 and out.shape == x.shape
    vm = jax.vmap(lambda a: tq_jax.encode(a, cfg))(x)
    np.testing.assert_array_equal(np.asarray(vm.packed), np.asarray(jitted.packed))
    assert cosine(out, x).mean() > 0.97


def test_packed_rows_concatenate_to_the_wire_stream():
    x = np.random.default_rng(5).standard_normal((2, 9, 96)).astype(np.float32)
    cfg = tq_jax.CodecConfig(96, 6)
    rows = np.asarray(tq_jax.encode(x, cfg).packed)
    assert rows.tobytes() == tq_jax.parse(tq_jax.dumps(x, bits=6)).indices[0].tobytes()


def test_second_call_does_not_recompile(compiles):
    x = np.random.default_rng(6).standard_normal((3, 40, 64)).astype(np.float32)
    b = tq_jax.dumps(x, bits=4)
    tq_jax.loads(b)
    assert compiles.count > 0, "the compile counter saw nothing: this test would pass vacuously"
    programs, n = blob.compiled_programs(), compiles.count
    for _ in range(3):
        b = tq_jax.dumps(x, bits=4)
        tq_jax.loads(b)
    assert compiles.count == n
    assert blob.compiled_programs() == programs
    cfg = tq_jax.CodecConfig(64, 4)
    xj = jnp.asarray(x)
    tq_jax.encode(xj, cfg)
    n = compiles.count
    tq_jax.encode(xj + 1, cfg)
    tq_jax.encode(xj, tq_jax.CodecConfig(64, 4, seed=1))  # seed is data, not a static arg
    assert compiles.count == n + 1  # the `+ 1` above, not encode


@pytest.mark.slow
def test_chunk_stream_compiles_a_bounded_number_of_programs():
    # LMCache-style chunks [2, L, T, H, D] for every token count T = 1..256.
    before = blob.compiled_programs()
    shapes = set()
    for t in range(1, 257):
        x = np.zeros((2, 2, t, 2, 64), jnp.bfloat16)
        x[..., 0] = 1
        tq_jax.dumps(x, bits=2)
        shapes.add(blob.bucket(2 * 2 * t * 2))
    compiled = blob.compiled_programs() - before
    # 256 distinct lengths (8..2048 vectors) -> one program per bucket: 17 here.
    assert compiled <= len(shapes) <= 17


def test_bucket_sizes():
    assert [blob.bucket(n) for n in (1, 8, 9, 16, 17, 24, 25, 33, 49, 100, 8192)] == [
        8, 8, 16, 16, 24, 24, 32, 48, 64, 128, 8192
    ]
    for n in range(1, 5000):
        b = blob.bucket(n)
        assert b >= n and b % 8 == 0 and (b <= 16 or b <= 1.5 * n)


@pytest.mark.parametrize("dim", sweep([128, 80, 256]))
def test_hadamard_float32_norms_are_the_same_bits_in_any_block(dim):
    # Hadamard norms are summed in a fixed order: XLA's CPU reduction gave 8- and
    # 16-vector blocks norms one ulp away from 4096-vector ones, which float32 norms
    # store. (Haar keeps XLA's reduction: see kernels.squared_norms.) 256 runs the
    # natural-order pipeline, the others the group kernel.
    x = np.random.default_rng(3).standard_normal((203, dim)).astype(jnp.bfloat16)
    one = tq_jax.dumps(x, bits=4, rotation="hadamard", norm_dtype="float32")
    for block in (8, 16, 24, 1000):
        assert tq_jax.dumps(x, bits=4, rotation="hadamard", norm_dtype="float32", block_vectors=block) == one


@pytest.mark.parametrize("dim,bits", sweep([(64, 3), (128, 4), (80, 2)]))
def test_hadamard_norm_correction_decodes_the_same_bits_in_any_block(dim, bits):
    # Norm correction sums squares in a fixed order: XLA's CPU reduction orders its
    # sums by batch size (8- and 16-vector blocks came out one ulp apart).
    x = np.random.default_rng(dim).standard_normal((203, dim)).astype(np.float32)
    b = tq_jax.dumps(x, bits=bits, rotation="hadamard", norm_correction=True)
    whole = np.asarray(tq_jax.loads(b))
    for block in (8, 16, 24, 1000):
        np.testing.assert_array_equal(np.asarray(tq_jax.loads(b, block_vectors=block)), whole)


@pytest.mark.parametrize("block", sweep([8, 1000, 24, 64], fast=2))  # quick tier: many blocks and one
@pytest.mark.parametrize("dim,bits", sweep([(64, 3), (13, 3), (7, 6), (5, 2)], fast=2))
def test_blocking_does_not_change_bytes(block, dim, bits):
    # dim*bits not a multiple of 8 (13*3, 7*6, 5*2) exercises the flat stream across blocks.
    x = np.random.default_rng(dim).standard_normal((203, dim)).astype(np.float32)
    one = tq_jax.dumps(x, bits=bits, block_vectors=1 << 20)
    assert tq_jax.dumps(x, bits=bits, block_vectors=block) == one
    # Decoded values may differ in the last float32 bit: XLA picks its matmul kernel
    # by shape, and the summation order with it.
    np.testing.assert_allclose(
        np.asarray(tq_jax.loads(one, block_vectors=block)), np.asarray(tq_jax.loads(one)), atol=2e-6
    )


def test_dtypes_and_load_into():
    x = np.random.default_rng(7).standard_normal((2, 3, 4, 64)).astype(np.float16)
    b = tq_jax.dumps(x, bits=4)
    assert tq_jax.loads(b).dtype == jnp.float16
    assert tq_jax.loads(b, dtype=jnp.float32).dtype == jnp.float32
    out = np.empty((2, 3, 256), np.float32)  # [.., H*D] receives [.., H, D]
    tq_jax.load_into(b, out)
    np.testing.assert_allclose(out.reshape(x.shape), np.asarray(tq_jax.loads(b, dtype=jnp.float32)))
    with pytest.raises(ValueError, match="same number of values"):
        tq_jax.load_into(b, np.empty((2, 3, 255), np.float32))
    with pytest.raises(ValueError, match="floating"):
        tq_jax.loads(b, dtype=jnp.int32)


def test_bad_inputs_say_how_to_fix():
    with pytest.raises(ValueError, match="`bits` must be an int in 1..8, got 9"):  # the argument given
        tq_jax.dumps(np.zeros((2, 64), np.float32), bits=9)
    with pytest.raises(ValueError, match="`key_bits` must be an int in 1..8, got 9"):
        tq_jax.dumps(np.zeros((2, 64), np.float32), key_bits=9, value_bits=4)
    with pytest.raises(ValueError, match="give `bits`"):
        tq_jax.dumps(np.zeros((2, 64), np.float32))
    with pytest.raises(ValueError, match=r"head_dim >= 2, got shape \(\)"):  # a 0-d input, as given
        tq_jax.dumps(np.float32(1.0), bits=4)
    with pytest.raises(ValueError, match="bfloat16, float16 or float32"):
        tq_jax.dumps(np.zeros((2, 64), np.float64), bits=4)
    with pytest.raises(ValueError, match="head_dim >= 2"):
        tq_jax.dumps(np.zeros((2, 1), np.float32), bits=4)
    with pytest.raises(ValueError, match="needs 1"):
        tq_jax.dump_into(np.zeros((2, 64), np.float32), bytearray(10), bits=4)
    with pytest.raises(ValueError, match="`bits` must be an int in 1..8"):
        tq_jax.CodecConfig(64, 9)
    with pytest.raises(ValueError, match="last axis must be dim=64"):
        tq_jax.encode(jnp.zeros((3, 32)), tq_jax.CodecConfig(64, 4))


def test_dump_into_writes_exact_size():
    x = np.random.default_rng(8).standard_normal((3, 5, 64)).astype(np.float32)
    need = tq_jax.serialized_size(x.shape, "float32", 3)
    buf = np.zeros(need + 10, np.uint8)
    assert tq_jax.dump_into(x, buf, bits=3) == need
    assert buf[:need].tobytes() == tq_jax.dumps(x, bits=3)
    assert not buf[need:].any()


def test_encode_kernel_cache_is_bounded(monkeypatch):
    # a small bound exercises the same eviction (the real one would compile 69 programs)
    from tq_jax._src import _lru

    monkeypatch.setattr(codec, "_encoders", _lru.LRU("test encoders", 3))
    x = np.random.default_rng(9).standard_normal((8, 16)).astype(np.float32)
    seeds = range(1000, 1008)
    for seed in seeds:
        tq_jax.dumps(x, bits=2, seed=seed)
        assert len(codec._encoders) <= 3
    kept = {key[2] for key in codec._encoders.keys()}  # (dim, bits, seed, rotation, trellis, device)
    assert kept == set(seeds[-3:]), kept  # oldest first out
