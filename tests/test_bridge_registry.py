"""Registration, option validation, size contract, launcher and plugin loader."""

from __future__ import annotations

import enum
import json
import logging
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lmcache")

from lmcache.v1.distributed.serde import SerdeConfig, create_serde_processor  # noqa: E402
from lmcache.v1.distributed.serde import factory as lmc_factory  # noqa: E402
from lmcache.v1.distributed.serde.async_processor import AsyncSerdeProcessor  # noqa: E402

import tq_jax  # noqa: E402
import tq_jax.bridge  # noqa: E402
from tq_jax.bridge import register  # noqa: E402

import numpy as np  # noqa: E402

from bridge_util import Events, build_manager, key, layout, make_obj, mean_cosine, store_evict_prefetch  # noqa: E402
from conftest import LMCACHE_WARNINGS, free_port  # noqa: E402

from tq_jax.bridge._src import dlpack  # noqa: E402
from tq_jax.bridge._src import layouts as layouts_mod  # noqa: E402
from tq_jax.bridge._src import registry as reg_mod  # noqa: E402
pytestmark = LMCACHE_WARNINGS
REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture
def fresh_registry(monkeypatch):
    """LMCache's serde registry with only the built-ins (fp8, aesgcm, turboquant)."""
    builtins = {k: v for k, v in lmc_factory._SERDE_FACTORY_REGISTRY.items() if k in ("fp8", "aesgcm", "turboquant")}
    monkeypatch.setattr(lmc_factory, "_SERDE_FACTORY_REGISTRY", builtins)
    monkeypatch.setattr(reg_mod, "_REGISTERED", {})
    return builtins


# ----------------------------------------------------------------------------- register


def test_package_reexports_the_function():
    assert tq_jax.bridge.register is reg_mod.register
    assert callable(tq_jax.bridge.register)


def test_register_is_idempotent_and_aliases_tqai(fresh_registry):
    assert register() == ("tq_jax", "tqai")
    assert register() == ("tq_jax", "tqai")
    assert fresh_registry["tq_jax"] is fresh_registry["tqai"] is reg_mod.make_serde_processor
    proc = create_serde_processor(SerdeConfig("tqai", {"head_dim": 128, "bits": 4}))
    assert isinstance(proc, AsyncSerdeProcessor)
    proc.close()


def test_alias_taken_by_the_reference_is_left_alone(fresh_registry):
    ref = pytest.importorskip("lmcache_turbo_quant_serde._register")
    monkeypatch_registered = dict(ref._REGISTERED)
    try:
        ref._REGISTERED.clear()
        ref.register()  # the reference plugin takes "tqai" first
        theirs = fresh_registry["tqai"]
        assert register() == ("tq_jax",)
        assert fresh_registry["tqai"] is theirs
    finally:
        ref._REGISTERED.clear()
        ref._REGISTERED.update(monkeypatch_registered)


def test_name_taken_by_someone_else_is_an_error(fresh_registry):
    lmc_factory.register_serde_factory("tq_jax", lambda kw: None)
    with pytest.raises(ValueError, match=r"already registered by another serde.*register\(name="):
        register()
    assert register("tq_jax_2", aliases=()) == ("tq_jax_2",)


def test_custom_name_without_aliases(fresh_registry):
    assert register("mine", aliases=()) == ("mine",)
    assert "tqai" not in fresh_registry
    with pytest.raises(ValueError, match="non-empty string"):
        register("")


class FakeContract(enum.Enum):
    UPPER_BOUND = "upper_bound"
    EXACT = "exact"


def test_size_contract_exact_when_supported(fresh_registry, monkeypatch):
    """Newer LMCache: register_serde_factory(name, factory, *, size_contract=...)."""
    calls = []

    def newer_register(name, factory, *, size_contract=FakeContract.UPPER_BOUND):
        calls.append((name, size_contract))
        fresh_registry[name] = factory

    monkeypatch.setattr(lmc_factory, "register_serde_factory", newer_register)
    assert register() == ("tq_jax", "tqai")
    assert calls == [("tq_jax", FakeContract.EXACT), ("tqai", FakeContract.EXACT)]


