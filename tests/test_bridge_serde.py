"""tq_jax.bridge._src.serde: the LMCache v1 Serializer/Deserializer, through AsyncSerdeProcessor.

Everything runs against the real lmcache 0.5.6 classes (TensorMemoryObj, MemoryLayoutDesc,
create_serde_processor); failures inside AsyncSerdeProcessor are only logged, so every
task's result is asserted.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lmcache")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from lmcache.v1.distributed.serde import SerdeConfig, create_serde_processor  # noqa: E402

import tq_jax  # noqa: E402
from tq_jax.bridge._src import dlpack  # noqa: E402
from tq_jax.bridge import register  # noqa: E402
from tq_jax.bridge._src import serde as S  # noqa: E402

from bridge_util import byte_obj, key, layout, make_obj, mean_cosine, wait  # noqa: E402

from conftest import LMCACHE_WARNINGS, sweep

pytestmark = LMCACHE_WARNINGS
BF16 = torch.bfloat16


@pytest.fixture(scope="module", autouse=True)
def _registered():
    register()


def kv(shape, dtype=BF16, seed=0, align=4096):
    obj = make_obj([shape], [dtype], align=align)
    g = torch.Generator().manual_seed(seed)
    obj.tensor.copy_(torch.randn(shape, generator=g).to(dtype))
    return obj


def processor(**kw):
    return create_serde_processor(SerdeConfig("tq_jax", kw))


def serialize(proc, srcs):
    """Serializes each src in its own task (so several workers run at once)."""
    size = proc.estimate_serialized_size(layout([srcs[0].get_shapes()[0]], [srcs[0].get_dtypes()[0]]))
    dsts = [byte_obj(size) for _ in srcs]
    tasks = [proc.submit_serialize([s], [d], [key(i)]) for i, (s, d) in enumerate(zip(srcs, dsts))]
    assert all(wait(proc.query_serialize_result, t) is True for t in tasks)
    return [bytes(d.tensor.numpy()) for d in dsts], dsts


def deserialize(proc, blobs_objs, shape, dtype=BF16):
    outs = [make_obj([shape], [dtype]) for _ in blobs_objs]
    for o in outs:
        o.tensor.fill_(-7)
    tasks = [proc.submit_deserialize([b], [o], [key(i)]) for i, (b, o) in enumerate(zip(blobs_objs, outs))]
    assert all(wait(proc.query_deserialize_result, t) is True for t in tasks)
    return [o.tensor.clone() for o in outs]


# ----------------------------------------------------------------------------- sizes


@pytest.mark.parametrize(
    "shapes,dtypes,head_dim",
    [
        ([(2, 32, 256, 1024)], [BF16], 128),  # W1
        ([(2, 4, 17, 512)], [torch.float16], 128),  # short last chunk
        ([(2, 3, 5, 192)], [torch.float32], 64),
        ([(1, 4, 32, 576)], [BF16], 576),  # MLA latent + rope
        ([(2, 2, 16, 256), (1, 2, 16, 576)], [BF16, torch.float16], 64),  # two groups
    ],
)
@pytest.mark.parametrize("bits", sweep([4, 2, 3, 6, 8]))
def test_estimate_is_exact(shapes, dtypes, head_dim, bits):
    ser = S.TQJaxSerializer(head_dim=head_dim, bits=bits)
    lay = layout(shapes, dtypes)
    expected = sum(
        tq_jax.serialized_size(S.stored_shape(s, head_dim), str(d).removeprefix("torch."), bits)
        for s, d in zip(shapes, dtypes)
    )
    assert ser.estimate_serialized_size(lay) == expected
    if np.prod(shapes[0]) > 10**6:
        return  # W1's exactness is exercised end to end in test_bridge_storage
    src = make_obj(shapes, dtypes)
    src.raw_data.view(torch.uint8).copy_(torch.randint(0, 60, (src.raw_data.numel(),), dtype=torch.uint8))
    for i, d in enumerate(dtypes):  # finite values in every group
        src.get_tensor(i).copy_(torch.randn(shapes[i]).to(d))
    dst = byte_obj(expected + 100)  # a larger buffer: the return value is still exact
    assert ser.serialize(src, dst, key(0)) == expected


def test_stored_shapes():
    assert S.stored_shape((2, 32, 256, 1024), 128) == (2, 32, 256, 8, 128)
    assert S.stored_shape((1, 61, 256, 576), 576) == (1, 61, 256, 1, 576)


# ----------------------------------------------------------------------------- processor


@pytest.mark.parametrize("bits", sweep([4, 2, 8]))
def test_processor_workers_bit_identical(bits):
    shape = (2, 4, 64, 512)
    srcs = [kv(shape, seed=i) for i in range(8)]
    serial = processor(bits=bits, max_workers=1, format="v1")
    parallel = processor(bits=bits, max_workers=4, format="v1")
    try:
        blobs1, objs1 = serialize(serial, srcs)
        blobs4, objs4 = serialize(parallel, srcs)
        assert blobs1 == blobs4
        # ... and both equal the core's offline encode of the per-head shape.
        assert blobs1[3] == tq_jax.dumps(dlpack.numpy_view(srcs[3].tensor).reshape(2, 4, 64, 4, 128), bits=bits)
        out1 = deserialize(serial, objs1, shape)
        out4 = deserialize(parallel, objs4, shape)
    finally:
        serial.close()
        parallel.close()
    for a, b, x in zip(out1, out4, srcs):
        assert torch.equal(a, b)
        assert mean_cosine(x.tensor, a, 128) >= {2: 0.93, 4: 0.994, 8: 0.9999}[bits]


def test_processor_batch_task_and_narrowing():
    """One task with several objects; AsyncSerdeProcessor narrows dst to our return value."""
    shape = (2, 2, 32, 256)
    proc = processor(bits=4, max_workers=2)
    try:
        srcs = [kv(shape, seed=i) for i in range(3)]
        n = proc.estimate_serialized_size(layout([shape], [BF16]))
        dsts = [byte_obj(n) for _ in srcs]
        t = proc.submit_serialize(srcs, dsts, [key(i) for i in range(3)])
        assert wait(proc.query_serialize_result, t) is True
        assert [d.get_size() for d in dsts] == [n] * 3
        outs = [make_obj([shape], [BF16]) for _ in srcs]
        t = proc.submit_deserialize(dsts, outs, [key(i) for i in range(3)])
        assert wait(proc.query_deserialize_result, t) is True
    finally:
        proc.close()
    for x, y in zip(srcs, outs):
        assert mean_cosine(x.tensor, y.tensor, 128) >= 0.994


@pytest.mark.parametrize("src_dtype", [BF16, torch.float16, torch.float32])
@pytest.mark.parametrize("dst_dtype", [BF16, torch.float16, torch.float32])
def test_dtypes_in_and_out(src_dtype, dst_dtype):
    shape = (2, 2, 8, 256)
    src = kv(shape, src_dtype)
    ser, de = S.TQJaxSerializer(bits=4), S.TQJaxDeserializer()
    n = ser.estimate_serialized_size(layout([shape], [src_dtype]))
    buf = byte_obj(n)
    assert ser.serialize(src, buf, key(0)) == n
    assert tq_jax.peek_header(buf.tensor.numpy()).dtype == str(src_dtype).removeprefix("torch.")
    out = make_obj([shape], [dst_dtype])
    de.deserialize(buf, out, key(0))
    ref = tq_jax.loads(buf.tensor.numpy(), dtype=np.float32)
    np.testing.assert_allclose(
        out.tensor.float().numpy(), np.asarray(ref).reshape(shape), rtol=1e-2, atol=1e-2
    )


def test_mla_layout_round_trip():
    shape = (1, 3, 16, 576)
    src = kv(shape)
    ser, de = S.TQJaxSerializer(head_dim=576, bits=4), S.TQJaxDeserializer()
    buf = byte_obj(ser.estimate_serialized_size(layout([shape], [BF16])))
    ser.serialize(src, buf, key(0))
    assert tq_jax.peek_header(buf.tensor.numpy()).shape == (1, 3, 16, 1, 576)
    out = make_obj([shape], [BF16])
    de.deserialize(buf, out, key(0))
    assert mean_cosine(src.tensor, out.tensor, 576) >= 0.994


def test_multi_group_round_trip():
    shapes, dtypes = [(2, 2, 16, 256), (1, 2, 16, 576)], [BF16, torch.float16]
    src = make_obj(shapes, dtypes)
    for i, (s, d) in enumerate(zip(shapes, dtypes)):
        src.get_tensor(i).copy_(torch.randn(s).to(d))
    ser, de = S.TQJaxSerializer(head_dim=64, bits=4), S.TQJaxDeserializer()
    plans = S.plan_layout(layout(shapes, dtypes), 64, 4)
    buf = byte_obj(sum(p.nbytes for p in plans))
    ser.serialize(src, buf, key(0))
    raw = buf.tensor.numpy()
    first = tq_jax.parse(raw[: plans[0].nbytes])  # two complete TQ01 blobs back to back
    second = tq_jax.parse(raw[plans[0].nbytes :])
    assert first.header.shape == (2, 2, 16, 4, 64) and second.header.shape == (1, 2, 16, 9, 64)
    out = make_obj(shapes, dtypes)
    de.deserialize(buf, out, key(0))
    for i in range(2):
        assert mean_cosine(src.get_tensor(i), out.get_tensor(i), 64) >= 0.994


@pytest.mark.parametrize("shapes", [[(2, 2, 16, 256)], [(2, 2, 16, 256), (1, 2, 16, 256)]], ids=["one group", "two groups"])
def test_a_damaged_checksummed_value_is_refused_before_any_group_is_written(shapes):
    # The CRC of the last group's blob is damaged: nothing of any group reaches dst.
    dtypes = [BF16] * len(shapes)
    src = make_obj(shapes, dtypes)
    for i, s in enumerate(shapes):
        src.get_tensor(i).copy_(torch.randn(s).to(BF16))
    ser, de = S.TQJaxSerializer(head_dim=64, bits=4, checksum=True), S.TQJaxDeserializer()
    n = ser.estimate_serialized_size(layout(shapes, dtypes))
    buf = byte_obj(n)
    ser.serialize(src, buf, key(0))
    last = S.plan_layout(layout(shapes, dtypes), 64, 4)[-1]
    raw = buf.tensor.numpy()
    raw[n - last.nbytes + last.nbytes // 2] ^= 0x10  # inside the last blob's index section
    out = make_obj(shapes, dtypes)
    for i in range(len(shapes)):
        out.get_tensor(i).fill_(7)
    with pytest.raises(tq_jax.WireError, match="CRC32"):
        de.deserialize(buf, out, key(0))
    assert all(bool((out.get_tensor(i) == 7).all()) for i in range(len(shapes)))


def test_src_longer_than_blob_is_read_by_header_length():
    shape = (2, 2, 8, 256)
    src = kv(shape)
    ser, de = S.TQJaxSerializer(bits=3), S.TQJaxDeserializer()
    n = ser.estimate_serialized_size(layout([shape], [BF16]))
    exact, padded = byte_obj(n), byte_obj(n + 4096)
    padded.tensor.fill_(0xAB)
    ser.serialize(src, exact, key(0))
    ser.serialize(src, padded, key(0))
    a, b = make_obj([shape], [BF16]), make_obj([shape], [BF16])
    de.deserialize(exact, a, key(0))
    de.deserialize(padded, b, key(0))
    assert torch.equal(a.tensor, b.tensor)


def test_unaligned_and_noncontiguous_destinations():
    """The copy paths: unaligned memory (JAX copies) and a non-contiguous dst view."""
    shape = (2, 2, 8, 256)
    src = kv(shape, align=64)
    src_odd = make_obj([shape], [BF16], align=4096)
    raw = torch.empty(src_odd.raw_data.numel() + 2, dtype=torch.uint8)[2:]  # 2-byte offset
    src_odd.raw_data = raw
    src_odd.tensor.copy_(src.tensor)
    ser, de = S.TQJaxSerializer(bits=4), S.TQJaxDeserializer()
    n = ser.estimate_serialized_size(layout([shape], [BF16]))
    b1, b2 = byte_obj(n), byte_obj(n)
    ser.serialize(src, b1, key(0))
    ser.serialize(src_odd, b2, key(0))
    assert torch.equal(b1.tensor, b2.tensor)

    class Strided:  # a duck MemoryObj whose tensor is a transposed (non-contiguous) view
        def __init__(self, t):
            self.tensor = t

        def get_shapes(self):
            return [self.tensor.shape]

    base = torch.zeros(shape[::-1], dtype=torch.float32)
    view = base.permute(3, 2, 1, 0)
    assert not view.is_contiguous() and tuple(view.shape) == shape
    de.deserialize(b1, Strided(view), key(0))
    want = make_obj([shape], [torch.float32])
    de.deserialize(b1, want, key(0))
    assert torch.equal(view, want.tensor)


# ----------------------------------------------------------------------------- errors


def test_error_hidden_not_divisible():
    ser = S.TQJaxSerializer(head_dim=128)
    with pytest.raises(ValueError, match=r"not a multiple of head_dim=128.*576"):
        ser.estimate_serialized_size(layout([(1, 2, 16, 576)], [BF16]))
    with pytest.raises(ValueError, match="not a multiple of head_dim"):
        ser.serialize(kv((2, 2, 4, 200)), byte_obj(10**5), key(0))


@pytest.mark.parametrize("dtype", [torch.float64, torch.int8, torch.float8_e4m3fn])
def test_error_unsupported_dtype(dtype):
    ser = S.TQJaxSerializer()
    with pytest.raises(ValueError, match=r"bfloat16, float16 and float32.*fp8"):
        ser.estimate_serialized_size(layout([(2, 2, 4, 256)], [dtype]))
    src = make_obj([(2, 2, 4, 256)], [dtype])
    with pytest.raises(ValueError, match="cannot record"):
        ser.serialize(src, byte_obj(10**5), key(0))


def test_error_bad_layouts():
    ser = S.TQJaxSerializer()
    with pytest.raises(ValueError, match="parallel, non-empty"):
        ser.estimate_serialized_size(layout([], []))
    with pytest.raises(ValueError, match="MAX_NDIM"):
        ser.estimate_serialized_size(layout([(1,) * 16 + (128,)], [BF16]))


def test_error_dst_not_uint8_or_too_small():
    shape = (2, 2, 4, 256)
    ser = S.TQJaxSerializer()
    n = ser.estimate_serialized_size(layout([shape], [BF16]))
    with pytest.raises(ValueError, match=r"dtype torch.float16; it must be LMCache's uint8"):
        ser.serialize(kv(shape), make_obj([(n,)], [torch.float16]), key(0))
    small = byte_obj(n - 1)
    small.tensor.fill_(9)
    with pytest.raises(ValueError, match=rf"holds {n - 1} bytes .* need exactly {n}"):
        ser.serialize(kv(shape), small, key(0))
    assert (small.tensor == 9).all()  # nothing written


def test_error_blob_shape_mismatch():
    ser, de = S.TQJaxSerializer(bits=4), S.TQJaxDeserializer()
    shape = (2, 2, 8, 256)
    buf = byte_obj(ser.estimate_serialized_size(layout([shape], [BF16])))
    ser.serialize(kv(shape), buf, key(0))
    for other in [(2, 2, 16, 256), (2, 2, 8, 512), (1, 2, 8, 512), (2, 2, 8, 2, 128, 1)]:
        with pytest.raises(ValueError, match=r"shape \[2, 2, 8, 2, 128\].*different KV layout"):
            de.deserialize(buf, make_obj([other], [BF16]), key(0))
    # Same element count and a compatible per-head split: fine.
    de.deserialize(buf, make_obj([(2, 2, 8, 2, 128)], [BF16]), key(0))


def test_error_src_not_uint8_truncated_or_garbage():
    ser, de = S.TQJaxSerializer(bits=4), S.TQJaxDeserializer()
    shape = (2, 2, 8, 256)
    n = ser.estimate_serialized_size(layout([shape], [BF16]))
    buf = byte_obj(n)
    ser.serialize(kv(shape), buf, key(0))
    with pytest.raises(ValueError, match="uint8 byte buffer"):
        de.deserialize(make_obj([(n // 2,)], [torch.float16]), make_obj([shape], [BF16]), key(0))
    short = byte_obj(n - 1)
    short.tensor.copy_(buf.tensor[: n - 1])
    with pytest.raises(tq_jax.WireError, match="truncated"):
        de.deserialize(short, make_obj([shape], [BF16]), key(0))
    junk = byte_obj(n)
    junk.tensor.fill_(0)
    with pytest.raises(tq_jax.WireError, match="not a TQ01 blob"):
        de.deserialize(junk, make_obj([shape], [BF16]), key(0))
    with pytest.raises(ValueError, match="decoding writes floats"):
        de.deserialize(buf, make_obj([shape], [torch.int16]), key(0))


def test_failures_surface_as_false_through_the_processor():
    """AsyncSerdeProcessor turns our ValueErrors into a False task result (and a log)."""
    proc = processor(bits=4)
    try:
        t = proc.submit_serialize([kv((2, 2, 4, 256))], [byte_obj(10)], [key(0)])
        assert wait(proc.query_serialize_result, t) is False
        t = proc.submit_deserialize([byte_obj(100)], [make_obj([(2, 2, 4, 256)], [BF16])], [key(0)])
        assert wait(proc.query_deserialize_result, t) is False
    finally:
        proc.close()


def test_serializer_argument_errors():
    with pytest.raises(ValueError, match="bits"):
        S.TQJaxSerializer(bits=9)
    with pytest.raises(ValueError, match="exactly its estimated size"):
        S.TQJaxSerializer(norm_dtype="auto")
    assert not S.TQJaxSerializer(bits=5).options.v1_expressible  # 5 bits: version 2
    with pytest.raises(ValueError, match="head_dim"):
        S.TQJaxSerializer(head_dim=1)
    with pytest.raises(ValueError, match="int32"):
        S.TQJaxSerializer(seed=2**31)


# ----------------------------------------------------------------------------- devices


def test_resolve_device():
    assert S.resolve_device("cpu") == jax.devices("cpu")[0]
    assert S.resolve_device(" CPU:0 ") == jax.devices("cpu")[0]
    assert S.resolve_device("auto") == jax.devices()[0]
    with pytest.raises(ValueError, match="must be one of"):
        S.resolve_device("cuda")
    with pytest.raises(ValueError, match="must be one of"):
        S.resolve_device("auto:1")
    with pytest.raises(ValueError, match=r"index must be in 0\.\."):
        S.resolve_device(f"cpu:{len(jax.devices('cpu'))}")


@pytest.mark.skipif(any(d.platform == "gpu" for d in jax.devices()), reason="a GPU exists here")
def test_missing_platform_fails_at_factory_time():
    with pytest.raises(ValueError, match=r"device='gpu'.*no such backend.*Available: \['cpu'\]"):
        processor(device="gpu")
    with pytest.raises(ValueError, match="no such backend"):
        S.TQJaxDeserializer(device="tpu")


def test_explicit_device_object():
    """A ``jax.Device`` is used as given (not parsed as a name): the serializer writes the
    core's blob for the per-head shape, and the deserializer decodes it as ``loads`` does."""
    dev = jax.devices("cpu")[0]
    shape = (2, 1, 8, 256)
    ser, de = S.TQJaxSerializer(device=dev), S.TQJaxDeserializer(device=dev)
    assert ser.device is dev and de.device is dev
    src = kv(shape)
    size = ser.estimate_serialized_size(layout([shape], [BF16]))
    buf = byte_obj(size)
    assert ser.serialize(src, buf, key(0)) == size
    blob = bytes(buf.tensor.numpy())
    assert blob == tq_jax.dumps(dlpack.numpy_view(src.tensor).reshape(2, 1, 8, 2, 128), bits=4)
    out = make_obj([shape], [BF16])
    out.tensor.fill_(-7)
    de.deserialize(buf, out, key(0))
    expected = tq_jax.loads(blob, dtype=dlpack.numpy_dtype(BF16)).reshape(shape)
    np.testing.assert_array_equal(dlpack.numpy_view(out.tensor), expected)
    assert mean_cosine(src.tensor, out.tensor, 128) >= 0.994


def test_norm_overflow_is_a_clear_error_not_a_v2_blob():
    """The serde pins float16 norms: every blob stays TQ01 v1 at the estimated size."""
    shape = (2, 1, 8, 256)
    src = kv(shape, torch.float32)
    src.tensor.mul_(1e4)  # norms ~1e5 > 65504
    ser = S.TQJaxSerializer(bits=4)
    buf = byte_obj(ser.estimate_serialized_size(layout([shape], [torch.float32])) + 4096)
    buf.tensor.fill_(3)
    with pytest.raises(tq_jax.NormOverflowError, match="float16"):
        ser.serialize(src, buf, key(0))
    assert (buf.tensor == 3).all()
