"""LMCache 0.5.6 over a real redis-server (the RESP L2 adapter) with tq_jax values.

A real ``StorageManager`` from LMCache's own config parser stores chunks through the
tq_jax serde into Redis, the chunks leave L1, and are prefetched back. Every load is
checked against ``tq_jax.loads`` of the value the serde wrote for that key (read from
Redis before any fault): a load is *correct* (bit-equal), a *miss*, or *wrong* (served
but not equal). Faults: values damaged in place (SETRANGE flips, truncation, values
swapped between keys, copied across tenants), the server killed mid-store and mid-load
and restarted empty, the server at maxmemory, the server stalled (SIGSTOP/SIGCONT).
Each test prints its row of the fault table (``docs/hardening.md``; run with ``-s``).
"""

from __future__ import annotations

import logging
import signal
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lmcache")
pytest.importorskip("redis")

import numpy as np  # noqa: E402
from lmcache.v1.distributed.api import GroupedObjectKeys, MemoryLayoutDesc, ObjectKey, PrefetchTaskSpec  # noqa: E402

import tq_jax  # noqa: E402
from tq_jax.bridge import register  # noqa: E402
from tq_jax.bridge._src import registry  # noqa: E402
from tq_jax.bridge._src.serde import KEY_TRAILER_BYTES, describe_key  # noqa: E402

from bridge_util import Events, build_manager  # noqa: E402
from redis_server import module_redis_server, redis_server, small_redis_server  # noqa: E402, F401 (fixtures)

from conftest import LMCACHE_WARNINGS  # noqa: E402

pytestmark = LMCACHE_WARNINGS

SHAPE = torch.Size((2, 4, 16, 512))  # 128 KiB of bf16 per chunk, head_dim 128
LAYOUT = MemoryLayoutDesc(shapes=[SHAPE], dtypes=[torch.bfloat16])
PRESETS = ["compat-4bit", "turbo-3.5", "turbo-2.5"]
# turbo-3.5 (the production preset) runs in the quick subset; the other presets are `slow`.
SWEEP = [pytest.param(p, marks=[] if p == "turbo-3.5" else [pytest.mark.slow]) for p in PRESETS]
CHECKSUM = {p: bool(tq_jax.PRESETS[p].get("checksum")) for p in PRESETS}
L1_GB = 0.004  # ~4 MiB (32 chunks): holds fewer chunks than the tests store, so L1 must evict to L2


def okey(i: int, tag: str, salt: str = "") -> ObjectKey:
    return ObjectKey(chunk_hash=f"{tag}-{i}".encode().ljust(32, b"\0"), model_name="m", kv_rank=0, cache_salt=salt)


def chunks(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE, generator=g).to(torch.bfloat16) for _ in range(n)]


class Store:
    """A StorageManager over the RESP adapter at ``port`` with the tq_jax serde
    (``adapter``: another adapter type and its extra keys, e.g. ``resp_reconnect``;
    ``l1_gb``: its L1's size)."""

    def __init__(self, port: int, preset: str, adapter: dict | None = None, l1_gb: float = L1_GB, **serde) -> None:
        register()
        self.serde = {"type": "tq_jax", "preset": preset, **serde}
        self.events = Events()
        spec = {"type": "resp", **(adapter or {}), "host": "127.0.0.1", "port": port, "serde": self.serde}
        self.sm = build_manager(spec, l1_gb=l1_gb)
        ser, _ = registry.build_serde(registry.parse_options({k: v for k, v in self.serde.items() if k != "type"}))
        self.size = ser.estimate_serialized_size(LAYOUT)

    def put(self, keys, data, *, wait: bool = True, timeout: float = 60):
        """Writes chunks in batches of two; with ``wait``, each batch's L2 stores are
        awaited and L1's LRU evicts stored chunks to make room. Returns (ok, failed)."""
        since = self.events.counts()
        for i in range(0, len(keys), 2):
            ks = keys[i : i + 2]
            deadline = time.monotonic() + 20
            while len(objs := self.sm.reserve_write(ks, LAYOUT)) != len(ks):  # L1 full until it evicts
                assert time.monotonic() < deadline, "L1 could not reserve the chunks (nothing evicted)"
                time.sleep(0.05)
            for k, x in zip(ks, data[i : i + 2]):
                objs[k].tensor.copy_(x)
            self.sm.finish_write(ks)
            if wait:
                self.events.wait_stores(i + len(ks), timeout, since)
        if wait:
            return self.events.wait_stores(len(keys), timeout, since)
        return since

    def drop_l1(self, keys) -> None:
        deadline = time.monotonic() + 30
        while True:
            _, skipped = self.sm.delete_l1_keys(keys)
            if not skipped or time.monotonic() > deadline:
                return
            time.sleep(0.02)

    def get(self, keys, timeout: float = 30):
        """One prefetch per key (a failed key fails its whole batch in LMCache): a CPU
        copy of each chunk, or None for a miss."""
        out = []
        for k in keys:
            h = self.sm.submit_prefetch_task(PrefetchTaskSpec(key_groups=[GroupedObjectKeys(keys=[k], object_group_id=0, layout_desc=LAYOUT)]))
            assert self.sm.wait_prefetch_status(h, timeout=timeout), "the prefetch did not finish"
            res = self.sm.query_prefetch_status(h)
            if res is None or res.hit_cells[0].popcount() != 1:
                out.append(None)
                continue
            with self.sm.read_prefetched_results([k]) as back:
                out.append(back[0].tensor.clone() if back else None)
            self.sm.finish_read_prefetched([k])
            self.drop_l1([k])
        return out

    def close(self) -> None:
        if self.sm is not None:  # idempotent: one L1 pool per process, so close before a second
            self.sm.close()
            self.events.stop()
            self.sm = None