def test_size_contract_absent_in_0_5_6(fresh_registry, monkeypatch):
    import inspect

    assert "size_contract" not in inspect.signature(lmc_factory.register_serde_factory).parameters
    calls = []
    real = lmc_factory.register_serde_factory

    def spy(name, factory):
        calls.append(name)
        real(name, factory)

    monkeypatch.setattr(lmc_factory, "register_serde_factory", spy)
    assert register() == ("tq_jax", "tqai")
    assert calls == ["tq_jax", "tqai"]
    assert reg_mod._size_contract_kwargs(real) == {}


# ----------------------------------------------------------------------------- options


def test_no_format_option_writes_the_checksummed_default_preset():
    """A serde dict that says nothing about the format gets turbo-4: a CRC32 and the key
    binding on every value (a damaged value is refused, never loaded)."""
    for cfg in ({}, {"head_dim": 64}, {"seed": 7, "max_workers": 2, "kv_layout": "vllm-cpu"}):
        o = reg_mod.parse_options(cfg)
        assert (o.preset, o.format, o.checksum) == ("turbo-4", "v2", True), cfg
        ser, de = reg_mod.build_serde(o)
        assert ser.options == tq_jax.encode_options(bits=4, seed=o.seed, norm_dtype="float16", **tq_jax.PRESETS["turbo-4"])
        assert ser.bind_key and de.bind_key
    # The reference plugin's keys are read as before; naming bits makes them v2 with a checksum.
    ref_cfg = {"head_dim": 128, "bits": 4, "seed": 42, "use_qjl": False, "qjl_sketch_size": 64, "max_workers": 1}
    o = reg_mod.parse_options(ref_cfg)
    assert (o.head_dim, o.bits, o.seed, o.max_workers, o.preset, o.format, o.checksum) == (128, 4, 42, 1, None, "v2", True)
    opts = tq_jax.encode_options(bits=o.bits, seed=o.seed, **o.codec_options())
    assert (opts.key_bits, opts.value_bits, opts.rotation, opts.checksum) == (4, 4, "haar", True)


def test_v1_is_written_only_when_asked_for_by_name():
    v1 = tq_jax.encode_options(bits=4, norm_dtype="float16")
    for cfg in ({"format": "v1"}, {"format": "v1", "bits": 4}, {"preset": "compat-4bit"}):
        o = reg_mod.parse_options(cfg)
        assert (o.format, o.checksum) == ("v1", False), cfg
        ser, de = reg_mod.build_serde(o)
        assert ser.options == v1 and ser.options.v1_expressible and not ser.bind_key and not de.bind_key
    assert reg_mod.parse_options({"format": "v1", "bits": 3}).bits == 3
    # checksum off, explicitly, with the reference's settings: what is written is v1, and format says so
    o = reg_mod.parse_options({"bits": 4, "checksum": False})
    assert (o.format, o.checksum) == ("v1", False)


@pytest.mark.parametrize(("cfg", "said"), [
    ({"format": "v1", "checksum": True}, "checksum=True"),
    ({"format": "v1", "key_bits": 5}, "key_bits=5"),
    ({"format": "v1", "bits": 5}, "bits=5"),
    ({"format": "v1", "preset": "turbo-4"}, "preset 'turbo-4' (key_bits=5, value_bits=3"),
])
def test_v1_with_settings_it_cannot_express_is_refused(cfg, said):
    with pytest.raises(ValueError, match=re.escape(said)) as e:
        reg_mod.parse_options(cfg)
    assert "remove `format` to write version 2" in str(e.value)


def test_an_unknown_format_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"`format` must be one of \('v1', 'v2'\), got 'tq01'"):
        reg_mod.make_serde_processor({"format": "tq01"})


