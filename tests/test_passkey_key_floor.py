"""benchmarks/passkey_key_floor.py: the bound's arithmetic against closed forms."""

import numpy as np
import pytest

from benchmarks.passkey_key_floor import allocation_gain, logit_error, waterfill


@pytest.mark.parametrize(
    "weighted, rate, want",
    [
        (np.full(8, 3.0), 2.0, 8 * 3.0 * 2.0**-4),  # equal channels: equal rates
        (np.array([16.0, 1.0]), 1.0, 16 * 2.0**-4 + 1 * 2.0**0),  # rates 2 and 0: 1 + 1
        (np.array([100.0, 1.0]), 0.5, 100 * 2.0**-2 + 1.0),  # the quiet channel gets no bits: 25 + 1
    ],
)
def test_waterfill_matches_the_closed_form(weighted, rate, want):
    assert waterfill(weighted, rate) == pytest.approx(want, rel=1e-9)


def test_waterfill_never_loses_to_equal_rates():
    rng = np.random.default_rng(0)
    for _ in range(20):
        w = rng.lognormal(0, 2, 16)
        assert waterfill(w, 3.0) <= np.sum(w) * 2.0**-6 * (1 + 1e-9)


def test_isotropic_statistics_gain_nothing_and_loud_channels_gain_their_am_gm():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 4000, 4, 8))  # [L, Q, heads, d], 2 KV heads
    k = rng.standard_normal((2, 4000, 2, 8))
    assert allocation_gain(q, k, 4.0) == pytest.approx(1.0, abs=0.05)
    scale = np.array([4.0, 4.0, 1, 1, 1, 1, 1, 1])  # two loud key channels, queries flat
    k2 = k * scale
    lam = np.mean(np.square(k2), axis=1)
    w = np.mean(np.square(q).reshape(2, 4000, 2, 2, 8), axis=(1, 3))
    am_gm = [np.mean(w[i, h]) * np.mean(lam[i, h]) / np.exp(np.mean(np.log(w[i, h] * lam[i, h])))
             for i in range(2) for h in range(2)]
    # every rate positive at 4 bits, so the gain is the AM/GM ratio, averaged with the heads' weights
    assert min(am_gm) > 1.5
    assert allocation_gain(q, k2, 4.0) == pytest.approx(np.mean(am_gm), rel=0.1)


def test_logit_error_is_the_rms_of_the_gqa_scores_error():
    rng = np.random.default_rng(2)
    q = rng.standard_normal((1, 3, 4, 8)).astype(np.float32)  # 4 query heads on 2 KV heads
    k = rng.standard_normal((1, 5, 2, 8)).astype(np.float32)
    k_hat = k + rng.standard_normal(k.shape).astype(np.float32)
    errs = [q[0, i, h] @ (k_hat - k)[0, t, h // 2] / np.sqrt(8) for i in range(3) for h in range(4) for t in range(5)]
    assert logit_error(q, k, k_hat) == pytest.approx(np.sqrt(np.mean(np.square(errs))), rel=1e-5)
    assert logit_error(q, k, k) == 0.0
