"""First-hour rough edges of the tq-jax command: file modes, --all pass-through,
raw-layer presets that cover a whole tensor, third-party log noise, small messages."""

import io
import json
import logging
import os
import stat
from importlib import metadata

import jax.numpy as jnp
import numpy as np
import pytest

import tq_jax
from tq_jax._src import bench
from tq_jax._src import cli
from tq_jax._src import safetensors_io as st

from conftest import mean_cosine

HD = 128


def run(*argv):
    return cli.main([str(a) for a in argv])




def _kv(layers=3):
    rng = np.random.default_rng(3)
    return rng.standard_normal((2, layers, 8, 2, HD), dtype=np.float32).astype(jnp.bfloat16)


@pytest.fixture
def umask():
    """Set the process umask for one test; restore it after."""
    saved = os.umask(0o022)
    os.umask(saved)
    yield lambda m: os.umask(m)
    os.umask(saved)


# --------------------------------------------------------------------------- file modes


@pytest.mark.parametrize("mask", [0o022, 0o027, 0o002], ids=oct)
def test_outputs_get_the_mode_umask_allows(tmp_path, umask, mask):
    """Like `cp`: 0o666 less the umask, not the 0o600 of a mkstemp file."""
    src = tmp_path / "in.safetensors"
    st.save_file({"x": np.ones((4, HD), np.float32), "ids": np.arange(3)}, src)
    umask(mask)
    outs = [tmp_path / "c.safetensors", tmp_path / "b.safetensors", tmp_path / "b.npz"]
    assert run("compress", src, outs[0], "-q") == 0
    assert run("decompress", outs[0], outs[1], "-q") == 0
    assert run("decompress", outs[0], outs[2], "-q") == 0
    st.save_file({"x": np.ones((2, HD), np.float32)}, tmp_path / "one.safetensors")
    assert run("compress", tmp_path / "one.safetensors", tmp_path / "one.c.safetensors", "-q") == 0
    assert run("decompress", tmp_path / "one.c.safetensors", tmp_path / "one.npy", "-q") == 0
    outs += [tmp_path / "one.c.safetensors", tmp_path / "one.npy"]
    for p in outs:
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o666 & ~mask, (p, oct(os.stat(p).st_mode))
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]


def test_atomic_file_appears_only_on_commit(tmp_path, umask):
    umask(0o077)
    dest = tmp_path / "f.bin"
    a = st.AtomicFile(dest)
    a.file.write(b"abc")
    assert not dest.exists() and os.path.exists(a.tmp_path)
    assert os.path.dirname(a.tmp_path) == str(tmp_path)  # same filesystem: rename is atomic
    a.commit()
    assert dest.read_bytes() == b"abc" and stat.S_IMODE(os.stat(dest).st_mode) == 0o600
    b = st.AtomicFile(dest)
    b.file.write(b"partial")
    b.abort()
    assert dest.read_bytes() == b"abc" and os.listdir(tmp_path) == ["f.bin"]


# --------------------------------------------------------------------------- --all


def test_all_passes_through_what_tq01_cannot_encode(tmp_path, capsys):
    kv = _kv()
    scale = np.linspace(0.5, 2.0, 10, dtype=np.float32)
    src = tmp_path / "in.safetensors"
    st.save_file({"kv": kv, "scale": scale, "f64": np.ones((2, HD)), "s": np.float32(3.0).reshape(())}, src)
    out, back = tmp_path / "c.safetensors", tmp_path / "b.safetensors"
    assert run("compress", src, out, "--all") == 0
    text = capsys.readouterr().out
    assert "1 TQ01 tensor(s), 3 passed through" in text
    assert "passed through unchanged (last axis not a multiple of --head-dim 128): 'scale'" in text
    assert "passed through unchanged (dtype F64; TQ01 encodes only BF16, F16, F32): 'f64'" in text
    assert "(a scalar; TQ01 encodes vectors of head_dim values): 's'" in text
    assert sorted(json.loads(st.load_file(out)[1]["tq_jax"])["tensors"]) == ["kv"]
    assert run("decompress", out, back, "-q") == 0
    got = st.load_file(back)[0]
    assert got["scale"].tobytes() == scale.tobytes() and got["scale"].dtype == np.float32
    assert got["f64"].tobytes() == np.ones((2, HD)).tobytes()
    assert got["kv"].shape == kv.shape and mean_cosine(got["kv"], kv) > 0.99


def test_without_all_a_head_dim_tensor_of_another_dtype_is_still_an_error(tmp_path, capsys):
    st.save_file({"f64": np.ones((2, HD))}, tmp_path / "in.safetensors")
    assert run("compress", tmp_path / "in.safetensors", tmp_path / "o.safetensors") == 1
    err = capsys.readouterr().err
    assert "tensor 'f64' has dtype F64" in err and "--exclude 'f64'" in err
    assert os.listdir(tmp_path) == ["in.safetensors"]


