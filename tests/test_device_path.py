"""The device-resident path: a jax.Array is encoded where it lives, loads(device=) decodes there.

The independent expectation for every blob is the numpy (host) path's bytes, which
tests/test_interop.py pins against the reference plugin. CPU devices take the host
pipeline in normal use (their memory is host memory); the calls' ``executor=`` of the
device path (the ``resident`` fixture's) runs the accelerator path on them.
"""

import itertools
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tq_jax
from tq_jax._src import blob
from tq_jax._src import blocks as blocks_mod
from tq_jax._src import program as program_mod
from tq_jax._src import resident as resident_mod

from conftest import sweep
from device_path_helpers import options_from, random_input

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CASES = sweep(
    [
        # (shape, dtype, options kwargs, block_vectors): small blocks give many blocks + a padded tail
        ((2, 4, 37, 3, 64), "bfloat16", dict(bits=4), 64),  # v1, Haar, planar rows
        ((2, 4, 37, 3, 64), "bfloat16", dict(preset="turbo-3.5"), 64),  # v2: groups, nc, norm codes, CRC
        ((5, 7, 36), "float32", dict(bits=3, norm_dtype="float32"), 8),  # natural order (36*3 % 8 != 0), f32 norms
        ((2, 3, 21, 2, 64), "bfloat16", dict(preset="turbo-4t"), 32),  # trellis codes
        # slow from here (the raw-layer case alone compiles ~10 s of programs on CPU)
        ((2, 6, 30, 2, 96), "float16", dict(key_bits=4, value_bits=3, skip_first_layers=1, skip_last_layers=1,
                                            checksum=True, norm_bits=6, rotation="hadamard",
                                            norm_correction=True), 32),  # raw layers
        ((1000, 64), "bfloat16", dict(bits=2, rotation="hadamard"), None),  # one partial block
        ((2, 4, 37, 3, 64), "bfloat16", dict(preset="turbo-2.5"), None),
        ((3, 16, 128), "float32", dict(bits=8, seed=7), 16),  # grid quantizer
    ],
    fast=4,
)


DEVICE_EXECUTORS = ("program", "blocks")  # the executors of the device path (blob.EXECUTORS less "host")


@pytest.fixture(params=DEVICE_EXECUTORS)
def resident(request):
    """Each executor of the accelerator path (the compiled program, and the per-block
    dispatch kept beside it), passed as ``executor=`` to run it on CPU devices."""
    return request.param


def _spy_encoder(monkeypatch, executor: str, seen: list) -> None:
    """Record the device each encoder of ``executor`` is built for."""
    if executor == "program":
        real = program_mod.encoder
        monkeypatch.setattr(program_mod, "encoder", lambda *a: seen.append(a[2]) or real(*a))
    else:
        real = resident_mod.encoder
        monkeypatch.setattr(resident_mod, "encoder", lambda *a: seen.append(a[-1]) or real(*a))


@pytest.fixture
def no_host_copy(resident, monkeypatch):
    """Fail if the encode takes the host path or copies the input to host."""

    def refuse(*args, **kwargs):
        raise AssertionError("the jax.Array input went through the host path")

    monkeypatch.setattr(blob, "_host_view", refuse)
    monkeypatch.setattr(blocks_mod, "encode_plan", refuse)


@pytest.mark.parametrize("shape,dtype,kw,block", CASES)
def test_jax_array_gives_the_numpy_bytes(shape, dtype, kw, block, resident, monkeypatch):
    x = random_input(shape, dtype)
    opts = options_from(kw)
    want = tq_jax.dumps(x, options=opts, block_vectors=block)
    xj = jnp.asarray(x)
    seen = []
    _spy_encoder(monkeypatch, resident, seen)
    monkeypatch.setattr(blob, "_host_view", lambda *a: pytest.fail("host path taken"))
    # Implicit device->host transfers are refused (on CPU arrays this guard is lenient,
    # hence the host-path spies above); the packed result comes back by device_get.
    with jax.transfer_guard_device_to_host("disallow"):
        got = tq_jax.dumps(xj, options=opts, block_vectors=block, executor=resident)
    assert seen and set(seen) == {jax.devices()[0]}
    assert got == want
    buf = bytearray(len(want) + 3)
    with jax.transfer_guard_device_to_host("disallow"):
        assert tq_jax.dump_into(xj, buf, options=opts, block_vectors=block, executor=resident) == len(want)
    assert bytes(buf[: len(want)]) == want


