"""tq_jax.kvcache: attention on TQ01 codes equals dense attention over the decoded blob.

The reference for every check is independent of the cache: ``tq_jax.dumps`` of the same
tokens (bytes), ``tq_jax.loads`` of that blob (the K/V the codes stand for), and dense
float64 attention over them (``tq_jax._src.kvcache.reference``). The grid is lean on purpose (compiles dominate):
each case covers several axes at once.
"""

import dataclasses
import os
import struct
import subprocess
import sys
import textwrap
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tq_jax
from conftest import sweep
from kvcache_helpers import D, H, dumps_kv, fill, with_impls
from tq_jax import kvcache
from tq_jax._src.kvcache.reference import dense_attention
from tq_jax._src.kvcache import state as kv_state

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# (rotation, key_bits, value_bits, q_heads // kv_heads, page_size, block_tokens, q_len)
CASES = [
    pytest.param("haar", 4, 4, 1, None, 16, 1, id="haar-4/4-gqa1-unpaged-q1"),
    pytest.param("haar", 2, 3, 4, 8, 16, 5, id="haar-2/3-gqa4-paged8-q5"),
    pytest.param("hadamard", 3, 3, 3, None, 16, 3, id="hadamard-3/3-gqa3-unpaged-q3"),
    pytest.param("hadamard", 4, 2, 1, 16, 32, 1, id="hadamard-4/2-gqa1-paged16x2-q1"),
]


IMPLS = ["xla", "pallas_tpu", "pallas_gpu"]  # the Pallas kernels run in interpret mode on CPU


# Quick tier: XLA on the first case and the Hadamard paged one (whose programs
# test_jit_donated_... compiles anyway). Slow: the other cases (paged with GQA 4 and a query
# block runs quick in test_kvcache_window) and the Pallas impls (each against dense
# attention quick in test_default_bfloat16_cache_... and test_kvcache_window).
@pytest.mark.parametrize("rotation,kb,vb,group,page_size,block,q_len,impl",
                         with_impls(CASES, IMPLS, quick=(0, 3), pallas_quick=False))
def test_attend_matches_dense_attention_over_decoded_blob(rotation, kb, vb, group, page_size, block, q_len, impl):
    rng = np.random.default_rng(kb * 10 + vb)
    cache = kvcache.init(3, 48, H, D, key_bits=kb, value_bits=vb, rotation=rotation, seed=11, page_size=page_size, dtype=jnp.float32,
                         block_tokens=block, window=0, sinks=0)
    # ragged lengths 32, 27, 25 over two appends, several blocks each (one dumps bucket for all)
    cache, ks, vs = fill(cache, rng, first=[16, 11, 16], second=[16, 16, 9])
    lengths = [len(k) for k in ks]
    assert np.asarray(cache.lengths).tolist() == lengths
    q = rng.standard_normal((3, q_len, H * group, D)).astype(np.float32)
    out = np.asarray(kvcache.attend(cache, q, impl=impl))
    for b in range(3):
        blob = dumps_kv(ks[b], vs[b], cache.config)
        assert kvcache.export(cache, seq=b) == blob  # same codes, same norms, same header
        kv = np.asarray(tq_jax.loads(blob, dtype=jnp.float32))
        ref = dense_attention(q[b], kv[0, 0], kv[1, 0])
        scale = np.abs(ref).max()
        np.testing.assert_allclose(out[b], ref, rtol=1e-3, atol=1e-3 * scale)
        assert np.abs(out[b] - ref).max() <= 1e-3 * scale


