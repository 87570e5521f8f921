"""The frames around a stored L2 value (tq_jax._src.frames), and how the core parser names them.

Handcrafted bytes against the documented layout (docs/bridge.md): the module's sizes,
the two recognisers, and ``tq_jax.loads`` of a key-bound value raising the wire error
that names the trailer instead of a CRC mismatch. No torch or lmcache here: the core
must recognise these frames without them.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import tq_jax
from tq_jax._src import frames, wire


def _blob(checksum: bool) -> bytes:
    x = np.random.default_rng(0).standard_normal((2, 2, 4, 128)).astype(np.float32)
    return tq_jax.dumps(x, bits=4, checksum=checksum)


def test_documented_sizes():
    assert frames.KEY_TRAILER_MAGIC == b"TQK1" and frames.KEY_TRAILER_BYTES == 4 + 16
    assert frames.SEAL_V1_MAGIC == b"TQS1" and frames.SEAL_V2_MAGIC == b"TQS2"
    # magic (4) | nonce or salt (12) | ciphertext | tag (16): the same 32 bytes for both.
    assert (frames.SEAL_HEADER_BYTES, frames.SEAL_OVERHEAD) == (16, 32)


def test_frames_imports_nothing_but_the_standard_library():
    code = "import sys, tq_jax._src.frames; bad = {m for m in ('numpy', 'jax', 'torch', 'lmcache', 'cryptography') if m in sys.modules}; print(sorted(bad))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_sealed_version():
    body = bytes(28)
    assert frames.sealed_version(b"TQS1" + body) == 1
    assert frames.sealed_version(np.frombuffer(b"TQS2" + body, np.uint8)) == 2
    assert frames.sealed_version(b"TQS2" + body[:-1]) is None  # cannot hold salt and tag
    for other in (b"TQS3", b"TQ01", b"tqs2", b""):
        assert frames.sealed_version(other + body) is None, other


def test_ends_with_key_trailer():
    blob = _blob(True)
    n = len(blob)
    bound = blob + b"TQK1" + bytes(range(16))
    assert frames.ends_with_key_trailer(bound, n)
    assert not frames.ends_with_key_trailer(bound, n - 1)  # the trailer must start where the blob ends
    assert not frames.ends_with_key_trailer(bound + b"\0", n)  # and end the value
    assert not frames.ends_with_key_trailer(blob + b"TQK2" + bytes(16), n)
    assert not frames.ends_with_key_trailer(blob, n)


@pytest.mark.parametrize("checksum", [True, False], ids=["crc32", "no-crc"])
def test_loads_of_a_key_bound_value_names_the_trailer(checksum):
    blob = _blob(checksum)
    bound = blob + b"TQK1" + bytes(range(16))
    with pytest.raises(wire.KeyTrailerError) as e:
        tq_jax.loads(bound)
    msg = str(e.value)
    assert "key-bound L2 value" in msg and f"{len(blob):,}-byte blob" in msg and "20-byte key trailer" in msg
    assert "CRC32" not in msg
    assert isinstance(e.value, wire.TrailingBytesError) and isinstance(e.value, wire.WireError)
    # The blob alone decodes; 20 other trailing bytes keep the errors they had.
    np.testing.assert_array_equal(np.asarray(tq_jax.loads(bound[: len(blob)])), np.asarray(tq_jax.loads(blob)))
    other = blob + b"XXXX" + bytes(16)
    with pytest.raises(wire.ChecksumError if checksum else wire.TrailingBytesError) as e:
        tq_jax.loads(other)
    assert not isinstance(e.value, wire.KeyTrailerError)


def test_a_trailer_magic_on_a_damaged_blob_is_not_named_a_key_bound_value():
    blob = bytearray(_blob(True))
    blob[0] ^= 1  # the magic: not a blob at all
    with pytest.raises(wire.BadMagicError):
        tq_jax.loads(bytes(blob) + b"TQK1" + bytes(16))
    with pytest.raises(wire.WireError):  # shorter than any header + trailer
        tq_jax.loads(b"TQ01" + b"TQK1" + bytes(16))
