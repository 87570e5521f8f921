"""The public codec inside a user's own transformations, called in every order.

`encode`/`decode` build their tables on first use and cache them process-wide. If the
first use happens while JAX traces a user's function, nothing traced may reach that
cache: a stored tracer breaks every later trace, eager call and blob
(`UnexpectedTracerError`). Each test starts from an empty table cache so the first
fill happens inside the transformation under test, then checks every later use
against an independent eager computation done in a fresh process state (results are
compared bit for bit: the same program pieces run either way).
"""

from __future__ import annotations

import functools
import gc
import os
import subprocess
import sys
import textwrap
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tq_jax
from tq_jax._src import codec

from conftest import sweep

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CONFIGS = [
    tq_jax.CodecConfig(dim=128, bits=4),
    tq_jax.CodecConfig(dim=64, bits=3, seed=7, rotation="hadamard", norm_correction=True),
    tq_jax.CodecConfig(dim=80, bits=2, seed=-5),  # rows not byte-aligned: the generic kernels
]
IDS = ["haar-128-4", "hadamard-64-3-nc", "haar-80-2"]


def _x(shape, dim, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((*shape, dim), dtype=np.float32))


def _empty_caches():
    codec._device_cache.clear()
    jax.clear_caches()


@pytest.fixture(autouse=True)
def fresh_tables():
    _empty_caches()
    yield
    _empty_caches()


def _expected(x, cfg):
    """Eager encode/decode in a state whose tables were never touched by a trace."""
    _empty_caches()
    enc = tq_jax.encode(x, cfg)
    out = tq_jax.decode(enc, cfg, jnp.bfloat16)
    _empty_caches()
    return np.asarray(enc.packed), np.asarray(enc.norms), np.asarray(out)


def _assert_same(got, want):
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), w)


def _roundtrip_fn(cfg):
    def roundtrip(x):
        enc = tq_jax.encode(x, cfg)
        return enc.packed, enc.norms, tq_jax.decode(enc, cfg, jnp.bfloat16)

    return roundtrip


# Quick tier: the Haar config; the Hadamard and non-byte-aligned ones are slow (each clears
# JAX's caches and compiles a kernel family afresh; test_vmap_then_eager keeps Hadamard quick).
@pytest.mark.parametrize("cfg", sweep(CONFIGS), ids=IDS)
def test_jit_then_second_shape_then_eager_then_blob(cfg):
    x1, x2 = _x((2, 10, 8), cfg.dim, 1), _x((2, 11, 8), cfg.dim, 2)
    want1, want2 = _expected(x1, cfg), _expected(x2, cfg)

    jitted = jax.jit(_roundtrip_fn(cfg))
    _assert_same(jitted(x1), want1)  # first use of the tables: inside the trace
    _assert_same(jitted(x2), want2)  # a retrace of the same function
    _assert_same(jax.jit(_roundtrip_fn(cfg))(x2), want2)  # a new jit
    _assert_same(_roundtrip_fn(cfg)(x1), want1)  # eager
    # a blob of the same config, after the traces: same codes, decoded with float16 norms
    kv = np.asarray(x1.reshape(2, 1, 10, 8, cfg.dim)).astype(jnp.bfloat16)
    blob = tq_jax.dumps(kv, bits=cfg.bits, seed=cfg.seed, rotation=cfg.rotation,
                        norm_correction=cfg.norm_correction)
    xb = jnp.asarray(kv.astype(np.float32)).reshape(x1.shape)
    enc = tq_jax.encode(xb, cfg)
    want = tq_jax.decode(enc._replace(norms=enc.norms.astype(jnp.float16)), cfg, jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(tq_jax.loads(blob)).reshape(x1.shape), np.asarray(want))


@pytest.mark.parametrize("cfg", CONFIGS[:1], ids=IDS[:1])
def test_eager_then_jit(cfg):
    x = _x((3, 5), cfg.dim, 3)
    want = _expected(x, cfg)
    _assert_same(_roundtrip_fn(cfg)(x), want)
    _assert_same(jax.jit(_roundtrip_fn(cfg))(x), want)


