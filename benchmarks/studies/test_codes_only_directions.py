"""The codes-only probe's prototype codecs do what its results file says they do."""

import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.studies import codes_only_directions as D
from tq_jax._src import codec


def _vectors(seed=0, b=1, t=512, h=2, d=64, offset=3.0):
    """Vectors sharing a large common component, and one sink-like vector far from it."""
    rng = np.random.default_rng(seed)
    mu = rng.standard_normal((b, h, d)).astype(np.float32) * offset
    x = mu[:, None] + rng.standard_normal((b, t, h, d)).astype(np.float32)
    x[:, 0] = -4 * mu  # the sink: centring it would raise its norm
    return jnp.asarray(x), jnp.asarray(mu)


def _err(a, b):
    return float(jnp.mean(jnp.sum((a - b) ** 2, -1)))


def test_plain_coding_is_tq_jax_codec_round_trip():
    x, _ = _vectors()
    cfg = codec.CodecConfig(dim=64, bits=5, rotation="hadamard", norm_correction=True)
    want = codec.decode(codec.encode(x, cfg), cfg)
    np.testing.assert_array_equal(np.asarray(D._code(x, 5, None, "", None)), np.asarray(want))


def test_exact_side_is_untouched():
    x, mu = _vectors()
    assert D._code(x, None, mu, "c", None) is x


@pytest.mark.parametrize("bits", [3, 5])
def test_centring_lowers_the_error_of_vectors_with_a_common_mean(bits):
    """The error of a per-vector code scales with the vector's norm: coding ``x - mu``
    for vectors near ``mu`` must cut it by about ``|x - mu|^2 / |x|^2``, here ~1/10."""
    x, mu = _vectors()
    plain = _err(D._code(x, bits, None, "", None), x)
    centred = _err(D._code(x, bits, mu, "c", None), x)
    assert centred < 0.25 * plain


def test_the_flag_leaves_a_far_vector_coded_as_itself():
    x, mu = _vectors()
    plain = D._code(x, 5, None, "", None)
    centred = D._code(x, 5, mu, "c", None)
    np.testing.assert_array_equal(np.asarray(centred[:, 0]), np.asarray(plain[:, 0]))


def test_block_means_follow_the_position():
    x, mu = _vectors(t=4)
    blocks = jnp.stack([jnp.zeros_like(mu), mu], axis=1)  # block 0's mean 0, block 1's mu
    pos = jnp.asarray([0, 1, D.BLOCK, 5 * D.BLOCK])  # the last past the blocks: the last block's
    got = D._code(x, 5, blocks, "C", pos)
    np.testing.assert_allclose(np.asarray(got[:, :2]), np.asarray(D._code(x[:, :2], 5, None, "", None)), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got[:, 2:]), np.asarray(D._code(x[:, 2:], 5, mu, "c", None)), rtol=1e-6, atol=1e-6)


def test_candidate_names_and_bits():
    c = D.Candidate("K5cV3Cx2", {"c": (0, 0), "C": (0, 0)}, None)
    assert (c.kbits, c.vbits, c.kc, c.vc, c.exact_layers) == (5, 3, "c", "C", 2)
    d, n, layers = 64, 2304, 30
    plain = D.Candidate("K5V3", {"c": (0, 0), "C": (0, 0)}, None).bits_per_value(d, n, layers)
    assert plain == pytest.approx(4 + D.NORM_BITS / d)
    with pytest.raises(ValueError, match="expected K"):
        D.Candidate("K5V3z", {"c": (0, 0), "C": (0, 0)}, None)


@pytest.mark.parametrize("entropy", [3.4, 4.6])
def test_the_uniform_coder_spends_the_entropy_it_is_named_for(entropy):
    """Gaussian vectors, rotated and normalised, give indices whose empirical entropy
    is the one the step was solved for, and a squared error of about step**2 / 12 per
    unit-variance coordinate (the high-rate law of a uniform quantiser)."""
    x = jnp.asarray(np.random.default_rng(1).standard_normal((20000, 64)), jnp.float32)
    assert D.measured_entropy(x, entropy) == pytest.approx(entropy, abs=0.03)
    step = D.gaussian_step(entropy)
    got = _err(D._code(x, entropy, None, "", None), x) / float(jnp.mean(jnp.sum(x * x, -1)))
    assert got == pytest.approx(step**2 / 12, rel=0.2)


