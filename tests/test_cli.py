"""The tq-jax command: compress/decompress round trips, inspect, error exits, bench."""

import dataclasses
import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

import tq_jax
from tq_jax._src import batch
from tq_jax._src import bench
from tq_jax._src import cli
from tq_jax._src import safetensors_io as st

from conftest import mean_cosine, sweep

HD = 128




def _tensors():
    rng = np.random.default_rng(1)
    return {
        "kv": rng.standard_normal((2, 3, 16, 4, HD), dtype=np.float32).astype(jnp.bfloat16),
        "k16": rng.standard_normal((5, 3, HD)).astype(np.float16),
        "f32": rng.standard_normal((9, HD)).astype(np.float32),
        "wide": rng.standard_normal((4, 2 * HD)).astype(np.float32),  # compressed only with --all
        "ids": np.arange(10, dtype=np.int64),
        "mask": np.array([True, False, True]),
        "f64": rng.standard_normal((3, 5)),  # last axis is not head_dim: passes through
        "empty": np.zeros((0, HD), np.float32),
    }


@pytest.fixture
def infile(tmp_path):
    path = tmp_path / "in.safetensors"
    st.save_file(_tensors(), path, {"model": "unit-test"})
    return path


def run(*argv):
    return cli.main([str(a) for a in argv])


def _listing(d):
    return sorted(os.listdir(d))


def test_roundtrip_restores_names_shapes_dtypes(tmp_path, infile, capsys):
    out, back = tmp_path / "c.safetensors", tmp_path / "back.safetensors"
    assert run("compress", infile, out, "--bits", 4, "-q") == 0
    assert run("decompress", out, back, "-q") == 0
    assert capsys.readouterr().out == ""  # --quiet

    comp, meta = st.load_file(out)
    doc = json.loads(meta["tq_jax"])
    assert meta["model"] == "unit-test"
    assert doc["format"] == "tq-jax" and doc["version"] == 1 and doc["source"] == "safetensors"
    assert sorted(doc["tensors"]) == ["empty", "f32", "k16", "kv"]
    kv = doc["tensors"]["kv"]
    assert {k: v for k, v in kv.items() if k != "options"} == {
        "codec": "TQ01", "dtype": "BF16", "shape": [2, 3, 16, 4, HD], "head_dim": HD,
        "blobs": [tq_jax.serialized_size((2, 3, 16, 4, HD), "bfloat16", 4)],
    }
    assert kv["options"] == dataclasses.asdict(tq_jax.Options(key_bits=4, value_bits=4, seed=42))
    assert comp["kv"].dtype == np.uint8 and comp["kv"].ndim == 1
    # Each stored blob is an ordinary TQ01 blob.
    assert tq_jax.peek_header(comp["kv"]).shape == (2, 3, 16, 4, HD)

    orig = _tensors()
    got, meta2 = st.load_file(back)
    assert list(got) == list(orig) and meta2 == {"model": "unit-test"}
    for k, v in orig.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
    for k in ("wide", "ids", "mask", "f64"):  # passed through bit for bit
        assert got[k].tobytes() == orig[k].tobytes()
    for k in ("kv", "k16", "f32"):
        assert mean_cosine(got[k], orig[k]) >= 0.99, k
    assert _listing(tmp_path) == ["back.safetensors", "c.safetensors", "in.safetensors"]


def test_chunked_blobs_decode_like_one_blob(tmp_path, infile):
    one, many = tmp_path / "one.safetensors", tmp_path / "many.safetensors"
    assert run("compress", infile, one, "-q") == 0
    assert run("compress", infile, many, "-q", "--chunk-mb", 0.01) == 0  # ~10 KB per blob
    doc = json.loads(st.load_file(many)[1]["tq_jax"])
    assert len(doc["tensors"]["kv"]["blobs"]) > 1
    headers = [h for _, _, h in batch.blob_headers(batch.open_source(many), "kv", doc["tensors"]["kv"])]
    assert all(h.shape[1:] == (16, 4, HD) or h.shape[1:] == (4, HD) for h in headers)
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    run("decompress", one, a, "-q")
    run("decompress", many, b, "-q", "--chunk-mb", 0.01)
    ga, gb = st.load_file(a)[0], st.load_file(b)[0]
    for k in ga:  # every vector is coded on its own: chunking changes no value
        assert ga[k].tobytes() == gb[k].tobytes(), k


