"""Numeric edge cases: documented behaviour (docs/hardening.md, "Numbers"), tested.

Zeros, tiny and subnormal vectors, huge norms, NaN/Inf, T = 1 and odd T, head_dim from
2 to 1024, every bit width 1..8, and byte-for-byte determinism across runs, threads
and device counts.
"""

from __future__ import annotations

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
from tq_jax._src import codebook, wire

from conftest import sweep

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


@pytest.mark.parametrize("rotation", ["haar", "hadamard"])
def test_a_huge_vector_leaves_its_neighbours_bytes_alone(rotation):
    # One vector whose squares overflow sends its block down the rescaled path; the
    # other vectors of that block must encode exactly as they do without it.
    x = unit(16) * 3
    big = x.copy()
    big[5] *= np.float32(1e30)
    opts = dict(bits=4, rotation=rotation, norm_dtype="float32")
    plain, rescued = wire.parse(tq_jax.dumps(x, **opts)), wire.parse(tq_jax.dumps(big, **opts))
    row = D * 4 // 8
    a = np.asarray(plain.indices[0]).reshape(16, row)
    b = np.asarray(rescued.indices[0]).reshape(16, row)
    keep = np.arange(16) != 5
    np.testing.assert_array_equal(a[keep], b[keep])
    np.testing.assert_array_equal(plain.norms[0][keep], rescued.norms[0][keep])
    assert np.isfinite(rescued.norms[0][5]) and rescued.norms[0][5] > 1e30
    y = np.asarray(tq_jax.loads(tq_jax.dumps(big, **opts)))
    assert cos(y[5], big[5]) > 0.98


# ----------------------------------------------------------------------------- zeros


ALL_FORMATS = [
    dict(bits=b) for b in range(1, 9)
] + [
    dict(bits=3, rotation="hadamard", norm_correction=True, checksum=True),
    dict(key_bits=4, value_bits=2, skip_first_layers=1, norm_dtype="float32"),
]


