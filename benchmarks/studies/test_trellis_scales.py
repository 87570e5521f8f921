"""benchmarks/studies/trellis_scales.py: the swept error is the format's own at its factor."""

import numpy as np

from benchmarks.studies import trellis_scales
from tq_jax._src import codebook, trellis


def test_error_at_the_formats_factor_is_the_formats_and_below_the_scalar_codebooks():
    d, bits = 32, 3
    y = np.random.default_rng(0).standard_normal((128, d))
    y = (y / np.linalg.norm(y, axis=-1, keepdims=True)).astype(np.float32)
    got = trellis_scales.error(y, bits, trellis.SCALES[bits])
    codes = trellis.quantize(y, bits)  # the format's search and decode, unpatched
    want = float(np.mean(np.sum((np.asarray(trellis.lookup(codes, bits)) - y) ** 2, axis=-1)))
    assert abs(got - want) <= 1e-6 * want
    assert got < codebook.expected_mse(d, bits) * d
    assert trellis_scales.error(y, bits, 0.6) > got  # the sweep moves the error