class _Shared:
    """One Store over ``module_redis_server`` for the tests that only store, damage and
    load values under keys of their own: closing a StorageManager costs over a second
    (LMCache's L1 eviction thread sleeps a second between checks), so they share it, one
    preset at a time; a new one starts on an emptied server (the presets' tests use the
    same keys). LMCache keeps one L1 pool per process: any other Store closes this one
    first."""

    store: Store | None = None

    def get(self, server, preset: str) -> Store:
        if self.store is not None and self.store.serde["preset"] != preset:
            self.close()
        if self.store is None:
            server.client().flushall()
            self.store = Store(server.port, preset)
        return self.store

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None


_SHARED = _Shared()


@pytest.fixture(scope="module")
def _close_shared():
    yield
    _SHARED.close()


@pytest.fixture
def shared_store(module_redis_server, _close_shared, request):  # noqa: F811
    """``get(preset)``: the shared Store (see :class:`_Shared`) and its server. A test
    that fails closes it, so the next test starts from a fresh one."""
    failed = request.session.testsfailed
    yield lambda preset: (_SHARED.get(module_redis_server, preset), module_redis_server)
    if request.session.testsfailed != failed:
        _SHARED.close()


@pytest.fixture
def open_store():
    made = []

    def make(port, preset, adapter=None, **kw):
        _SHARED.close()
        made.append(Store(port, preset, adapter, **kw))
        return made[-1]

    yield make
    for s in made:
        s.close()


def decode(value: bytes, preset: str):
    """What a correct load of ``value`` is: ``tq_jax.loads`` of its TQ01 blob."""
    blob = value[: len(value) - KEY_TRAILER_BYTES] if CHECKSUM[preset] else value  # minus the key trailer
    arr = np.asarray(tq_jax.loads(blob)).view(np.int16)
    return torch.from_numpy(arr.copy()).view(torch.bfloat16).reshape(SHAPE)


def classify(got, want) -> str:
    if got is None:
        return "miss"
    return "correct" if torch.equal(got, want) else "wrong"


def row(fault: str, preset: str, results: list[str]) -> dict:
    r = {"trials": len(results), "detected": results.count("miss"), "wrong": results.count("wrong")}
    print(f"\nFAULT-TABLE | {fault} | {preset} | {r['trials']} | {r['detected']} | {r['wrong']} |")
    return r


# ----------------------------------------------------------------------------- end to end


@pytest.mark.parametrize("preset", SWEEP)
def test_store_evict_load_through_redis(shared_store, preset):
    st, redis_server = shared_store(preset)
    keys, data = [okey(i, "e2e") for i in range(12)], chunks(12)
    assert st.put(keys, data) == (12, 0)
    st.drop_l1(keys)
    rc = redis_server.client()
    values = [rc.get(describe_key(k)) for k in keys]
    assert all(v is not None and len(v) == st.size for v in values)  # exactly the serde's estimate
    got = st.get(keys)
    for x, y, v in zip(data, got, values):
        assert y is not None, "a stored chunk did not load back from Redis"
        assert torch.equal(y, decode(v, preset))  # the served chunk is the stored blob's decode
        cos = torch.nn.functional.cosine_similarity(x.float().reshape(-1, 128), y.float().reshape(-1, 128)).mean()
        assert cos > 0.96
    if CHECKSUM[preset]:
        assert len(values[0]) == tq_jax.Options(**tq_jax.PRESETS[preset]).serialized_size((2, 4, 16, 4, 128), "bfloat16") + KEY_TRAILER_BYTES


