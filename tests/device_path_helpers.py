"""Helpers shared by the device-path tests (tests/test_device_path.py, tests/test_program.py,
tests/test_bridge_program.py): their inputs, their options, and how a decode on the device
may differ from the host path's."""

import jax.numpy as jnp
import numpy as np

import tq_jax


def options_from(kw):
    """``tq_jax.Options`` from a case's keyword fields; ``preset`` names a preset to start from."""
    kw = dict(kw)
    if "preset" in kw:
        return tq_jax.encode_options(**tq_jax.PRESETS[kw.pop("preset")], **kw)
    return tq_jax.encode_options(**kw)


def random_input(shape, dtype, seed=0):
    """Standard normal values of ``shape``, drawn in float32 and cast to ``dtype``."""
    return np.random.default_rng(seed).standard_normal(shape, np.float32).astype(jnp.dtype(dtype))


def assert_decoded_like(got, want):
    """The program's decoded values against the host path's: equal, except that XLA may
    order a float32 sum differently inside the program (tq_jax._src.program's docstring):
    then elements differ by float32 rounding of their row's norm plus one unit in the
    last place of the output dtype. In a 16-bit output that shows only where a rounding
    boundary is crossed: at most 1 element in 1,000. A float32 output shows every such
    difference: none under jax 0.10.2, about 1 in 8 under jax 0.9.2 for 3-bit Hadamard
    rows at head_dim 128, each within one float32 rounding."""
    dtype = np.asarray(got).dtype
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape
    diff = got != want
    if not diff.any():
        return
    if dtype != np.float32:
        assert diff.mean() <= 1e-3, f"{int(diff.sum())} of {diff.size} values differ"
    ulp = {np.dtype(jnp.bfloat16): 2.0**-7, np.dtype(np.float16): 2.0**-10}.get(dtype, 2.0**-23)
    scale = np.linalg.norm(want.reshape(-1, want.shape[-1]), axis=-1, keepdims=True)
    err = np.abs(got - want).reshape(scale.shape[0], -1)
    bound = 2.0**-20 * scale + ulp * np.abs(want).reshape(scale.shape[0], -1) + 1e-30
    assert (err <= bound).all(), float((err / bound).max())