def test_export_is_v1_bytes_and_load_round_trip_keeps_attend_bit_identical():
    rng = np.random.default_rng(1)
    cache = kvcache.init(3, 48, H, D, key_bits=4, value_bits=4, rotation="haar", seed=11, dtype=jnp.float32, block_tokens=16, window=0, sinks=0)
    cache, ks, vs = fill(cache, rng, first=[16, 11, 16], second=[16, 16, 9])
    q = rng.standard_normal((3, 1, H, D)).astype(np.float32)
    blobs = [kvcache.export(cache, seq=b) for b in range(3)]
    for b, blob in enumerate(blobs):
        assert tq_jax.peek_header(blob).version == 1  # the reference's format
        assert blob == tq_jax.dumps(np.stack([ks[b], vs[b]])[:, None], bits=4, seed=11)
    fresh = kvcache.init(3, 48, H, D, key_bits=4, value_bits=4, rotation="haar", seed=11, dtype=jnp.float32, block_tokens=16, window=0, sinks=0)
    for b in (2, 0, 1):
        fresh = kvcache.load(fresh, blobs[b], seq=b)
    assert np.asarray(fresh.lengths).tolist() == [32, 27, 25]
    assert [kvcache.export(fresh, seq=b) for b in range(3)] == blobs
    np.testing.assert_array_equal(np.asarray(kvcache.attend(fresh, q)), np.asarray(kvcache.attend(cache, q)))


