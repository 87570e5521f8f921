"""benchmarks/studies/passkey_codec_probe.py: the K/V it feeds the model are the cache's codes, decoded.

The probe replaces the coded span of a context's K/V with ``decode(encode(x))`` outside
the cache; its table is only worth reading if that is what a TQ01 blob of those vectors
decodes to, with the sinks, the window and the untouched side left bit for bit.
"""

import jax.numpy as jnp
import numpy as np
import pytest

import tq_jax
from benchmarks.studies.passkey_codec_probe import parse_variant, variant_kv

L, B, T, H, D = 3, 2, 40, 2, 64
SINKS, WINDOW = 4, 8


@pytest.fixture(scope="module")
def kv():
    rng = np.random.default_rng(0)
    k = (rng.standard_normal((L, B, T, H, D)) + 2.0).astype(np.float32)  # a common offset, as real keys have
    v = rng.standard_normal((L, B, T, H, D)).astype(np.float32)
    return jnp.asarray(k), jnp.asarray(v)


def _wire(x, bits, seed=42):
    """``x``'s vectors (last axis) as a v1 TQ01 blob decodes them (float16 norms, Haar)."""
    x = np.asarray(x, np.float32)
    flat = x.reshape(1, -1, 1, x.shape[-1])  # [layers, tokens, heads, dim]: every vector coded alone
    blob = tq_jax.dumps(np.stack([flat, flat]), bits=bits, seed=seed, norm_dtype="float16")
    return np.asarray(tq_jax.loads(blob, dtype=jnp.float32))[0].reshape(x.shape)


