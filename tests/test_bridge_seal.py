"""Key binding of checksummed values and per-tenant AES-GCM sealing, without a store.

The serializers and deserializers LMCache gets from :func:`tq_jax.bridge._src.registry.build_serde`
are driven directly on real ``MemoryObj``s; every refusal is checked to leave the
destination untouched (nothing decoded), and every accepted value against
``tq_jax.loads`` of the same TQ01 blob.
"""

from __future__ import annotations

import logging
import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lmcache")

import numpy as np  # noqa: E402
from lmcache.v1.distributed.api import ObjectKey  # noqa: E402

import tq_jax  # noqa: E402
from tq_jax.bridge._src import dlpack, registry, seal  # noqa: E402
from tq_jax.bridge._src import serde as S  # noqa: E402

from bridge_util import byte_obj, layout, make_obj  # noqa: E402

from conftest import LMCACHE_WARNINGS  # noqa: E402

pytestmark = LMCACHE_WARNINGS

SHAPE = (2, 4, 8, 256)
STORED = (2, 4, 8, 2, 128)
BF16 = torch.bfloat16
MASTER = bytes(range(7, 7 + 32))  # a recognisable master key, searched for in logs and blobs


def okey(i: int = 0, salt: str = "", model: str = "m", rank: int = 0, group: int = 0) -> ObjectKey:
    return ObjectKey(chunk_hash=f"h{i}".encode().ljust(32, b"\0"), model_name=model, kv_rank=rank,
                     object_group_id=group, cache_salt=salt)


def chunk(seed: int = 0):
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)).to(BF16)
    obj = make_obj([SHAPE], [BF16])
    obj.tensor.copy_(x)
    return obj


def serde_pair(preset: str, master_path=None, **encrypt):
    """The serde of ``preset``; with ``master_path`` (a file, or a list of files newest
    first) sealed, ``encrypt`` adding keys of the block (``accept_tqs1``)."""
    cfg = {"preset": preset}
    if master_path is not None:
        paths = {"master_key_paths": [str(p) for p in master_path]} if isinstance(master_path, list) else {"master_key_path": str(master_path)}
        cfg["encrypt"] = {"key_provider": "hkdf", **paths, "aes_bits": 256, **encrypt}
    return registry.build_serde(registry.parse_options(cfg))


def store(ser, obj, k) -> bytes:
    n = ser.estimate_serialized_size(layout([SHAPE], [BF16]))
    dst = byte_obj(n)
    assert ser.serialize(obj, dst, k) == n  # exact, from the layout
    return bytes(dlpack.numpy_view(dst.tensor))


def load(de, value: bytes, k):
    """The decoded chunk, or the exception the deserializer raised (the destination is
    pre-filled with -7 and must stay so on a refusal)."""
    src = byte_obj(len(value))
    dlpack.numpy_view(src.tensor)[:] = np.frombuffer(value, np.uint8)
    dst = make_obj([SHAPE], [BF16])
    dst.tensor.fill_(-7)
    try:
        de.deserialize(src, dst, k)
    except Exception as e:  # noqa: BLE001 - returned for the caller to check
        assert (dst.tensor == -7).all(), "a refused value was (partly) decoded into the destination"
        return e
    return dst.tensor.clone()


@pytest.fixture
def master_file(tmp_path):
    p = tmp_path / "master.key"
    p.write_bytes(MASTER)
    return p


def expected(blob: bytes):
    # np.array copies: torch.from_numpy of a read-only view warns ("NumPy array is not writable").
    return torch.from_numpy(np.array(tq_jax.loads(blob)).view(np.int16)).view(BF16).reshape(SHAPE)


# ----------------------------------------------------------------------------- key binding


# Quick tier: turbo-3.5 (the trailer does not depend on the preset's bits).
@pytest.mark.parametrize("preset", ["turbo-3.5", pytest.param("turbo-2.5", marks=pytest.mark.slow)])
def test_checksummed_value_is_bound_to_its_key(preset):
    ser, de = serde_pair(preset)
    size = tq_jax.Options(**tq_jax.PRESETS[preset]).serialized_size(STORED, "bfloat16")
    k = okey(1, salt="a")
    value = store(ser, chunk(1), k)
    assert len(value) == size + S.KEY_TRAILER_BYTES
    assert value[size:] == S.KEY_TRAILER_MAGIC + S.key_digest(k)  # the blob, then the key trailer
    assert torch.equal(load(de, value, k), expected(value[:size]))
    # Every field of the key is bound: model, hash, rank, group, salt.
    for other in (okey(2, salt="a"), okey(1, salt="b"), okey(1, salt="a", model="n"),
                  okey(1, salt="a", rank=1), okey(1, salt="a", group=1), okey(1)):
        err = load(de, value, other)
        assert isinstance(err, S.KeyMismatchError), other
        assert "names another key" in str(err) and S.describe_key(other) in str(err)
    # A value without the trailer (a bare checksummed blob) or without a checksum is refused.
    assert isinstance(load(de, value[:size] + bytes(S.KEY_TRAILER_BYTES), k), S.KeyMismatchError)