def test_paged_pages_allocate_in_order_and_round_trip_page_by_page():
    rng = np.random.default_rng(2)
    kw = dict(seed=11, page_size=8, dtype=jnp.float32, block_tokens=16, window=0, sinks=0)
    cache = kvcache.init(3, 48, H, D, key_bits=2, value_bits=3, rotation="haar", **kw)
    cache, ks, vs = fill(cache, rng, first=[16, 3, 16], second=[16, 0, 11])
    table = np.asarray(cache.page_table)
    # first append: seq 0 takes pages 0,1; seq 1 page 2; seq 2 pages 3,4; second: 5,6 / - / 7,8
    assert table.tolist() == [[0, 1, 5, 6, -1, -1], [2, -1, -1, -1, -1, -1], [3, 4, 7, 8, -1, -1]]
    assert int(cache.next_page) == 9
    q = rng.standard_normal((3, 5, 4 * H, D)).astype(np.float32)
    out = np.asarray(kvcache.attend(cache, q))
    assert not out[1, :2].any() and np.abs(out[1, 2:]).min(axis=-1).all()  # 3 tokens: 2 queries see none
    pallas = np.asarray(kvcache.attend(cache, q, impl="pallas_tpu"))
    assert not pallas[1, :2].any()
    np.testing.assert_allclose(pallas, out, rtol=1e-5, atol=1e-5 * np.abs(out).max())
    fresh = kvcache.init(3, 48, H, D, key_bits=2, value_bits=3, rotation="haar", **kw)
    for b in range(3):
        n_pages = -(-len(ks[b]) // 8)
        for i in range(n_pages):
            blob = kvcache.export(cache, seq=b, page=i)
            if (b, i) in ((0, 1), (2, 3)):  # a full page and a partial one are their own blobs
                lo, hi = 8 * i, min(len(ks[b]), 8 * i + 8)
                assert blob == dumps_kv(ks[b][lo:hi], vs[b][lo:hi], cache.config)
            fresh = kvcache.load(fresh, blob, seq=b, page=i)
    assert np.asarray(fresh.lengths).tolist() == np.asarray(cache.lengths).tolist()
    np.testing.assert_array_equal(np.asarray(kvcache.attend(fresh, q)), out)
    # replacing an interior page keeps the length; the last page sets it
    fresh = kvcache.load(fresh, kvcache.export(cache, seq=0, page=0), seq=0, page=1)
    assert int(fresh.lengths[0]) == 32
    fresh = kvcache.load(fresh, kvcache.export(cache, seq=1, page=0), seq=0, page=3)
    assert int(fresh.lengths[0]) == 24 + 3


def test_memory_at_4_bits_is_at_most_0_27_of_bf16():
    bf16 = 2 * 2 * 4096 * 8 * 128 * 2  # K and V, batch 2, 4096 tokens, 8 heads, 128 dims, 2 bytes
    for page_size in (None, 16):
        cache = kvcache.init(batch=2, max_len=4096, kv_heads=8, head_dim=128, key_bits=4, value_bits=4,
                             rotation="haar", seed=42, page_size=page_size, window=0, sinks=0)
        leaves = jax.tree_util.tree_leaves(cache)
        measured = sum(leaf.size * leaf.dtype.itemsize for leaf in leaves)
        assert measured == kvcache.nbytes(cache)
        assert measured / bf16 <= 0.27, (page_size, measured / bf16)
        assert measured / bf16 >= (64 + 2) / 256  # the codes and norms themselves


# Quick tier: XLA. Retracing depends on the cache's pytree, which is the same for every
# impl; the Pallas kernels run under jit in every quick attend (kvcache.attend is jitted).
@pytest.mark.parametrize("impl", sweep(IMPLS))
def test_jit_donated_append_and_attend_do_not_recompile_as_lengths_grow(impl):
    traces = {"append": 0, "attend": 0}

    def step(cache, k, v):
        traces["append"] += 1
        return kvcache.append(cache, k, v)

    def read(cache, q):
        traces["attend"] += 1
        return kvcache.attend(cache, q, impl=impl)

    step_jit = jax.jit(step, donate_argnums=0)
    read_jit = jax.jit(read)
    rng = np.random.default_rng(3)
    kw = dict(seed=11, page_size=16, dtype=jnp.float32, block_tokens=32, window=0, sinks=0)  # as a case above: compiled once
    cache = kvcache.init(3, 48, H, D, key_bits=4, value_bits=2, rotation="hadamard", **kw)
    k = rng.standard_normal((3, 16, H, D)).astype(np.float32)
    v = rng.standard_normal((3, 16, H, D)).astype(np.float32)
    q = rng.standard_normal((3, 1, H, D)).astype(np.float32)
    for t in range(16):  # decode: one token at a time, crossing a page
        cache = step_jit(cache, k[:, t : t + 1], v[:, t : t + 1])
        out = read_jit(cache, q)
    assert traces == {"append": 1, "attend": 1}
    assert np.asarray(cache.lengths).tolist() == [16, 16, 16]
    eager = kvcache.append(kvcache.init(3, 48, H, D, key_bits=4, value_bits=2, rotation="hadamard", **kw), k, v)
    for b in range(3):
        assert kvcache.export(cache, seq=b) == kvcache.export(eager, seq=b)
    np.testing.assert_allclose(np.asarray(out), np.asarray(kvcache.attend(eager, q)), rtol=1e-5, atol=1e-5)


def test_jit_append_past_max_len_drops_tokens_and_clamps_length():
    rng = np.random.default_rng(4)
    cache = kvcache.init(2, 20, H, D, key_bits=4, value_bits=4, rotation="haar", seed=11, dtype=jnp.float32, block_tokens=16, window=0, sinks=0)
    k = rng.standard_normal((2, 16, H, D)).astype(np.float32)
    v = rng.standard_normal((2, 16, H, D)).astype(np.float32)
    append = jax.jit(kvcache.append)
    cache = append(cache, k, v, np.array([16, 2]))
    cache = append(cache, k, v, np.array([16, 99]))  # 32 > 20 for seq 0; new_lengths clipped to 16 for seq 1
    assert np.asarray(cache.lengths).tolist() == [20, 18]
    assert kvcache.export(cache, seq=0) == dumps_kv(np.concatenate([k[0], k[0, :4]]),
                                                    np.concatenate([v[0], v[0, :4]]), cache.config)


def test_vmap_over_stacked_layer_caches_matches_each_layer():
    rng = np.random.default_rng(5)
    layers = [kvcache.init(3, 48, H, D, key_bits=4, value_bits=4, rotation="haar", seed=11, dtype=jnp.float32, block_tokens=16, window=0, sinks=0)
              for _ in range(2)]
    k = rng.standard_normal((2, 3, 16, H, D)).astype(np.float32)  # [layer, batch, tokens, H, D]
    v = rng.standard_normal((2, 3, 16, H, D)).astype(np.float32)
    q = rng.standard_normal((2, 3, 1, H, D)).astype(np.float32)
    n = np.array([[16, 5, 0], [9, 16, 1]], np.int32)
    stacked = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *layers)
    stacked = jax.vmap(kvcache.append)(stacked, k, v, n)
    out = np.asarray(jax.vmap(kvcache.attend)(stacked, q))
    for i in range(2):
        one = kvcache.append(layers[i], k[i], v[i], new_lengths=n[i])
        layer = jax.tree_util.tree_map(lambda a: a[i], stacked)
        assert [kvcache.export(layer, seq=b) for b in range(3)] == [kvcache.export(one, seq=b) for b in range(3)]
        np.testing.assert_allclose(out[i], np.asarray(kvcache.attend(one, q[i])), rtol=1e-6, atol=1e-6)