@pytest.mark.parametrize("shape,dtype,kw,block", CASES)
def test_loads_on_a_device_equals_loads(shape, dtype, kw, block, monkeypatch):
    b = tq_jax.dumps(random_input(shape, dtype, 1), options=options_from(kw))
    _check_resident_loads(b, block, monkeypatch)


def _check_resident_loads(b, block, monkeypatch):
    dev = jax.devices()[0]
    for out_dtype, executor in itertools.product((None, jnp.float32), DEVICE_EXECUTORS):
        want = np.asarray(tq_jax.loads(b, dtype=out_dtype, block_vectors=block))  # the host pipeline
        with monkeypatch.context() as m:
            m.setattr(blocks_mod, "decode_plan", lambda *a: pytest.fail("host output buffer used"))
            got = tq_jax.loads(b, dtype=out_dtype, block_vectors=block, device=dev, executor=executor)
        assert isinstance(got, jax.Array) and got.devices() == {dev}
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got), want)


def test_qjl_blob_decodes_on_a_device(monkeypatch):
    """A reference-style v1 QJL blob (sections from wire's writer) decodes the same on the device."""
    rng = np.random.default_rng(3)
    h = tq_jax._src.wire.Header(bits=3, seed=5, shape=(2, 41, 64), dtype="bfloat16", use_qjl=True, qjl_sketch_size=32)
    n = h.num_vectors
    sections = tq_jax._src.wire.Sections(
        [[np.packbits(rng.integers(0, 2, n * h.dim * h.bits, dtype=np.uint8), bitorder="little")]],
        [rng.uniform(0.5, 2, n).astype(np.float16)],
        sketch=rng.choice(np.array([-1, 1], np.int8), (n, h.qjl_sketch_size)),
        residual_norms=rng.uniform(0, 0.2, n).astype(np.float16),
    )
    b = b"".join(bytes(piece) for piece in tq_jax._src.wire.pieces(h, sections))
    assert tq_jax.parse(b).header.use_qjl
    _check_resident_loads(b, 16, monkeypatch)


def test_cpu_devices_keep_the_zero_copy_host_pipeline(monkeypatch):
    """On the CPU backend both directions take the host pipeline: loads' result is the
    aligned host buffer it decoded into (adopted by XLA without a copy), and a CPU
    jax.Array is read in place; ``executor="host"`` pins that pipeline on any device."""
    monkeypatch.setattr(resident_mod, "decode", lambda *a: pytest.fail("resident decode on a CPU device"))
    monkeypatch.setattr(resident_mod, "encoder", lambda *a: pytest.fail("resident encode on a CPU device"))
    monkeypatch.setattr(program_mod, "encoder", lambda *a: pytest.fail("program encode on a CPU device"))
    monkeypatch.setattr(program_mod, "decoder", lambda *a: pytest.fail("program decode on a CPU device"))
    filled = []
    real = blocks_mod.decode_plan
    monkeypatch.setattr(blocks_mod, "decode_plan", lambda p, plan, out, *a: filled.append(out) or real(p, plan, out, *a))
    x = random_input((4, 40, 64), "float32")
    b = tq_jax.dumps(x, bits=4)
    out = tq_jax.loads(b, device=jax.devices()[0])
    assert len(filled) == 1 and np.asarray(out).ctypes.data == filled[0].ctypes.data  # no copy
    xj = jnp.asarray(x)
    seen = []
    real_view = blob._host_view
    monkeypatch.setattr(blob, "_host_view", lambda a: seen.append(real_view(a)) or seen[-1])
    assert tq_jax.dumps(xj, bits=4) == b
    assert seen and np.shares_memory(seen[0], np.asarray(xj))  # read in place
    assert tq_jax.dumps(xj, bits=4, executor="host") == b
    np.testing.assert_array_equal(np.asarray(tq_jax.loads(b, device=jax.devices()[0], executor="host")), np.asarray(out))


def test_device_path_keeps_the_host_path_errors(resident, no_host_copy, monkeypatch):
    with pytest.raises(ValueError, match="bfloat16, float16 or float32"):
        tq_jax.dumps(jnp.ones((4, 8), jnp.int32), bits=4, executor=resident)
    with pytest.raises(blob.NormOverflowError):
        tq_jax.dumps(jnp.full((8, 16), 3e4, jnp.float32), bits=4, norm_dtype="float16", executor=resident)
    big = tq_jax.dumps(jnp.full((8, 16), 3e4, jnp.float32), bits=4, executor=resident)  # "auto": float32 norms
    assert tq_jax.parse(big).header.norm_dtype == "float32"
    monkeypatch.undo()  # the numpy path, for the expectation
    assert big == tq_jax.dumps(np.full((8, 16), 3e4, np.float32), bits=4)