def test_turbo_4_preset_through_the_serde():
    """The bridge's ``preset: turbo-4``: the bytes tq_jax.dumps writes with the preset
    (K5V3, 6-bit log norms, CRC) and the key trailer, at most 4.25 bits per element,
    and the blob's decoded values back."""
    ser, de = serde_pair("turbo-4")
    k, obj = okey(5), chunk(5)
    size = tq_jax.Options(**tq_jax.PRESETS["turbo-4"]).serialized_size(STORED, "bfloat16")
    value = store(ser, obj, k)
    assert len(value) == size + S.KEY_TRAILER_BYTES and 8 * size / math.prod(STORED) <= 4.25
    h = tq_jax.peek_header(value[:size])
    assert (h.bits, h.value_bits, h.norm_bits, h.rotation, h.checksum) == (5, 3, 6, "hadamard", True)
    assert value[:size] == tq_jax.dumps(dlpack.numpy_view(obj.tensor).reshape(STORED), **tq_jax.PRESETS["turbo-4"])
    assert torch.equal(load(de, value, k), expected(value[:size]))


def test_binding_reader_refuses_a_blob_without_crc_even_with_the_right_trailer():
    _, de = serde_pair("turbo-3.5")
    k = okey(3)
    x = dlpack.numpy_view(chunk(3).tensor).reshape(STORED)
    blob = tq_jax.dumps(x, **{**tq_jax.PRESETS["turbo-3.5"], "checksum": False})
    err = load(de, blob + S.KEY_TRAILER_MAGIC + S.key_digest(k), k)
    assert isinstance(err, S.KeyMismatchError) and "no CRC32 trailer" in str(err)


def test_compat_4bit_values_stay_the_reference_bytes():
    """v1 values get no trailer: exactly tq_jax.dumps' (= the reference plugin's) blob."""
    ser, de = serde_pair("compat-4bit")
    assert not ser.bind_key and not de.bind_key
    obj = chunk(4)
    value = store(ser, obj, okey(4))
    assert value == tq_jax.dumps(dlpack.numpy_view(obj.tensor).reshape(STORED), bits=4)
    # ... and so nothing binds them to a key: read under another key, they decode.
    assert torch.equal(load(de, value, okey(5, salt="x")), expected(value))


def test_every_flipped_byte_of_a_checksummed_value_is_refused():
    ser, de = serde_pair("turbo-3.5")
    k = okey(6)
    value = bytearray(store(ser, chunk(6), k))
    rng = np.random.default_rng(0)
    offsets = sorted({0, len(value) - 1, *rng.integers(0, len(value), 40).tolist()})
    for off in offsets:
        bad = bytearray(value)
        bad[off] ^= 1 << int(rng.integers(8))
        assert isinstance(load(de, bytes(bad), k), Exception), off


# ----------------------------------------------------------------------------- sealing

# The derivations, written out here independently of bridge/_src/seal.py (docs/bridge.md, frames).
V1_INFO, V2_INFO, VALUE_INFO = b"tq_jax-l2-aesgcm-v1", b"tq_jax-l2-aesgcm-v2", b"tq_jax-l2-value-v2"