def test_all_summary_names_at_most_eight_tensors_per_reason(tmp_path, capsys):
    st.save_file({f"n{i}": np.ones(5, np.float16) for i in range(11)}, tmp_path / "in.safetensors")
    assert run("compress", tmp_path / "in.safetensors", tmp_path / "o.safetensors", "--all") == 0
    cap = capsys.readouterr()
    line = next(ln for ln in cap.out.splitlines() if "passed through unchanged" in ln)
    assert line.endswith("'n7' and 3 more")
    assert "no tensor of" in cap.err  # nothing compressed: the existing note still says so


# --------------------------------------------------------------------------- raw layers


def test_preset_whose_raw_layers_cover_the_tensor_is_refused(tmp_path, capsys):
    src, out = tmp_path / "in.safetensors", tmp_path / "o.safetensors"
    st.save_file({"kv": _kv(layers=4)}, src)
    assert run("compress", src, out, "--preset", "k4v3-edges") == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("tq-jax: error: ") and len(err.splitlines()) == 1 and "Traceback" not in err
    for part in ("--preset k4v3-edges", "first 2 and last 2 layers raw", "all 4 layers",
                 "larger than the input", "--skip-first-layers 0 --skip-last-layers 0", "--exclude 'kv'"):
        assert part in err, part
    assert os.listdir(tmp_path) == ["in.safetensors"]
    # Flags win over the preset: one raw layer at each end leaves two coded: smaller.
    assert run("compress", src, out, "--preset", "k4v3-edges", "--skip-first-layers", 1,
               "--skip-last-layers", 1, "-q") == 0
    assert os.path.getsize(out) < 0.75 * os.path.getsize(src)  # half raw, half ~4 bits
    # The same counts given as flags: refused too, the message naming the flags.
    assert run("compress", src, out, "--skip-first-layers", 3, "--skip-last-layers", 1) == 1
    err = capsys.readouterr().err
    assert "--skip-first-layers 3 --skip-last-layers 1 keep the first 3" in err and "--preset" not in err


def test_preset_on_a_tensor_with_a_layer_left_to_code(tmp_path):
    src, out = tmp_path / "in.safetensors", tmp_path / "o.safetensors"
    st.save_file({"kv": _kv(layers=5)}, src)
    assert run("compress", src, out, "--preset", "k4v3-edges", "-q") == 0
    assert os.path.getsize(out) < os.path.getsize(src)


# --------------------------------------------------------------------------- logging


def _lmcache_style_logger(stream):
    """A logger set up as lmcache.logging.init_logger does: own handler and level, no propagation."""
    log = logging.getLogger("lmcache.v1.platform._device_detect_test")
    log.handlers.clear()
    log.propagate = False
    h = logging.StreamHandler(stream)
    h.setLevel(logging.INFO)
    log.addHandler(h)
    log.setLevel(logging.INFO)
    return log


def test_quiet_third_party_logs_hides_info_but_not_warnings():
    buf = io.StringIO()
    log = _lmcache_style_logger(buf)
    with cli.quiet_third_party_logs():
        log.info("torch_dev=StubCPUDevice")
        logging.getLogger("jax._src.xla_bridge").info("jax info")
        late = _lmcache_style_logger(buf)  # loggers created inside the block are covered too
        late.info("late info")
        log.warning("a real warning")
    assert buf.getvalue() == "a real warning\n"
    log.info("after")  # restored on leaving
    with cli.quiet_third_party_logs(verbose=True):
        log.info("verbose")
    assert buf.getvalue().endswith("after\nverbose\n")


@pytest.mark.parametrize("flags, shown", [((), False), (("-v",), True), (("--verbose",), True)])
def test_bench_command_silences_lmcache_info_unless_verbose(tmp_path, monkeypatch, flags, shown):
    buf = io.StringIO()
    log = _lmcache_style_logger(buf)

    def fake_run_bench(**kw):  # what importing the reference does inside the real one
        log.info("LMCache INFO: torch_dev=StubCPUDevice")
        return {}

    monkeypatch.setattr(bench, "run_bench", fake_run_bench)
    assert run("bench", "--quick", "--out-dir", tmp_path, *flags) == 0
    assert ("torch_dev" in buf.getvalue()) == shown


# --------------------------------------------------------------------------- small


def test_bits_error_names_the_argument_given():
    x = np.ones((2, HD), np.float32)
    with pytest.raises(ValueError, match=r"^`bits` must be an int in 1..8, got 0: "):
        tq_jax.dumps(x, bits=0)
    with pytest.raises(ValueError, match=r"^`bits` must be an int in 1..8, got 9"):
        tq_jax.serialized_size((2, HD), "float32", 9)
    with pytest.raises(ValueError, match=r"^`value_bits` must be"):
        tq_jax.dumps(x, bits=4, value_bits=0)
    assert tq_jax.encode_options(bits=3) == tq_jax.Options(3, 3)


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"tq-jax {metadata.version('tq-jax')}\n"


