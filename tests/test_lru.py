"""tq_jax._src._lru.LRU: bounded by entries and bytes, LRU order, thread safety, no tracers."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tq_jax._src import _lru, blob, codebook, codec, rotation, wire


def test_bound_by_entry_count_evicts_least_recently_used():
    c = _lru.LRU("t", max_entries=3)
    for k in "abc":
        c.put(k, k.upper())
    assert c.get("a") == "A"  # a is now the most recent
    c.put("d", "D")
    assert c.keys() == ["c", "a", "d"] and "b" not in c
    s = c.stats()
    assert (s.entries, s.evictions, s.hits, s.misses, s.max_entries) == (3, 1, 1, 0, 3)
    assert c.get("b", "missing") == "missing" and c.stats().misses == 1


def test_bound_by_bytes():
    c = _lru.LRU("t", max_entries=100, max_bytes=1000)
    arrays = [np.zeros(100, np.float32) for _ in range(4)]  # 400 bytes each
    for i, a in enumerate(arrays):
        assert c.put(i, a) is a
    assert c.keys() == [2, 3] and c.stats().nbytes == 800 and c.stats().evictions == 2
    c.put("pair", (np.zeros(10, np.uint8), {"x": np.zeros(5, np.float64)}))  # nested leaves count
    assert c.stats().nbytes == 850 and c.keys() == [2, 3, "pair"]
    c.put(4, np.zeros(50, np.float32))  # 200 more: 2 goes
    assert c.stats().nbytes == 650 and c.keys() == [3, "pair", 4]
    big = np.zeros(1001, np.uint8)
    assert c.put("big", big) is big and "big" not in c  # larger than the cache: never stored
    assert c.stats().nbytes == 650
    c.clear()
    assert c.stats().entries == 0 and c.stats().nbytes == 0 and len(c) == 0


def test_nbytes_counts_numpy_and_jax_arrays():
    assert _lru.nbytes((np.zeros(3, np.float32), jnp.zeros(4, jnp.float16), 7, "s", None)) == 12 + 8


def test_put_keeps_the_first_value_and_get_or_create_builds_once():
    c = _lru.LRU("t", max_entries=4)
    first = np.ones(2)
    assert c.put("k", first) is first
    assert c.put("k", np.zeros(2)) is first
    calls = []
    v = c.get_or_create("n", lambda: calls.append(1) or np.arange(3))
    assert c.get_or_create("n", lambda: calls.append(1) or np.arange(3)) is v and calls == [1]


def test_memoize_keys_by_function_and_arguments():
    c = _lru.LRU("t", max_entries=2)
    calls = []

    @c.memoize
    def square(n):
        calls.append(n)
        return [n * n]

    @c.memoize
    def cube(n):
        return [n**3]

    assert square.__name__ == "square"
    a = square(3)
    assert square(3) is a and calls == [3]
    assert cube(3) == [27] and c.keys() == [("square", 3), ("cube", 3)]  # one cache, two functions
    square(4)  # evicts the least recently used, ("square", 3)
    assert square(3) == [9] and calls == [3, 4, 3]


def test_constructor_checks_its_bounds():
    with pytest.raises(ValueError, match="max_entries"):
        _lru.LRU("t", max_entries=0)
    with pytest.raises(ValueError, match="max_bytes"):
        _lru.LRU("t", max_entries=1, max_bytes=-1)


def test_tracers_are_refused():
    c = _lru.LRU("t", max_entries=4)

    def f(x):
        with pytest.raises(TypeError, match="tracer"):
            c.put("k", (np.zeros(1), {"deep": [x]}))
        with pytest.raises(TypeError, match="tracer"):
            c.get_or_create("k2", lambda: x * 2)
        with pytest.raises(TypeError, match="tracer"):
            c.put(("key", x), 1)  # unhashable anyway, but named as a tracer first
        return x

    jax.jit(f)(jnp.ones(2))
    jax.vmap(f)(jnp.ones((2, 2)))
    assert len(c) == 0


def test_threads_share_one_object_and_respect_the_bounds():
    c = _lru.LRU("t", max_entries=8, max_bytes=8 * 800)
    results, errors = {}, []
    barrier = threading.Barrier(8)

    def work(t):
        try:
            barrier.wait()
            for i in range(200):
                key = i % 12
                v = c.get_or_create(key, lambda key=key: np.full(100, key, np.float64))
                assert v[0] == key
                if key == 3:
                    results.setdefault(t, []).append(v)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    s = c.stats()
    assert s.entries <= 8 and s.nbytes <= 8 * 800 and s.nbytes == 800 * s.entries
    assert s.hits + s.misses == 8 * 200


def test_module_caches_are_bounded_lrus_keyed_by_header_fields():
    for caches in (rotation.CACHES, codebook.CACHES, codec.CACHES, blob.CACHES):
        for cache in caches.values():
            assert isinstance(cache, _lru.LRU) and cache.max_entries <= 1024
    rotation.clear_caches()
    a = rotation.haar_rotation(32, 5)
    assert rotation.haar_rotation(32, 5 + 2**32) is a  # one entry per seed32
    st = rotation.cache_stats()["haar"]
    assert (st.entries, st.nbytes, st.hits, st.misses) == (1, 32 * 32 * 4, st.hits, st.misses) and st.hits >= 1
    # the worst header-chosen table (MAX_DENSE_DIM) fits, and the byte bound caps how many
    worst = wire.MAX_DENSE_DIM**2 * 4
    assert worst <= rotation.CACHES["haar"].max_bytes
    rotation.clear_caches()
    assert rotation.cache_stats()["haar"].entries == 0
    codebook.clear_caches()
    cb = codebook.lloyd_max(16, 2)
    assert codebook.lloyd_max(16, 2) is cb and codebook.cache_stats()["lloyd_max"].entries == 1


def test_one_device_rotation_per_seed_dim_and_device():
    """Every bit width's device tables share one device copy of their rotation; a new
    seed is a new entry."""
    codec.clear_caches()
    k4, v3 = (codec.CodecConfig(64, b, seed=9) for b in (4, 3))
    a, b = codec.device_tables(k4), codec.device_tables(v3)
    assert a.rotation.dense is b.rotation.dense
    h4, h3 = (codec.CodecConfig(64, b, seed=9, rotation="hadamard") for b in (4, 3))
    assert codec.device_tables(h4).rotation.signs is codec.device_tables(h3).rotation.signs
    assert codec.cache_stats()["device rotations"].entries == 2
    assert codec.device_tables(codec.CodecConfig(64, 4, seed=10)).rotation.dense is not a.rotation.dense
    assert codec.cache_stats()["device rotations"].entries == 3
    np.testing.assert_array_equal(np.asarray(a.rotation.dense), rotation.haar_rotation(64, 9))