def open_tqs2(master: bytes, value: bytes, k) -> bytes:
    """A TQS2 value's plaintext: AES-GCM under HKDF-Expand(tenant PRK, info | salt | key), nonce 0."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    from cryptography.hazmat.primitives.hashes import SHA256
    from cryptography.hazmat.primitives.kdf.hkdf import HKDFExpand
    from lmcache.v1.distributed.serde.key_provider import HkdfKeyProvider

    assert value[:4] == b"TQS2"
    prk = HkdfKeyProvider(master, 32, V2_INFO).get_key(k.cache_salt)
    vk = HKDFExpand(SHA256(), 32, VALUE_INFO + value[4:16] + S.object_key_bytes(k)).derive(prk)
    return AESGCM(vk).decrypt(bytes(12), value[16:], S.object_key_bytes(k))


def seal_tqs1(master: bytes, plain: bytes, k) -> bytes:
    """The TQS1 frame as this serde wrote it before: the tenant key, a random nonce."""
    import os

    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    from lmcache.v1.distributed.serde.key_provider import HkdfKeyProvider

    nonce = os.urandom(12)
    dek = HkdfKeyProvider(master, 32, V1_INFO).get_key(k.cache_salt)
    return b"TQS1" + nonce + AESGCM(dek).encrypt(nonce, plain, S.object_key_bytes(k))


@pytest.mark.parametrize("preset", ["turbo-3.5", "compat-4bit"])
def test_sealed_value_opens_only_under_its_key(preset, master_file):
    ser, de = serde_pair(preset, master_file)
    size = tq_jax.Options(**tq_jax.PRESETS[preset]).serialized_size(STORED, "bfloat16")
    k = okey(7, salt="tenant-a")
    value = store(ser, chunk(7), k)
    assert len(value) == size + 32 == size + seal.OVERHEAD and value[:4] == b"TQS2"
    got = load(de, value, k)
    assert isinstance(got, torch.Tensor)
    # The plaintext is the same TQ01 blob the unencrypted serde writes (no key trailer inside).
    plain_ser, _ = serde_pair(preset)
    plain = store(plain_ser, chunk(7), k)
    assert torch.equal(got, expected(plain[:size]))
    # Another salt (tenant), chunk, model, rank or group: refused, a miss, never garbage.
    for other in (okey(7, salt="tenant-b"), okey(7), okey(8, salt="tenant-a"), okey(7, salt="tenant-a", model="n"),
                  okey(7, salt="tenant-a", rank=2), okey(7, salt="tenant-a", group=1)):
        err = load(de, value, other)
        assert isinstance(err, seal.SealError) and "does not verify" in str(err), other


def test_tqs2_value_key_is_per_value_and_opens_independently(master_file):
    ser, de = serde_pair("turbo-3.5", master_file)
    k = okey(9, salt="t")
    a, b = store(ser, chunk(9), k), store(ser, chunk(9), k)
    assert a[4:16] != b[4:16] and a[16:] != b[16:]  # same chunk, same key: another salt, other bytes
    # Opened with LMCache's key provider, cryptography's HKDF and AESGCM, the documented infos.
    plain = open_tqs2(MASTER, a, k)
    assert open_tqs2(MASTER, b, k) == plain
    assert torch.equal(load(de, a, k), expected(plain))
    plain_ser, _ = serde_pair("turbo-3.5")
    assert plain == store(plain_ser, chunk(9), k)[: len(plain)]  # the unencrypted serde's blob
    # The value key depends on the salt and on the whole key: the same ciphertext under
    # another salt, or the salt moved to another key, does not open.
    from cryptography.exceptions import InvalidTag

    with pytest.raises(InvalidTag):
        open_tqs2(MASTER, a[:4] + b[4:16] + a[16:], k)
    with pytest.raises(InvalidTag):
        open_tqs2(MASTER, a, okey(9, salt="t", group=1))


def test_tqs1_values_still_open_and_can_be_refused(master_file):
    ser, de = serde_pair("turbo-3.5", master_file)
    k = okey(12, salt="t")
    plain = open_tqs2(MASTER, store(ser, chunk(12), k), k)
    old = seal_tqs1(MASTER, plain, k)
    assert len(old) == len(plain) + 32  # the same size as TQS2: LMCache's adapters accept it
    assert torch.equal(load(de, old, k), expected(plain))
    for other in (okey(12, salt="u"), okey(13, salt="t")):  # still bound to its key
        assert isinstance(load(de, old, other), seal.SealError)
    _, strict = serde_pair("turbo-3.5", master_file, accept_tqs1=False)
    err = load(strict, old, k)
    assert isinstance(err, seal.SealError) and "TQS1" in str(err) and "accept_tqs1" in str(err)
    assert isinstance(load(strict, store(ser, chunk(12), k), k), torch.Tensor)  # TQS2 still opens


class FsCache:
    """A real StorageManager over LMCache's fs adapter with the tq_jax serde of ``serde``."""

    def __init__(self, base, serde: dict) -> None:
        from bridge_util import Events, build_manager
        from tq_jax.bridge import register

        register()
        self.base, self.events = base, Events()
        self.sm = build_manager({"type": "fs", "base_path": str(base), "serde": {"type": "tq_jax", **serde}}, l1_gb=0.05)
        self.lay = layout([SHAPE], [BF16])

    def path(self, k):
        from lmcache.v1.distributed.l2_adapters.fs_l2_adapter import _object_key_to_filename

        return self.base / _object_key_to_filename(k)

    def store(self, keys, seeds) -> None:
        """Writes the chunks to L1, waits for their L2 stores, then drops them from L1."""
        import time

        objs = self.sm.reserve_write(keys, self.lay)
        for k, sd in zip(keys, seeds):
            objs[k].tensor.copy_(chunk(sd).tensor)
        since = self.events.counts()
        self.sm.finish_write(keys)
        assert self.events.wait_stores(len(keys), 60, since) == (len(keys), 0)
        deadline = time.monotonic() + 30
        while self.sm.delete_l1_keys(keys)[1] and time.monotonic() < deadline:
            time.sleep(0.02)

    def prefetch(self, keys) -> dict:
        """One prefetch of ``keys``: {index: chunk} of the hits (a miss is not readable in L1)."""
        from lmcache.v1.distributed.api import GroupedObjectKeys, PrefetchTaskSpec

        h = self.sm.submit_prefetch_task(PrefetchTaskSpec(key_groups=[GroupedObjectKeys(keys=keys, object_group_id=0, layout_desc=self.lay)]))
        assert self.sm.wait_prefetch_status(h, timeout=60)
        res = self.sm.query_prefetch_status(h)
        hits = [] if res is None or not res.hit_cells else res.hit_cells[0].get_indices_list()
        got = {}
        if hits:
            with self.sm.read_prefetched_results([keys[i] for i in hits]) as back:
                got = {i: o.tensor.clone() for i, o in zip(hits, back)}
            self.sm.finish_read_prefetched([keys[i] for i in hits])
            self.sm.delete_l1_keys([keys[i] for i in hits])
        for i, k in enumerate(keys):
            if i not in got:
                with self.sm.read_prefetched_results([k]) as back:
                    assert back is None, f"key {i} missed but is readable in L1"
        return got

    def close(self) -> None:
        self.sm.close()
        self.events.stop()