@pytest.mark.parametrize("cfg", CONFIGS[:1], ids=IDS[:1])
def test_lower_first(cfg):
    """Lowering (no execution) is a trace too: it must leave nothing behind."""
    x = _x((4, 6), cfg.dim, 4)
    want = _expected(x, cfg)
    lowered = jax.jit(_roundtrip_fn(cfg)).lower(jax.ShapeDtypeStruct(x.shape, x.dtype))
    _assert_same(_roundtrip_fn(cfg)(x), want)
    _assert_same(lowered.compile()(x), want)


# Quick tier: Hadamard, which runs both its encoder paths under vmap; Haar is slow.
@pytest.mark.parametrize("cfg", sweep(CONFIGS[1::-1]), ids=IDS[1::-1])
def test_vmap_then_eager(cfg):
    x = _x((3, 4), cfg.dim, 5)
    want = _expected(x, cfg)
    _assert_same(jax.vmap(_roundtrip_fn(cfg))(x), want)  # vmap traces with BatchTracers
    _assert_same(jax.jit(jax.vmap(_roundtrip_fn(cfg)))(x), want)
    _assert_same(_roundtrip_fn(cfg)(x), want)


def test_grad_through_decode_leaves_no_tracer():
    """Differentiating a loss through decode (e.g. distillation on the decoded cache)."""
    cfg = CONFIGS[0]
    enc = tq_jax.encode(_x((2, 3), cfg.dim), cfg)
    _empty_caches()

    def loss(norms):
        return jnp.sum(tq_jax.decode(enc._replace(norms=norms), cfg) ** 2)

    g = jax.jit(jax.grad(loss))(enc.norms)
    # d/dn sum((n * r)^2) = 2 n |r|^2 with |r| the length of the unit-norm reconstruction
    r = tq_jax.decode(enc._replace(norms=jnp.ones_like(enc.norms)), cfg)
    np.testing.assert_allclose(g, 2 * enc.norms * jnp.sum(r * r, -1), rtol=1e-5)


def _tracers_reachable_from(roots, limit=200_000):
    """Tracers reachable from ``roots`` through containers, closures and lru_caches."""
    found, seen, stack = [], set(), list(roots)
    leaf_types = (str, bytes, int, float, complex, bool, type(None), np.ndarray, types.ModuleType, type)
    with warnings.catch_warnings():  # isinstance on other libraries' deprecated objects (torch's
        warnings.simplefilter("ignore")  # reduce_op, reached through tq_jax.bridge) warns
        while stack and len(seen) < limit:
            obj = stack.pop()
            if id(obj) in seen or isinstance(obj, leaf_types):
                continue
            seen.add(id(obj))
            if isinstance(obj, jax.core.Tracer):
                found.append(obj)
                continue
            if isinstance(obj, jax.Array):
                continue
            if isinstance(obj, (dict, list, tuple, set, frozenset)) or callable(obj) or hasattr(obj, "__dict__"):
                # gc.get_referents sees the cache dict of a functools.lru_cache wrapper
                stack.extend(gc.get_referents(obj))
    return found


def _library_roots():
    mods = [m for name, m in sorted(sys.modules.items()) if name == "tq_jax" or name.startswith("tq_jax.")]
    roots = []
    for m in mods:
        for value in vars(m).values():
            if isinstance(value, types.ModuleType):
                continue
            owner = getattr(value, "__module__", None)
            if callable(value) and owner is not None and not owner.startswith("tq_jax"):
                continue  # a function imported from another library
            roots.append(value)
    return roots


LEAK_CONFIGS = [tq_jax.CodecConfig(dim=64, bits=5, rotation="hadamard"), tq_jax.CodecConfig(dim=64, bits=4),
                tq_jax.CodecConfig(dim=64, bits=3, norm_correction=True)]