@pytest.mark.slow
def test_l1_evicts_to_redis(redis_server, open_store):  # noqa: F811
    """48 chunks through a 32-chunk L1: writing them at all needs LMCache's LRU to evict
    stored chunks; the first ones then load back from Redis, equal to their stored blobs."""
    st = open_store(redis_server.port, "turbo-3.5")
    keys, data = [okey(i, "evict") for i in range(48)], chunks(48, seed=3)
    assert st.put(keys, data) == (48, 0)
    rc = redis_server.client()
    values = [rc.get(describe_key(k)) for k in keys[:4]]
    assert [classify(y, decode(v, "turbo-3.5")) for y, v in zip(st.get(keys[:4]), values)] == ["correct"] * 4


# ----------------------------------------------------------------------------- damaged values


def _stored(st, server, tag, n, salt=""):
    keys, data = [okey(i, tag, salt) for i in range(n)], chunks(n, seed=n)
    assert st.put(keys, data) == (n, 0)
    st.drop_l1(keys)
    rc = server.client()
    return st, rc, keys, [rc.get(describe_key(k)) for k in keys]


@pytest.mark.parametrize("preset", SWEEP)
def test_setrange_flips(shared_store, preset):
    st, rc, keys, values = _stored(*shared_store(preset), "flip", 16)
    rng = np.random.default_rng(0)
    offs = []
    for k, v in zip(keys, values):
        off = int(rng.integers(len(v)))
        offs.append(off)
        rc.setrange(describe_key(k), off, bytes([v[off] ^ (1 << int(rng.integers(8)))]))
    results = [classify(y, decode(v, preset)) for y, v in zip(st.get(keys), values)]
    r = row("SETRANGE flip, 1 byte at a random offset", preset, results)
    if CHECKSUM[preset]:
        assert (r["detected"], r["wrong"]) == (16, 0)
    else:  # v1: only a flip the header parser notices is refused; the rest is served damaged
        assert r["detected"] + r["wrong"] == 16 and r["wrong"] >= 12


@pytest.mark.parametrize("preset", SWEEP)
def test_values_swapped_between_keys(shared_store, preset):
    st, rc, keys, values = _stored(*shared_store(preset), "swap", 8)
    for i in range(0, 8, 2):
        rc.set(describe_key(keys[i]), values[i + 1])
        rc.set(describe_key(keys[i + 1]), values[i])
    r = row("values swapped between two keys", preset, [classify(y, decode(v, preset)) for y, v in zip(st.get(keys), values)])
    if CHECKSUM[preset]:
        assert (r["detected"], r["wrong"]) == (8, 0)
    else:
        assert r["wrong"] == 8  # v1 carries nothing of its key: served as the other chunk


@pytest.mark.parametrize("preset", SWEEP)
def test_value_copied_across_tenants(shared_store, preset):
    """Same prompt, two tenants (same chunk hashes, other cache_salt): tenant A's value
    copied over tenant B's."""
    st, rc, keys_b, values_b = _stored(*shared_store(preset), "tenant", 6, salt="B")
    keys_a, data_a = [okey(i, "tenant", "A") for i in range(6)], chunks(6, seed=99)
    assert st.put(keys_a, data_a) == (6, 0)
    st.drop_l1(keys_a)
    for ka, kb in zip(keys_a, keys_b):
        rc.set(describe_key(kb), rc.get(describe_key(ka)))
    r = row("value copied from tenant A's key to B's", preset, [classify(y, decode(v, preset)) for y, v in zip(st.get(keys_b), values_b)])
    if CHECKSUM[preset]:
        assert (r["detected"], r["wrong"]) == (6, 0)
    else:
        assert r["wrong"] == 6


@pytest.mark.parametrize("preset", SWEEP)
def test_truncated_values(redis_server, open_store, preset):  # noqa: F811
    """Its own server and manager: once LMCache's RESP client has refused a value of the
    wrong length, that manager's later stores are reported failed and most of its loads
    miss (its connections stay out of step), so no other test shares them."""
    st, rc, keys, values = _stored(open_store(redis_server.port, preset), redis_server, "trunc", 8)
    rng = np.random.default_rng(1)
    for k, v in zip(keys, values):
        rc.set(describe_key(k), v[: int(rng.integers(1, len(v)))])
    r = row("truncated (SET of a prefix)", preset, [classify(y, decode(v, preset)) for y, v in zip(st.get(keys), values)])
    assert (r["detected"], r["wrong"]) == (8, 0)  # the RESP client's GET checks the length


