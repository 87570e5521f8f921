"""``tq-jax inspect`` and ``decompress`` on values an LMCache L2 adapter stores.

The values are written by the tq_jax serde itself (the serializer LMCache gets from
:func:`tq_jax.bridge._src.registry.build_serde`) and saved to files, as an operator would
save an ``fs`` file or a Redis value: a key-bound value (``turbo-3.5``: the blob and the
``TQK1`` key trailer), a multi-group one, and sealed ones (``encrypt``: ``TQS2``, and a
``TQS1`` value sealed as the serde did before). Expected headers and digests come from
``tq_jax.peek_header`` of the blob and BLAKE2b of the key, computed here.
"""

from __future__ import annotations

import hashlib
import json
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lmcache")

import numpy as np  # noqa: E402
from lmcache.v1.distributed.api import ObjectKey  # noqa: E402

import tq_jax  # noqa: E402
from tq_jax._src import cli  # noqa: E402
from tq_jax.bridge._src import dlpack, registry  # noqa: E402
from tq_jax.bridge._src import serde as S  # noqa: E402

from bridge_util import byte_obj, layout, make_obj  # noqa: E402

from conftest import LMCACHE_WARNINGS  # noqa: E402

pytestmark = LMCACHE_WARNINGS

SHAPE = (2, 4, 8, 256)
STORED = (2, 4, 8, 2, 128)
BF16 = torch.bfloat16
KEY = ObjectKey(chunk_hash=b"inspect".ljust(32, b"\0"), model_name="m", kv_rank=0, object_group_id=0, cache_salt="t")


def run(*argv):
    return cli.main([str(a) for a in argv])


def _stored(cfg: dict, shapes=(SHAPE,)) -> bytes:
    ser, _ = registry.build_serde(registry.parse_options(cfg))
    obj = make_obj(shapes, [BF16] * len(shapes))
    g = torch.Generator().manual_seed(0)
    for i in range(len(shapes)):
        t = obj.tensor if len(shapes) == 1 else obj.get_tensor(i)
        t.copy_(torch.randn(shapes[i], generator=g).to(BF16))
    n = ser.estimate_serialized_size(layout(shapes, [BF16] * len(shapes)))
    dst = byte_obj(n)
    assert ser.serialize(obj, dst, KEY) == n
    return bytes(dlpack.numpy_view(dst.tensor))


@pytest.fixture(scope="module")
def key_bound() -> bytes:
    return _stored({"preset": "turbo-3.5"})


@pytest.fixture
def master(tmp_path):
    p = tmp_path / "master.key"
    p.write_bytes(os.urandom(32))
    return p


def test_inspect_a_key_bound_value(tmp_path, key_bound, capsys):
    blob_n = tq_jax.Options(**tq_jax.PRESETS["turbo-3.5"]).serialized_size(STORED, "bfloat16")
    assert len(key_bound) == blob_n + 20
    digest = hashlib.blake2b(S.object_key_bytes(KEY), digest_size=16).hexdigest()
    path = tmp_path / "value.bin"
    path.write_bytes(key_bound)
    assert run("inspect", path) == 0
    out = capsys.readouterr().out
    assert f"key-bound L2 value, {len(key_bound):,} bytes, 1 tensor(s)" in out
    assert f"bound to a key (BLAKE2b-128 {digest}, the TQK1 trailer)" in out and "not verified here" in out
    assert "crc32" in out and "2x4x8x2x128" in out
    assert run("inspect", path, "--json") == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["key_binding"] == {"trailer": "TQK1", "algorithm": "BLAKE2b-128", "digest": digest, "verified": False}
    (t,) = doc["tensors"]
    h = tq_jax.peek_header(key_bound[:blob_n])
    assert (t["shape"], t["stored_bytes"], t["seed"], t["version"]) == (list(h.shape), blob_n, h.seed, 2)


def test_inspect_a_multi_group_key_bound_value(tmp_path, capsys):
    value = _stored({"preset": "turbo-3.5"}, shapes=(SHAPE, (2, 4, 8, 128)))
    path = tmp_path / "value.bin"
    path.write_bytes(value)
    assert run("inspect", path, "--json") == 0
    doc = json.loads(capsys.readouterr().out)
    assert [t["name"] for t in doc["tensors"]] == ["group 0", "group 1"]
    assert [t["shape"] for t in doc["tensors"]] == [list(STORED), [2, 4, 8, 1, 128]]
    assert sum(t["stored_bytes"] for t in doc["tensors"]) + 20 == len(value) == doc["bytes"]
    # Without a checksum preset: the blobs back to back, no trailer.
    plain = _stored({"preset": "compat-4bit"}, shapes=(SHAPE, (2, 4, 8, 128)))
    path.write_bytes(plain)
    assert run("inspect", path, "--json") == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["kind"] == "L2 value" and "key_binding" not in doc and len(doc["tensors"]) == 2
    assert sum(t["stored_bytes"] for t in doc["tensors"]) == len(plain)