@pytest.mark.parametrize("opts", ALL_FORMATS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_zero_vectors_decode_to_exact_zeros(opts):
    if "key_bits" in opts or "checksum" in opts:
        x = np.random.default_rng(1).standard_normal((2, 3, 4, D)).astype(np.float32)
        x[0, 1, 2] = 0.0
        x[1, 2] = 0.0
        x = x.astype(jnp.bfloat16)
    else:  # the shape and dtype of test_every_bit_width: the same compiled programs
        x = unit(512, 128, seed=99)
        x[::7] = 0.0
    for t in (x, np.zeros_like(x)):
        blob, y = rt(t, **opts)
        assert np.isfinite(np.asarray(y, np.float32)).all()
        zero = ~np.any(np.asarray(t, np.float32) != 0, axis=-1)
        assert zero.any() and (np.asarray(y, np.float32)[zero] == 0).all()
        assert len(blob) == tq_jax.serialized_size(t.shape, jnp.dtype(t.dtype).name, **opts)


# ----------------------------------------------------------------------------- tiny norms


# (vector norm, v1 with float16 norms, v2 with float32 norms): "ok" = mean cosine > 0.99
# and norm within 2 %; "ok~" = cosine > 0.99, norm off by up to 20 % (float16 subnormal
# norm, or the reference's 1e-10 in x / (|x| + 1e-10)); "coarse" = cosine 0.5..0.99
# (|x| << 1e-10: every rotated coordinate lands next to zero); "zero" = exact zeros.
TINY = [
    (1.0, "ok", "ok"),
    (1e-4, "ok", "ok"),
    (1e-6, "ok", "ok"),
    (1e-7, "ok~", "ok"),  # float16 norm is subnormal: ~10 % off
    (5e-8, "ok~", "ok"),
    (2e-8, "zero", "ok"),  # below half float16's smallest subnormal: norm 0
    (1e-9, "zero", "ok~"),  # x / (|x| + 1e-10) shortens the unit vector: 0.91
    (1e-11, "zero", "coarse"),
    (1e-18, "zero", "coarse"),
    (1e-20, "zero", "zero"),  # squares are float32 subnormals, flushed: norm 0
    (1e-30, "zero", "zero"),
    (1e-40, "zero", "zero"),  # float32 subnormal entries
]


def _classify(x, y):
    y = np.asarray(y, np.float64)
    if (y == 0).all():
        return "zero"
    c = cos(y, x).mean()
    r = np.median(np.linalg.norm(y, axis=1) / np.linalg.norm(np.asarray(x, np.float64), axis=1))
    if c > 0.99:
        return "ok" if abs(r - 1) < 0.02 else "ok~" if abs(r - 1) < 0.6 else f"norm {r}"
    return "coarse" if c > 0.5 else f"cos {c}"


@pytest.mark.parametrize("norm,v1,v2", TINY)
def test_tiny_and_subnormal_vectors(norm, v1, v2):
    x = unit(16) * np.float32(norm)
    blob, y = rt(x, bits=4)
    assert wire.peek_header(blob).version == 1 and np.isfinite(y).all()
    assert _classify(x, y) == v1
    _, y2 = rt(x, bits=4, norm_dtype="float32")
    assert np.isfinite(y2).all() and _classify(x, y2) == v2
    if v2 == "ok~":  # norm correction restores the magnitude, not the direction
        _, y3 = rt(x, bits=4, norm_dtype="float32", norm_correction=True)
        assert _classify(x, y3) == "ok"


def test_subnormal_half_and_bfloat16_inputs():
    u = unit(16)
    x16 = (u * np.float32(1e-5)).astype(np.float16)  # entries ~1e-6: float16 subnormals
    assert (np.abs(x16) < np.finfo(np.float16).smallest_normal).all()
    _, y = rt(x16, bits=4)
    assert y.dtype == np.float16 and np.isfinite(np.asarray(y, np.float32)).all()
    assert cos(y, x16).mean() > 0.98
    xb = (u * np.float32(1e-39)).astype(jnp.bfloat16)  # bfloat16 subnormals
    _, yb = rt(xb, bits=4, norm_dtype="float32")
    assert (np.asarray(yb, np.float32) == 0).all()  # squares underflow: exact zeros


# ----------------------------------------------------------------------------- huge norms


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_norms_beyond_float16(dtype):
    x = np.random.default_rng(2).standard_normal((3, 5, D)).astype(np.float32)
    x[1, 2] *= 2e4  # norm ~1.6e5 > 65504 (float16 entries stay finite)
    x = x.astype(dtype)
    blob, y = rt(x, bits=4)  # norm_dtype="auto"
    h = wire.peek_header(blob)
    assert (h.version, h.norm_dtype) == (2, "float32")
    assert len(blob) == tq_jax.serialized_size(x.shape, jnp.dtype(dtype).name, bits=4, norm_dtype="float32")
    assert np.isfinite(np.asarray(y, np.float32)).all() and cos(y, x).min() > 0.98
    with pytest.raises(tq_jax.NormOverflowError, match="1 of 15 vectors"):
        tq_jax.dumps(x, bits=4, norm_dtype="float16")
    with pytest.raises(ValueError, match="stored as float32"):  # dump_into sized for float16 norms
        tq_jax.dump_into(x, bytearray(tq_jax.serialized_size(x.shape, jnp.dtype(dtype).name, bits=4)), bits=4)


def test_norm_beyond_float32_decodes_infinite_like_an_infinite_input():
    x = unit(4)
    x[1] = np.float32(1e38) * np.sign(x[1])  # norm 8e38: no float format holds it
    blob, y = rt(x, bits=4)
    assert not np.isfinite(y[1]).any() and np.isfinite(np.delete(y, 1, 0)).all()


# ----------------------------------------------------------------------------- NaN / Inf


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("opts", [dict(bits=4), dict(bits=5, rotation="hadamard", norm_dtype="float32"),
                                  dict(bits=4, norm_dtype="float16")])
def test_non_finite_entries_poison_only_their_vector(bad, opts):
    x = unit(12) * 3
    x[4, 7] = bad
    blob, y = rt(x, **opts)
    assert not np.isfinite(y[4]).any()  # the whole vector: its norm is NaN or inf
    if np.isnan(bad):
        assert np.isnan(y[4]).all()
    rest = np.delete(np.arange(12), 4)
    assert np.isfinite(y[rest]).all() and cos(y[rest], x[rest]).min() > 0.98
    if opts.get("norm_dtype") != "float32":
        assert wire.peek_header(blob).version == (1 if opts["bits"] == 4 else 2)


# ----------------------------------------------------------------------------- shapes


@pytest.mark.parametrize("tokens", sweep([1, 7, 3], fast=2))
def test_single_and_odd_token_counts(tokens):
    x = np.random.default_rng(tokens).standard_normal((2, 3, tokens, 2, D)).astype(np.float32).astype(jnp.bfloat16)
    for opts in (dict(bits=3), dict(key_bits=4, value_bits=2, skip_last_layers=1, checksum=True)):
        blob, y = rt(x, **opts)
        assert y.shape == x.shape and len(blob) == tq_jax.serialized_size(x.shape, "bfloat16", **opts)
        assert cos(y[:, :2], x[:, :2]).mean() > 0.9
    # Vectors are independent: the v1 sections equal those of the same vectors as rows.
    flat = tq_jax.dumps(x.reshape(-1, D), bits=3)
    full = tq_jax.dumps(x, bits=3)
    assert wire.parse(full).indices[0].tobytes() == wire.parse(flat).indices[0].tobytes()
    assert wire.parse(full).norms[0].tobytes() == wire.parse(flat).norms[0].tobytes()


HEAD_DIMS = [2, 3, 5, 7, 16, 33, 64, 80, 96, 100, 128, 257, 512, 1024]


@pytest.mark.parametrize("dim", sweep(sorted(HEAD_DIMS, key=lambda d: d not in (128, 80, 3, 257)), fast=4))
def test_head_dims_from_2_to_1024(dim):
    u = unit(max(32, 2048 // dim), dim, seed=dim)
    configs = [("haar", 4, 0.995)]
    if dim in (2, 3, 33, 100, 257, 1024):
        configs.append(("hadamard", 3, 0.98))
    for rot, bits, floor in configs:
        blob, y = rt(u, bits=bits, rotation=rot, norm_dtype="float32")
        assert wire.peek_header(blob).dim == dim
        assert cos(y, u).mean() > floor, (rot, bits)
        # Per-coordinate MSE against Lloyd-Max theory for N(0, 1/d): at most the theory
        # (small d is *better*: a coordinate of a rotated unit vector is not Gaussian).
        ratio = ((y - u) ** 2).sum(1).mean() / dim / codebook.expected_mse(dim, bits)
        assert 0.5 < ratio < (1.15 if dim >= 64 else 1.0), (rot, bits, ratio)


@pytest.mark.parametrize("bits", range(1, 9))
def test_every_bit_width(bits):
    u = unit(512, 128, seed=bits)
    blob, y = rt(u, bits=bits)
    h = wire.peek_header(blob)
    assert h.version == (1 if bits in wire.READ_BITS_V1 else 2)
    assert len(blob) == tq_jax.serialized_size(u.shape, "float32", bits)
    ratio = ((y - u) ** 2).sum(1).mean() / 128 / codebook.expected_mse(128, bits)
    assert 0.9 < ratio < 1.1, ratio


# ----------------------------------------------------------------------------- determinism


DETERMINISM_SCRIPT = textwrap.dedent(
    """
    import hashlib, json, sys
    import jax, numpy as np, jax.numpy as jnp
    import tq_jax
    devices = jax.devices() if sys.argv[1] == "all" else None
    out = {"devices": len(jax.devices())}
    rng = np.random.default_rng(123)
    x = rng.standard_normal((2, 3, 13, 2, 64)).astype(np.float32)  # 156 vectors: 3 blocks of 64
    cases = {
        "v1-b4-bf16": (x.astype(jnp.bfloat16), dict(bits=4, seed=-5)),
        "v2-kv": (x.astype(jnp.float16), dict(key_bits=7, value_bits=3, skip_first_layers=1,
                                              rotation="hadamard", norm_correction=True, checksum=True)),
    }
    for name, (t, opts) in cases.items():
        blob = tq_jax.dumps(t, block_vectors=64, device=devices, **opts)
        y = np.asarray(tq_jax.loads(blob, block_vectors=64, device=devices))
        out[name] = [hashlib.sha256(blob).hexdigest(), hashlib.sha256(y.tobytes()).hexdigest()]
    print("RESULT" + json.dumps(out))
    """
)


def _run_determinism(extra_env: dict, arg: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra_env)
    env.setdefault("JAX_PLATFORMS", "cpu")
    proc = subprocess.run([sys.executable, "-c", DETERMINISM_SCRIPT, arg], capture_output=True, text=True,
                          env=env, cwd=str(ROOT), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")][-1]
    return json.loads(line[len("RESULT"):])


@pytest.mark.slow
def test_bytes_identical_across_runs_and_device_counts():
    """A fresh process dealing blocks over 4 devices and this one (one device, whatever
    ran in it before: warm caches, other threads) write the same bytes and decode the
    same values."""
    four = _run_determinism({"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}, "all")
    assert four.pop("devices") == 4
    namespace: dict = {"__name__": "determinism"}
    exec(DETERMINISM_SCRIPT.replace('sys.argv[1] == "all"', "False"), namespace)  # noqa: S102
    here = namespace["out"]
    here.pop("devices")
    assert here == four
