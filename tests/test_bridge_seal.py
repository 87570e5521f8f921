"""Key binding of checksummed values and per-tenant AES-GCM sealing, without a store.

The serializers and deserializers LMCache gets from :func:`tq_jax.bridge.registry.build_serde`
are driven directly on real ``MemoryObj``s; every refusal is checked to leave the
destination untouched (nothing decoded), and every accepted value against
``tq_jax.loads`` of the same TQ01 blob.
"""

from __future__ import annotations

import logging

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lmcache")

import numpy as np  # noqa: E402
from lmcache.v1.distributed.api import ObjectKey  # noqa: E402

import tq_jax  # noqa: E402
from tq_jax.bridge import dlpack, registry, seal  # noqa: E402
from tq_jax.bridge import serde as S  # noqa: E402

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


def serde_pair(preset: str, master_path=None):
    cfg = {"preset": preset}
    if master_path is not None:
        cfg["encrypt"] = {"key_provider": "hkdf", "master_key_path": str(master_path), "aes_bits": 256}
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
    return torch.from_numpy(np.asarray(tq_jax.loads(blob)).view(np.int16)).view(BF16).reshape(SHAPE)


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


@pytest.mark.parametrize("preset", ["turbo-3.5", "compat-4bit"])
def test_sealed_value_opens_only_under_its_key(preset, master_file):
    ser, de = serde_pair(preset, master_file)
    size = tq_jax.Options(**tq_jax.PRESETS[preset]).serialized_size(STORED, "bfloat16")
    k = okey(7, salt="tenant-a")
    value = store(ser, chunk(7), k)
    assert len(value) == size + seal.OVERHEAD and value[:4] == seal.MAGIC
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


def test_sealing_uses_a_fresh_nonce_and_lmcache_hkdf_keys(master_file):
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    from lmcache.v1.distributed.serde.key_provider import HkdfKeyProvider

    ser, de = serde_pair("turbo-3.5", master_file)
    k = okey(9, salt="t")
    a, b = store(ser, chunk(9), k), store(ser, chunk(9), k)
    assert a[4:16] != b[4:16] and a[16:] != b[16:]  # same chunk, same key: other nonce, other bytes
    # Independent opening with LMCache's key provider and cryptography's AESGCM.
    dek = HkdfKeyProvider(MASTER, 32, b"tq_jax-l2-aesgcm-v1").get_key("t")
    plain = AESGCM(dek).decrypt(a[4:16], a[16:], S.object_key_bytes(k))
    assert torch.equal(load(de, a, k), expected(plain))


def test_sealed_value_refuses_any_flip_and_a_wrong_master_key(master_file, tmp_path):
    ser, de = serde_pair("compat-4bit", master_file)
    k = okey(10, salt="t")
    value = store(ser, chunk(10), k)
    rng = np.random.default_rng(1)
    for off in sorted({0, 4, 15, 16, len(value) - 1, *rng.integers(0, len(value), 30).tolist()}):
        bad = bytearray(value)
        bad[off] ^= 1 << int(rng.integers(8))
        assert isinstance(load(de, bytes(bad), k), seal.SealError), off
    other = tmp_path / "other.key"
    other.write_bytes(bytes(32))
    _, de_other = serde_pair("compat-4bit", other)
    assert isinstance(load(de_other, value, k), seal.SealError)
    # Unencrypted values are refused by an encrypting reader, and the other way round.
    plain_ser, plain_de = serde_pair("compat-4bit")
    assert isinstance(load(de, store(plain_ser, chunk(10), k) + bytes(seal.OVERHEAD), k), seal.SealError)
    assert isinstance(load(plain_de, value, k), Exception)


def test_key_never_in_logs_errors_or_blobs(master_file, tmp_path, caplog):
    from lmcache.v1.distributed.serde.key_provider import HkdfKeyProvider

    dek = HkdfKeyProvider(MASTER, 32, seal.HKDF_INFO_PREFIX).get_key("t")
    secrets = [MASTER, dek, MASTER.hex().encode(), dek.hex().encode()]
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
    assert "aes-256-gcm" in caplog.text  # the start-up line says it seals
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
    with pytest.raises(ValueError, match="cannot be read"):
        serde_pair("turbo-3.5", tmp_path / "missing.key")
    assert registry.parse_options({"encrypt": {"master_key_path": "/x"}}).encrypt.aes_bits == 256
