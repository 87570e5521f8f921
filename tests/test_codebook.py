"""Lloyd–Max codebooks: the reference's shipped tables, its scipy solver, and theory.

The shipped tables are held here as fingerprints too, so that the comparison with them
runs without the reference installed; the full tables are compared where it is.
"""

from __future__ import annotations

import math
import subprocess
import sys
from importlib.resources import files

import numpy as np
import pytest

from tq_jax._src.codebook import Codebook, expected_mse, lloyd_max

SHIPPED_DIMS = (64, 96, 128, 256)
SHIPPED_BITS = (2, 3, 4, 6, 8)
# Our closed forms reproduce the tables to float32 precision. The largest deviation
# (1.2e-7, at d=96, 6 bits) is scipy.quad's error on the outermost cells' infinite
# integrals in the run that produced the table, not ours.
TABLE_ATOL = 1e-6


# Fingerprints of tqai 0.6.1's shipped tables (tqai/codebook/data/dDDD_bB.npz), read
# from the files in float64: (largest centroid, centroids · w, boundaries · w) with the
# fixed weights w_k = sin(1 + 0.37 k). Tables that agree to TABLE_ATOL per entry agree
# to TABLE_ATOL · Σ|w| on each dot product; any other change moves them far more.
SHIPPED_FINGERPRINTS = {
    (64, 2): (0.18880371749401093, 0.0034718851993685296, 0.017699395029462814),
    (64, 3): (0.26899972558021545, -0.59420920762475, -0.3150910762437157),
    (64, 4): (0.3416537344455719, -1.3559918274237206, -1.4345510447039498),
    (64, 6): (0.5234678387641907, -2.2945345717516332, -1.907708549626644),
    (64, 8): (0.6413177251815796, -1.5215067874025303, -2.0480280573654124),
    (96, 2): (0.1541575938463211, 0.002834782454973095, 0.014451495560430946),
    (96, 3): (0.21963898837566376, -0.4851745550116142, -0.2572735830141131),
    (96, 4): (0.27895912528038025, -1.1071626912338508, -1.171306038554272),
    (96, 6): (0.4274095892906189, -1.8734791537896336, -1.557637150427071),
    (96, 8): (0.5236337184906006, -1.242304920726073, -1.6722079607140676),
    (128, 2): (0.13350439071655273, 0.002454993598588334, 0.012515362279757233),
    (128, 3): (0.19021379947662354, -0.42017601178244385, -0.22280693740078694),
    (128, 4): (0.24158568680286407, -0.9588310203663779, -1.0143807714252029),
    (128, 6): (0.3701476752758026, -1.6224809683312678, -1.348953663462512),
    (128, 8): (0.4534800946712494, -1.0758677281443556, -1.4481744009322266),
    (256, 2): (0.09440238028764725, 0.0017359527537611635, 0.008849752863470374),
    (256, 3): (0.13450294733047485, -0.2971136551493192, -0.15755085611097885),
    (256, 4): (0.17082686722278595, -0.6779959137118603, -0.7172755223519749),
    (256, 6): (0.26173391938209534, -1.1472672858758166, -0.953854274813322),
    (256, 8): (0.3206588625907898, -0.7607533937012652, -1.0240139921159899),
}


def _weights(n: int) -> np.ndarray:
    return np.sin(1 + 0.37 * np.arange(n))


def _fingerprint(centroids: np.ndarray, boundaries: np.ndarray) -> tuple[float, float, float]:
    c, b = np.asarray(centroids, np.float64), np.asarray(boundaries, np.float64)
    return float(c[-1]), float(c @ _weights(c.size)), float(b @ _weights(b.size))


def _shipped(dim: int, bits: int) -> tuple[np.ndarray, np.ndarray]:
    pytest.importorskip("tqai.codebook")  # the reference's tables; fingerprints below need none
    path = files("tqai.codebook") / "data" / f"d{dim:03d}_b{bits}.npz"
    with path.open("rb") as f, np.load(f) as data:
        return np.array(data["centroids"]), np.array(data["boundaries"])


@pytest.mark.parametrize("bits", SHIPPED_BITS)
@pytest.mark.parametrize("dim", SHIPPED_DIMS)
def test_matches_shipped_tables(dim, bits):
    ref_c, ref_b = _shipped(dim, bits)
    cb = lloyd_max(dim, bits)
    assert cb.centroids.shape == ref_c.shape and cb.boundaries.shape == ref_b.shape
    assert np.abs(cb.centroids - ref_c).max() <= TABLE_ATOL
    assert np.abs(cb.boundaries - ref_b).max() <= TABLE_ATOL


def test_matches_shipped_table_fingerprints():
    """No reference needed: the stored fingerprints of its shipped tables."""
    assert sorted(SHIPPED_FINGERPRINTS) == [(d, b) for d in SHIPPED_DIMS for b in SHIPPED_BITS]
    for (dim, bits), (top, dot_c, dot_b) in SHIPPED_FINGERPRINTS.items():
        cb = lloyd_max(dim, bits)
        got = _fingerprint(cb.centroids, cb.boundaries)
        assert abs(got[0] - top) <= TABLE_ATOL, (dim, bits)
        assert abs(got[1] - dot_c) <= TABLE_ATOL * np.abs(_weights(2**bits)).sum(), (dim, bits)
        assert abs(got[2] - dot_b) <= TABLE_ATOL * np.abs(_weights(2**bits - 1)).sum(), (dim, bits)


