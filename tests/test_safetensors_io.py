"""tq_jax._src.safetensors_io: round trips, interop with the `safetensors` package, hostile headers."""

import json
import os
import struct

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hst

from tq_jax._src import safetensors_io as st


def _arrays():
    rng = np.random.default_rng(0)
    return {
        "bf16": rng.standard_normal((3, 4)).astype(jnp.bfloat16),
        "f16": rng.standard_normal((2, 5)).astype(np.float16),
        "f32": rng.standard_normal((7,)).astype(np.float32),
        "f64": rng.standard_normal((2, 2)),
        "i8": np.arange(-3, 3, dtype=np.int8),
        "u8": np.arange(6, dtype=np.uint8).reshape(2, 3),
        "i16": np.arange(4, dtype=np.int16),
        "i32": np.arange(4, dtype=np.int32),
        "i64": np.arange(4, dtype=np.int64),
        "bool": np.array([True, False, True]),
        "f8": np.array([0.5, -2.0], dtype=jnp.float8_e4m3fn),
        "empty": np.zeros((0, 3), np.float32),
        "scalar": np.array(7, np.int32),
    }


def _same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_roundtrip_all_dtypes(tmp_path):
    arrays = _arrays()
    path = tmp_path / "a.safetensors"
    st.save_file(arrays, path, {"k": "v"})
    got, meta = st.load_file(path)
    assert meta == {"k": "v"} and list(got) == list(arrays)
    for k in arrays:
        _same(got[k], arrays[k])
    # The buffer starts 8-byte aligned, as the reference writer does.
    with st.SafetensorsReader(path) as r:
        assert r.header.data_start % 8 == 0


def test_reader_ranges_are_readonly_memmaps(tmp_path):
    x = np.arange(1000, dtype=np.float32)
    st.save_file({"x": x}, tmp_path / "x.safetensors")
    with st.SafetensorsReader(tmp_path / "x.safetensors") as r:
        part = r.read("x", 100, 250)
        assert isinstance(part, np.memmap) and not part.flags.writeable
        np.testing.assert_array_equal(part, x[100:250])
        assert r.read("x", 5, 5).size == 0
        assert r.read_bytes("x", 4, 12) == x[1:3].tobytes()
        with pytest.raises(IndexError):
            r.read("x", 10, 1001)


def test_interop_with_safetensors_package(tmp_path):
    torch = pytest.importorskip("torch")
    st_torch = pytest.importorskip("safetensors.torch")
    st_numpy = pytest.importorskip("safetensors.numpy")
    arrays = {k: v for k, v in _arrays().items() if k != "f8"}
    ours = tmp_path / "ours.safetensors"
    st.save_file(arrays, ours, {"m": "1"})
    # Theirs reads ours (torch for bf16, numpy for the rest).
    loaded = st_torch.load_file(str(ours))
    assert loaded["bf16"].dtype == torch.bfloat16
    np.testing.assert_array_equal(
        loaded["bf16"].view(torch.int16).numpy(), arrays["bf16"].view(np.int16)
    )
    for k, v in arrays.items():
        if k != "bf16":
            np.testing.assert_array_equal(loaded[k].numpy(), v)
    # Ours reads theirs.
    theirs = tmp_path / "theirs.safetensors"
    st_torch.save_file(
        {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)},
        str(theirs),
        metadata={"format": "pt"},
    )
    got, meta = st.load_file(theirs)
    assert meta == {"format": "pt"}
    np.testing.assert_array_equal(got["a"], np.arange(6, dtype=np.float32).reshape(2, 3))
    assert got["b"].dtype == jnp.bfloat16 and got["b"].astype(np.float32).tolist() == [1.0] * 4
    num = tmp_path / "num.safetensors"
    st_numpy.save_file({"z": np.arange(5, dtype=np.int16)}, str(num))
    np.testing.assert_array_equal(st.load_file(num)[0]["z"], np.arange(5, dtype=np.int16))


def test_writer_is_atomic(tmp_path):
    path = tmp_path / "w.safetensors"
    with pytest.raises(RuntimeError):
        with st.SafetensorsWriter(path, [("a", "F32", (4,))]) as w:
            w.write(np.zeros(2, np.float32))
            raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []
    w = st.SafetensorsWriter(path, [("a", "F32", (4,))])
    with pytest.raises(ValueError, match="overruns"):
        w.write(np.zeros(5, np.float32))
    with pytest.raises(ValueError, match="0 buffer bytes were written but the header declares 16"):
        w.commit()
    assert os.listdir(tmp_path) == []
    # Pieces of any size, across tensor boundaries.
    with st.SafetensorsWriter(path, [("a", "F32", (2,)), ("b", "U8", (3,))]) as w:
        w.write(np.float32(1.0).tobytes() + b"\x00")
        w.write(b"\x00\x00\x00" + b"\x01\x02\x03")
    got, _ = st.load_file(path)
    assert got["a"].tolist() == [1.0, 0.0] and got["b"].tolist() == [1, 2, 3]


def test_writer_with_reserved_header(tmp_path):
    path = tmp_path / "r.safetensors"
    w = st.SafetensorsWriter(path, [("a", "U8", (4,)), ("b", "F32", (1,))], {"n": "4"}, header_size=256)
    assert w.data_start == 256
    w.write(b"\x01" * 6)  # "a" turned out longer than planned
    w.write(np.float32(2.5))
    w.commit([("a", "U8", (6,)), ("b", "F32", (1,))], {"n": "6"})
    got, meta = st.load_file(path)
    assert got["a"].tolist() == [1] * 6 and got["b"].tolist() == [2.5] and meta == {"n": "6"}
    with st.SafetensorsReader(path) as r:
        assert r.header.data_start == 256
    w = st.SafetensorsWriter(path, [("a", "U8", (4,))], header_size=64)
    w.write(b"1234")
    with pytest.raises(ValueError, match="reserved"):
        w.commit([("a" * 100, "U8", (4,))])
    assert os.listdir(tmp_path) == ["r.safetensors"]


