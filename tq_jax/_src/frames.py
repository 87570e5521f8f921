"""The frames an L2 value can have around its TQ01 blob(s): magics and fixed sizes.

Dependency-free (standard library only) so that both sides can use it: the LMCache
bridge (:mod:`tq_jax.bridge._src.serde`, :mod:`tq_jax.bridge._src.seal`), which writes and
reads these frames, and the core CLI (``tq-jax inspect``, ``decompress``), which must
recognise a stored value without importing torch or lmcache.

A value an LMCache L2 adapter holds is one of (byte by byte in docs/bridge.md)::

    bare        TQ01 blob(s)                                  (no checksum preset)
    key-bound   TQ01 blob(s) | b"TQK1" | BLAKE2b-128(ObjectKey) (16)   (checksum presets)
    sealed v1   b"TQS1" | nonce (12) | AES-GCM(blob(s)) | tag (16)      (encrypt, read only)
    sealed v2   b"TQS2" | salt (12)  | AES-GCM(blob(s)) | tag (16)      (encrypt, written)

Every size here is fixed, so a value's length follows from its layout alone (LMCache's
adapters refuse any other length). The functions below look at bytes only; they verify
nothing (the key trailer needs the ObjectKey, a sealed value the master key).
"""

from __future__ import annotations

__all__ = [
    "KEY_DIGEST_BYTES",
    "KEY_TRAILER_BYTES",
    "KEY_TRAILER_MAGIC",
    "SEAL_FIELD_BYTES",
    "SEAL_HEADER_BYTES",
    "SEAL_MAGICS",
    "SEAL_OVERHEAD",
    "SEAL_TAG_BYTES",
    "SEAL_V1_MAGIC",
    "SEAL_V2_MAGIC",
    "ends_with_key_trailer",
    "sealed_version",
]

KEY_TRAILER_MAGIC = b"TQK1"
KEY_DIGEST_BYTES = 16  # BLAKE2b-128 of the ObjectKey's canonical bytes
KEY_TRAILER_BYTES = len(KEY_TRAILER_MAGIC) + KEY_DIGEST_BYTES
"""Bytes a key-bound value carries after its blob(s): ``b"TQK1"`` + BLAKE2b-128 of the key."""

SEAL_V1_MAGIC = b"TQS1"  # AES-GCM under the tenant key, a random 96-bit nonce per value
SEAL_V2_MAGIC = b"TQS2"  # AES-GCM under a per-value HKDF subkey (a random 96-bit salt)
SEAL_MAGICS = {SEAL_V1_MAGIC: 1, SEAL_V2_MAGIC: 2}
SEAL_FIELD_BYTES = 12  # v1: the GCM nonce; v2: the subkey's salt (the GCM nonce is fixed)
SEAL_TAG_BYTES = 16  # GCM's full 128-bit tag
SEAL_HEADER_BYTES = 4 + SEAL_FIELD_BYTES
SEAL_OVERHEAD = SEAL_HEADER_BYTES + SEAL_TAG_BYTES
"""Bytes a sealed value holds beyond its plaintext (the same 32 for both versions)."""


def sealed_version(value) -> int | None:
    """1 or 2 when ``value`` starts with a sealed frame's magic and is long enough to hold
    its header and tag, else None. Nothing is opened or checked.

    Examples:
        >>> sealed_version(b"TQS2" + bytes(28))
        2
        >>> sealed_version(b"TQS2" + bytes(27)) is None  # too short for a header and a tag
        True
    """
    head = bytes(value[:4])
    if head not in SEAL_MAGICS or len(value) < SEAL_OVERHEAD:
        return None
    return SEAL_MAGICS[head]


def ends_with_key_trailer(value, blob_nbytes: int) -> bool:
    """Whether ``value`` is exactly ``blob_nbytes`` of blob(s) followed by a key trailer
    (its magic in place; the digest, which needs the ObjectKey, is not checked).

    Examples:
        >>> ends_with_key_trailer(b"x" * 8 + KEY_TRAILER_MAGIC + bytes(16), 8)
        True
        >>> ends_with_key_trailer(b"x" * 8 + bytes(20), 8)
        False
    """
    n = int(blob_nbytes)
    if n < 0 or len(value) != n + KEY_TRAILER_BYTES:
        return False
    return bytes(value[n : n + len(KEY_TRAILER_MAGIC)]) == KEY_TRAILER_MAGIC
