"""benchmarks/studies/passkey_key_floor.py: the bound's arithmetic against closed forms."""

import numpy as np
import pytest

from benchmarks.studies.passkey_key_floor import allocation_gain, logit_error, waterfill


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


def test_isotropic_statistics_gain_nothing_and_uneven_ones_gain_their_am_over_gm():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 4000, 4, 8))  # [L, Q, heads, d], 2 KV heads
    k = rng.standard_normal((2, 4000, 2, 8))
    assert allocation_gain(q, k, 4.0) == pytest.approx(1.0, abs=0.02)
    # Every rate stays positive at 4 bits, so the ideal error is N * GM(w * lam) * 2^-8 over the
    # N channels of all heads, against sum over heads of sum(w) * mean(lam) * 2^-8 for the
    # rotated code: with flat queries that is AM/GM of the key energies, over channels within a
    # head (a rotation evens them out) and over heads (it cannot move bits between heads).
    loud_channels = k * np.array([4.0, 4.0, 1, 1, 1, 1, 1, 1])  # energies 16, 16, 1 x 6 in every head
    am_gm = np.mean([16, 16, 1, 1, 1, 1, 1, 1]) / np.exp(np.mean(np.log([16, 16, 1, 1, 1, 1, 1, 1])))
    assert allocation_gain(q, loud_channels, 4.0) == pytest.approx(am_gm, rel=0.05)
    loud_head = k * np.array([1.0, 4.0])[:, None]  # KV head 1 keys 4x in both layers: energies 1 and 16
    assert allocation_gain(q, loud_head, 4.0) == pytest.approx(8.5 / 4.0, rel=0.05)


def test_logit_error_is_the_rms_of_the_gqa_scores_error():
    rng = np.random.default_rng(2)
    q = rng.standard_normal((1, 3, 4, 8)).astype(np.float32)  # 4 query heads on 2 KV heads
    k = rng.standard_normal((1, 5, 2, 8)).astype(np.float32)
    k_hat = k + rng.standard_normal(k.shape).astype(np.float32)
    errs = [q[0, i, h] @ (k_hat - k)[0, t, h // 2] / np.sqrt(8) for i in range(3) for h in range(4) for t in range(5)]
    assert logit_error(q, k, k_hat) == pytest.approx(np.sqrt(np.mean(np.square(errs))), rel=1e-5)
    assert logit_error(q, k, k) == 0.0