@pytest.mark.slow  # a fresh process with 4 forced host devices (seconds a case)
@pytest.mark.parametrize("window,sinks", [(0, 0), (8, 2)])
def test_shard_map_over_heads_on_four_devices_matches_one_device(window, sinks):
    code = """
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import Mesh, PartitionSpec as P
        from tq_jax import kvcache
        assert len(jax.devices()) == 4
        rng = np.random.default_rng(6)
        cache = kvcache.init(2, 32, 8, 64, key_bits=3, value_bits=4, rotation="haar", seed=9, page_size=8,
                             dtype=jnp.float32, block_tokens=16, window=WINDOW, sinks=SINKS)
        k = rng.standard_normal((2, 16, 8, 64)).astype(np.float32)
        v = rng.standard_normal((2, 16, 8, 64)).astype(np.float32)
        q = rng.standard_normal((2, 2, 16, 64)).astype(np.float32)
        n = np.array([16, 7], np.int32)
        mesh = Mesh(np.array(jax.devices()), ("h",))
        heads = dict(k_codes=P(None, None, "h"), k_norms=P(None, None, "h"), v_codes=P(None, None, "h"),
                     v_norms=P(None, None, "h"), lengths=P(), page_table=P(), next_page=P(), overflow=P(None, "h"),
                     k_window=P(None, None, "h"), v_window=P(None, None, "h"), k_sinks=P(None, None, "h"),
                     v_sinks=P(None, None, "h"), exact_from=P())
        spec = kvcache.KVCache(config=cache.config, **heads)
        kv = P(None, None, "h")
        app = jax.jit(jax.shard_map(kvcache.append, mesh=mesh, in_specs=(spec, kv, kv, P()), out_specs=spec))
        att = jax.jit(jax.shard_map(kvcache.attend, mesh=mesh, in_specs=(spec, kv), out_specs=kv))
        sharded = app(cache, k, v, n)
        assert sharded.k_codes.sharding.spec == P(None, None, "h")
        one = kvcache.append(cache, k, v, new_lengths=n)
        for b in range(2):
            assert kvcache.export(sharded, seq=b) == kvcache.export(one, seq=b)
        np.testing.assert_allclose(np.asarray(att(sharded, q)), np.asarray(kvcache.attend(one, q)), rtol=1e-6, atol=1e-6)
        print("ok")
    """
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4".strip()
    code = f"WINDOW, SINKS = {window}, {sinks}\n" + textwrap.dedent(code)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=180)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


# --------------------------------------------------------------------------- non-finite and overflow