def test_unknown_key_lists_valid_ones():
    with pytest.raises(ValueError) as e:
        reg_mod.parse_options({"bitz": 4, "head_dims": 128})
    msg = str(e.value)
    assert "'bitz', 'head_dims'" in msg
    for name in ("head_dim", "bits", "seed", "max_workers", "device"):
        assert name in msg
    assert "TQ01 version 2 options: key_bits" in msg


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        ({"bits": "4"}, TypeError, r"`bits` must be an int, got str"),
        ({"bits": True}, TypeError, r"`bits` must be an int, got bool"),
        ({"bits": 9}, ValueError, r"must be in 1\.\.8"),
        ({"key_bits": 0}, ValueError, r"must be in 1\.\.8"),
        ({"rotation": "dct"}, ValueError, r"one of \('haar', 'hadamard'\)"),
        ({"norm_dtype": "auto"}, ValueError, r"exactly its estimated size"),
        ({"checksum": 1}, TypeError, r"must be a bool"),
        ({"skip_first_layers": -1}, ValueError, r"must be in 0\.\."),
        ({"preset": "fast"}, ValueError, r"must be one of"),
        ({"head_dim": 128.0}, TypeError, r"`head_dim` must be an int, got float"),
        ({"head_dim": 1}, ValueError, r"`head_dim` must be in 2\.\."),
        ({"seed": 2**31}, ValueError, r"`seed` must be in"),
        ({"max_workers": 0}, ValueError, r"`max_workers` must be in 1\.\."),
        ({"max_workers": "4"}, TypeError, "must be an int"),
        ({"device": 0}, TypeError, r"`device` must be a string"),
        ({"device": "cuda"}, ValueError, "must be one of"),
        ({"use_qjl": 1}, TypeError, "must be a bool"),
        ({"use_qjl": True}, ValueError, "does not write them"),
    ],
)
def test_bad_values(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        reg_mod.parse_options(kwargs)
    with pytest.raises(exc, match=match):  # the factory LMCache calls validates the same way
        reg_mod.make_serde_processor(kwargs)


def test_v2_options_and_presets():
    o = reg_mod.parse_options({"preset": "k4v3-edges", "value_bits": 2, "checksum": False})
    assert (o.key_bits, o.value_bits, o.skip_first_layers, o.rotation, o.checksum) == (4, 2, 2, "hadamard", False)
    opts = tq_jax.encode_options(bits=o.bits, seed=o.seed, **o.codec_options())
    assert not opts.v1_expressible and opts.value_bits == 2
    assert not tq_jax.encode_options(bits=4, **reg_mod.parse_options({}).codec_options()).v1_expressible
    assert tq_jax.encode_options(bits=4, **reg_mod.parse_options({"format": "v1"}).codec_options()).v1_expressible


def test_option_table_shape():
    names = [o.name for o in reg_mod.OPTIONS]
    assert len(names) == len(set(names))
    assert {f.name for f in reg_mod.dataclasses.fields(reg_mod.SerdeOptions)} == {o.name for o in reg_mod.OPTIONS}
    for o in reg_mod.OPTIONS:
        if o.version <= reg_mod.WIRE_VERSION:
            assert o.check(o.name, o.default) == o.default  # defaults pass their own check


def test_factory_builds_with_max_workers():
    register()
    proc = create_serde_processor(SerdeConfig("tq_jax", {"max_workers": 3, "bits": 2, "device": "auto"}))
    try:
        assert proc._pool._max_workers == 3
        assert proc._serializer.bits == 2
    finally:
        proc.close()


# ----------------------------------------------------------------------------- creation log


def _created_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "tq_jax.bridge._src.registry" and r.levelno == logging.INFO and "serde created" in r.getMessage()]


def test_each_creation_logs_one_info_line(caplog):
    register()
    caplog.set_level(logging.INFO, logger="tq_jax.bridge._src.registry")
    for n in (1, 2):
        proc = create_serde_processor(SerdeConfig("tq_jax", {"bits": 3, "head_dim": 64, "format": "v1"}))
        proc.close()
        lines = _created_lines(caplog)
        assert len(lines) == n
    line = lines[-1]
    assert line.startswith("tq_jax serde created: TQJaxSerializer/TQJaxDeserializer writing TQ01 v1 ")
    assert "detects damaged values: NO (no checksum" in line
    assert "registered as 'tq_jax', 'tqai'" in line
    for field in ("head_dim=64", "key_bits=3", "value_bits=3", "seed=42", "rotation=haar",
                  "norm_dtype=float16", "checksum=False", "max_workers=1", "device=cpu:0"):
        assert f" {field}" in line, field


def test_creation_line_shows_effective_v2_options(caplog):
    register()
    caplog.set_level(logging.INFO, logger="tq_jax.bridge._src.registry")
    proc = create_serde_processor(SerdeConfig("tqai", {"preset": "k4v3-edges", "value_bits": 2}))
    proc.close()
    (line,) = _created_lines(caplog)
    assert "writing TQ01 v2 (tq_jax reads it, the reference plugin cannot)" in line
    # The preset expanded, the explicit key over it.
    for field in ("key_bits=4", "value_bits=2", "skip_first_layers=2", "skip_last_layers=2", "rotation=hadamard",
                  "norm_dtype=float32", "norm_correction=True", "checksum=True", "preset=k4v3-edges"):
        assert f" {field}" in line, field