def test_chunk_rows():
    assert list(batch.chunk_rows((4, 8, 128), 2, 1 << 20)) == [(0, 4096, (4, 8, 128))]
    chunks = list(batch.chunk_rows((2, 3, 8, 128), 2, 8 * 128 * 2 * 2))  # 2 rows of (8, 128)
    assert [c[2] for c in chunks] == [(2, 8, 128), (2, 8, 128), (2, 8, 128)]
    assert chunks[-1][1] == 2 * 3 * 8 * 128
    # A budget below one vector still makes progress, one vector at a time.
    assert len(list(batch.chunk_rows((3, 128), 4, 10))) == 3


def test_all_splits_heads(tmp_path, infile):
    out, back = tmp_path / "c.safetensors", tmp_path / "b.safetensors"
    assert run("compress", infile, out, "--all", "--exclude", "f64", "-q") == 0
    comp, meta = st.load_file(out)
    doc = json.loads(meta["tq_jax"])
    assert "wide" in doc["tensors"] and "f64" not in doc["tensors"]
    assert tq_jax.peek_header(comp["wide"]).shape == (4, 2, HD)
    assert run("decompress", out, back, "-q") == 0
    got = st.load_file(back)[0]
    assert got["wide"].shape == (4, 2 * HD) and mean_cosine(got["wide"].reshape(-1, HD), _tensors()["wide"].reshape(-1, HD)) > 0.99


def test_options_reach_the_blobs(tmp_path, infile):
    out = tmp_path / "c.safetensors"
    assert run("compress", infile, out, "--bits", 2, "--seed", 7, "-q") == 0
    h = tq_jax.peek_header(st.load_file(out)[0]["k16"])
    assert (h.bits, h.seed, h.dtype) == (2, 7, "float16")


NOT_KV = ("--exclude", "k16", "--exclude", "f32", "--exclude", "empty")


# Quick tier: one blob per tensor; many small chunks (0.005 MiB) are slow
# (test_chunked_blobs_decode_like_one_blob keeps chunking quick).
@pytest.mark.parametrize("chunk_mb", sweep([64, 0.005]))
def test_v2_options_per_group_and_raw_layers(tmp_path, infile, capsys, chunk_mb):
    flags = ["--key-bits", 4, "--value-bits", 3, "--skip-first-layers", 1, "--skip-last-layers", 1,
             "--rotation", "hadamard", "--checksum", "--norm-correction", "-q"]
    out, back = tmp_path / "c.safetensors", tmp_path / "b.safetensors"
    # Per-group options need KV tensors [2, layers, ..., head_dim]: others are refused...
    _fails(capsys, "compress", infile, out, *flags, match="tensor 'k16'")
    # ...unless left uncompressed.
    assert run("compress", infile, out, *flags, *NOT_KV, "--chunk-mb", chunk_mb) == 0
    comp, meta = st.load_file(out)
    kv = json.loads(meta["tq_jax"])["tensors"]["kv"]
    assert kv["options"]["key_bits"] == 4 and kv["options"]["value_bits"] == 3
    assert (len(kv["blobs"]) > 1) == (chunk_mb < 1)
    assert run("decompress", out, back, "-q") == 0
    got, x = st.load_file(back)[0]["kv"], _tensors()["kv"]
    assert got.shape == x.shape and got.dtype == x.dtype
    # The first and last layers (axis 1) of K and V are stored raw: exact.
    for layer in (0, 2):
        assert got[:, layer].tobytes() == x[:, layer].tobytes()
    assert mean_cosine(got[0, 1], x[0, 1]) > 0.99 and mean_cosine(got[1, 1], x[1, 1]) > 0.97
    assert mean_cosine(got[0, 1], x[0, 1]) > mean_cosine(got[1, 1], x[1, 1])  # keys got more bits
    assert run("inspect", out) == 0
    row = next(ln.split() for ln in capsys.readouterr().out.splitlines() if ln.strip().startswith("kv "))
    assert row[4] == "4/3" and row[6] == "2" and "hadamard," in row and "crc32" in row
    # Chunked or not, every vector decodes to the same values.
    one = tmp_path / "one.safetensors"
    assert run("compress", infile, one, *flags, *NOT_KV) == 0
    assert run("decompress", one, tmp_path / "one_back.safetensors", "-q") == 0
    assert st.load_file(tmp_path / "one_back.safetensors")[0]["kv"].tobytes() == got.tobytes()