def test_tqs1_value_opens_through_a_real_lmcache_fs_adapter(master_file, tmp_path):
    """A store written in the TQS1 frame reads back through LMCache's fs adapter."""
    enc = {"key_provider": "hkdf", "master_key_path": str(master_file), "aes_bits": 256}
    cache = FsCache(tmp_path, {"preset": "turbo-3.5", "encrypt": enc})
    keys = [okey(20 + i, salt="t") for i in range(3)]
    try:
        cache.store(keys, [20, 21, 22])
        paths = [cache.path(k) for k in keys]
        written = [p.read_bytes() for p in paths]
        assert all(w[:4] == b"TQS2" for w in written)
        plains = [open_tqs2(MASTER, w, k) for w, k in zip(written, keys)]
        paths[0].write_bytes(seal_tqs1(MASTER, plains[0], keys[0]))  # as written before TQS2
        paths[1].write_bytes(seal_tqs1(MASTER, plains[2], keys[2]))  # a TQS1 value moved to another key
        assert paths[0].stat().st_size == len(written[0])
        got = {}
        for i, k in enumerate(keys):  # one key per prefetch (a refused value fails its batch)
            got.update({i: t for t in cache.prefetch([k]).values()})
    finally:
        cache.close()
    assert sorted(got) == [0, 2], sorted(got)  # the moved value is a miss
    assert torch.equal(got[0], expected(plains[0])) and torch.equal(got[2], expected(plains[2]))


