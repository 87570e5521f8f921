"""Compressed and encrypted, per tenant and per value: AES-GCM around the serde's values.

With ``"encrypt": {"key_provider": "hkdf", "master_key_paths": [...], "aes_bits": 256}``
in the serde dict, :mod:`~tq_jax.bridge._src.registry` wraps the TQ01 serializer and
deserializer in :class:`SealingSerializer` / :class:`OpeningDeserializer`.

Keys
    Each master key (a file; ``master_key_paths`` lists them newest first, or one
    ``master_key_path``) gives a key per ``ObjectKey.cache_salt`` (a tenant) through
    LMCache's own :class:`~lmcache.v1.distributed.serde.key_provider.HkdfKeyProvider`
    (HKDF-SHA256, as LMCache's ``aesgcm`` serde derives its keys) under this serde's own
    ``info`` prefixes (domain separation, as LMCache asks of callers with another frame).
    A value is sealed under the first master key and opened under any of them, so an
    operator rotates keys without a cold cache (docs/bridge.md, "Rotating the master key").

Frame ``TQS2`` (written)
    A random 96-bit salt per value; the value's AES-GCM key is HKDF-Expand(SHA-256) of
    the tenant's key with :data:`VALUE_INFO_PREFIX` + salt + the whole ``ObjectKey`` as
    info (:func:`value_key`). Each such key seals one value, so the GCM nonce is fixed
    (:data:`V2_NONCE`) and the 2^32-encryptions-per-key bound of random nonces does not
    apply: two values share a key only if they share the ObjectKey *and* the salt.

Frame ``TQS1`` (opened while ``accept_tqs1``, never written)
    AES-GCM under the tenant key itself with a random 96-bit nonce per value, the frame
    this serde wrote before; NIST SP 800-38D caps such a key at 2^32 values.

Both frames are :data:`~tq_jax._src.frames.SEAL_OVERHEAD` = 32 bytes longer than the plaintext,
so sizes stay exact and follow from the layout alone (:mod:`tq_jax._src.frames`)::

    b"TQS2" | salt (12)  | AES-GCM(value key, nonce 0^96, TQ01 blob(s), ad) | tag (16)
    b"TQS1" | nonce (12) | AES-GCM(tenant key, nonce, TQ01 blob(s), ad)      | tag (16)

The associated data ``ad`` is the whole ``ObjectKey`` (model, chunk hash, rank, group,
salt: :func:`~tq_jax.bridge._src.serde.object_key_bytes`). The GCM tag is the integrity check:
a value damaged in the store, moved to any other key (another tenant's, or the same
tenant's), or sealed under a master key this serde does not hold fails to open and is
reported as a miss. Nothing is decoded from a value that does not open.

No key material is logged, put in an error message or written to a value; the master
keys' *paths* appear in the start-up line.
"""

from __future__ import annotations

import os

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.hashes import SHA256
from cryptography.hazmat.primitives.kdf.hkdf import HKDFExpand
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.serde.base import Deserializer, Serializer
from lmcache.v1.distributed.serde.key_provider import HkdfKeyProvider
from lmcache.v1.memory_management import MemoryObj

from tq_jax._src import frames as _frames
from tq_jax.bridge._src import serde as _serde
from tq_jax.bridge._src.schema import EncryptConfig

__all__ = [
    "HKDF_INFO_PREFIX",
    "HKDF_INFO_PREFIX_V2",
    "KeyRing",
    "MAGIC",
    "MAGIC_V1",
    "OVERHEAD",
    "OpeningDeserializer",
    "SealError",
    "SealingSerializer",
    "V2_NONCE",
    "VALUE_INFO_PREFIX",
    "key_ring",
    "value_key",
]

MAGIC = _frames.SEAL_V2_MAGIC  # the frame written
MAGIC_V1 = _frames.SEAL_V1_MAGIC  # the frame written before, still opened unless refused
FIELD_BYTES = _frames.SEAL_FIELD_BYTES  # v2: the value key's salt; v1: the GCM nonce
NONCE_BYTES = FIELD_BYTES  # (v1's name for the field)
TAG_BYTES = _frames.SEAL_TAG_BYTES
HEADER_BYTES = _frames.SEAL_HEADER_BYTES
OVERHEAD = _frames.SEAL_OVERHEAD
HKDF_INFO_PREFIX = b"tq_jax-l2-aesgcm-v1"  # + cache_salt: a TQS1 tenant key (the AES key itself)
HKDF_INFO_PREFIX_V2 = b"tq_jax-l2-aesgcm-v2"  # + cache_salt: a TQS2 tenant key (an HKDF PRK, 32 bytes)
VALUE_INFO_PREFIX = b"tq_jax-l2-value-v2"  # + salt + ObjectKey bytes: a TQS2 value's AES key
V2_NONCE = bytes(12)  # fixed: each TQS2 value key seals one value
PRK_BYTES = 32  # HKDF-Expand wants a PRK of at least the hash's 32 bytes, also for AES-128