def test_nan_token_is_stored_as_dumps_stores_it_and_poisons_only_its_readers():
    rng = np.random.default_rng(7)
    cache = kvcache.init(3, 48, H, D, key_bits=4, value_bits=4, rotation="haar", seed=11, dtype=jnp.float32, block_tokens=16, window=0, sinks=0)
    k = rng.standard_normal((3, 16, H, D)).astype(np.float32)
    v = rng.standard_normal((3, 16, H, D)).astype(np.float32)
    k[0, 4, 1, 7] = np.nan
    v[2, 2, 0, 0] = np.inf
    cache = kvcache.append(cache, k, v)
    for b in range(3):
        assert kvcache.export(cache, seq=b) == dumps_kv(k[b], v[b], cache.config)
    q = rng.standard_normal((3, 1, H, D)).astype(np.float32)
    for impl in IMPLS:
        out = np.asarray(kvcache.attend(cache, q, impl=impl))
        assert np.isnan(out[0, 0, 1]).all() and np.isfinite(out[0, 0, 0]).all()  # only the head holding the NaN key
        assert not np.isfinite(out[2, 0, 0]).all() and np.isfinite(out[2, 0, 1]).all()
        assert np.isfinite(out[1]).all()


def test_norm_overflow_raises_eagerly_and_blocks_export_under_jit():
    cache = kvcache.init(3, 48, H, D, key_bits=4, value_bits=4, rotation="haar", seed=11, dtype=jnp.float32, block_tokens=16, window=0, sinks=0)
    k = np.ones((3, 16, H, D), np.float32)
    k[1, 3, 0] = 1e4  # norm 8e4 > 65504: float16 cannot hold it
    with pytest.raises(tq_jax.NormOverflowError, match="1 appended vector"):
        kvcache.append(cache, k, k)
    assert not np.asarray(cache.lengths).any()
    jitted = jax.jit(kvcache.append)(cache, k, k)
    assert kvcache.export(jitted, seq=0) == dumps_kv(k[0], k[0], cache.config)
    with pytest.raises(tq_jax.NormOverflowError, match="sequence 1"):
        kvcache.export(jitted, seq=1)


# --------------------------------------------------------------------------- bad input


@pytest.fixture(scope="module")
def small():
    return kvcache.init(2, 20, H, D, key_bits=4, value_bits=4, rotation="haar", seed=11, dtype=jnp.float32, block_tokens=16, window=0, sinks=0)


def test_attend_rejects_bad_query_shapes(small):
    with pytest.raises(ValueError, match="not a multiple of the cache's kv_heads=2"):
        kvcache.attend(small, np.zeros((2, 1, 3, D), np.float32))
    with pytest.raises(ValueError, match="head_dim 32 but the cache holds head_dim=64"):
        kvcache.attend(small, np.zeros((2, 1, 2, 32), np.float32))
    with pytest.raises(ValueError, match=r"batch=2"):
        kvcache.attend(small, np.zeros((3, 1, 2, D), np.float32))
    with pytest.raises(ValueError, match="`impl` must be one of"):
        kvcache.attend(small, np.zeros((2, 1, 2, D), np.float32), impl="cuda")
    with pytest.raises(ValueError, match="impl='pallas' was removed .* impl='pallas_tpu' .* impl='pallas_gpu'"):
        kvcache.attend(small, np.zeros((2, 1, 2, D), np.float32), impl="pallas")


def test_append_rejects_bad_shapes_and_lengths(small):
    z = np.zeros((2, 4, H, D), np.float32)
    with pytest.raises(ValueError, match="head_dim=64"):
        kvcache.append(small, np.zeros((2, 4, H, 32), np.float32), np.zeros((2, 4, H, 32), np.float32))
    with pytest.raises(ValueError, match="kv_heads=2"):
        kvcache.append(small, np.zeros((2, 4, 3, D), np.float32), np.zeros((2, 4, 3, D), np.float32))
    with pytest.raises(ValueError, match=r"new_lengths\[1\] = 5 is outside 0..4"):
        kvcache.append(small, z, z, new_lengths=np.array([1, 5]))
    grown = kvcache.append(small, np.ones((2, 16, H, D), np.float32), np.ones((2, 16, H, D), np.float32),
                           new_lengths=np.array([16, 15]))
    with pytest.raises(ValueError, match=r"sequence 0 past max_len=20: it holds 16 tokens and 5 more") as e:
        kvcache.append(grown, np.ones((2, 5, H, D), np.float32), np.ones((2, 5, H, D), np.float32))
    assert "unchanged" in str(e.value)
    assert np.asarray(grown.lengths).tolist() == [16, 15]