def test_dtype_name():
    assert st.dtype_name(np.float32) == "F32"
    assert st.dtype_name(jnp.bfloat16) == "BF16"
    with pytest.raises(st.InvalidDtypeError, match="big-endian"):
        st.dtype_name(np.dtype(">f4"))
    with pytest.raises(st.InvalidDtypeError):
        st.dtype_name(np.dtype("U3"))


# --------------------------------------------------------------------------- hostile input


def _file(header, buffer=b"", n=None):
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if n is None else n) + raw + buffer


def _parse(blob):
    return st.parse_header(blob, len(blob))


GOOD = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}


@pytest.mark.parametrize(
    "blob, err",
    [
        (b"\x01\x02", st.TruncatedFileError),
        (_file(b"{}", n=st.MAX_HEADER_SIZE + 1), st.HeaderTooLargeError),
        (_file(b"{}", n=50), st.TruncatedFileError),
        (_file(b"\xff\xfe{}"), st.InvalidHeaderError),
        (_file(b' {"a":1}'), st.InvalidHeaderError),
        (_file(b"{not json"), st.InvalidHeaderError),
        (_file(b"[1]"), st.InvalidHeaderError),
        (_file(b'{"a":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},"a":{"dtype":"F32","shape":[0],"data_offsets":[0,0]}}'), st.InvalidHeaderError),
        (_file({"__metadata__": {"k": 1}}), st.InvalidHeaderError),
        (_file({"a": {"dtype": "F32", "shape": [2]}}, b"\0" * 8), st.InvalidHeaderError),
        (_file({"a": dict(GOOD["a"], extra=1)}, b"\0" * 8), st.InvalidHeaderError),
        (_file({"a": [1, 2]}), st.InvalidHeaderError),
        (_file({"a": dict(GOOD["a"], dtype="F4")}, b"\0" * 8), st.InvalidDtypeError),
        (_file({"a": dict(GOOD["a"], dtype=3)}, b"\0" * 8), st.InvalidHeaderError),
        (_file({"a": dict(GOOD["a"], shape=[-2])}, b"\0" * 8), st.InvalidHeaderError),
        (_file({"a": dict(GOOD["a"], shape=[2.0])}, b"\0" * 8), st.InvalidHeaderError),
        (_file({"a": dict(GOOD["a"], shape=[True])}, b"\0" * 8), st.InvalidHeaderError),
        (_file({"a": dict(GOOD["a"], data_offsets=[0])}, b"\0" * 8), st.InvalidHeaderError),
        (_file({"a": dict(GOOD["a"], shape=[3])}, b"\0" * 8), st.TensorSizeError),
        (_file({"a": dict(GOOD["a"], shape=[2**62, 2**62])}, b"\0" * 8), st.TensorSizeError),
        (_file({"a": dict(GOOD["a"], data_offsets=[8, 0])}, b"\0" * 8), st.TensorSizeError),
        (_file({"a": dict(GOOD["a"], data_offsets=[4, 12])}, b"\0" * 12), st.InvalidOffsetsError),
        (
            _file({**GOOD, "b": {"dtype": "U8", "shape": [4], "data_offsets": [4, 8]}}, b"\0" * 8),
            st.InvalidOffsetsError,
        ),
        (_file(GOOD, b"\0" * 9), st.InvalidOffsetsError),
        (_file(GOOD, b"\0" * 7), st.InvalidOffsetsError),
    ],
)
def test_hostile_headers(blob, err):
    with pytest.raises(err):
        _parse(blob)


def test_good_handcrafted_header():
    h = _parse(_file({"__metadata__": {"x": "y"}, **GOOD}, b"\0" * 8))
    assert h.metadata == {"x": "y"} and h.tensors["a"].shape == (2,) and h.buffer_nbytes == 8


def test_reader_reports_truncated_file(tmp_path):
    path = tmp_path / "t.safetensors"
    st.save_file({"x": np.zeros(100, np.float32)}, path)
    data = path.read_bytes()
    for cut in (3, 20, len(data) - 1):
        path.write_bytes(data[:cut])
        with pytest.raises(st.SafetensorsError):
            st.SafetensorsReader(path)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hst.binary(max_size=200))
def test_fuzz_random_bytes(data):
    try:
        _parse(data)
    except st.SafetensorsError:
        pass


_VALID = _file({"__metadata__": {"k": "v"}, **GOOD, "b": {"dtype": "BF16", "shape": [1, 2], "data_offsets": [8, 12]}}, b"\0" * 12)


@settings(max_examples=300, deadline=None)
@given(hst.lists(hst.tuples(hst.integers(0, len(_VALID) - 1), hst.integers(0, 255)), min_size=1, max_size=4),
       hst.integers(0, len(_VALID)))
def test_fuzz_mutated_valid_file(mutations, cut):
    data = bytearray(_VALID)
    for pos, val in mutations:
        data[pos] = val
    for blob in (bytes(data), bytes(data[:cut])):
        try:
            _parse(blob)
        except st.SafetensorsError:
            pass