def test_refused_options_log_no_creation_line(caplog):
    caplog.set_level(logging.INFO, logger="tq_jax.bridge._src.registry")
    with pytest.raises(ValueError):
        reg_mod.make_serde_processor({"bits": 9})
    assert _created_lines(caplog) == []


# ----------------------------------------------------------------------------- plugin loader


SMALL = (2, 4, 64, 512)


def test_plugin_adapter_loads_the_serde_from_config_alone(tmp_path, fresh_registry):
    """Only the config mentions tq_jax: LMCache's plugin adapter imports our module,
    which registers the serde before LMCache builds it."""
    sys.modules.pop("tq_jax.bridge.plugin", None)
    assert "tq_jax" not in fresh_registry
    adapter = {
        "type": "plugin",
        "module_path": "tq_jax.bridge.plugin",
        "class_name": "L2Adapter",
        "adapter_params": {"type": "fs", "base_path": str(tmp_path)},
        "serde": {"type": "tq_jax", "format": "v1"},
    }
    events = Events()
    sm = build_manager(adapter, l1_gb=0.1)
    g = torch.Generator().manual_seed(1)
    data = [torch.randn(SMALL, generator=g).to(torch.bfloat16) for _ in range(2)]
    try:
        assert "tq_jax" in fresh_registry
        ok, failed, hits, l2_hits, got = store_evict_prefetch(sm, events, [key(i, "plugin") for i in range(2)], data, SMALL)
    finally:
        sm.close()
        events.stop()
    assert (ok, failed, hits, l2_hits) == (2, 0, 2, 2)
    size = tq_jax.serialized_size((2, 4, 64, 4, 128), "bfloat16", 4)
    assert {f.stat().st_size for f in tmp_path.rglob("*.data")} == {size}
    for x, y in zip(data, got):
        assert mean_cosine(x, y, 128) >= 0.994


def test_plugin_refuses_misplaced_serde(tmp_path):
    from tq_jax.bridge import plugin

    with pytest.raises(ValueError, match="move 'serde' from adapter_params to the outer"):
        plugin.build_inner_adapter({"type": "fs", "base_path": str(tmp_path), "serde": {"type": "tq_jax"}})
    with pytest.raises(ValueError, match="string 'type'"):
        plugin.build_inner_adapter({"base_path": str(tmp_path)})
    with pytest.raises(ValueError, match="cannot itself be a plugin"):
        plugin.build_inner_adapter({"type": "plugin"})


# ----------------------------------------------------------------------------- launcher


def _env():
    env = dict(os.environ, PYTHONWARNINGS="ignore", LMCACHE_LOG_LEVEL="INFO")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


