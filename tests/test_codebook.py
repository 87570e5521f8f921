"""Lloyd–Max codebooks: the reference's shipped tables, its scipy solver, and theory."""

from __future__ import annotations

import math
import subprocess
import sys
from importlib.resources import files

import numpy as np
import pytest

from tq_jax.codebook import Codebook, expected_mse, lloyd_max

SHIPPED_DIMS = (64, 96, 128, 256)
SHIPPED_BITS = (2, 3, 4, 6, 8)
# Our closed forms reproduce the tables to float32 precision. The largest deviation
# (1.2e-7, at d=96, 6 bits) is scipy.quad's error on the outermost cells' infinite
# integrals in the run that produced the table, not ours.
TABLE_ATOL = 1e-6


def _shipped(dim: int, bits: int) -> tuple[np.ndarray, np.ndarray]:
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


def test_fast():
    import time

    from tq_jax import codebook

    t0 = time.perf_counter()
    codebook._solve(127, 8)  # uncached
    assert time.perf_counter() - t0 < 0.5


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


def test_does_not_import_scipy_or_torch():
    code = (
        "import sys, tq_jax.codebook as c; c.lloyd_max(80, 3); "
        "bad = [m for m in ('scipy', 'torch') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