def test_paged_pool_exhaustion_is_refused_eagerly():
    cache = kvcache.init(2, 32, H, D, key_bits=4, value_bits=4, rotation="haar", seed=11, page_size=8, num_pages=3, dtype=jnp.float32, window=0, sinks=0)
    x = np.ones((2, 16, H, D), np.float32)
    with pytest.raises(ValueError, match="needs 4 new page"):
        kvcache.append(cache, x, x)


def blob_of(header):
    """A well-formed TQ01 blob for ``header`` with zero codes and norms (no encoding)."""
    sizes = [(n_vec * header.dim * bits + 7) // 8 for _, bits, _, _, n_vec in header.segments()]
    norm_size = 4 if header.norm_dtype == "float32" else 2
    body = b"".join(struct.pack("<q", n) + bytes(n) + struct.pack("<q", v * norm_size) + bytes(v * norm_size)
                    for n, (_, _, _, _, v) in zip(sizes, header.segments()))
    raw = struct.pack("<q", header.raw_nbytes()) + bytes(header.raw_nbytes()) if header.version == 2 else b""
    blob = tq_jax._src.wire.header_bytes(header) + body + raw
    assert len(blob) == tq_jax._src.wire.blob_nbytes(header)
    return blob


def test_load_rejects_blobs_of_another_config(small):
    good = tq_jax.Header(bits=4, seed=11, shape=(2, 1, 5, H, D), dtype="float32")
    kvcache.load(small, blob_of(good), seq=0)  # the control: this one fits
    v2 = dict(version=2, value_bits=4)
    bad = {
        "head_dim": good._replace(shape=(2, 1, 5, H, 32)),
        "kv_heads": good._replace(shape=(2, 1, 5, 4, D)),
        "key bits": good._replace(bits=3),
        "value bits": good._replace(version=2, value_bits=2, kv_layout=True),
        "rotation": good._replace(rotation="hadamard", **v2),
        "seed": good._replace(seed=12),
        "raw layers": good._replace(skip_first=1, kv_layout=True, **v2),
        "shape": good._replace(shape=(2, 5, H, D)),
        "at most 20": good._replace(shape=(2, 1, 21, H, D)),
    }
    for what, header in bad.items():
        with pytest.raises(ValueError, match=what):
            kvcache.load(small, blob_of(header), seq=0)
    with pytest.raises(tq_jax.WireError):
        kvcache.load(small, blob_of(good)[:-3], seq=0)
    with pytest.raises(ValueError, match="paged cache"):
        kvcache.load(small, blob_of(good), seq=0, page=0)
    with pytest.raises(ValueError, match="seq"):
        kvcache.export(small, seq=2)


def test_paged_load_refuses_gaps_and_short_interior_pages():
    cache = kvcache.init(1, 32, H, D, key_bits=4, value_bits=4, rotation="haar", seed=11, page_size=8, dtype=jnp.float32, window=0, sinks=0)
    blob = blob_of(tq_jax.Header(bits=4, seed=11, shape=(2, 1, 5, H, D), dtype="float32"))
    with pytest.raises(ValueError, match="leave a gap"):
        kvcache.load(cache, blob, seq=0, page=1)
    full = blob_of(tq_jax.Header(bits=4, seed=11, shape=(2, 1, 24, H, D), dtype="float32"))
    cache = kvcache.load(cache, full, seq=0)
    assert int(cache.lengths[0]) == 24
    with pytest.raises(ValueError, match="full page of 8 tokens, got 5"):
        kvcache.load(cache, blob, seq=0, page=1)
    with pytest.raises(ValueError, match="at most 8"):
        kvcache.load(cache, full, seq=0, page=3)


def test_init_rejects_unpackable_head_dim_and_bad_page_size():
    with pytest.raises(ValueError, match="multiple of 8 at 3 bits"):
        kvcache.init(1, 8, 1, 100, key_bits=3, value_bits=4, window=0, sinks=0)
    with pytest.raises(ValueError, match="power of two"):
        kvcache.init(1, 8, 1, 64, key_bits=4, value_bits=4, page_size=12, window=0, sinks=0)
    with pytest.raises(ValueError, match="rotation"):
        kvcache.init(1, 8, 1, 64, key_bits=4, value_bits=4, rotation="dct", window=0, sinks=0)
    with pytest.raises(ValueError, match="num_pages"):
        kvcache.init(1, 8, 1, 64, key_bits=4, value_bits=4, num_pages=4, window=0, sinks=0)
    assert dataclasses.is_dataclass(kvcache.init(1, 8, 1, 64, window=0, sinks=0).config)


def test_init_is_one_program_per_configuration_and_its_leaves_are_separate_buffers(compiles):
    kw = dict(batch=3, max_len=40, kv_heads=2, head_dim=64, page_size=8, window=8, sinks=2, seed=1234)
    before = compiles.count
    cache = kvcache.init(**kw)
    assert compiles.count == before + 1  # every leaf from one program, not one per zero array
    again = kvcache.init(**kw)
    assert compiles.count == before + 1
    assert (np.asarray(cache.page_table) == -1).all() and int(cache.next_page) == 0
    unpaged = kvcache.init(**{**kw, "page_size": None})
    np.testing.assert_array_equal(np.asarray(unpaged.page_table), [[0], [1], [2]])
    assert int(unpaged.next_page) == 3
    for c in (cache, again, unpaged):
        for name in ("k_codes", "k_norms", "v_codes", "v_norms", "lengths", "overflow", "k_window", "v_window",
                     "k_sinks", "v_sinks", "exact_from"):
            assert not np.asarray(getattr(c, name)).any(), name
    # append and attend donate the leaves: no two may share a buffer, within a cache or across two
    ptrs = [leaf.unsafe_buffer_pointer() for c in (cache, again) for leaf in jax.tree_util.tree_leaves(c)]
    assert len(set(ptrs)) == len(ptrs)


def test_default_bfloat16_cache_stores_what_dumps_stores_for_bfloat16_kv():
    rng = np.random.default_rng(10)
    cache = kvcache.init(2, 20, H, D, key_bits=4, value_bits=4, rotation="haar", seed=11, block_tokens=16, window=0, sinks=0)  # dtype defaults to bfloat16
    k = rng.standard_normal((2, 16, H, D)).astype(np.float32)
    v = rng.standard_normal((2, 16, H, D)).astype(np.float32)
    cache = kvcache.append(cache, k, v)  # float32 in: cast to the cache's dtype first
    kb, vb = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
    blob = kvcache.export(cache, seq=1)
    assert tq_jax.peek_header(blob).dtype == "bfloat16"
    assert blob == tq_jax.dumps(np.stack([kb[1], vb[1]])[:, None], bits=4, seed=11)
    q = rng.standard_normal((2, 1, H, D)).astype(jnp.bfloat16)
    kv = np.asarray(tq_jax.loads(blob, dtype=jnp.float32))
    ref = dense_attention(np.asarray(q[1], np.float32), kv[0, 0], kv[1, 0])
    for impl in IMPLS:
        out = kvcache.attend(cache, q, impl=impl)
        assert out.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(out[1], np.float32), ref, rtol=1e-2, atol=1e-2 * np.abs(ref).max())


