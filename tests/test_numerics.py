"""Numeric edge cases: documented behaviour (docs/hardening.md, "Numbers"), tested.

Zeros, tiny and subnormal vectors, huge norms, NaN/Inf, T = 1 and odd T, head_dim from
2 to 1024, every bit width 1..8, and byte-for-byte determinism across runs, threads
and device counts.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import tq_jax
from tq_jax import codebook, wire

ROOT = Path(__file__).resolve().parents[1]
D = 64


def unit(n, d=D, seed=0):
    u = np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)
    return u / np.linalg.norm(u, axis=1, keepdims=True)


def cos(a, b):
    a = np.asarray(a, np.float64).reshape(-1, np.shape(a)[-1])
    b = np.asarray(b, np.float64).reshape(-1, np.shape(b)[-1])
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def rt(x, **opts):
    blob = tq_jax.dumps(x, **opts)
    return blob, np.asarray(tq_jax.loads(blob))


# ----------------------------------------------------------------------------- huge norms


def test_regression_finite_vectors_beyond_1e19_keep_finite_norms():
    # Found while tabulating huge norms: squares of entries beyond ~1e19 overflow
    # float32, so a finite vector got an infinite norm, stayed "v1, float16 norms" and
    # decoded as +-inf (and a pinned norm_dtype="float16" raised nothing). Its norm is
    # now taken on a copy scaled by 2**-96; other vectors' bytes are unchanged.
    u = unit(8)
    for scale in (1e19, 1e30, 1e38 * 2):
        x = u * np.float32(scale)
        blob, y = rt(x, bits=4)
        h = wire.peek_header(blob)
        assert (h.version, h.norm_dtype) == (2, "float32")
        assert np.isfinite(y).all() and cos(y, x).min() > 0.99
        n = np.linalg.norm(y.astype(np.float64), axis=1) / scale
        assert np.allclose(n, np.median(n), rtol=0.05)
        with pytest.raises(tq_jax.NormOverflowError, match="8 of 8 vectors"):
            tq_jax.dumps(x, bits=4, norm_dtype="float16")
        yb = np.asarray(tq_jax.loads(tq_jax.dumps(x.astype(jnp.bfloat16), bits=4)), np.float32)
        assert np.isfinite(yb).all()