def test_lmcache_fails_a_whole_load_batch_on_one_refused_value(tmp_path):
    """LMCache 0.5.6 (docs/hardening.md): two values swapped between keys make the whole
    four-key prefetch miss, not only those two; nothing is served. Prefetched one key at a
    time, the two good chunks load. Pins LMCache's behaviour: a serde cannot refuse one
    value of a batch (AsyncSerdeProcessor reports one bool per task)."""
    # Imported before the handler is added: LMCache's init_logger clears a module's
    # logger handlers when the module is first imported.
    from lmcache.v1.distributed.l2_adapters import serde_wrapper

    wrapper_log = logging.getLogger(serde_wrapper.__name__)
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    keep = Keep(logging.WARNING)
    wrapper_log.addHandler(keep)
    cache = FsCache(tmp_path, {"preset": "turbo-3.5"})
    keys = [okey(40 + i, salt="t") for i in range(4)]
    try:
        cache.store(keys, [40, 41, 42, 43])
        paths = [cache.path(k) for k in keys]
        values = [p.read_bytes() for p in paths]
        paths[1].write_bytes(values[3])
        paths[3].write_bytes(values[1])
        batch = cache.prefetch(keys)
        single = {}
        for i, k in enumerate(keys):
            single.update({i: t for t in cache.prefetch([k]).values()})
    finally:
        cache.close()
        wrapper_log.removeHandler(keep)
    assert batch == {}  # all four miss
    assert any("deserialize failed" in ln and "reporting all keys as failed" in ln for ln in lines), lines
    assert sorted(single) == [0, 2]
    size = len(values[0]) - S.KEY_TRAILER_BYTES
    for i in (0, 2):
        assert torch.equal(single[i], expected(values[i][:size]))


def test_every_flip_of_a_tqs2_value_is_refused(master_file):
    ser, de = serde_pair("compat-4bit", master_file)
    k = okey(10, salt="t")
    value = store(ser, chunk(10), k)
    n = len(value)
    rng = np.random.default_rng(1)
    regions = {"magic": range(0, 4), "salt": range(4, 16), "ciphertext": rng.integers(16, n - 16, 24).tolist(),
               "tag": range(n - 16, n)}
    for region, offsets in regions.items():
        for off in offsets:
            for bit in (0, int(rng.integers(1, 8))):
                bad = bytearray(value)
                bad[off] ^= 1 << bit
                assert isinstance(load(de, bytes(bad), k), seal.SealError), (region, off, bit)
    # Relabelled as the older frame (b"TQS2" -> b"TQS1"), it does not open either.
    err = load(de, b"TQS1" + value[4:], k)
    assert isinstance(err, seal.SealError) and "TQS1 frame" in str(err)


def test_wrong_master_key_is_a_miss_with_the_hint(master_file, tmp_path):
    ser, de = serde_pair("compat-4bit", master_file)
    k = okey(10, salt="t")
    value = store(ser, chunk(10), k)
    other = tmp_path / "other.key"
    other.write_bytes(bytes(32))
    _, de_other = serde_pair("compat-4bit", other)
    err = load(de_other, value, k)
    assert isinstance(err, seal.SealError)
    assert "does not verify under any of this serde's 1 master key(s)" in str(err)
    assert "check that all servers read the same master key files" in str(err)
    # Unencrypted values are refused by an encrypting reader, and the other way round.
    plain_ser, plain_de = serde_pair("compat-4bit")
    err = load(de, store(plain_ser, chunk(10), k) + bytes(seal.OVERHEAD), k)
    assert isinstance(err, seal.SealError) and "magic (TQS1 or TQS2)" in str(err)
    assert isinstance(load(plain_de, value, k), Exception)


def test_master_key_rotation(tmp_path):
    """Sealed under A; rotate to [B, A]: A's values still open, new ones are sealed under
    B; then [B] alone: A's values are misses, B's open."""
    key_a, key_b = bytes(range(100, 132)), bytes(range(200, 232))
    a, b = tmp_path / "a.key", tmp_path / "b.key"
    a.write_bytes(key_a)
    b.write_bytes(key_b)
    k1, k2, k3 = okey(30, salt="t"), okey(31, salt="t"), okey(32, salt="u")
    ser_a, de_a = serde_pair("turbo-3.5", [a])
    old = store(ser_a, chunk(30), k1)
    old_v1 = seal_tqs1(key_a, open_tqs2(key_a, store(ser_a, chunk(32), k3), k3), k3)  # a TQS1 value under A
    want_old, want_v1 = expected(open_tqs2(key_a, old, k1)), expected(open_tqs2(key_a, store(ser_a, chunk(32), k3), k3))

    ser_ba, de_ba = serde_pair("turbo-3.5", [b, a])
    assert torch.equal(load(de_ba, old, k1), want_old)  # written before the rotation: opens
    assert torch.equal(load(de_ba, old_v1, k3), want_v1)
    new = store(ser_ba, chunk(31), k2)
    from cryptography.exceptions import InvalidTag

    want_new = expected(open_tqs2(key_b, new, k2))  # sealed under B ...
    with pytest.raises(InvalidTag):
        open_tqs2(key_a, new, k2)  # ... not A
    assert torch.equal(load(de_ba, new, k2), want_new)
    assert isinstance(load(de_a, new, k2), seal.SealError)  # a server not yet rotated misses B's values

    _, de_b = serde_pair("turbo-3.5", [b])
    assert torch.equal(load(de_b, new, k2), want_new)
    for value, k in ((old, k1), (old_v1, k3)):
        err = load(de_b, value, k)
        assert isinstance(err, seal.SealError) and "1 master key(s)" in str(err)