def test_inspect_of_mutated_stored_values_is_a_row_or_one_error_line(tmp_path, key_bound, capsys):
    """Hostile input: random flips and cuts of a key-bound value end in exit 0 (only the
    unverified digest changed) or exit 1 with one error line, never a traceback."""
    rng = np.random.default_rng(7)
    path = tmp_path / "m.bin"
    n = len(key_bound)
    for trial in range(40):
        data = bytearray(key_bound)
        if trial % 4 == 3:
            data = data[: int(rng.integers(0, n))]
        else:
            off = int(rng.integers(0, n))
            data[off] ^= 1 << int(rng.integers(8))
        path.write_bytes(bytes(data))
        rc = run("inspect", path)
        out, err = capsys.readouterr()
        if rc == 0:
            assert "bound to a key" in out and len(data) == n, trial  # a flip in the digest
            assert bytes(data[: n - 16]) == key_bound[: n - 16], trial
        else:
            assert rc == 1 and err.count("\n") == 1 and err.startswith("tq-jax: error:"), (trial, err)


def test_inspect_keeps_clear_errors_for_damaged_key_bound_values(tmp_path, key_bound, capsys):
    blob_n = len(key_bound) - 20
    cases = {
        "truncated trailer": (key_bound[:-1], "damaged key trailer (19 bytes"),
        "trailer and more": (key_bound + b"\0", "damaged key trailer (21 bytes"),
        "other 20 bytes": (key_bound[:blob_n] + bytes(20), "followed by 20 bytes that are not part of it"),
        "flipped payload": (key_bound[:100] + bytes([key_bound[100] ^ 1]) + key_bound[101:], "CRC32"),
        "truncated blob": (key_bound[: blob_n - 5], "truncated"),
    }
    for name, (data, want) in cases.items():
        path = tmp_path / "bad.bin"
        path.write_bytes(data)
        assert run("inspect", path) == 1, name
        err = capsys.readouterr().err
        assert want in err and "corrupt TQ01 blob" in err, (name, err)


def test_inspect_sealed_values(tmp_path, master, capsys):
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    from lmcache.v1.distributed.serde.key_provider import HkdfKeyProvider

    enc = {"master_key_path": str(master)}
    v2 = _stored({"preset": "turbo-3.5", "encrypt": enc})
    plain_n = tq_jax.Options(**tq_jax.PRESETS["turbo-3.5"]).serialized_size(STORED, "bfloat16")
    assert len(v2) == plain_n + 32 and v2[:4] == b"TQS2"
    dek = HkdfKeyProvider(master.read_bytes(), 32, b"tq_jax-l2-aesgcm-v1").get_key(KEY.cache_salt)
    nonce = os.urandom(12)
    v1 = b"TQS1" + nonce + AESGCM(dek).encrypt(nonce, bytes(plain_n), S.object_key_bytes(KEY))
    for frame, value in (("TQS2", v2), ("TQS1", v1)):
        path = tmp_path / f"{frame}.bin"
        path.write_bytes(value)
        assert run("inspect", path) == 0
        out = capsys.readouterr().out
        assert f"sealed L2 value ({frame}), {len(value):,} bytes: encrypted per tenant" in out
        assert "nothing more can be shown without the master key" in out and f"{plain_n:,} bytes of TQ01" in out
        assert run("inspect", path, "--json") == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["tensors"] == [] and doc["sealed"]["frame"] == frame and doc["sealed"]["plaintext_bytes"] == plain_n
    short = tmp_path / "short.bin"
    short.write_bytes(v2[:20])
    assert run("inspect", short) == 1
    assert "cut short: 20 bytes" in capsys.readouterr().err


def test_decompress_names_stored_values(tmp_path, key_bound, master, capsys):
    bound = tmp_path / "bound.bin"
    bound.write_bytes(key_bound)
    assert run("decompress", bound, tmp_path / "out.safetensors") == 1
    err = capsys.readouterr().err
    n = len(key_bound) - 20
    assert "key-bound L2 value" in err and f"[:{n}]" in err and "not verified" in err
    assert not (tmp_path / "out.safetensors").exists()
    # What the message says to run does decode the blob.
    np.asarray(tq_jax.loads(bound.read_bytes()[:n]))
    sealed = tmp_path / "sealed.bin"
    sealed.write_bytes(_stored({"preset": "turbo-3.5", "encrypt": {"master_key_path": str(master)}}))
    assert run("decompress", sealed, tmp_path / "out.safetensors") == 1
    err = capsys.readouterr().err
    assert "sealed L2 value (TQS2" in err and "master key" in err
