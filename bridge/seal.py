"""Compressed and encrypted, per tenant: AES-GCM around the tq_jax serde's values.

With ``"encrypt": {"key_provider": "hkdf", "master_key_path": ..., "aes_bits": 256}`` in
the serde dict, :mod:`~tq_jax.bridge.registry` wraps the TQ01 serializer and
deserializer in :class:`SealingSerializer` / :class:`OpeningDeserializer`:

* the key of a value is derived per ``ObjectKey.cache_salt`` (a tenant) from one master
  key, with LMCache's own :class:`~lmcache.v1.distributed.serde.key_provider.HkdfKeyProvider`
  (HKDF-SHA256, as LMCache's ``aesgcm`` serde derives its keys) under this serde's own
  ``info`` prefix :data:`HKDF_INFO_PREFIX` (domain separation, as LMCache asks of callers
  with another frame);
* each value is the TQ01 blob(s) sealed with the ``cryptography`` package's ``AESGCM``
  under a fresh random 96-bit nonce, the whole ``ObjectKey`` (model, chunk hash, rank,
  group, salt: :func:`~tq_jax.bridge.serde.object_key_bytes`) bound as associated data.
  The GCM tag is the integrity check: a value damaged in the store, moved to any other
  key (another tenant's, or the same tenant's), or read with another master key fails to
  open and is reported as a miss. Nothing is decoded from a value that does not open.

Frame (:data:`OVERHEAD` = 32 bytes more than the plaintext, so sizes stay exact and
follow from the layout alone)::

    b"TQS1" | nonce (12) | AES-GCM ciphertext of the TQ01 blob(s) | tag (16)

No key material is logged, put in an error message or written to a value; the master
key's *path* appears in the start-up line.
"""

from __future__ import annotations

import os

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.serde.base import Deserializer, Serializer
from lmcache.v1.distributed.serde.key_provider import HkdfKeyProvider, KeyProvider
from lmcache.v1.memory_management import MemoryObj

from tq_jax.bridge import serde as _serde
from tq_jax.bridge.schema import EncryptConfig

__all__ = [
    "HKDF_INFO_PREFIX",
    "MAGIC",
    "OVERHEAD",
    "OpeningDeserializer",
    "SealError",
    "SealingSerializer",
    "key_provider",
]

MAGIC = b"TQS1"
NONCE_BYTES = 12  # GCM's native 96-bit nonce, fresh from os.urandom per value
TAG_BYTES = 16
HEADER_BYTES = len(MAGIC) + NONCE_BYTES
OVERHEAD = HEADER_BYTES + TAG_BYTES
HKDF_INFO_PREFIX = b"tq_jax-l2-aesgcm-v1"  # + cache_salt, the HKDF info of each tenant's key


class SealError(ValueError):
    """A sealed value does not open under the key it was read for: it is a miss."""


NOT_SEALED = (
    "refused the value read under key {key}: {why}, so it is not a value this encrypting "
    "serde wrote (an unencrypted writer shares the store, or the value was truncated). Give "
    "every writer of this store the same `encrypt` block."
)
DOES_NOT_OPEN = (
    "refused the value read under key {key}: its AES-GCM tag does not verify. The value was "
    "damaged in the store, written for another key or tenant, or sealed with another master "
    "key; it is reported as a miss and nothing is decoded. If every load fails, check that all "
    "servers read the same master key file."
)
BAD_MASTER_KEY = (
    "the encrypt block's master key file {path!r} {why}: write at least {need} random bytes "
    "there (e.g. `head -c 32 /dev/urandom > {path}`) and make it readable by this process only."
)


def key_provider(cfg: EncryptConfig) -> KeyProvider:
    """LMCache's HKDF key provider over the master key read from ``cfg.master_key_path``.

    Raises:
        ValueError: the file cannot be read, or holds fewer bytes than the AES key
            (the message names the path, never the contents).
    """
    need = cfg.aes_bits // 8
    try:
        with open(cfg.master_key_path, "rb") as f:
            master = f.read()
    except OSError as e:
        raise ValueError(BAD_MASTER_KEY.format(path=cfg.master_key_path, why=f"cannot be read ({e.strerror})", need=need)) from None
    if len(master) < need:
        raise ValueError(BAD_MASTER_KEY.format(path=cfg.master_key_path, why=f"holds {len(master)} bytes, fewer than the {need} of an AES-{cfg.aes_bits} key", need=need))
    return HkdfKeyProvider(master, key_len=need, info_prefix=HKDF_INFO_PREFIX)


class SealingSerializer(Serializer):
    """Seals what ``inner`` serializes (see the module docstring for the frame).

    Args:
        inner: the TQ01 serializer (:class:`~tq_jax.bridge.serde.TQJaxSerializer`); it
            should not add its key trailer (the associated data binds the key).
        keys: a per-``cache_salt`` key provider (:func:`key_provider`).
    """

    def __init__(self, inner: _serde.TQJaxSerializer, keys: KeyProvider) -> None:
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
        aead = AESGCM(self.keys.get_key(key.cache_salt))
        nonce = os.urandom(NONCE_BYTES)

        def fill(out: np.ndarray) -> None:
            out[: len(MAGIC)] = np.frombuffer(MAGIC, np.uint8)
            out[len(MAGIC) : HEADER_BYTES] = np.frombuffer(nonce, np.uint8)
            aead.encrypt_into(nonce, plain, _serde.object_key_bytes(key), out[HEADER_BYTES:])

        return _serde.write_bytes(dst, n + OVERHEAD, fill, layout)


class OpeningDeserializer(Deserializer):
    """Opens a sealed value for the key it is read under, then decodes it with ``inner``.

    Args:
        inner: the TQ01 deserializer (without key binding: the associated data binds).
        keys: the same key provider as the writer's.
        plain_size: the exact plaintext size of a layout (the inner serializer's
            ``estimate_serialized_size``).
    """

    def __init__(self, inner: _serde.TQJaxDeserializer, keys: KeyProvider, plain_size) -> None:
        self.inner = inner
        self.keys = keys
        self.plain_size = plain_size

    def deserialize(self, src: MemoryObj, dst: MemoryObj, key: ObjectKey) -> None:
        """Raises :class:`SealError` (a miss) unless the value opens under ``key``."""
        buf = _serde.read_bytes(src)
        layout = MemoryLayoutDesc(shapes=list(dst.get_shapes()), dtypes=list(dst.get_dtypes()))
        n = self.plain_size(layout)
        who = _serde.describe_key(key)
        if len(buf) < n + OVERHEAD:
            raise SealError(NOT_SEALED.format(key=who, why=f"it holds {len(buf)} bytes, fewer than the {n + OVERHEAD} of a sealed value"))
        if bytes(buf[: len(MAGIC)]) != MAGIC:
            raise SealError(NOT_SEALED.format(key=who, why="it does not start with the sealed frame's magic"))
        plain = np.empty(n, np.uint8)
        nonce = bytes(buf[len(MAGIC) : HEADER_BYTES])
        try:
            AESGCM(self.keys.get_key(key.cache_salt)).decrypt_into(
                nonce, buf[HEADER_BYTES : HEADER_BYTES + n + TAG_BYTES], _serde.object_key_bytes(key), plain
            )
        except InvalidTag:
            raise SealError(DOES_NOT_OPEN.format(key=who)) from None
        self.inner.decode_from(plain, dst, key)
