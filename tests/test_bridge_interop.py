"""Our LMCache serde vs the reference plugin's (lmcache-turbo-quant-serde 0.1.0), both ways.

The reference's v1 classes take ``serialize(src, dst)`` / ``deserialize(src, dst)``,
without the ``key`` LMCache 0.5.6 passes; the shims below add it (test-only), and the
first test records that without them the reference cannot run through LMCache at all.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lmcache")
ref_v1 = pytest.importorskip("lmcache_turbo_quant_serde._v1_codec")
ref_codec = pytest.importorskip("lmcache_turbo_quant_serde._codec")

from lmcache.v1.distributed.serde import AsyncSerdeProcessor  # noqa: E402

import tq_jax  # noqa: E402
from tq_jax.bridge._src import serde as S  # noqa: E402

from bridge_util import byte_obj, key, layout, make_obj, wait  # noqa: E402

from conftest import LMCACHE_WARNINGS  # noqa: E402

pytestmark = LMCACHE_WARNINGS
BF16 = torch.bfloat16


class RefSerializer(ref_v1.TqaiSerializer):
    """The reference serializer with the `key` argument LMCache 0.5.6 passes."""

    def serialize(self, src, dst, key):  # type: ignore[override]
        return super().serialize(src, dst)


class RefDeserializer(ref_v1.TqaiDeserializer):
    def deserialize(self, src, dst, key):  # type: ignore[override]
        return super().deserialize(src, dst)


def kv(shape, dtype=BF16, seed=0):
    obj = make_obj([shape], [dtype])
    obj.tensor.copy_(torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype))
    return obj


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def ours_blob(src, head_dim, bits):
    ser = S.TQJaxSerializer(head_dim=head_dim, bits=bits)
    buf = byte_obj(ser.estimate_serialized_size(layout(src.get_shapes(), src.get_dtypes())))
    assert ser.serialize(src, buf, key(0)) == buf.get_size()
    return buf


def test_reference_without_key_shim_fails_in_lmcache():
    proc = AsyncSerdeProcessor(ref_v1.TqaiSerializer(head_dim=128, bits=4), ref_v1.TqaiDeserializer())
    try:
        src = kv((2, 1, 8, 256))
        t = proc.submit_serialize([src], [byte_obj(10**5)], [key(0)])
        assert wait(proc.query_serialize_result, t) is False  # TypeError: no `key` parameter
    finally:
        proc.close()


# Quick tier: W1's head_dim at 4 bits and MLA's 576; the other widths are slow
# (test_we_read_reference_lmcache_blobs runs 2, 3, 4 and 8 bits the other way).
@pytest.mark.parametrize(
    "shape,head_dim,bits",
    [((2, 4, 32, 512), 128, 4), ((1, 2, 16, 576), 576, 4),
     pytest.param((2, 2, 16, 256), 128, 2, marks=pytest.mark.slow),
     pytest.param((2, 2, 16, 256), 64, 8, marks=pytest.mark.slow)],
)
def test_reference_reads_our_blobs(shape, head_dim, bits):
    src = kv(shape)
    buf = ours_blob(src, head_dim, bits)
    blob = bytes(buf.tensor.numpy())
    ours = make_obj([shape], [BF16])
    S.TQJaxDeserializer().deserialize(buf, ours, key(0))

    # Standalone from_bytes: the per-head tensor [..., H, D].
    theirs = ref_codec.TurboQuantDeserializer().from_bytes(blob)
    assert tuple(theirs.shape) == S.stored_shape(shape, head_dim)
    assert rel_err(theirs.float().reshape(shape), ours.tensor.float()) <= 1e-3

    # Their LMCache deserializer (key shim) writes [2, L, T, H*D] into a KV MemoryObj.
    theirs_kv = make_obj([shape], [BF16])
    RefDeserializer().deserialize(buf, theirs_kv, key(0))
    assert rel_err(theirs_kv.tensor.float(), ours.tensor.float()) <= 1e-3


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_we_read_reference_lmcache_blobs(bits):
    shape = (2, 4, 32, 512)
    src = kv(shape, seed=bits)
    ref_ser = RefSerializer(head_dim=128, bits=bits)
    est = ref_ser.estimate_serialized_size(layout([shape], [BF16]))
    buf = byte_obj(est)
    buf.tensor.fill_(0x5A)
    n = ref_ser.serialize(src, buf, key(0))
    # The reference over-estimates; its blob is exactly our size for the layout.
    assert n == S.TQJaxSerializer(bits=bits).estimate_serialized_size(layout([shape], [BF16])) < est

    theirs = make_obj([shape], [BF16])
    RefDeserializer().deserialize(_narrowed(buf, n), theirs, key(0))

    # Ours reads it from the full estimate-sized buffer: the length comes from the header.
    ours = make_obj([shape], [BF16])
    S.TQJaxDeserializer().deserialize(buf, ours, key(0))
    assert tuple(ours.tensor.shape) == shape
    assert rel_err(ours.tensor.float(), theirs.tensor.float()) <= 1e-3
    # ... and the same from the narrowed buffer LMCache's AsyncSerdeProcessor would leave.
    ours2 = make_obj([shape], [BF16])
    S.TQJaxDeserializer().deserialize(_narrowed(buf, n), ours2, key(0))
    assert torch.equal(ours.tensor, ours2.tensor)


def _narrowed(buf, n):
    """A copy of the first n bytes: the view AsyncSerdeProcessor leaves after serialize."""
    out = byte_obj(n)
    out.tensor.copy_(buf.tensor[:n])
    return out


def test_same_bytes_as_the_reference_header():
    """Our blob's header equals the reference's for the same layout (same stored shape)."""
    shape = (2, 2, 8, 256)
    src = kv(shape)
    ours = bytes(ours_blob(src, 128, 4).tensor.numpy())
    buf = byte_obj(10**6)
    n = RefSerializer(head_dim=128, bits=4).serialize(src, buf, key(0))
    theirs = bytes(buf.tensor.numpy()[:n])
    assert len(ours) == len(theirs)
    assert tq_jax.peek_header(ours) == tq_jax.peek_header(theirs)
    assert ours[:71] == theirs[:71]  # the 63-byte 5-D bf16 header and the indices length (docs/TQ01.md)