def test_preset_and_invalid_options(tmp_path, infile, capsys):
    out = tmp_path / "c.safetensors"
    assert run("compress", infile, out, "--preset", "compat-4bit", "-q") == 0
    assert tq_jax.peek_header(st.load_file(out)[0]["kv"]).version == 1
    _fails(capsys, "compress", infile, out, "--skip-first-layers", 9, *NOT_KV, match="layers")


def test_npy_and_npz(tmp_path):
    x = np.random.default_rng(2).standard_normal((6, 4, HD)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    np.savez(tmp_path / "z.npz", a=x, ids=np.arange(3))
    np.savez_compressed(tmp_path / "zc.npz", a=x)
    for name, out_ext in (("x.npy", ".npy"), ("z.npz", ".npz"), ("zc.npz", ".safetensors")):
        comp, back = tmp_path / f"{name}.tq.safetensors", tmp_path / f"{name}.back{out_ext}"
        assert run("compress", tmp_path / name, comp, "-q") == 0
        assert run("decompress", comp, back, "-q") == 0
        if out_ext == ".npy":
            y = np.load(back)
        elif out_ext == ".npz":
            with np.load(back) as z:
                y = z["a"]
                np.testing.assert_array_equal(z["ids"], np.arange(3))
        else:
            y = st.load_file(back)[0]["a"]
        assert y.dtype == x.dtype and y.shape == x.shape and mean_cosine(y, x) > 0.99


def test_several_inputs_into_a_directory(tmp_path, infile):
    other = tmp_path / "other.safetensors"
    st.save_file({"k": np.ones((2, HD), np.float16)}, other)
    outdir = tmp_path / "out"
    assert run("compress", infile, other, outdir, "-q") == 0
    assert _listing(outdir) == ["in.safetensors", "other.safetensors"]
    assert run("decompress", outdir / "in.safetensors", outdir / "other.safetensors", tmp_path / "back", "-q") == 0
    assert _listing(tmp_path / "back") == ["in.safetensors", "other.safetensors"]


def test_multiple_devices_option_in_process(tmp_path, infile):
    out = tmp_path / "c.safetensors"
    assert run("compress", infile, out, "--devices", "1", "-q") == 0
    assert run("compress", infile, out, "--devices", "99", "-q") == 1


def test_progress_and_summary(tmp_path, infile, capsys):
    assert run("compress", infile, tmp_path / "c.safetensors") == 0
    cap = capsys.readouterr()
    assert "compressed" in cap.out and "4 TQ01 tensor(s), 4 passed through" in cap.out
    assert "compress in.safetensors" in cap.err  # the progress bar's label
    assert "B/s" in cap.err


def test_progress_fallback_without_tqdm(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    p = batch.Progress(2_000_000, "job")
    p.update(1_000_000)
    p.update(1_000_000)
    p.close()
    err = capsys.readouterr().err
    assert "job: 100.0% 2.0/2.0 MB" in err and "MB/s" in err


# --------------------------------------------------------------------------- inspect


def test_inspect_text_and_json(tmp_path, infile, capsys):
    out = tmp_path / "c.safetensors"
    run("compress", infile, out, "-q", "--bits", 3)
    capsys.readouterr()
    assert run("inspect", out) == 0
    text = capsys.readouterr().out
    lines = {ln.split()[0]: ln.split() for ln in text.splitlines()[1:] if ln.startswith("  ")}
    assert text.startswith(f"{out}: tq-jax safetensors")
    assert lines["kv"][:8] == ["kv", "TQ01", "BF16", "2x3x16x4x128", "3", "42", "1", "1"]
    assert lines["ids"][1] == "raw" and lines["ids"][4] == "-"
    assert "metadata" in lines and "total: 4 TQ01 tensor(s), 4 raw" in text

    assert run("inspect", out, "--json") == 0
    doc = json.loads(capsys.readouterr().out)
    t = {r["name"]: r for r in doc["tensors"]}
    assert t["kv"]["bits"] == "3" and t["kv"]["blobs"] == 1 and t["kv"]["dtype"] == "BF16"
    assert t["kv"]["seed"] == 42 and t["kv"]["version"] == 1 and t["kv"]["options"] == "-"
    assert t["kv"]["stored_bytes"] == tq_jax.serialized_size((2, 3, 16, 4, HD), "bfloat16", 3)
    assert t["kv"]["original_bytes"] == 2 * 3 * 16 * 4 * HD * 2
    assert t["kv"]["ratio"] == pytest.approx(t["kv"]["original_bytes"] / t["kv"]["stored_bytes"])
    assert t["mask"]["kind"] == "raw" and doc["metadata"] == {"model": "unit-test"}

    assert run("inspect", out, "-v") == 0
    assert "blob 0" in capsys.readouterr().out


def test_inspect_bare_blob_and_plain_files(tmp_path, infile, capsys):
    blob = tmp_path / "x.tq01"
    blob.write_bytes(tq_jax.dumps(np.ones((3, HD), np.float32), bits=2, seed=5))
    assert run("inspect", blob, "--json") == 0
    (t,) = json.loads(capsys.readouterr().out)["tensors"]
    assert (t["bits"], t["seed"], t["shape"], t["dtype"]) == ("2", 5, [3, HD], "float32")
    assert run("inspect", infile) == 0
    assert "total: 0 TQ01 tensor(s), 8 raw" in capsys.readouterr().out


def test_inspect_refuses_a_bare_blob_whose_length_is_not_its_headers(tmp_path, capsys):
    """A truncated (or padded) bare blob is an error, not a ratio: its length follows from its header."""
    whole = tq_jax.dumps(np.ones((3, HD), np.float32), bits=2, seed=5)
    assert len(whole) == tq_jax.serialized_size((3, HD), "float32", 2)
    for name, data, what in [("short.tq01", whole[:-7], "truncated"), ("long.tq01", whole + b"\0" * 3, "followed by 3")]:
        (tmp_path / name).write_bytes(data)
        _fails(capsys, "inspect", tmp_path / name, match=f"declares {len(whole):,} bytes")
        assert run("inspect", tmp_path / name, "--json") == 1
        assert what in capsys.readouterr().err


def test_decompress_of_a_bare_blob_says_what_it_is_and_what_to_run(tmp_path, capsys):
    blob = tmp_path / "x.tq01"
    blob.write_bytes(tq_jax.dumps(np.ones((3, HD), np.float32), bits=4))
    _fails(capsys, "decompress", blob, tmp_path / "x.safetensors", match="bare TQ01 blob")
    run("decompress", blob, tmp_path / "x.safetensors")
    err = capsys.readouterr().err
    assert "tq_jax.loads(" in err and f"tq-jax inspect {blob}" in err and "MAX_HEADER_SIZE" not in err
    assert not (tmp_path / "x.safetensors").exists()


def test_a_codec_other_than_tq01_in_the_metadata_is_refused(tmp_path, infile, capsys):
    out = tmp_path / "c.safetensors"
    assert run("compress", infile, out, "-q") == 0
    tensors, meta = st.load_file(out)
    doc = json.loads(meta[batch.META_KEY])
    doc["tensors"]["kv"]["codec"] = "TQ02"
    st.save_file(tensors, tmp_path / "other.safetensors", {**meta, batch.META_KEY: json.dumps(doc)})
    for argv in (["decompress", tmp_path / "other.safetensors", tmp_path / "x.safetensors"],
                 ["inspect", tmp_path / "other.safetensors"]):
        _fails(capsys, *argv, match="names codec 'TQ02', but this tq-jax reads only 'TQ01'")
    assert not (tmp_path / "x.safetensors").exists()


# --------------------------------------------------------------------------- errors


def _fails(capsys, *argv, match):
    assert run(*argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    errors = [ln for ln in err if "tq-jax: error: " in ln]
    assert len(errors) == 1 and err[-1].startswith("tq-jax: error: "), err
    assert "Traceback" not in "".join(err)
    assert match in err[-1], err[-1]


@pytest.mark.parametrize("content", [b"hello notes\nmore lines\n", b"abc", b""])
def test_a_file_of_neither_kind_is_named_as_such(tmp_path, capsys, content):
    (tmp_path / "notes.txt").write_bytes(content)
    for cmd in ("inspect", "compress"):
        _fails(capsys, cmd, tmp_path / "notes.txt", *(["o.safetensors"] if cmd == "compress" else []),
               match=f"notes.txt: not a safetensors file or TQ01 blob: it starts with {content[:8]!r}")


def test_error_exits(tmp_path, infile, capsys):
    out = tmp_path / "o.safetensors"
    _fails(capsys, "compress", tmp_path / "missing.safetensors", out, match="no such file")
    (tmp_path / "junk.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{bad}")
    _fails(capsys, "compress", tmp_path / "junk.safetensors", out, match="not a valid safetensors file")
    (tmp_path / "short.safetensors").write_bytes(infile.read_bytes()[:-10])
    _fails(capsys, "compress", tmp_path / "short.safetensors", out, match="not a valid safetensors file")
    # (--all passes a dtype or last axis TQ01 cannot encode through: test_cli_rough_edges.py)
    _fails(capsys, "decompress", infile, out, match="not a tq-jax compressed file")
    _fails(capsys, "compress", infile, tmp_path / "nodir" / "o.safetensors", match="does not exist")
    _fails(capsys, "inspect", tmp_path, match="is a directory")
    (tmp_path / "bad.npy").write_bytes(b"\x93NUMPY garbage")
    _fails(capsys, "compress", tmp_path / "bad.npy", out, match="not a valid .npy")
    np.save(tmp_path / "s.npy", np.array(["a", "b"]))
    _fails(capsys, "compress", tmp_path / "s.npy", out, match="unsupported dtype")
    assert not out.exists()

    run("compress", infile, out, "-q")
    _fails(capsys, "compress", out, tmp_path / "o2.safetensors", match="already a tq-jax compressed file")
    # A corrupt blob header inside a compressed file.
    data = bytearray(out.read_bytes())
    with st.SafetensorsReader(out) as r:
        pos = r.header.data_start + r.tensors["kv"].begin
    data[pos + 5] = 99  # the bits field
    (tmp_path / "corrupt.safetensors").write_bytes(bytes(data))
    _fails(capsys, "decompress", tmp_path / "corrupt.safetensors", tmp_path / "x.safetensors",
           match="corrupt TQ01 blob")
    _fails(capsys, "inspect", tmp_path / "corrupt.safetensors", match="corrupt TQ01 blob")
    _fails(capsys, "decompress", out, tmp_path / "x.npy", match=".npy file holds exactly one tensor")
    assert capsys.readouterr().err == ""  # refused before any progress bar
    _fails(capsys, "decompress", out, tmp_path / "x.npz", match="cannot record dtype BF16")
    # Nothing half-written is left behind.
    assert not any(n.startswith(".") for n in os.listdir(tmp_path))
    assert not (tmp_path / "x.safetensors").exists() and not (tmp_path / "o2.safetensors").exists()


def test_norms_beyond_float16(tmp_path, capsys):
    """Norms float16 cannot hold: a longer (float32-norm) blob than planned, or an error line.

    Whichever the core does, the output header stays consistent with the blobs written.
    """
    x = np.full((3, HD), 1e4, np.float32)
    x[1] = 1.0
    st.save_file({"big": x, "ids": np.arange(3)}, tmp_path / "big.safetensors")
    out, back = tmp_path / "o.safetensors", tmp_path / "b.safetensors"
    rc = run("compress", tmp_path / "big.safetensors", out, "-q")
    err = capsys.readouterr().err.strip()
    if rc == 1:  # a core that refuses such norms (TQ01 v1 only)
        assert err.startswith("tq-jax: error: ") and "tensor 'big'" in err
        assert _listing(tmp_path) == ["big.safetensors"]
        return
    assert rc == 0
    comp, meta = st.load_file(out)
    blobs = json.loads(meta["tq_jax"])["tensors"]["big"]["blobs"]
    assert blobs == [comp["big"].size] and blobs[0] > tq_jax.serialized_size((3, HD), "float32", 4)
    np.testing.assert_array_equal(comp["ids"], np.arange(3))
    assert run("decompress", out, back, "-q") == 0
    got = st.load_file(back)[0]["big"]
    # (decoded norms run a little short of the input's at 4 bits: ||centroid vector|| < 1)
    assert mean_cosine(got, x) > 0.99 and np.allclose(np.linalg.norm(got, axis=1), np.linalg.norm(x, axis=1), rtol=0.05)


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["compress", "--bits", "9", "a", "b"])
    assert e.value.code == 2
    capsys.readouterr()


@pytest.mark.slow  # a fresh process; test_usage_errors_exit_2 and test_error_exits run main() in this one
def test_console_entry_point_error_has_no_traceback(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "tq_jax", "inspect", str(tmp_path / "nope.safetensors")],
        capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 1
    assert r.stderr.strip() == f"tq-jax: error: {tmp_path / 'nope.safetensors'}: no such file"


@pytest.mark.slow  # a fresh process; test_import checks that `import tq_jax` loads no torch
def test_cli_modules_import_no_optional_dependency():
    code = (
        "import sys, tq_jax._src.cli, tq_jax._src.batch, tq_jax._src.bench, tq_jax._src.distributed, tq_jax._src.safetensors_io\n"
        "print(sorted({'torch', 'matplotlib', 'tqdm', 'safetensors', 'lmcache_turbo_quant_serde'} & set(sys.modules)))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_compressed_file_reads_with_safetensors_package(tmp_path, infile):
    out = tmp_path / "c.safetensors"
    run("compress", infile, out, "-q")
    safe_open = pytest.importorskip("safetensors").safe_open
    with safe_open(str(out), framework="np") as f:
        meta = f.metadata()
        kv = f.get_tensor("kv")
        ids = f.get_tensor("ids")
    assert "tq_jax" in meta and kv.dtype == np.uint8 and tq_jax.peek_header(kv).shape == (2, 3, 16, 4, HD)
    np.testing.assert_array_equal(ids, np.arange(10))


def test_reference_decodes_compressed_entries(tmp_path, infile):
    torch = pytest.importorskip("torch")
    ref = pytest.importorskip("lmcache_turbo_quant_serde._codec")
    out = tmp_path / "c.safetensors"
    run("compress", infile, out, "-q", "--chunk-mb", 0.01)
    comp, meta = st.load_file(out)
    blobs = json.loads(meta["tq_jax"])["tensors"]["kv"]["blobs"]
    off = 0
    parts = []
    for n in blobs:
        blob = comp["kv"][off : off + n]
        t = ref.TurboQuantDeserializer().from_bytes(blob.tobytes())
        assert t.dtype == torch.bfloat16  # the original's dtype, recorded in the blob
        ours = np.asarray(tq_jax.loads(blob), np.float32)
        assert tuple(t.shape) == ours.shape
        # Same values as tq_jax's own decode of the blob, to bf16 rounding (1 ulp ~ 2**-8 relative).
        np.testing.assert_allclose(t.float().numpy(), ours, rtol=2**-7, atol=1e-3)
        parts.append(t.float().numpy().reshape(-1))
        off += n
    theirs = np.concatenate(parts).reshape(2, 3, 16, 4, HD)
    assert mean_cosine(theirs, _tensors()["kv"]) > 0.99


# --------------------------------------------------------------------------- bench


@pytest.mark.slow  # seconds of reference runs and charts; .ci/run runs the full `tq-jax bench` too
def test_bench_quick_writes_table_and_charts(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "bench"
    assert run("bench", "--quick", "--repeats", 1, "--bits", "2,4", "--out-dir", out) == 0
    text = capsys.readouterr().out
    presets = ("turbo-4", "turbo-3.5", "turbo-2.5")  # shown by default, beside the v1 widths
    for row in ("bf16 memcpy", "fp8 e4m3 cast", "tq-jax 2-bit", "tq-jax 4-bit", *(f"tq-jax {p}" for p in presets)):
        assert row in text
    assert "ratio vs bf16" in text and "attn rel err" in text and "enc MB/s" in text
    assert _listing(out) == ["bench.json", "bench.md", "size_vs_quality.png", "throughput.png"]
    for png in ("size_vs_quality.png", "throughput.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    doc = json.loads((out / "bench.json").read_text())
    res = {r["method"]: r for r in doc["results"]}
    assert res["bf16 memcpy"]["ratio"] == 1.0 and res["bf16 memcpy"]["cosine"] == pytest.approx(1.0)
    assert res["tq-jax 4-bit"]["cosine"] > 0.99 and res["tq-jax 4-bit"]["ratio"] > 3.8
    assert res["tq-jax 2-bit"]["attn_err"] > res["tq-jax 4-bit"]["attn_err"] > 0
    for p in presets:  # the preset's blob, sized independently of the bench
        assert res[f"tq-jax {p}"]["nbytes"] == tq_jax.serialized_size(doc["shape"], jnp.bfloat16, options=p)
        assert res[f"tq-jax {p}"]["cosine"] > 0.95
    assert not any(m.startswith(f"reference {p}") for m in res for p in presets)  # the reference has no presets
    try:
        import lmcache_turbo_quant_serde  # noqa: F401
    except ImportError:
        return
    # The reference's bytes are the same size and its quality the same as ours.
    assert res["reference 4-bit"]["nbytes"] == res["tq-jax 4-bit"]["nbytes"]
    assert res["reference 4-bit"]["cosine"] == pytest.approx(res["tq-jax 4-bit"]["cosine"], abs=1e-4)


def test_bench_without_matplotlib(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    out = tmp_path / "bench"
    assert run("bench", "--quick", "--repeats", 1, "--bits", "4", "--presets", "", "--no-reference",
               "--out-dir", out) == 0
    text = capsys.readouterr().out
    assert "matplotlib is not installed" in text
    assert "tq-jax 4-bit" in text and "turbo" not in text  # --presets '': the v1 width alone
    assert _listing(out) == ["bench.json", "bench.md"]


def test_bench_bad_bits(capsys):
    assert run("bench", "--bits", "4,9") == 1
    assert "--bits" in capsys.readouterr().err


def test_bench_bad_preset_names_the_presets(capsys):
    assert run("bench", "--presets", "turbo-4,turbo-9") == 1
    err = capsys.readouterr().err
    assert "--presets" in err and "'turbo-4,turbo-9'" in err and "turbo-3.5" in err


def test_bench_measure_times_every_method_and_floor_in_each_round():
    """One timing loop for both front ends: in rounds, a time per round for every encode, decode and floor."""
    x = bench.synthetic_kv(bench.QUICK_SHAPE, seed=0, outliers=0)
    floor_calls = []
    m = bench.measure(x, bench.attention_setup(x, seed=0), [bench.memcpy_method(x)], repeats=3, interleaved=True,
                      floors={"floor": lambda: floor_calls.append(1)})
    assert sorted(m.times) == [("bf16 memcpy", "decode"), ("bf16 memcpy", "encode"), ("floor", "floor")]
    assert all(len(t) == 3 for t in m.times.values()) and len(floor_calls) == 4  # a warm-up, then 3 rounds
    (r,) = m.results
    assert (r.method, r.nbytes, r.ratio, r.bits_per_value, r.cosine, r.attn_err) == (
        "bf16 memcpy", x.nbytes, 1.0, 16.0, pytest.approx(1.0), 0.0)
    assert r.peak_mb is None  # measured only when asked
