"""tq_jax.kvcache's exact window and sinks: attention reads the last ``window`` tokens
and the first ``sinks`` exactly and every other token from its codes.

The reference is independent of the cache: ``tq_jax._src.kvcache.reference.attend``, dense
float64 attention over K/V built from the tokens as given (exact positions) and
``tq_jax.loads`` of ``tq_jax.dumps`` of the same tokens (the rest), and ``tq_jax.dumps``
for the bytes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tq_jax
from conftest import sweep
from kvcache_helpers import D, H, attend_reference, dumps_kv, fill, with_impls
from tq_jax import kvcache
from tq_jax._src.kvcache.reference import dense_attention


# (rotation, key_bits, value_bits, q_heads // kv_heads, page_size, window, sinks, q_len)
CASES = [
    pytest.param("haar", 2, 3, 4, 8, 5, 2, 3, id="haar-2/3-gqa4-paged8-w5-s2-q3"),
    pytest.param("haar", 4, 4, 1, None, 8, 0, 1, id="haar-4/4-gqa1-unpaged-w8-q1"),
    pytest.param("hadamard", 4, 2, 3, None, 16, 4, 1, id="hadamard-4/2-gqa3-unpaged-w16-s4-q1"),
    pytest.param("hadamard", 3, 3, 1, 16, 0, 3, 2, id="hadamard-3/3-gqa1-paged16-sinks-only-q2"),
]
IMPLS = ["xla", "pallas_tpu", "pallas_gpu"]  # the Pallas kernels run in interpret mode on CPU


# Quick tier: every impl on the first case (paged, window and sinks, GQA 4, a query block);
# the rest are slow (unpaged with a window and sinks: test_load_brings_codes_only_...; the
# Hadamard rotation: the turbo-3.5 tests).
@pytest.mark.parametrize("rotation,kb,vb,group,page_size,window,sinks,q_len,impl", with_impls(CASES, IMPLS, quick=(0,)))
def test_attend_reads_window_and_sinks_exactly_and_the_rest_from_codes(
    rotation, kb, vb, group, page_size, window, sinks, q_len, impl
):
    rng = np.random.default_rng(kb * 10 + vb + window)
    cache = kvcache.init(3, 48, H, D, key_bits=kb, value_bits=vb, rotation=rotation, seed=11, page_size=page_size,
                         dtype=jnp.float32, block_tokens=16, window=window, sinks=sinks)
    # ragged lengths 32, 27, 25 over two appends: the window ring wraps, blocks cross its edge
    cache, ks, vs = fill(cache, rng, first=[16, 11, 16], second=[16, 16, 9])
    q = rng.standard_normal((3, q_len, H * group, D)).astype(np.float32)
    out = np.asarray(kvcache.attend(cache, q, impl=impl))
    for b in range(3):
        want = attend_reference(ks[b], vs[b], cache.config, q[b])
        np.testing.assert_allclose(out[b], want, rtol=2e-5, atol=2e-5)


def test_window_covering_every_token_is_dense_attention_over_the_tokens():
    rng = np.random.default_rng(3)
    cache = kvcache.init(2, 32, H, D, dtype=jnp.float32, window=32, block_tokens=16)
    cache, ks, vs = fill(cache, rng, first=[16, 3], second=[16, 16])
    q = rng.standard_normal((2, 2, H * 2, D)).astype(np.float32)
    out = np.asarray(kvcache.attend(cache, q))
    for b in range(2):
        np.testing.assert_allclose(out[b], dense_attention(q[b], ks[b], vs[b]), rtol=2e-5, atol=2e-5)


# Quick tier: a window with sinks; no window (test_kvcache's exports) and all-window are slow.
@pytest.mark.parametrize("window,sinks", sweep([(8, 2), (0, 0), (48, 0)]))
def test_export_bytes_equal_dumps_whatever_the_window(window, sinks):
    """Tokens are quantized once, when appended: the window never changes a code."""
    rng = np.random.default_rng(4)
    cache = kvcache.init(3, 48, H, D, seed=11, dtype=jnp.float32, window=window, sinks=sinks, block_tokens=16)
    cache, ks, vs = fill(cache, rng, first=[16, 11, 16], second=[16, 16, 9])
    before = [kvcache.export(cache, seq=b) for b in range(3)]
    assert before == [dumps_kv(ks[b], vs[b], cache.config) for b in range(3)]
    k2 = rng.standard_normal((3, 8, H, D)).astype(np.float32)  # the ring wraps past the exported tokens
    cache = kvcache.append(cache, k2, k2, new_lengths=np.array([8, 5, 0]))
    after = [kvcache.export(cache, seq=b) for b in range(3)]
    assert after[2] == before[2]
    for b, n in ((0, 8), (1, 5)):
        ks[b], vs[b] = np.concatenate([ks[b], k2[b, :n]]), np.concatenate([vs[b], k2[b, :n]])
        assert after[b] == dumps_kv(ks[b], vs[b], cache.config)


@pytest.mark.parametrize("page_size", sweep([8, None]))  # quick tier: the paged cache
def test_decode_loop_compiles_once_over_300_steps_across_ring_wraps(page_size, compiles):
    rng = np.random.default_rng(5)
    cache = kvcache.init(2, 320, H, D, seed=3, window=16, sinks=2, page_size=page_size, dtype=jnp.float32,
                         block_tokens=32)
    kv = rng.standard_normal((300, 2, 1, H, D)).astype(np.float32)
    q = rng.standard_normal((2, 1, H * 2, D)).astype(np.float32)

    def step(c, k, v, q):
        c = kvcache.append(c, k, v)
        return c, kvcache.attend(c, q)

    step = jax.jit(step, donate_argnums=0)
    cache, out = step(cache, kv[0], kv[0], q)  # compile once
    jax.block_until_ready(out)
    before = compiles.count
    for i in range(1, 300):
        cache, out = step(cache, kv[i], kv[i], q)
    jax.block_until_ready(out)
    assert compiles.count == before
    assert np.asarray(cache.lengths).tolist() == [300, 300]
    ks = kv[:, 0, 0]  # sequence 0's tokens, keys == values
    np.testing.assert_allclose(np.asarray(out)[0], attend_reference(ks, ks, cache.config, q[0]), rtol=2e-5, atol=2e-5)


def test_load_brings_codes_only_then_appends_are_exact():
    """A loaded sequence has no exact copy: attend reads it from codes, and the window
    refills with the tokens appended after it."""
    rng = np.random.default_rng(6)
    cache = kvcache.init(1, 40, H, D, seed=11, dtype=jnp.float32, window=8, sinks=2, block_tokens=16)
    k = rng.standard_normal((24, H, D)).astype(np.float32)
    v = rng.standard_normal((24, H, D)).astype(np.float32)
    cache = kvcache.load(cache, dumps_kv(k[:20], v[:20], cache.config), seq=0)
    q = rng.standard_normal((1, 1, H, D)).astype(np.float32)
    out = np.asarray(kvcache.attend(cache, q))[0]
    want = attend_reference(k[:20], v[:20], cache.config, q[0], exact_from=20)
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)
    cache = kvcache.append(cache, k[None, 20:], v[None, 20:])
    out = np.asarray(kvcache.attend(cache, q))[0]
    np.testing.assert_allclose(out, attend_reference(k, v, cache.config, q[0], exact_from=20), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("preset", sweep(["turbo-3.5", "turbo-2.5"]))
def test_presets_by_name_read_what_a_norm_corrected_blob_decodes_to(preset):
    rng = np.random.default_rng(7)
    cache = kvcache.init(2, 32, H, D, options=preset, dtype=jnp.float32, window=0, sinks=0, block_tokens=16)
    want = tq_jax.PRESETS[preset]
    cfg = cache.config
    assert (cfg.key_bits, cfg.value_bits, cfg.rotation, cfg.norm_correction) == (
        want["key_bits"], want["value_bits"], want["rotation"], True)
    cache, ks, vs = fill(cache, rng, first=[16, 9], second=[16, 16])
    q = rng.standard_normal((2, 1, H * 3, D)).astype(np.float32)
    out = np.asarray(kvcache.attend(cache, q))
    for b in range(2):
        # the preset's decoder (norm correction; float32 norms: the cache keeps float16 norms, not log codes)
        blob = tq_jax.dumps(np.stack([ks[b], vs[b]])[:, None], key_bits=cfg.key_bits, value_bits=cfg.value_bits,
                            rotation=cfg.rotation, norm_correction=True, norm_dtype="float32", seed=cfg.seed)
        dec = np.asarray(tq_jax.loads(blob), np.float64)
        np.testing.assert_allclose(out[b], dense_attention(q[b], dec[0, 0], dec[1, 0]), rtol=2e-3, atol=2e-3)
        # export folds the correction into float16 norms: loads gives what attend reads
        dec2 = np.asarray(tq_jax.loads(kvcache.export(cache, seq=b)), np.float64)
        np.testing.assert_allclose(out[b], dense_attention(q[b], dec2[0, 0], dec2[1, 0]), rtol=2e-5, atol=2e-5)


def test_centroid_norms_match_the_length_of_the_decoded_unit_vector():
    from tq_jax._src import codec
    from tq_jax._src.kvcache import scoring

    rng = np.random.default_rng(8)
    for bits, rotation in ((2, "haar"), (3, "hadamard"), (4, "haar")):
        cfg = codec.CodecConfig(D, bits, 5, rotation)
        enc = codec.encode(jnp.asarray(rng.standard_normal((50, D)), jnp.float32), cfg)
        unit = codec.decode(codec.Encoded(enc.packed, jnp.ones(50, jnp.float32)), cfg, jnp.float32)
        want = np.linalg.norm(np.asarray(unit, np.float64), axis=-1)
        np.testing.assert_allclose(np.asarray(scoring.centroid_norms(enc.packed, cfg)), want, rtol=1e-5)


def test_default_window_and_memory_at_8k_and_32k_tokens():
    """The window costs its tokens at full width and nothing else per token."""
    for tokens, bound in ((8192, 0.285), (32768, 0.265)):
        cache = kvcache.init(1, tokens, 8, 128)
        assert (cache.config.window, cache.config.sinks) == (kvcache.DEFAULT_WINDOW, kvcache.DEFAULT_SINKS)
        bf16 = 2 * tokens * 8 * 128 * 2
        assert kvcache.nbytes(cache) <= bound * bf16
        assert kvcache.nbytes(cache) - kvcache.nbytes(kvcache.init(1, tokens, 8, 128, window=0, sinks=0)) == (
            2 * (kvcache.DEFAULT_WINDOW + kvcache.DEFAULT_SINKS) * 8 * 128 * 2)
        # turbo-4 (K5V3) in the cache costs 4/4's bytes: 5 + 3 bits per coordinate of K and V, the same window
        turbo4 = kvcache.init(1, tokens, 8, 128, options="turbo-4")
        assert turbo4.config.window == kvcache.DEFAULT_WINDOW and kvcache.nbytes(turbo4) == kvcache.nbytes(cache)
    short = kvcache.init(1, 3, 2, 64).config  # a short cache: the window and sinks are all of it
    assert (short.window, short.sinks) == (3, 3)


@pytest.mark.parametrize("kwargs,window", [
    (dict(), 128),
    (dict(options="turbo-3.5"), 128),  # K4V3
    (dict(options="turbo-4"), 128),  # K5V3
    (dict(key_bits=6, value_bits=2), 256),  # 4/4's bytes too, but 2-bit values: +1.2 % with 128
    (dict(key_bits=3, value_bits=3), 128),
    (dict(options="turbo-2.5"), 256),  # K3V2: 2-bit values get the longer window
    (dict(key_bits=2, value_bits=4), 256),
    (dict(key_bits=4, value_bits=1), 256),
    (dict(options="turbo-2.5", window=64), 64),  # asked for: taken as given
    (dict(options="turbo-2.5", window=0), 0),
])
def test_default_window_is_longer_for_two_bit_codes(kwargs, window):
    """Measured in the loop (benchmarks/studies/serving-smollm2.md): 2-bit codes need 256 exact tokens
    for what 128 give 3- and 4-bit codes; an explicit window is never changed."""
    cfg = kvcache.init(1, 1024, 2, 64, **kwargs).config
    assert cfg.window == window
    assert kvcache.default_window(cfg.key_bits, cfg.value_bits) == (256 if min(cfg.key_bits, cfg.value_bits) <= 2 else 128)
    assert kvcache.init(1, 100, 2, 64, **{k: v for k, v in kwargs.items() if k != "window"}).config.window == 100  # capped at max_len


@pytest.mark.parametrize("kwargs,match", [
    (dict(window=65), r"`window` must be an int in 0..max_len=64"),
    (dict(window=-1), r"`window` must be an int in 0..max_len=64"),
    (dict(window=2.5), r"`window` must be an int"),
    (dict(sinks=-2), r"`sinks` must be an int in 0..max_len=64"),
    (dict(sinks=65), r"`sinks` must be an int in 0..max_len=64"),
    (dict(options="turbo-9"), r"`options` names no preset: 'turbo-9'"),
    (dict(options=3), r"`options` must be None, a preset name or a tq_jax.Options"),
    (dict(options="k4v3-edges"), r"raw layers"),
    (dict(key_bits=9), r"`key_bits` must be an int in 1..8"),
])
def test_bad_window_sinks_and_options_are_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        kvcache.init(1, 64, H, D, **kwargs)
