"""tq_jax._src.batch as a package: its .npy header reader (versions 1.0-3.0, hostile
version-3.0 headers), CompressOptions' Options, the numpy-output checks, and the
packaging (every subpackage listed in pyproject.toml)."""

import dataclasses
import io
import os
import struct
import sys
import zipfile

import numpy as np
import pytest

import tq_jax
from tq_jax._src import batch
from tq_jax._src import safetensors_io as st
from tq_jax._src.batch import sources

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
V3_MAGIC = b"\x93NUMPY\x03\x00"


def _npy_bytes(arr, version):
    f = io.BytesIO()
    np.lib.format.write_array(f, arr, version=version, allow_pickle=False)
    return f.getvalue()


def _v3(header: bytes, data: bytes = b"") -> bytes:
    return V3_MAGIC + struct.pack("<I", len(header)) + header + data


@pytest.mark.parametrize("version", [(1, 0), (2, 0), (3, 0)])
@pytest.mark.parametrize("dtype", ["<f4", "<f2", "<i8", "|u1", "<f8"])
def test_npy_versions_read_alike(tmp_path, version, dtype):
    arr = (np.arange(2 * 3 * 4) - 5).reshape(2, 3, 4).astype(dtype)
    path = tmp_path / "x.npy"
    path.write_bytes(_npy_bytes(arr, version))
    # The header reader agrees with np.load, and leaves the file at the data.
    with open(path, "rb") as f:
        shape, fortran, dt = sources.read_npy_header(f)
        assert f.tell() == os.path.getsize(path) - arr.nbytes
    assert (shape, fortran, dt) == (arr.shape, False, np.load(path).dtype)
    with batch.open_source(path) as src:
        info = src.tensors["x"]
        assert (info.shape, st.DTYPES[info.dtype]) == (arr.shape, arr.dtype)
        np.testing.assert_array_equal(np.asarray(src.read("x")), arr.reshape(-1))
        np.testing.assert_array_equal(np.asarray(src.read("x", 3, 7)), arr.reshape(-1)[3:7])


@pytest.mark.parametrize("compression", [zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED])
def test_npz_members_of_every_version(tmp_path, compression):
    arrs = {f"v{v[0]}": np.arange(12, dtype=np.float32).reshape(3, 4) * v[0] for v in [(1, 0), (2, 0), (3, 0)]}
    path = tmp_path / "x.npz"
    with zipfile.ZipFile(path, "w", compression) as z:
        for (name, a), v in zip(arrs.items(), [(1, 0), (2, 0), (3, 0)]):
            z.writestr(name + ".npy", _npy_bytes(a, v))
    with batch.open_source(path) as src:
        assert sorted(src.tensors) == sorted(arrs)
        for name, a in arrs.items():
            np.testing.assert_array_equal(np.asarray(src.read(name)), a.reshape(-1))


def test_v3_utf8_field_names_parse_then_refused_as_dtype(tmp_path):
    # Version 3.0 exists for UTF-8 field names; the reader parses them like np.load,
    # and open_source refuses the structured dtype as unsupported.
    dt = np.dtype([("naïve", "<f4"), ("β", "<i2")])
    arr = np.zeros(3, dt)
    path = tmp_path / "s.npy"
    path.write_bytes(_npy_bytes(arr, (3, 0)))
    with open(path, "rb") as f:
        shape, fortran, got = sources.read_npy_header(f)
    assert (shape, fortran, got) == ((3,), False, np.load(path).dtype)
    with pytest.raises(batch.BatchError, match="unsupported dtype"):
        batch.open_source(path)


def _good_header(**over) -> bytes:
    d = {"descr": "<f4", "fortran_order": False, "shape": (2,)}
    d.update(over)
    return repr(d).encode()


HOSTILE_V3 = {
    "huge declared length": V3_MAGIC + struct.pack("<I", 0xFFFFFFFF),
    "declared length over the limit": V3_MAGIC + struct.pack("<I", 4 * 10_000 + 1) + b" " * 100,
    "truncated length": V3_MAGIC + b"\x10\x00",
    "truncated header": V3_MAGIC + struct.pack("<I", 100) + _good_header(),
    "not utf-8": _v3(b"{'descr': '\xff\xfe'}"),
    "code, not a literal": _v3(b"__import__('os').system('echo hi')"),
    "a call in a value": _v3(b"{'descr': '<f4', 'fortran_order': False, 'shape': (print(1),)}"),
    "deep nesting": _v3(b"(" * 5000 + b")" * 5000),
    "not a dict": _v3(b"[1, 2, 3]"),
    "missing key": _v3(b"{'descr': '<f4', 'shape': (2,)}"),
    "extra key": _v3(_good_header(extra=1)),
    "shape a list": _v3(_good_header(shape=[2])),
    "shape of floats": _v3(_good_header(shape=(2.0,))),
    "fortran_order an int": _v3(_good_header(fortran_order=0)),
    "bad descr": _v3(_good_header(descr="<q9")),
    "descr not a dtype": _v3(_good_header(descr=42)),
    "negative shape": _v3(_good_header(shape=(-2,)), b"\0" * 8),
    "unknown version": b"\x93NUMPY\x04\x00" + struct.pack("<I", 10) + b"{}" + b" " * 8,
    "not npy": b"PK\x03\x04 not an npy file at all",
}


@pytest.mark.parametrize("case", sorted(HOSTILE_V3))
def test_hostile_npy_headers_raise_only_batch_error(tmp_path, case):
    path = tmp_path / "h.npy"
    path.write_bytes(HOSTILE_V3[case])
    with pytest.raises(batch.BatchError, match=r"h\.npy is not a valid \.npy array") as e:
        batch.open_source(path)
    assert len(str(e.value)) < len(str(path)) + 400  # one readable line, not the hostile header