def test_second_call_does_not_recompile(compiles, resident, no_host_copy):
    x = jnp.asarray(random_input((2, 2, 50, 2, 64), "bfloat16", 2))
    opts = options_from(dict(preset="turbo-3.5"))
    dev = jax.devices()[0]
    b = tq_jax.dumps(x, options=opts, block_vectors=64, executor=resident)
    tq_jax.loads(b, device=dev, block_vectors=64, executor=resident)
    assert compiles.count > 0, "the compile counter saw nothing: this test would pass vacuously"
    n = compiles.count
    for _ in range(2):
        assert tq_jax.dumps(x, options=opts, block_vectors=64, executor=resident) == b
        tq_jax.loads(b, device=dev, block_vectors=64, executor=resident)
    assert compiles.count == n


def test_options_argument():
    x = random_input((3, 5, 64), "float32")
    opts = tq_jax.encode_options(bits=3, rotation="hadamard")
    want = tq_jax.dumps(x, bits=3, rotation="hadamard")
    assert tq_jax.dumps(x, options=opts) == want
    assert tq_jax.serialized_size(x.shape, "float32", options=opts) == len(want)
    buf = bytearray(len(want))
    assert tq_jax.dump_into(x, buf, options=opts) == len(want) and bytes(buf) == want
    # bits and keyword fields override the Options, as they override a preset (tq_jax.encode_options)
    assert tq_jax.dumps(x, 4, options=opts) == tq_jax.dumps(x, bits=4, rotation="hadamard")
    assert tq_jax.dumps(x, options=opts, seed=1) == tq_jax.dumps(x, bits=3, rotation="hadamard", seed=1)
    with pytest.raises(ValueError, match=r"`bits` is a width .* options=tq_jax\.Options"):
        tq_jax.dumps(x, opts, options=opts)
    with pytest.raises(ValueError, match="tq_jax.Options"):
        tq_jax.dumps(x, options={"bits": 3})


@pytest.mark.slow
def test_four_host_devices_encode_and_decode_where_asked():
    code = """
    import jax, jax.numpy as jnp, numpy as np, tq_jax
    from tq_jax._src import program
    devs = jax.devices()
    assert len(devs) == 4, devs
    x = np.random.default_rng(0).standard_normal((2, 4, 300, 2, 64), np.float32).astype(jnp.bfloat16)
    opts = tq_jax.encode_options("turbo-3.5")
    want = tq_jax.dumps(x, options=opts)
    seen = []
    real = program.encoder
    program.encoder = lambda *a: seen.append(a[2]) or real(*a)
    on3 = jax.device_put(x, devs[3])
    assert tq_jax.dumps(on3, options=opts, executor="program") == want  # the accelerator path, on CPU devices
    assert seen == [devs[3]], seen
    assert tq_jax.dumps(on3, options=opts, device=devs[1], executor="program") == want  # moved device to device
    assert seen[-1] == devs[1], seen
    out = tq_jax.loads(want, device=devs[2], executor="program")
    assert out.devices() == {devs[2]}, out.devices()
    np.testing.assert_array_equal(np.asarray(out), np.asarray(tq_jax.loads(want)))
    print("ok")
    """
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4".strip()
    env["JAX_PLATFORMS"] = "cpu"
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_the_executor_is_a_calls_argument_and_an_unknown_one_is_refused():
    """Which executor runs a call is that call's ``executor=``, not a module setting, and
    a name outside blob.EXECUTORS is refused before any work, naming the choices."""
    assert not any(hasattr(m, n) for m in (blob, resident_mod) for n in ("EXECUTOR", "ON_CPU"))
    x = random_input((2, 8, 64), "float32")
    b = tq_jax.dumps(x, bits=4)
    buf = bytearray(len(b))
    calls = (lambda: tq_jax.dumps(x, bits=4, executor="gpu"), lambda: tq_jax.dump_into(x, buf, bits=4, executor="pallas"),
             lambda: tq_jax.loads(b, executor="device"), lambda: tq_jax.load_into(b, np.empty_like(x), executor="xla"))
    for call in calls:
        with pytest.raises(ValueError, match=r"executor must be None .*'host', 'program', 'blocks'"):
            call()
    assert buf == bytearray(len(b))  # nothing written