class SealError(ValueError):
    """A sealed value does not open under the key it was read for: it is a miss."""


NOT_SEALED = (
    "refused the value read under key {key}: {why}, so it is not a value this encrypting "
    "serde wrote (an unencrypted writer shares the store, or the value was truncated). Give "
    "every writer of this store the same `encrypt` block."
)
DOES_NOT_OPEN = (
    "refused the value read under key {key}: its AES-GCM tag does not verify under any of this "
    "serde's {n} master key(s) ({frame} frame). The value was damaged in the store, written for "
    "another key or tenant, or sealed with a master key not in `master_key_paths`; it is reported "
    "as a miss and nothing is decoded. If every load fails, check that all servers read the same "
    "master key files (after a rotation, keep the previous key listed second until its values are gone)."
)
TQS1_REFUSED = (
    "refused the value read under key {key}: it is in the TQS1 frame (random nonces under the "
    "tenant key, written before per-value keys), and this serde has `accept_tqs1: false`; it is "
    "reported as a miss and nothing is decoded. Set `accept_tqs1: true` while the store still "
    "holds TQS1 values."
)
BAD_MASTER_KEY = (
    "the encrypt block's master key file {path!r} {why}: write at least {need} random bytes "
    "there (e.g. `head -c 32 /dev/urandom > {path}`) and make it readable by this process only."
)


def _read_master(path: str, need: int, aes_bits: int) -> bytes:
    try:
        with open(path, "rb") as f:
            master = f.read()
    except OSError as e:
        raise ValueError(BAD_MASTER_KEY.format(path=path, why=f"cannot be read ({e.strerror})", need=need)) from None
    if len(master) < need:
        raise ValueError(BAD_MASTER_KEY.format(path=path, why=f"holds {len(master)} bytes, fewer than the {need} of an AES-{aes_bits} key", need=need))
    return master


def value_key(prk: bytes, salt: bytes, key: ObjectKey, nbytes: int) -> bytes:
    """A TQS2 value's AES key: HKDF-Expand-SHA256(tenant PRK, VALUE_INFO_PREFIX | salt | ObjectKey)."""
    info = VALUE_INFO_PREFIX + salt + _serde.object_key_bytes(key)
    return HKDFExpand(SHA256(), nbytes, info).derive(prk)


class KeyRing:
    """The tenant keys of every master key, newest first: seals with the first, opens with any.

    Args:
        masters: the master keys' bytes, newest first (at least ``aes_bits / 8`` each).
        aes_bits: 128 or 256.
    """

    def __init__(self, masters: list[bytes], aes_bits: int) -> None:
        self.nbytes = aes_bits // 8
        self.v1 = [HkdfKeyProvider(m, key_len=self.nbytes, info_prefix=HKDF_INFO_PREFIX) for m in masters]
        self.v2 = [HkdfKeyProvider(m, key_len=PRK_BYTES, info_prefix=HKDF_INFO_PREFIX_V2) for m in masters]

    def __len__(self) -> int:
        return len(self.v2)

    def seal_key(self, salt: bytes, key: ObjectKey) -> bytes:
        """The first master key's value key for ``key`` and ``salt``."""
        return value_key(self.v2[0].get_key(key.cache_salt), salt, key, self.nbytes)

    def open_keys(self, version: int, field: bytes, key: ObjectKey):
        """(AES key, GCM nonce) to try, newest master key first, for a frame ``version`` value."""
        for v1, v2 in zip(self.v1, self.v2):
            if version == 1:
                yield v1.get_key(key.cache_salt), field
            else:
                yield value_key(v2.get_key(key.cache_salt), field, key, self.nbytes), V2_NONCE


def key_ring(cfg: EncryptConfig) -> KeyRing:
    """The :class:`KeyRing` of ``cfg.master_key_paths``, every file read now (start-up).

    Raises:
        ValueError: a file cannot be read, or holds fewer bytes than the AES key
            (the message names the path, never the contents).
    """
    need = cfg.aes_bits // 8
    return KeyRing([_read_master(p, need, cfg.aes_bits) for p in cfg.master_key_paths], cfg.aes_bits)