def test_static_code_lengths_of_gaussian_pages_match_the_design_entropy():
    """Under the static Gaussian code, the mean cost is the design entropy (an
    independent check: the entropy of the cell probabilities), and pages of 64 vectors
    stray from it by the binomial spread of a mean of 4096 coordinates, not more."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, 1, 256, 2, 64)).astype(np.float32)
    bits = D.static_code_bits(x, 3.5)
    assert bits.shape == x.shape
    assert float(bits.mean()) == pytest.approx(3.5, abs=0.02)
    per = D.page_bits(bits, 64)
    assert per.shape == (8,)  # 4 pages of 64 tokens x 2 heads
    assert float(per.std()) < 0.05 and abs(float(per.mean()) - float(bits.mean())) < 1e-6


def test_the_loaded_prefix_round_trip_codes_every_layer_and_counts_its_bytes():
    rng = np.random.default_rng(3)
    k = jnp.asarray(rng.standard_normal((2, 1, 8, 1, 64)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((2, 1, 8, 1, 64)), jnp.bfloat16)
    zeros = jnp.zeros((2, 1, 1, 64))
    means = {"c": (zeros, zeros), "C": (zeros[:, :, None], zeros[:, :, None])}
    exact = D.Candidate("K-V-", means, None)
    kd, vd, _ = exact.roundtrip(k, v)
    np.testing.assert_array_equal(np.asarray(kd), np.asarray(k))
    coded = D.Candidate("K5V3", means, None)
    kd, vd, nbytes = coded.roundtrip(k, v)
    for layer in range(2):
        want = D._code(k[layer].astype(jnp.float32), 5, None, "", None).astype(jnp.bfloat16)
        np.testing.assert_array_equal(np.asarray(kd[layer]), np.asarray(want))
    assert nbytes == int((4 + D.NORM_BITS / 64) * (k.size + v.size) / 8)


def test_trellis_viterbi_finds_the_best_path_on_short_vectors():
    """On 8 coordinates, every one of the 256 branch sequences can be tried: the best
    path (each coordinate the nearest level of its subset) is what the Viterbi search
    returns, and the parallel decoder rebuilds it from the branch bits and indices."""
    levels = D.tcq_levels(64, 3)
    lv = np.asarray(levels, np.float64)
    y = np.asarray(np.random.default_rng(6).standard_normal((20, 8)) / 8, np.float32)
    branch, index = D.tcq_quantize(jnp.asarray(y), levels)
    got = np.asarray(D.tcq_decode(branch, index, levels), np.float64)
    for row in range(len(y)):
        best = np.inf
        for seq in range(256):
            bits = [(seq >> t) & 1 for t in range(8)]
            state, total = 0, 0.0
            for t, b in enumerate(bits):
                sub = lv[int(D._tcq_subset(state, b))]
                total += ((sub - y[row, t]) ** 2).min()
                state = ((state << 1) | b) & 7
            best = min(best, total)
        assert ((got[row] - y[row]) ** 2).sum() == pytest.approx(best, rel=1e-5)


@pytest.mark.parametrize("bits", [3, 4])
def test_trellis_beats_the_lloyd_max_codes_at_the_same_bits(bits):
    """Trellis-coded quantisation of Gaussian sources gains about 1 dB over a fixed-rate
    scalar quantiser at these rates (Marcellin & Fischer, 8 states); at least 0.8 dB here."""
    x = jnp.asarray(np.random.default_rng(7).standard_normal((2000, 64)), jnp.float32)
    tcq, lm = D._tcq_roundtrip(x, bits), D._roundtrip(x, bits)
    gain = 10 * np.log10(_err(lm, x) / _err(tcq, x))
    assert gain > 0.8


def test_trellis_candidate_costs_the_lloyd_max_bytes():
    k5v3 = D.Candidate("K5V3", {"c": (None, None), "C": (None, None)}, None)
    t = D.Candidate("K5tV3t", {"c": (None, None), "C": (None, None)}, None)
    assert (t.kt, t.vt) == (True, True)
    assert t.bits_per_value(64, 2048, 30) == k5v3.bits_per_value(64, 2048, 30)
    with pytest.raises(ValueError, match="trellis"):
        D.Candidate("K4.7tV3", {"c": (None, None), "C": (None, None)}, None)