def _pair_energy(x):
    """Mean energy of each RoPE pair ``(i, i + D/2)`` over the vectors of ``x [T, D]``."""
    x = x.astype(np.float64)
    return (x[:, : D // 2] ** 2 + x[:, D // 2:] ** 2).mean(0)


def _assert_pairs_decode_as_a_blob(kk, x, layer, head, pairs, bits, seed):
    """The channels of ``pairs`` (both halves) of ``kk[layer, 0, :, head]`` are what a
    ``bits``-bit blob of just those channels of ``x`` decodes to."""
    chans = np.r_[pairs, pairs + D // 2]
    want = _wire(x[layer, 0, :, head][:, chans], bits, seed)
    np.testing.assert_allclose(kk[layer, 0, :, head][:, chans], want, rtol=0, atol=1e-5)


def test_the_coded_span_is_what_a_blob_decodes_to_and_the_rest_is_untouched(kv):
    k, v = kv
    kk, vv = variant_kv(k, v, key_bits=4, value_bits=None, rotation="haar", seed=42, norm_correction=False,
                        sinks=SINKS, window=WINDOW, centre_tokens=0)
    kk, vv = np.asarray(kk), np.asarray(vv)
    np.testing.assert_array_equal(vv, np.asarray(v))  # values exact
    np.testing.assert_array_equal(kk[:, :, :SINKS], np.asarray(k)[:, :, :SINKS])
    np.testing.assert_array_equal(kk[:, :, T - WINDOW:], np.asarray(k)[:, :, T - WINDOW:])
    np.testing.assert_allclose(kk[:, :, SINKS:T - WINDOW], _wire(k[:, :, SINKS:T - WINDOW], 4), rtol=0, atol=1e-5)


# slow: a benchmark probe's variants; the quick tier keeps the coded span = a blob's decode
@pytest.mark.slow
def test_layers_outside_the_slice_stay_exact(kv):
    k, v = kv
    kk, vv = variant_kv(k, v, key_bits=3, value_bits=2, rotation="hadamard", seed=42, norm_correction=True,
                        sinks=SINKS, window=WINDOW, centre_tokens=0, layers=slice(1, 2))
    kk, vv = np.asarray(kk), np.asarray(vv)
    for i in (0, 2):
        np.testing.assert_array_equal(kk[i], np.asarray(k)[i])
        np.testing.assert_array_equal(vv[i], np.asarray(v)[i])
    assert not np.array_equal(kk[1], np.asarray(k)[1]) and not np.array_equal(vv[1], np.asarray(v)[1])


def test_centring_codes_a_shorter_vector(kv):
    """Keys with a common offset: coding ``k - mu`` (mu from the first tokens) and adding
    ``mu`` back errs less than coding ``k``, the same codec otherwise."""
    k, v = kv
    args = dict(key_bits=3, value_bits=None, rotation="haar", seed=42, norm_correction=False, sinks=SINKS, window=WINDOW)
    plain = np.asarray(variant_kv(k, v, centre_tokens=0, **args)[0])
    centred = np.asarray(variant_kv(k, v, centre_tokens=16, **args)[0])
    err = lambda y: np.linalg.norm(y[:, :, SINKS:T - WINDOW] - np.asarray(k)[:, :, SINKS:T - WINDOW])  # noqa: E731
    assert err(centred) < 0.7 * err(plain), (err(centred), err(plain))


def test_variant_names():
    assert parse_variant("K5V3 hadamard nc") == dict(key_bits=5, value_bits=3, rotation="hadamard", seed=42,
                                                     norm_correction=True, centre_tokens=0, seeds="shared")
    assert parse_variant("K-V2 haar")["key_bits"] is None
    assert parse_variant("K4V3 (turbo-3.5)") == parse_variant("K4V3 hadamard nc")  # a named variant is a codec
    assert parse_variant("K3V2 centred", 100)["centre_tokens"] == 100
    with pytest.raises(SystemExit, match="K<bits>V<bits>"):
        parse_variant("K9V3 haar")


def test_noise_has_the_relative_rms_it_names(kv):
    k, v = kv
    kk, vv = variant_kv(k, v, **parse_variant("noise K0.05 V-"), sinks=SINKS, window=WINDOW)
    np.testing.assert_array_equal(np.asarray(vv), np.asarray(v))
    span = slice(SINKS, T - WINDOW)
    a, b = np.asarray(k, np.float64)[:, :, span], np.asarray(kk, np.float64)[:, :, span]
    rel = np.sqrt(np.sum((a - b) ** 2) / np.sum(a**2))
    assert abs(rel - 0.05) < 0.05 * 0.05, rel  # ~18k coordinates: within 5 % of the target


def test_per_block_seeds_code_each_block_with_its_own_rotation(kv):
    """seeds="block": the tokens at positions 64..127 of layer 1 get the rotation of seed
    42 + 7919 * 1 + 104729 * 1, and the tokens before them that of block 0."""
    rng = np.random.default_rng(5)
    k = jnp.asarray(rng.standard_normal((2, 1, 150, H, D)).astype(np.float32))
    kk, _ = variant_kv(k, k, **dict(parse_variant("K4V- haar per-block"), seed=42), sinks=SINKS, window=10)
    kk = np.asarray(kk)
    np.testing.assert_array_equal(kk[:, :, :SINKS], np.asarray(k)[:, :, :SINKS])
    for block, span in ((0, slice(SINKS, 64)), (1, slice(64, 128)), (2, slice(128, 140))):
        cfg = tq_jax.CodecConfig(D, 4, 42 + 7919 + 104729 * block, "haar")
        enc = tq_jax.encode(k[1, :, span], cfg)
        want = tq_jax.decode(enc._replace(norms=enc.norms.astype(jnp.float16).astype(jnp.float32)), cfg)
        np.testing.assert_allclose(kk[1, :, span], np.asarray(want), rtol=0, atol=1e-6)


# slow: a benchmark probe's variants; the quick tier keeps the coded span = a blob's decode
@pytest.mark.slow
def test_outlier_split_codes_the_loudest_rope_pairs_at_the_high_width():
    """``K<hi>/<m>+<lo>``: per layer and head, the ``m`` channels of most energy (whole
    RoPE pairs ``(i, i + D/2)``, loudest first) decode as a ``hi``-bit blob of just those
    channels, and the others as a ``lo``-bit blob of the rest (seed + 1)."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 1, 30, H, D)).astype(np.float32)
    x[0, ..., 0, [3, 3 + D // 2]] *= 10  # layer 0, head 0: pair 3 is loud
    x[1, ..., 1, [20, 20 + D // 2]] *= 10  # layer 1, head 1: pairs 20 and 5
    x[1, ..., 1, [5, 5 + D // 2]] *= 5
    spec = parse_variant("K8/4+2V- haar")
    assert spec["key_bits"] == (4, 8, 2)
    kk, vv = variant_kv(jnp.asarray(x), jnp.asarray(x), **spec, sinks=0, window=0)
    kk = np.asarray(kk)
    np.testing.assert_array_equal(np.asarray(vv), x)
    for layer in range(2):
        for head in range(H):
            order = np.argsort(-_pair_energy(x[layer, 0, :, head]))
            if (layer, head) == (0, 0):
                assert order[0] == 3
            if (layer, head) == (1, 1):
                assert list(order[:2]) == [20, 5]
            for pairs, bits, seed in ((order[:2], 8, 42), (order[2:], 2, 43)):
                _assert_pairs_decode_as_a_blob(kk, x, layer, head, pairs, bits, seed)
    with pytest.raises(SystemExit, match="RoPE pairs"):
        variant_kv(jnp.asarray(x), jnp.asarray(x), **parse_variant("K8/3+2V- haar"), sinks=0, window=0)


def test_waterfill_bits_spend_the_plain_codes_bytes_and_follow_the_energy():
    """Reverse water-filling in whole bits: equal energies get the plain width; a pair
    4x louder gets one bit more (Gaussian distortion falls 4x a bit); codes plus a
    float16 norm per group never exceed the plain code's bits and one norm."""
    from benchmarks.studies.passkey_codec_probe import NORM_BITS, waterfill_bits

    assert waterfill_bits(np.ones(32), 5).tolist() == [5] * 32
    e = np.ones(32)
    e[:16] = 4.0
    b = waterfill_bits(e, 5)
    assert set(b[:16].tolist()) == {b[0]} and set(b[16:].tolist()) == {b[0] - 1}
    rng = np.random.default_rng(3)
    for bits in (3, 4, 5):
        e = np.exp(rng.standard_normal(32) * 2)
        b = waterfill_bits(e, bits)
        groups = len(set(b[b > 0].tolist()))
        assert 2 * b.sum() + NORM_BITS * groups <= 2 * 32 * bits + NORM_BITS
        loud, quiet = int(np.argmax(e)), int(np.argmin(e))
        assert b[loud] > b[quiet]
        free = waterfill_bits(e, bits, norm_bits=0)  # the bound: groups' norms free, all the code bits spent
        assert 2 * free.sum() == 2 * 32 * bits
    assert parse_variant("Kwf0n5V3 haar nc")["key_bits"] == "wf0n5"


# slow: a benchmark probe's variants; the quick tier keeps the coded span = a blob's decode
@pytest.mark.slow
def test_waterfilled_keys_decode_each_group_as_its_own_blob():
    """``Kwf<bits>``: per layer and head, the pairs of each width (from the first 256
    coded tokens' energy) decode as a blob of just those channels at that width (seed
    + width); values untouched with ``V-``; Hadamard is refused (groups of any size)."""
    from benchmarks.studies.passkey_codec_probe import waterfill_bits

    rng = np.random.default_rng(9)
    x = rng.standard_normal((2, 1, 30, H, D)).astype(np.float32)
    x[..., : D // 4] *= 6  # the first 16 pairs loud
    x[..., D // 2: D // 2 + D // 4] *= 6
    spec = parse_variant("Kwf4V- haar")
    kk, vv = variant_kv(jnp.asarray(x), jnp.asarray(x), **spec, sinks=0, window=0)
    kk = np.asarray(kk)
    np.testing.assert_array_equal(np.asarray(vv), x)
    for layer in range(2):
        for head in range(H):
            b = waterfill_bits(_pair_energy(x[layer, 0, :, head]), 4)
            assert b[:16].min() > b[16:].max()  # the loud pairs get more bits
            for level in set(b[b > 0].tolist()):
                _assert_pairs_decode_as_a_blob(kk, x, layer, head, np.flatnonzero(b == level), level, 42 + level)
    with pytest.raises(SystemExit, match="haar"):
        parse_variant("Kwf4V- hadamard")