class SealingSerializer(Serializer):
    """Seals what ``inner`` serializes in the ``TQS2`` frame (see the module docstring).

    Args:
        inner: the TQ01 serializer (:class:`~tq_jax.bridge._src.serde.TQJaxSerializer`); it
            should not add its key trailer (the associated data binds the key).
        keys: the master keys (:func:`key_ring`); values are sealed under the first.
    """

    def __init__(self, inner: _serde.TQJaxSerializer, keys: KeyRing) -> None:
        self.inner = inner
        self.keys = keys

    def estimate_serialized_size(self, layout_desc: MemoryLayoutDesc) -> int:
        """Exact: the inner serializer's exact size plus :data:`OVERHEAD`."""
        return self.inner.estimate_serialized_size(layout_desc) + OVERHEAD

    def serialize(self, src: MemoryObj, dst: MemoryObj, key: ObjectKey) -> int:
        """Encodes ``src`` into a scratch buffer and seals it into ``dst`` for ``key``."""
        layout = MemoryLayoutDesc(shapes=list(src.get_shapes()), dtypes=list(src.get_dtypes()))
        n = self.inner.estimate_serialized_size(layout)
        plain = np.empty(n, np.uint8)
        if self.inner.encode_into(src, plain, key) != n:
            raise RuntimeError(f"the TQ01 serializer wrote a value of other than its exact {n} bytes")
        salt = os.urandom(FIELD_BYTES)
        aead = AESGCM(self.keys.seal_key(salt, key))

        def fill(out: np.ndarray) -> None:
            out[: len(MAGIC)] = np.frombuffer(MAGIC, np.uint8)
            out[len(MAGIC) : HEADER_BYTES] = np.frombuffer(salt, np.uint8)
            aead.encrypt_into(V2_NONCE, plain, _serde.object_key_bytes(key), out[HEADER_BYTES:])

        return _serde.write_bytes(dst, n + OVERHEAD, fill, layout)


class OpeningDeserializer(Deserializer):
    """Opens a sealed value (``TQS2``, or ``TQS1`` while accepted) for the key it is read
    under, with any master key of the ring, then decodes it with ``inner``.

    Args:
        inner: the TQ01 deserializer (without key binding: the associated data binds).
        keys: the same master keys as the writer's (it may list older ones after them).
        plain_size: the exact plaintext size of a layout (the inner serializer's
            ``estimate_serialized_size``).
        accept_tqs1: open values in the ``TQS1`` frame; False refuses them as misses.
    """

    def __init__(self, inner: _serde.TQJaxDeserializer, keys: KeyRing, plain_size, *, accept_tqs1: bool = True) -> None:
        self.inner = inner
        self.keys = keys
        self.plain_size = plain_size
        self.accept_tqs1 = bool(accept_tqs1)

    def deserialize(self, src: MemoryObj, dst: MemoryObj, key: ObjectKey) -> None:
        """Raises :class:`SealError` (a miss) unless the value opens under ``key``."""
        buf = _serde.read_bytes(src)
        layout = MemoryLayoutDesc(shapes=list(dst.get_shapes()), dtypes=list(dst.get_dtypes()))
        n = self.plain_size(layout)
        who = _serde.describe_key(key)
        if len(buf) < n + OVERHEAD:
            raise SealError(NOT_SEALED.format(key=who, why=f"it holds {len(buf)} bytes, fewer than the {n + OVERHEAD} of a sealed value"))
        version = _frames.sealed_version(buf)
        if version is None:
            raise SealError(NOT_SEALED.format(key=who, why="it does not start with a sealed frame's magic (TQS1 or TQS2)"))
        if version == 1 and not self.accept_tqs1:
            raise SealError(TQS1_REFUSED.format(key=who))
        field = bytes(buf[len(MAGIC) : HEADER_BYTES])
        body = buf[HEADER_BYTES : HEADER_BYTES + n + TAG_BYTES]
        ad = _serde.object_key_bytes(key)
        plain = np.empty(n, np.uint8)
        for aes_key, nonce in self.keys.open_keys(version, field, key):
            try:
                AESGCM(aes_key).decrypt_into(nonce, body, ad, plain)
                break
            except InvalidTag:
                continue
        else:
            raise SealError(DOES_NOT_OPEN.format(key=who, n=len(self.keys), frame=f"TQS{version}"))
        self.inner.decode_from(plain, dst, key)