def test_v3_header_over_numpy_limit_in_characters(tmp_path):
    # Same limit as numpy's readers: characters, not bytes (here 2 bytes each).
    pad = "é" * 10_001
    header = repr({"descr": "<f4", "fortran_order": False, "shape": (1,)})[:-1] + f", }}#{pad}"
    path = tmp_path / "h.npy"
    path.write_bytes(_v3(header.encode("utf-8"), b"\0" * 4))
    with pytest.raises(batch.BatchError, match="large and may not be safe"):
        batch.open_source(path)


def test_fortran_order_npy_refused_but_deflated_npz_member_read(tmp_path):
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.save(tmp_path / "f.npy", np.asfortranarray(x))
    with pytest.raises(batch.BatchError, match="Fortran order"):
        batch.open_source(tmp_path / "f.npy")
    np.savez_compressed(tmp_path / "f.npz", a=np.asfortranarray(x))  # read whole, by numpy
    with batch.open_source(tmp_path / "f.npz") as src:
        np.testing.assert_array_equal(np.asarray(src.read("a")), x.reshape(-1))


def test_compress_options_hold_validated_options():
    default = batch.CompressOptions()
    assert default.options == tq_jax.Options(4, 4, seed=42)
    o = tq_jax.Options(3, 2, skip_first_layers=1)
    pairs = tuple(sorted(dataclasses.asdict(o).items()))
    assert batch.CompressOptions(options=pairs).options == o  # the old form, until cli switches
    assert batch.CompressOptions(options=o, exclude=["a*"]).exclude == ("a*",)
    with pytest.raises(batch.BatchError, match="invalid codec options: `key_bits`"):
        batch.CompressOptions(options=(("key_bits", 9), ("value_bits", 4)))
    with pytest.raises(batch.BatchError, match="invalid codec options"):
        batch.CompressOptions(options=(("bits", 4),))
    assert not hasattr(batch.CompressOptions, "make")


def test_metadata_records_every_option_field(tmp_path):
    path = tmp_path / "in.safetensors"
    st.save_file({"k": np.ones((2, 64), np.float32)}, path)
    o = tq_jax.Options(3, 3, seed=7, rotation="hadamard", checksum=True)
    with batch.open_source(path) as src:
        plan = batch.plan_compress(src, tmp_path / "o.safetensors", batch.CompressOptions(options=o, head_dim=64))
    entry = plan.tq["tensors"]["k"]
    assert entry == {"codec": "TQ01", "dtype": "F32", "shape": [2, 64], "head_dim": 64,
                     "options": dataclasses.asdict(o), "blobs": entry["blobs"]}
    assert plan.metadata[batch.META_KEY] == batch.metadata.to_json(plan.tq)
    assert [u.options for u in plan.entries[0].units] == [o]


def test_error_type_and_tq_dtypes():
    assert issubclass(batch.BatchError, Exception) and not hasattr(batch, "CliError")  # cli's own
    assert not issubclass(batch.BatchError, ValueError)
    # Safetensors names of wire.DTYPES, in its order (cli indexes one by the other).
    assert batch.TQ_DTYPES == ("BF16", "F16", "F32")
    assert [st.dtype_name(np.dtype(n)) for n in tq_jax._src.wire.DTYPES] == list(batch.TQ_DTYPES)


@pytest.mark.parametrize("ext,specs,match", [
    (".npy", [("a", "F32", (2,)), ("b", "F32", (2,))], "holds exactly one tensor, this output has 2"),
    (".npy", [("a", "BF16", (2,))], r"\.npy cannot record dtype BF16 \(tensor 'a'\)"),
    (".npz", [("a", "F32", (2,)), ("b", "F8_E4M3", (2,))], r"\.npz cannot record dtype F8_E4M3 \(tensor 'b'\)"),
])
def test_numpy_outputs_refused_before_any_file(tmp_path, ext, specs, match):
    out = tmp_path / ("o" + ext)
    with pytest.raises(batch.BatchError, match=match):
        batch.writers.check_numpy_output(out, specs)
    plan = batch.FilePlan("decompress", "in", str(out), tuple(batch.Entry(n, d, s, ()) for n, d, s in specs), {}, {})
    with pytest.raises(batch.BatchError, match=match):
        batch.open_writer(plan)
    assert os.listdir(tmp_path) == []
    batch.writers.check_numpy_output(tmp_path / "o.safetensors", specs)  # safetensors holds them all


def test_public_names_still_importable():
    import tq_jax._src.batch as b

    for name in b.__all__:
        assert getattr(b, name) is not None
    for name in ("open_source", "check_input", "plan_compress", "plan_decompress", "read_tq_metadata",
                 "blob_headers", "chunk_rows", "run_local", "produce", "byte_view", "open_writer",
                 "Progress", "CompressOptions", "FilePlan", "Unit", "Entry", "Source", "BatchError",
                 "META_KEY", "FORMAT", "FORMAT_VERSION", "DEFAULT_CHUNK_BYTES", "TQ_DTYPES"):
        assert name in b.__all__, name


def test_pyproject_lists_every_package():
    # setuptools takes the packages listed, no more: a subpackage missing from the list
    # is missing from a clean (non-editable) install.
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        listed = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    found = set()
    for dirpath, dirnames, files in os.walk(os.path.join(ROOT, "tq_jax")):
        dirnames[:] = [d for d in dirnames if not d.startswith((".", "__"))]
        if "__init__.py" in files:
            found.add(os.path.relpath(dirpath, ROOT).replace(os.sep, "."))
    assert found <= listed, f"add {sorted(found - listed)} to [tool.setuptools] packages in pyproject.toml"
    assert "tq_jax.bridge" in listed