def test_key_never_in_logs_errors_or_blobs(master_file, tmp_path, caplog):
    from lmcache.v1.distributed.serde.key_provider import HkdfKeyProvider

    deks = [HkdfKeyProvider(MASTER, 32, info).get_key("t") for info in (V1_INFO, V2_INFO)]
    secrets = [MASTER, MASTER.hex().encode()] + [x for d in deks for x in (d, d.hex().encode())]
    with caplog.at_level(logging.DEBUG):
        proc = registry.make_serde_processor({"preset": "turbo-3.5", "encrypt": {"master_key_path": str(master_file)}})
        proc.close()
        ser, de = serde_pair("turbo-3.5", master_file)
        k = okey(11, salt="t")
        value = store(ser, chunk(11), k)
        errors = [load(de, value, okey(11, salt="u")), load(de, value[:-1] + b"\0", k)]
        short = tmp_path / "short.key"
        short.write_bytes(MASTER[:8])
        with pytest.raises(ValueError, match="holds 8 bytes") as e:
            serde_pair("turbo-3.5", short)
        errors.append(e.value)
    text = (caplog.text + " ".join(map(str, errors)) + " ".join(map(repr, errors))).encode()
    assert "aes-256-gcm" in caplog.text and "TQS2" in caplog.text  # the start-up line says it seals
    for s in secrets:
        assert s not in text and s not in value
        assert s[:8] not in value  # not even a fragment of the key in the stored bytes


def test_encrypt_option_errors(tmp_path):
    with pytest.raises(ValueError, match="master_key_path"):
        registry.parse_options({"encrypt": {"aes_bits": 256}})
    with pytest.raises(ValueError, match="aes_bits"):
        registry.parse_options({"encrypt": {"master_key_path": "/x", "aes_bits": 192}})
    with pytest.raises(ValueError, match="unknown key"):
        registry.parse_options({"encrypt": {"master_key_path": "/x", "cipher": "aes"}})
    with pytest.raises(ValueError, match="not both"):
        registry.parse_options({"encrypt": {"master_key_path": "/x", "master_key_paths": ["/y"]}})
    for bad in ([], "/x", ["/x", "/x"], ["/x", ""]):
        with pytest.raises(ValueError, match="master_key_paths"):
            registry.parse_options({"encrypt": {"master_key_paths": bad}})
    with pytest.raises(ValueError, match="accept_tqs1"):
        registry.parse_options({"encrypt": {"master_key_path": "/x", "accept_tqs1": "no"}})
    with pytest.raises(ValueError, match="cannot be read"):
        serde_pair("turbo-3.5", tmp_path / "missing.key")
    cfg = registry.parse_options({"encrypt": {"master_key_path": "/x"}}).encrypt
    assert (cfg.aes_bits, cfg.master_key_paths, cfg.accept_tqs1) == (256, ("/x",), True)


def test_start_up_line_names_the_key_files_and_the_frames(master_file, tmp_path):
    older = tmp_path / "older.key"
    older.write_bytes(bytes(range(50, 82)))
    o = registry.parse_options({"preset": "turbo-3.5", "encrypt": {"master_key_paths": [str(master_file), str(older)], "accept_tqs1": False}})
    ser, _ = registry.build_serde(o)
    line = registry.created_message(o, ser.inner.options, "cpu:0")
    assert f"sealing with master key file {master_file}, opening with {older} too" in line
    assert "a key per value (frame TQS2)" in line and "TQS1 values refused" in line


def test_every_master_key_file_is_checked_at_start_up(master_file, tmp_path):
    short, missing = tmp_path / "short.key", tmp_path / "missing.key"
    short.write_bytes(bytes(31))
    with pytest.raises(ValueError, match=r"short\.key' holds 31 bytes, fewer than the 32"):
        serde_pair("turbo-3.5", [master_file, short])
    with pytest.raises(ValueError, match=r"missing\.key' cannot be read"):
        serde_pair("turbo-3.5", [master_file, missing])