# ----------------------------------------------------------------------------- server faults


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["compat-4bit", "turbo-3.5"])
def test_server_killed_mid_store_and_restarted_empty(redis_server, open_store, preset):  # noqa: F811
    st = open_store(redis_server.port, preset)
    keys, data = [okey(i, "kill-store") for i in range(8)], chunks(8, seed=5)
    since = st.put(keys, data, wait=False)
    redis_server.kill()
    ok, failed = st.events.wait_stores(8, 60, since)  # every store reports; nothing raised
    assert ok + failed == 8
    redis_server.start()  # empty: persistence is off
    st.drop_l1(keys)
    assert st.get(keys[:4]) == [None] * 4  # lookups miss
    # LMCache 0.5.6's native RESP client does not reconnect: this manager's stores now fail
    # (reported, not raised). A new StorageManager (an LMCache restart) stores and loads again;
    # the resp_reconnect adapter keeps the same one working (test_resp_reconnect_...).
    assert st.put([okey(0, "after")], chunks(1)) == (0, 1)
    st.close()
    fresh = open_store(redis_server.port, preset)
    k, x = [okey(1, "after")], chunks(1, seed=6)
    assert fresh.put(k, x) == (1, 0)
    fresh.drop_l1(k)
    v = redis_server.client().get(describe_key(k[0]))
    assert torch.equal(fresh.get(k)[0], decode(v, preset))
    row("server SIGKILL mid-store, restarted empty", preset, ["miss"] * 4)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["compat-4bit", "turbo-3.5"])
def test_server_killed_mid_load(redis_server, open_store, preset):  # noqa: F811
    st = open_store(redis_server.port, preset)
    keys, data = [okey(i, "kill-load") for i in range(12)], chunks(12, seed=7)
    assert st.put(keys, data) == (12, 0)
    st.drop_l1(keys)
    rc = redis_server.client()
    values = [rc.get(describe_key(k)) for k in keys]
    h = st.sm.submit_prefetch_task(PrefetchTaskSpec(key_groups=[GroupedObjectKeys(keys=keys, object_group_id=0, layout_desc=LAYOUT)]))
    redis_server.kill()
    assert st.sm.wait_prefetch_status(h, timeout=30), "a load hung after the server died"
    res = st.sm.query_prefetch_status(h)
    hits = res.hit_cells[0].popcount() if res is not None else 0
    results = ["miss"] * (len(keys) - hits)
    if hits:  # whatever did load before the kill must be right
        with st.sm.read_prefetched_results(keys[:hits]) as back:
            results += [classify(o.tensor.clone(), decode(v, preset)) for o, v in zip(back, values)]
        st.sm.finish_read_prefetched(keys[:hits])
    redis_server.start()
    assert st.get(keys[-2:]) == [None, None]
    r = row("server SIGKILL mid-load, restarted empty", preset, results)
    assert r["wrong"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["compat-4bit", "turbo-3.5"])
def test_server_at_maxmemory(small_redis_server, open_store, preset):  # noqa: F811
    """4 MiB with allkeys-lru and ~6 MiB of values: Redis evicts; loads miss or are right.
    L1 holds every chunk here (Redis's eviction is the subject, test_l1_evicts_to_redis
    covers L1's): through the 32-chunk L1, LMCache's once-a-second eviction paced the
    writes at about 30 s a preset."""
    st = open_store(small_redis_server.port, preset, l1_gb=0.032)  # 256 chunks of 128 KiB
    n = 6 * 2**20 // st.size + 1
    keys, data = [okey(i, "full") for i in range(n)], chunks(n, seed=8)
    ok, failed = st.put(keys, data)
    assert ok + failed == n
    st.drop_l1(keys)
    rc = small_redis_server.client()
    values = [rc.get(describe_key(k)) for k in keys]
    kept = [v is not None for v in values]
    assert 0 < sum(kept) < n, "Redis evicted nothing (or everything): maxmemory not reached"
    got = st.get(keys)
    results = [classify(y, decode(v, preset)) if v is not None else ("miss" if y is None else "wrong") for y, v in zip(got, values)]
    assert "wrong" not in results and results.count("correct") > 0
    r = row("server at maxmemory (allkeys-lru): evicted keys", preset, [r for r, k in zip(results, kept) if not k])
    assert r["wrong"] == 0