def test_decompress_help_describes_decompress(capsys):
    with pytest.raises(SystemExit):
        cli.main(["decompress", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "compress writes one blob per piece" not in text
    assert "decoded blob by blob" in text
    with pytest.raises(SystemExit):
        cli.main(["compress", "--help"])
    assert "one blob per piece" in " ".join(capsys.readouterr().out.split())


def test_bench_charts_say_which_way_is_better_and_label_fp8_and_presets():
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    def res(codec, setting, bits, nbytes, cos):  # a 512-value workload: 1024 bytes of bf16
        return bench.Result(codec, setting, bits, nbytes, 8 * nbytes / 512, 1024 / nbytes, cos, 1 - cos,
                            1.0, 1.0, 10.0, 20.0, 0.0, 0.0)

    results = [res("bf16 memcpy", "", 16, 1024, 1.0), res("fp8 e4m3 cast", "", 8, 520, 0.9997),
               res("tq-jax", "4-bit", 4, 270, 0.995), res("tq-jax", "turbo-3.5", 3.5, 230, 0.99),
               res("reference", "4-bit", 4, 270, 0.995)]
    figs = bench.figures(results, "test")
    try:
        quality, speed = figs["size_vs_quality.png"], figs["throughput.png"]
        for ax in quality.axes:
            assert "lower is better" in ax.get_ylabel()
            labels = {t.get_text() for t in ax.texts}
            assert {"fp8", "4b", "turbo-3.5"} <= labels, labels
            assert "tq-jax presets" in {t.get_text() for t in ax.get_legend().get_texts()}
        assert "higher is better" in speed.axes[0].get_xlabel()
    finally:
        for f in figs.values():
            plt.close(f)


def test_turbo_preset_and_norm_bits_flag_reach_the_blobs(tmp_path, capsys):
    """`--preset turbo-3.5` / `turbo-4` / `turbo-4t` write the preset's blobs (same bytes as
    tq_jax.dumps with it); `--norm-bits` overrides the preset's norm codes; inspect
    names them."""
    import tq_jax

    x = np.random.default_rng(4).standard_normal((2, 3, 16, 2, 64)).astype(np.float32)
    src = tmp_path / "kv.safetensors"
    st.save_file({"kv": x}, src)
    for preset, extra, norm_bits, bits in (("turbo-3.5", (), 6, (4, 3)), ("turbo-3.5", ("--norm-bits", "4"), 4, (4, 3)),
                                           ("turbo-4", (), 6, (5, 3)), ("turbo-4t", (), 6, (5, 3))):
        out = tmp_path / f"{preset}-{norm_bits}.safetensors"
        assert cli.main(["compress", str(src), str(out), "--head-dim", "64", "--preset", preset, *extra, "-q"]) == 0
        blob = st.load_file(out)[0]["kv"].tobytes()
        h = tq_jax.peek_header(blob)
        assert (h.bits, h.value_bits, h.norm_bits, h.rotation) == (*bits, norm_bits, "hadamard")
        want = dict(tq_jax.PRESETS[preset], norm_bits=norm_bits)
        assert blob == tq_jax.dumps(x, **want)
    capsys.readouterr()
    assert cli.main(["inspect", str(tmp_path / "turbo-3.5-6.safetensors")]) == 0  # in process: the entry point is tested apart
    assert "6-bit log norms" in capsys.readouterr().out
    assert cli.main(["inspect", str(tmp_path / "turbo-4t-6.safetensors")]) == 0
    assert "trellis, 6-bit log norms" in capsys.readouterr().out


def test_cli_and_batch_errors_end_with_one_line_and_status_1(tmp_path, capsys):
    """cli's own CliError (flags) and batch's BatchError (files) are reported the same way."""
    from tq_jax._src import batch

    assert not issubclass(cli.CliError, batch.BatchError) and not issubclass(batch.BatchError, cli.CliError)
    x = tmp_path / "x.npy"
    np.save(x, np.ones((2, HD), np.float32))
    cases = [
        (("compress", x, tmp_path / "o.safetensors", "--chunk-mb", "0"), "--chunk-mb must be positive"),  # CliError
        (("compress", x, tmp_path / "o.safetensors", "--norm-bits", "4", "--norm-dtype", "float32"),
         "invalid codec options: `norm_bits` and norm_dtype='float32'"),  # CliError from Options
        (("inspect", tmp_path / "missing.safetensors"), "no such file"),  # BatchError
    ]
    for argv, want in cases:
        assert run(*argv) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("tq-jax: error: ") and want in err, err