@pytest.mark.parametrize("bits", SHIPPED_BITS)
@pytest.mark.parametrize("dim", SHIPPED_DIMS)
def test_shipped_fingerprints_are_the_installed_tables(dim, bits):
    """The stored fingerprints are those of the installed reference's files (to
    float64 rounding: numpy's sin may differ in the last bit between CPUs)."""
    got = _fingerprint(*_shipped(dim, bits))
    assert got == pytest.approx(SHIPPED_FINGERPRINTS[dim, bits], rel=1e-12, abs=1e-14)


@pytest.mark.parametrize("bits", [2, 3, 4, 6])
def test_matches_reference_scipy_solver_for_unshipped_dim(bits):
    solvers = pytest.importorskip("tqai.codebook.solvers")
    pytest.importorskip("scipy")
    ref_c, ref_b = solvers.solve_codebook(80, bits, solver="lloyd_max")
    cb = lloyd_max(80, bits)
    assert np.abs(cb.centroids - ref_c).max() <= TABLE_ATOL
    assert np.abs(cb.boundaries - ref_b).max() <= TABLE_ATOL


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("dim", [2, 3, 64, 80, 128, 1024])
def test_structure(dim, bits):
    cb = lloyd_max(dim, bits)
    c, b = cb.centroids, cb.boundaries
    assert isinstance(cb, Codebook)
    assert c.dtype == np.float32 and b.dtype == np.float32
    assert c.shape == (2**bits,) and b.shape == (2**bits - 1,)
    assert np.all(np.diff(c) > 0) and np.all(np.diff(b) > 0)
    assert np.all(c[:-1] < b) and np.all(b < c[1:])
    np.testing.assert_allclose(c, -c[::-1], rtol=0, atol=1e-7)  # symmetric
    # boundaries are midpoints: within 1e-7, or one float32 ulp where values are
    # large (d = 2, 3 put centroids near ±3)
    mid = (c[:-1].astype(np.float64) + c[1:].astype(np.float64)) / 2
    tol = np.maximum(1e-7, np.spacing(np.abs(b)))
    assert np.all(np.abs(b - mid) <= tol)


def test_one_bit_closed_form():
    for dim in (2, 7, 64, 128, 300):
        c = lloyd_max(dim, 1).centroids
        expected = math.sqrt(2.0 / (math.pi * dim))
        np.testing.assert_allclose(c, [-expected, expected], rtol=0, atol=1e-6)
        np.testing.assert_array_equal(lloyd_max(dim, 1).boundaries, [0.0])
        # MSE of the sign quantizer: (1 - 2/pi) / d
        assert expected_mse(dim, 1) == pytest.approx((1 - 2 / math.pi) / dim, rel=1e-6)


@pytest.mark.parametrize("dim", [3, 64, 128])
def test_expected_mse_decreases_with_bits(dim):
    mses = [expected_mse(dim, b) for b in range(1, 9)]
    assert all(a > b for a, b in zip(mses, mses[1:]))
    assert all(m > 0 for m in mses)


@pytest.mark.parametrize(("dim", "bits"), [(64, 1), (64, 2), (128, 3), (128, 4), (96, 6), (256, 8)])
def test_expected_mse_matches_monte_carlo(dim, bits):
    cb = lloyd_max(dim, bits)
    x = np.random.default_rng(1234).standard_normal(1_000_000) / math.sqrt(dim)
    idx = np.searchsorted(cb.boundaries.astype(np.float64), x)
    mc = float(np.mean((x - cb.centroids[idx].astype(np.float64)) ** 2))
    assert mc == pytest.approx(expected_mse(dim, bits), rel=0.02)


def test_expected_mse_known_values():
    # Lloyd–Max distortion of a unit Gaussian, scaled by d (TurboQuant Table / Max 1960).
    assert 128 * expected_mse(128, 2) == pytest.approx(0.1175, abs=1e-4)
    assert 128 * expected_mse(128, 3) == pytest.approx(0.03455, abs=1e-4)
    assert 128 * expected_mse(128, 4) == pytest.approx(0.0095, abs=1e-4)


def test_cached_and_read_only():
    a = lloyd_max(128, 4)
    assert lloyd_max(128, 4) is a
    assert lloyd_max(np.int64(128), np.int32(4)) is a  # numpy ints are fine
    with pytest.raises(ValueError):
        a.centroids[0] = 0.0
    with pytest.raises(ValueError):
        a.boundaries[0] = 0.0


@pytest.mark.parametrize("bits", [0, 9, -1, 2.0, True, "4", None])
def test_bad_bits(bits):
    with pytest.raises(ValueError, match="`bits` must be an int in 1..8"):
        lloyd_max(128, bits)
    with pytest.raises(ValueError, match="`bits`"):
        expected_mse(128, bits)


@pytest.mark.parametrize("dim", [1, 0, -64, 64.0, False, "128", None])
def test_bad_dim(dim):
    with pytest.raises(ValueError, match="`dim` must be an int >= 2"):
        lloyd_max(dim, 4)
    with pytest.raises(ValueError, match="`dim`"):
        expected_mse(dim, 4)


def test_solves_fast_without_scipy_or_torch():
    # a fresh process, so the 8-bit solve is not served from lloyd_max's cache
    code = (
        "import sys, time, tq_jax._src.codebook as c; t0 = time.perf_counter(); c.lloyd_max(127, 8); "
        "print(time.perf_counter() - t0); c.lloyd_max(80, 3); "
        "bad = [m for m in ('scipy', 'torch') if m in sys.modules]; "
        "assert not bad, bad"
    )
    got = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert float(got.stdout.split()[-1]) < 0.5