@pytest.mark.slow
def test_server_stalled_then_resumed(redis_server, open_store):  # noqa: F811
    """SIGSTOP: the RESP client has no timeout, so loads wait; the caller's
    ``wait_prefetch_status(timeout=...)`` returns, nothing else blocks, and after SIGCONT
    the load completes with the right chunk."""
    st = open_store(redis_server.port, "turbo-3.5")
    keys, data = [okey(i, "stall") for i in range(2)], chunks(2, seed=9)
    assert st.put(keys, data) == (2, 0)
    st.drop_l1(keys)
    values = [redis_server.client().get(describe_key(k)) for k in keys]
    redis_server.stop_signal(signal.SIGSTOP)
    try:
        h = st.sm.submit_prefetch_task(PrefetchTaskSpec(key_groups=[GroupedObjectKeys(keys=keys, object_group_id=0, layout_desc=LAYOUT)]))
        t0 = time.monotonic()
        done = st.sm.wait_prefetch_status(h, timeout=2)
        assert time.monotonic() - t0 < 5
        since = st.put([okey(5, "stall")], chunks(1, seed=10), wait=False)
    finally:
        redis_server.stop_signal(signal.SIGCONT)
    assert done or True  # either outcome is allowed while stalled; what matters is below
    assert st.sm.wait_prefetch_status(h, timeout=30), "the load did not resume after SIGCONT"
    res = st.sm.query_prefetch_status(h)
    hits = res.hit_cells[0].popcount()
    results = ["miss"] * (2 - hits)
    if hits:
        with st.sm.read_prefetched_results(keys[:hits]) as back:
            results += [classify(o.tensor.clone(), decode(v, "turbo-3.5")) for o, v in zip(back, values)]
        st.sm.finish_read_prefetched(keys[:hits])
    assert st.events.wait_stores(1, 30, since) == (1, 0)  # the store made during the stall lands
    r = row("server SIGSTOP 2 s, then SIGCONT", "turbo-3.5", results)
    assert r["wrong"] == 0
    st.drop_l1(keys)
    assert [classify(y, decode(v, "turbo-3.5")) for y, v in zip(st.get(keys), values)] == ["correct"] * 2


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["compat-4bit", "turbo-3.5"])
def test_resp_reconnect_same_manager_after_restart(redis_server, open_store, preset):  # noqa: F811
    """``resp_reconnect`` (tq_jax.bridge._src.reconnect): SIGKILL mid-store, restart empty on the
    same port, and the SAME StorageManager stores and loads again, loads equal to the
    stored blobs' decode."""
    st = open_store(redis_server.port, preset, adapter={"type": "resp_reconnect", "reconnect_interval": 0.2})
    keys, data = [okey(i, "rc-kill") for i in range(8)], chunks(8, seed=13)
    since = st.put(keys, data, wait=False)
    redis_server.kill()
    ok, failed = st.events.wait_stores(8, 60, since)
    assert ok + failed == 8  # every store reported, nothing raised
    redis_server.start()  # empty: persistence is off
    st.drop_l1(keys)
    assert st.get(keys[:4]) == [None] * 4  # lookups miss (the first ones may see the dead connection)
    tries, deadline = 0, time.monotonic() + 20
    k = [okey(0, "rc-after")]
    while True:  # a store made before the client is rebuilt fails (reported); then it succeeds
        tries += 1
        if st.put(k, chunks(1, seed=14)) == (1, 0):
            break
        assert time.monotonic() < deadline, f"the same StorageManager did not store again in 20 s ({tries} tries)"
        st.drop_l1(k)
        time.sleep(0.1)
    more, more_data = [okey(i, "rc-after") for i in range(1, 7)], chunks(6, seed=15)
    assert st.put(more, more_data) == (6, 0)
    st.drop_l1(k + more)
    rc = redis_server.client()
    values = [rc.get(describe_key(x)) for x in k + more]
    assert all(v is not None and len(v) == st.size for v in values)
    got = st.get(k + more)
    assert [classify(y, decode(v, preset)) for y, v in zip(got, values)] == ["correct"] * 7
    for x, y in zip(more_data, got[1:]):
        cos = torch.nn.functional.cosine_similarity(x.float().reshape(-1, 128), y.float().reshape(-1, 128)).mean()
        assert cos > 0.96  # the chunk stored after the restart, not another
    print(f"\nresp_reconnect: {tries} store attempt(s) after the restart until the first succeeded")
    row("resp_reconnect: SIGKILL mid-store, restarted empty, same manager", preset, ["miss"] * 4)