def test_default_block_fills_about_block_bytes_of_float32_keys():
    # the benchmark's shape: 4 x 8 heads x 128 dims x 4 bytes = 16 KiB a token -> 64 tokens = 1 MiB
    assert kvcache.init(4, 8192, 8, 128, window=0, sinks=0).config.block_tokens == 64
    assert kvcache.init(4, 8192, 8, 128, page_size=16, window=0, sinks=0).config.block_tokens == 64  # blocks span pages
    assert kvcache.init(1, 4096, 3, 64, window=0, sinks=0).config.block_tokens == kv_state.BLOCK_TOKENS  # small: the cap
    assert kvcache.init(64, 64, 32, 256, window=0, sinks=0).config.block_tokens == 16  # large: the floor
    assert kvcache.init(1, 40, 3, 64, window=0, sinks=0).config.block_tokens == 64  # never beyond the capacity's power of two
    for batch, heads, dim in ((4, 8, 128), (2, 8, 64), (1, 3, 64), (8, 16, 128)):
        block = kvcache.init(batch, 2048, heads, dim, window=0, sinks=0).config.block_tokens
        per_token = batch * heads * dim * 4
        assert block * per_token <= kv_state.BLOCK_BYTES or block == 16
        assert 2 * block * per_token > kv_state.BLOCK_BYTES or block == kv_state.BLOCK_TOKENS