@pytest.mark.slow
def test_launcher_runs_a_module_after_registering(tmp_path):
    (tmp_path / "probe_mod.py").write_text(
        "import sys\n"
        "from lmcache.v1.distributed.serde import get_registered_serde_types\n"
        "print('ARGS', sys.argv[1:], 'TYPES', sorted(get_registered_serde_types()))\n"
    )
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join((str(tmp_path), env["PYTHONPATH"]))
    out = subprocess.run(
        [sys.executable, "-m", "tq_jax.bridge.launch", "-m", "probe_mod", "--x", "1"],
        env=env, capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    assert "ARGS ['--x', '1'] TYPES ['aesgcm', 'fp8', 'tq_jax', 'tqai', 'turboquant']" in out


@pytest.mark.slow
def test_launcher_starts_lmcache_server_with_tq_jax_serde(tmp_path):
    """`python -m tq_jax.bridge.launch server ...` gets past building the StorageManager
    (plain `lmcache server` fails there with "Unknown serde type 'tq_jax'")."""
    adapter = {"type": "fs", "base_path": str(tmp_path), "serde": {"type": "tq_jax", "bits": 4}}
    cmd = [
        sys.executable, "-m", "tq_jax.bridge.launch", "server",
        "--l1-size-gb", "0.05", "--eviction-policy", "LRU",
        "--l2-adapter", json.dumps(adapter),
        "--port", str(free_port()), "--http-port", str(free_port()),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "Application startup complete" in line or "startup failed" in line:
                break
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    log = "".join(lines)
    assert "Unknown serde type" not in log
    assert "Application startup complete" in log, log[-3000:]
    assert log.count("tq_jax INFO: tq_jax serde created: ") == 1, log[-3000:]  # the operator sees it


def _quiet_env():
    env = _env()
    for name in ("LMCACHE_LOG_LEVEL", "LMCACHE_DISABLE_BANNER"):
        env.pop(name, None)
    return env


def test_launcher_help_is_plain_and_loads_neither_torch_nor_lmcache():
    r = subprocess.run([sys.executable, "-m", "tq_jax.bridge.launch", "--help"], env=_quiet_env(),
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: python -m tq_jax.bridge.launch [-v]")
    assert "INFO:" not in r.stdout + r.stderr and "\x1b" not in r.stdout + r.stderr  # no log lines, no colour
    probe = (
        "import runpy, sys; sys.argv = ['launch', '--help']; "
        "runpy.run_module('tq_jax.bridge.launch', run_name='__main__'); "
        "print('LOADED', sorted(m for m in ('torch', 'lmcache') if m in sys.modules))"
    )
    r = subprocess.run([sys.executable, "-c", probe], env=_quiet_env(), capture_output=True, text=True, timeout=120)
    assert "LOADED []" in r.stdout, r.stdout + r.stderr
    r = subprocess.run([sys.executable, "-m", "tq_jax.bridge.launch"], env=_quiet_env(),
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 2 and r.stderr.startswith("usage: python -m tq_jax.bridge.launch")


@pytest.mark.slow
def test_lmcache_help_through_the_launcher_is_quiet():
    r = subprocess.run([sys.executable, "-m", "tq_jax.bridge.launch", "server", "--help"], env=_quiet_env(),
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "usage: lmcache server" in r.stdout
    both = r.stdout + r.stderr
    for noise in ("LMCache INFO", "\x1b[", "FutureWarning", "Set LMCACHE_DISABLE_BANNER"):
        assert noise not in both, noise


def test_quiet_lmcache_levels(monkeypatch):
    """Loggers LMCache creates inside log WARNING+, INFO again after (a server's log is
    untouched); -v or an explicit LMCACHE_LOG_LEVEL leaves them alone; restore=False
    (help) keeps them quiet."""
    from lmcache.logging import init_logger

    from tq_jax.bridge._src import logs

    for name in ("LMCACHE_LOG_LEVEL", "LMCACHE_DISABLE_BANNER"):
        monkeypatch.setenv(name, "x")  # recorded, so monkeypatch restores the real state
        monkeypatch.delenv(name)
    with logs.quiet_lmcache():
        lg = init_logger("lmcache.tq_jax_test.quiet")
        assert lg.level == logging.WARNING and {h.level for h in lg.handlers} == {logging.WARNING}
        assert os.environ["LMCACHE_DISABLE_BANNER"] == "1"
    assert lg.level == logging.INFO and {h.level for h in lg.handlers} == {logging.INFO}
    assert "LMCACHE_LOG_LEVEL" not in os.environ and "LMCACHE_DISABLE_BANNER" not in os.environ
    with logs.quiet_lmcache(verbose=True):
        assert init_logger("lmcache.tq_jax_test.verbose").level == logging.INFO
    monkeypatch.setenv("LMCACHE_LOG_LEVEL", "DEBUG")
    with logs.quiet_lmcache():
        assert init_logger("lmcache.tq_jax_test.user").level == logging.DEBUG
    monkeypatch.delenv("LMCACHE_LOG_LEVEL")
    with logs.quiet_lmcache(restore=False):
        lg = init_logger("lmcache.tq_jax_test.help")
    assert lg.level == logging.WARNING and os.environ["LMCACHE_DISABLE_BANNER"] == "1"


# ----------------------------------------------------------------------------- the host's layout


CPU_CHUNK = (2, 256, 384)  # [L, T, H*2*D]: 2 layers of SmolLM2's CPU chunk


def obj_of(t: torch.Tensor):
    o = make_obj([tuple(t.shape)], [t.dtype])
    o.tensor.copy_(t)
    return o


@pytest.mark.parametrize(("cfg", "cuda", "want"), [
    ({}, False, "vllm-cpu"),  # no CUDA: vLLM's CPU worker fills [L, T, H*2*D] chunks
    ({}, True, "fused"),  # CUDA: its GPU backends do
    ({"kv_layout": "fused"}, False, "fused"),  # explicit settings win
    ({"kv_layout": "vllm-cpu", "block_size": 64}, True, "vllm-cpu"),
])
def test_auto_layout_follows_the_host(cfg, cuda, want):
    """``auto`` stores a paired chunk in the K/V order of the layout the host's vLLM
    fills (checked against the layout's own form) and restores it exactly."""
    ser, de = reg_mod.build_serde(reg_mod.parse_options({"head_dim": 64, **cfg}), cuda=cuda)
    (plan,) = ser.plan(layout([CPU_CHUNK], [torch.bfloat16]))
    assert plan.form.layout == want
    expect = layouts_mod.form(CPU_CHUNK, 64, want, cfg.get("block_size", 128))
    assert plan.stored == expect.kv
    src = torch.randn(CPU_CHUNK, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    value = np.empty(ser.estimate_serialized_size(layout([CPU_CHUNK], [torch.bfloat16])), np.uint8)
    ser.encode_into(obj_of(src), value, key(0, "host"))
    out = obj_of(torch.zeros(CPU_CHUNK, dtype=torch.bfloat16))
    de.decode_from(value, out, key(0, "host"))
    # decoded through the right grouping, every key vector of the chunk is close to its original
    got = layouts_mod.to_stored(dlpack.numpy_view(out.tensor).astype(np.float32), expect, True)
    ref = layouts_mod.to_stored(dlpack.numpy_view(src).astype(np.float32), expect, True)
    cos = (got * ref).sum(-1) / (np.linalg.norm(got, axis=-1) * np.linalg.norm(ref, axis=-1))
    assert cos[0].mean() > 0.995 and cos[1].mean() > 0.97  # 5-bit keys, 3-bit values


def test_creation_line_says_how_auto_reads_the_chunks(caplog):
    register()
    caplog.set_level(logging.INFO, logger="tq_jax.bridge._src.registry")
    proc = reg_mod.make_serde_processor({"head_dim": 64, "warmup": False})
    proc.close()
    (line,) = _created_lines(caplog)
    cuda = torch.cuda.is_available()
    want = "fused: CUDA on this host" if cuda else "vllm-cpu: no CUDA on this host, so vLLM runs its CPU backend"
    assert f"kv_layout=auto ([L, T, H*2*D] chunks read as {want}" in line
    assert "writing TQ01 v2" in line and "detects damaged values: yes (CRC32 and key binding)" in line
    assert (" block_size=128" in line) is not cuda


# ----------------------------------------------------------------------------- warm-up


WARM_CHILD = r"""
import json, sys
import numpy as np, torch
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
import tq_jax._src.blob
from tq_jax.bridge._src import registry
sys.path.insert(0, "tests")
from bridge_util import byte_obj, make_obj
cfg, shape, store = json.loads(sys.argv[1]), tuple(json.loads(sys.argv[2])), sys.argv[3] == "store"
registry.register()
proc = registry.make_serde_processor(cfg)
ser, de = proc._serializer, proc._deserializer
before = tq_jax._src.blob.compiled_programs()
lay = MemoryLayoutDesc(shapes=[torch.Size(shape)], dtypes=[torch.bfloat16])
k = ObjectKey(chunk_hash=b"w".ljust(32, b"\0"), model_name="m", kv_rank=0)
src = make_obj([shape], [torch.bfloat16])
src.tensor.copy_(torch.randn(shape).to(torch.bfloat16))
value = byte_obj(ser.estimate_serialized_size(lay))
ser.serialize(src, value, k)
de.deserialize(value, make_obj([shape], [torch.bfloat16]), k)
print(json.dumps({"compiled_at_first_use": tq_jax._src.blob.compiled_programs() - before}))
proc.close()
"""


def _first_use(tmp_path, cfg: dict, shape) -> int:
    """Programs compiled by a fresh process's first store and load of a ``shape`` chunk,
    after the serde was built (its warm-up done), with ``tmp_path`` as its cache dir."""
    env = {**os.environ, "TQ_JAX_CACHE_DIR": str(tmp_path), "JAX_PLATFORMS": "cpu", "LMCACHE_LOG_LEVEL": "ERROR"}
    r = subprocess.run([sys.executable, "-c", WARM_CHILD, json.dumps(cfg), json.dumps(list(shape)), "store"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])["compiled_at_first_use"]


@pytest.mark.slow
def test_a_started_serde_compiles_nothing_at_its_first_hit(tmp_path):
    """Full blocks are warm from the first start; a chunk shape with a short last block
    (SmolLM2's chunk, 6 of its 30 layers) compiles at its first use once, and is warm
    at every later start (remembered under TQ_JAX_CACHE_DIR); without the warm-up
    everything compiles at first use."""
    cfg = {"head_dim": 64, "kv_layout": "vllm-cpu", "format": "v1"}  # one segment of 2*L*T*H vectors
    full = (4, 1024, 384)  # 24,576 vectors: 3 full blocks of 8,192
    short = (6, 256, 384)  # 9,216 vectors: a full block and a last block of 1,024
    assert _first_use(tmp_path / "a", cfg, full) == 0
    assert _first_use(tmp_path / "b", cfg, short) > 0  # a new replica: its last block compiles once
    assert json.loads(next((tmp_path / "b").glob("lmcache-chunks-*.json")).read_text()) == [[list(short), "bfloat16"]]
    assert _first_use(tmp_path / "b", cfg, short) == 0  # restarted: remembered and warmed
    assert _first_use(tmp_path / "c", {**cfg, "warmup": False}, full) > 0


def test_chunk_shapes_are_remembered_per_setting(tmp_path, caplog):
    from tq_jax.bridge._src.warmup import MAX_SHAPES, ChunkShapes

    a = ChunkShapes("setting a", tmp_path)
    for t in range(MAX_SHAPES + 2):
        a.add([torch.Size((30, 256 * (t + 1), 384))], [torch.bfloat16])
        a.add([torch.Size((30, 256 * (t + 1), 384))], [torch.bfloat16])  # seen again: not added twice
    a.add([torch.Size((2, 2)), torch.Size((2, 2))], [torch.bfloat16] * 2)  # multi-group layouts are not warmed
    again = ChunkShapes("setting a", tmp_path).shapes
    assert again == a.shapes and len(again) == MAX_SHAPES
    assert again[0] == ((30, 256 * 3, 384), "bfloat16") and again[-1] == ((30, 256 * (MAX_SHAPES + 2), 384), "bfloat16")
    assert ChunkShapes("setting b", tmp_path).shapes == []
    a.path.write_text("not json")
    caplog.set_level(logging.WARNING, logger="tq_jax.bridge._src.warmup")
    assert ChunkShapes("setting a", tmp_path).shapes == []
    assert "ignoring the remembered chunk shapes" in caplog.text
    blocked = tmp_path / "file"
    blocked.write_text("")
    c = ChunkShapes("setting c", blocked)  # a file where the directory should be
    c.add([torch.Size((1, 256, 128))], [torch.bfloat16])
    c.add([torch.Size((2, 256, 128))], [torch.bfloat16])
    assert c.shapes == [((1, 256, 128), "bfloat16"), ((2, 256, 128), "bfloat16")]  # kept in memory
    assert caplog.text.count("cannot remember chunk shapes") == 1  # said once


def test_remembered_shapes_the_layout_refuses_are_skipped_and_forgotten(tmp_path, caplog):
    """The warm-up plans each remembered shape first: one that does not fit this serde's
    layout (e.g. written by hand, or by a serde before a layout change) is skipped and
    dropped from the file; the rest are warmed; a shape the serde plans is remembered
    only when it fits."""
    cfg = {"head_dim": 64, "kv_layout": "vllm-cpu", "format": "v1"}
    ser, de = reg_mod.build_serde(reg_mod.parse_options(cfg))
    reg_mod.warm(ser, de, tmp_path)
    assert not list(tmp_path.glob("*.json"))  # nothing planned yet but the synthetic chunk
    ser.plan(layout([(2, 256, 384)], [torch.bfloat16]))
    with pytest.raises(ValueError):
        ser.plan(layout([(2, 100, 384)], [torch.bfloat16]))  # not whole vLLM blocks: refused, not remembered
    (path,) = tmp_path.glob("lmcache-chunks-*.json")  # the setting's file
    assert json.loads(path.read_text()) == [[[2, 256, 384], "bfloat16"]]
    path.write_text(json.dumps([[[2, 2, 256, 128], "bfloat16"], [[2, 256, 384], "bfloat16"]]))  # a split chunk: no fit
    caplog.set_level(logging.INFO, logger="tq_jax.bridge._src.registry")
    ser2, de2 = reg_mod.build_serde(reg_mod.parse_options(cfg))
    reg_mod.warm(ser2, de2, tmp_path)
    assert "warm-up failed" not in caplog.text
    assert "the chunk shapes planned before ([2, 256, 384] bfloat16)" in caplog.text
    assert json.loads(path.read_text()) == [[[2, 256, 384], "bfloat16"]]