def test_resp_reconnect_config_errors():
    from tq_jax.bridge._src.reconnect import ReconnectingRESPConfig

    cfg = ReconnectingRESPConfig.from_dict({"host": "127.0.0.1", "port": 6379, "reconnect_interval": 0.5})
    assert (cfg.reconnect_interval, cfg.probe_timeout, cfg.num_workers) == (0.5, 2.0, 8)
    for bad in ({"reconnect_interval": 0}, {"probe_timeout": "2"}, {"reconnect_interval": True}):
        with pytest.raises(ValueError, match="positive number of seconds"):
            ReconnectingRESPConfig.from_dict({"host": "127.0.0.1", "port": 6379, **bad})
    with pytest.raises(ValueError, match="port"):
        ReconnectingRESPConfig.from_dict({"host": "127.0.0.1", "port": -1})


# ----------------------------------------------------------------------------- tenants, encrypted


def test_two_encrypted_tenants_same_prompt_each_load_their_own(redis_server, open_store, tmp_path):  # noqa: F811
    master = tmp_path / "master.key"
    master.write_bytes(bytes(range(32)))
    enc = {"encrypt": {"key_provider": "hkdf", "master_key_path": str(master), "aes_bits": 256}}
    st = open_store(redis_server.port, "turbo-3.5", **enc)
    a, b = chunks(4, seed=11), chunks(4, seed=12)
    keys_a, keys_b = [okey(i, "same", "A") for i in range(4)], [okey(i, "same", "B") for i in range(4)]
    assert st.put(keys_a, a) == (4, 0) and st.put(keys_b, b) == (4, 0)
    st.drop_l1(keys_a + keys_b)
    rc = redis_server.client()
    assert all(len(rc.get(describe_key(k))) == st.size for k in keys_a + keys_b)
    got_a, got_b = st.get(keys_a), st.get(keys_b)
    for x, y in zip(a + b, got_a + got_b):
        assert y is not None
        cos = torch.nn.functional.cosine_similarity(x.float().reshape(-1, 128), y.float().reshape(-1, 128)).mean()
        assert cos > 0.98  # each tenant's own chunk (the other tenant's would be ~0)
    for ka, kb in zip(keys_a, keys_b):  # B's values replaced by A's: refused, a miss
        rc.set(describe_key(kb), rc.get(describe_key(ka)))
    assert st.get(keys_b) == [None] * 4
    row("encrypted: tenant A's value copied to B's key", "turbo-3.5 + encrypt", ["miss"] * 4)


def test_resp_reconnect_server_down_at_start_up(redis_server, open_store, caplog):  # noqa: F811
    """A store that is down when the server starts: the adapter is built anyway, says so
    once, fails every store and misses every lookup at once (no hang), and serves from
    the store as soon as it answers, in the same StorageManager."""
    redis_server.kill()
    caplog.set_level(logging.WARNING, logger="tq_jax.bridge._src.reconnect")
    st = open_store(redis_server.port, "turbo-3.5", adapter={"type": "resp_reconnect", "reconnect_interval": 0.2})
    (said,) = [r.getMessage() for r in caplog.records if "does not answer at start-up" in r.getMessage()]
    assert f"127.0.0.1:{redis_server.port}" in said and "the engine computes" in said
    keys, data = [okey(i, "down-at-start") for i in range(2)], chunks(2, seed=21)
    t0 = time.monotonic()
    assert st.put(keys, data, timeout=10) == (0, 2)  # reported failed, promptly
    st.drop_l1(keys)
    assert st.get(keys) == [None, None]
    assert time.monotonic() - t0 < 10
    redis_server.start()
    deadline = time.monotonic() + 20
    while st.put(keys[:1], data[:1], timeout=10) != (1, 0):  # connected within reconnect_interval of its return
        assert time.monotonic() < deadline, "the adapter did not connect within 20 s of the server's start"
        st.drop_l1(keys[:1])
        time.sleep(0.1)
    st.drop_l1(keys[:1])
    (y,) = st.get(keys[:1])
    cos = torch.nn.functional.cosine_similarity(data[0].float().reshape(-1, 128), y.float().reshape(-1, 128)).mean()
    assert cos > 0.96