# Quick tier: the Hadamard config (group kernels, grid quantizer); the two Haar ones are slow.
@pytest.mark.parametrize("cfg", sweep(LEAK_CONFIGS), ids=["hadamard-5", "haar-4", "haar-3-nc"])
def test_no_module_level_cache_is_filled_during_tracing(cfg):
    """Repo-wide: after tracing every public entry point in every transformation, no
    object reachable from any tq_jax module global holds a tracer, and JAX's own leak
    checker (which fails a trace whose tracers outlive it) stays quiet."""
    x = _x((2, 3), 64, 6)
    with jax.checking_leaks():
        for cfg in (cfg,):
            _empty_caches()
            fn = _roundtrip_fn(cfg)
            jax.jit(fn)(x)
            jax.vmap(fn)(x)
            jax.jit(fn).lower(x)
            jax.eval_shape(fn, x)
            jax.make_jaxpr(fn)(x)
            jax.jit(lambda v, cfg=cfg: codec.rotate(v, codec.device_tables(cfg).rotation))(x)
            jax.jit(lambda v, cfg=cfg: codec.unrotate(v, codec.device_tables(cfg).rotation))(x)
    assert codec._device_cache, "the tables were not cached at all: this test would not see a leak"
    found = _tracers_reachable_from(_library_roots())
    assert not found, f"tracers reachable from tq_jax module state: {found[:3]}"


def test_leak_detector_sees_a_planted_tracer():
    """The walker above finds a tracer hidden in an lru_cache inside a dict (so its
    silence means something)."""

    @functools.lru_cache(maxsize=4)
    def cached(key, holder=[]):  # noqa: B006 - the holder is the planted leak
        return holder

    leaked = []
    jax.jit(lambda v: (leaked.append(v), v)[1])(jnp.ones(2))
    cached("k").append({"deep": (leaked[0],)})
    assert _tracers_reachable_from([{"cache": cached}])


@pytest.mark.slow
def test_shard_map_on_four_devices_then_eager_then_blob():
    """shard_map over 4 forced CPU devices as the first use (a fresh process: the host
    device count is fixed when XLA starts), then eager and blob paths in that process."""
    code = textwrap.dedent(
        """
        import jax, jax.numpy as jnp, numpy as np, tq_jax
        from jax.sharding import Mesh, PartitionSpec as P
        assert jax.device_count() == 4, jax.devices()
        mesh = Mesh(np.array(jax.devices()), ("b",))
        # bfloat16-exact values: a bf16 blob of them encodes the very same floats
        x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 6, 128), dtype=np.float32)
                        .astype(jnp.bfloat16).astype(np.float32))
        results = {}
        for rot in ("haar", "hadamard"):
            cfg = tq_jax.CodecConfig(dim=128, bits=4, rotation=rot)

            def roundtrip(v, cfg=cfg):
                enc = tq_jax.encode(v, cfg)
                return enc.packed, tq_jax.decode(enc, cfg, jnp.bfloat16)

            sharded = jax.jit(jax.shard_map(roundtrip, mesh=mesh, in_specs=P("b"), out_specs=(P("b"), P("b"))))
            packed, out = sharded(x)
            assert len(packed.sharding.device_set) == 4
            epacked, eout = roundtrip(x)                      # eager after the sharded trace
            np.testing.assert_array_equal(np.asarray(packed), np.asarray(epacked))
            np.testing.assert_array_equal(np.asarray(out), np.asarray(eout))
            kv = np.asarray(x.reshape(2, 1, 4, 6, 128)).astype(jnp.bfloat16)
            blob = tq_jax.dumps(kv, bits=4, rotation=rot) if rot == "hadamard" else tq_jax.dumps(kv, bits=4)
            back = np.asarray(tq_jax.loads(blob)).reshape(8, 6, 128)
            enc16 = tq_jax.Encoded(epacked, tq_jax.encode(x, cfg).norms.astype(jnp.float16))  # the wire's norms
            np.testing.assert_array_equal(back, np.asarray(tq_jax.decode(enc16, cfg, jnp.bfloat16)))
            results[rot] = int(packed.size)
        print("OK", results)
        """
    )
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4".strip()
    env["JAX_PLATFORMS"] = "cpu"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith("OK"), r.stdout