@pytest.mark.parametrize("preset", sweep(["turbo-4", "turbo-3.5", "turbo-2.5"]))
def test_load_of_a_turbo_blob_attends_as_its_decoded_values(preset):
    """Log-coded norms are decoded and norm correction folded into the float16 norm:
    the cache then attends over what tq_jax.loads decodes, to float16 rounding."""
    opts = tq_jax.PRESETS[preset]
    rng = np.random.default_rng(3)
    t = 21
    k = (rng.standard_normal((t, H, D)) * np.linspace(0.2, 3, t)[:, None, None]).astype(np.float32)
    v = rng.standard_normal((t, H, D)).astype(np.float32)
    k[4, 1] = 0.0  # a zero vector: code 0, norm 0
    blob = tq_jax.dumps(np.stack([k, v])[:, None], **opts)
    h = tq_jax.peek_header(blob)
    assert h.norm_bits and h.norm_correction and h.checksum
    cache = kvcache.init(1, 32, H, D, key_bits=opts["key_bits"], value_bits=opts["value_bits"], rotation=opts["rotation"], seed=42,
                         dtype=jnp.float32, block_tokens=16, window=0, sinks=0)
    cache = kvcache.load(cache, blob)
    assert int(cache.lengths[0]) == t
    kv = np.asarray(tq_jax.loads(blob, dtype=jnp.float32))
    q = rng.standard_normal((1, 2, H, D)).astype(np.float32)
    ref = dense_attention(q[0], kv[0, 0], kv[1, 0])
    out = np.asarray(kvcache.attend(cache, q))[0]
    np.testing.assert_allclose(out, ref, rtol=2e-3, atol=2e-3 * np.abs(ref).max())
    # the sequence exports as float16 norms: same codes, values within a float16 rounding
    back = np.asarray(tq_jax.loads(kvcache.export(cache), dtype=jnp.float32))
    np.testing.assert_allclose(back, kv, rtol=0, atol=1e-3 * np.abs(kv).max(axis=-1, keepdims=True).max())
    assert np.all(back[0, 0, 4, 1] == 0)


def test_load_of_float32_norms_rounds_them_as_dumps_does_for_float16():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 1, 9, H, D)).astype(np.float32)
    wide = tq_jax.dumps(x, bits=4, seed=11, norm_dtype="float32")
    assert tq_jax.peek_header(wide).norm_dtype == "float32"
    cache = kvcache.load(kvcache.init(1, 16, H, D, key_bits=4, value_bits=4, rotation="haar", seed=11, dtype=jnp.float32, window=0, sinks=0), wide)
    assert kvcache.export(cache) == tq_jax.dumps(x, bits=4, seed=11, norm_dtype="float16")
    huge = tq_jax.dumps(x * 1e4, bits=4, seed=11, norm_dtype="float32")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the error says it all: no numpy cast warning beside it
        with pytest.raises(tq_jax.NormOverflowError, match="exceed float16"):
            kvcache.load(cache, huge)
