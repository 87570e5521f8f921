"""The resolved plan (tq_jax._src.plan) and the device executor (tq_jax._src.program).

The independent expectation for every blob is the host block driver's bytes (pinned
against the reference plugin in tests/test_interop.py): the device program, run on
the CPU backend, must write the same bytes and decode the same values. On CPU the
device path is forced with ``executor="program"``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tq_jax
from tq_jax._src import blocks as blocks_mod
from tq_jax._src import plan as plan_mod
from tq_jax._src import program as program_mod
from tq_jax._src import resident as resident_mod
from tq_jax._src import wire

from conftest import sweep
from device_path_helpers import assert_decoded_like, options_from, random_input

CPU = jax.devices("cpu")[0]

# (shape, dtype, options kwargs, block_vectors): small blocks give many blocks + a padded tail
MATRIX = sweep(
    [
        ((2, 4, 37, 3, 64), "bfloat16", dict(bits=4), 64),  # v1, planar rows, 7 blocks + a tail
        ((2, 4, 37, 3, 64), "bfloat16", dict(preset="turbo-3.5"), 64),  # K!=V, Hadamard, nc, log norms, CRC
        ((2, 3, 21, 2, 64), "bfloat16", dict(preset="turbo-4t"), 32),  # trellis codes (natural order)
        # slow from here (raw edge layers through the program's encoder run quick in
        # test_a_change_of_options_reaches_both_executors_through_the_plan)
        ((2, 6, 30, 2, 96), "float16", dict(key_bits=4, value_bits=3, skip_first_layers=1, skip_last_layers=2,
                                            checksum=True, rotation="hadamard"), 32),  # raw edge layers, d 96
        ((2, 4, 48, 4, 128), "bfloat16", dict(key_bits=4, value_bits=3, rotation="hadamard"), None),
        ((3, 40, 128), "bfloat16", dict(bits=2), 16),
        ((5, 7, 36), "float32", dict(bits=3, norm_dtype="float32"), 8),  # natural order (36*3 % 8 != 0)
        ((2, 3, 11, 256), "bfloat16", dict(bits=8, seed=7), 16),  # grid quantizer, d 256
        ((2, 2, 21, 2, 128), "float32", dict(key_bits=6, value_bits=2, norm_bits=4), 24),  # v2 K6V2, log norms
        ((2, 3, 50, 2, 64), "bfloat16", dict(bits=4, rotation="hadamard", norm_correction=True,
                                             norm_dtype="float32"), None),  # one block (the default size)
        ((2, 1, 1000, 64), "bfloat16", dict(preset="turbo-2.5"), None),  # one partial default block
        ((0, 8, 128), "bfloat16", dict(bits=4), None),  # no vectors at all
        ((2, 3, 0, 2, 64), "bfloat16", dict(key_bits=4, value_bits=2), None),  # 0 tokens, KV layout
        ((2, 4, 0, 64), "float16", dict(bits=3, skip_first_layers=1, checksum=True), None),  # 0 tokens, raw layers
    ],
    fast=3,
)


@pytest.fixture
def on_device(monkeypatch):
    """Records the programs built, and fails if the per-block dispatch runs: the tests
    using it pin ``executor="program"``, the device path's compiled program on CPU devices."""
    built = {"encoder": 0, "decoder": 0}
    for name in built:
        real = getattr(program_mod, name)

        def spy(*a, _real=real, _name=name):
            built[_name] += 1
            return _real(*a)

        monkeypatch.setattr(program_mod, name, spy)
    monkeypatch.setattr(resident_mod, "encoder", lambda *a: pytest.fail("per-block encoder used"))
    monkeypatch.setattr(resident_mod, "decode", lambda *a: pytest.fail("per-block decoder used"))
    return built


@pytest.mark.parametrize("shape,dtype,kw,block", MATRIX)
def test_program_writes_the_host_paths_bytes(shape, dtype, kw, block, monkeypatch):
    x = random_input(shape, dtype)
    opts = options_from(kw)
    want = tq_jax.dumps(x, options=opts, block_vectors=block)  # the host block driver
    want_values = np.asarray(tq_jax.loads(want, block_vectors=block))
    want_f32 = np.asarray(tq_jax.loads(want, dtype=jnp.float32, block_vectors=block))
    with monkeypatch.context() as m:
        m.setattr(blocks_mod, "encode_plan", lambda *a: pytest.fail("host block driver used"))
        m.setattr(blocks_mod, "decode_plan", lambda *a: pytest.fail("host block driver used"))
        run = dict(block_vectors=block, executor="program")
        assert tq_jax.dumps(jnp.asarray(x), options=opts, **run) == want  # a jax.Array
        assert tq_jax.dumps(x, options=opts, **run) == want  # host data, device= the default
        buf = bytearray(len(want) + 5)
        assert tq_jax.dump_into(x, buf, options=opts, **run) == len(want)
        assert bytes(buf[: len(want)]) == want and bytes(buf[len(want) :]) == bytes(5)
        got = tq_jax.loads(want, device=CPU, **run)
        assert got.dtype == want_values.dtype and got.shape == want_values.shape
        assert_decoded_like(got, want_values)
        got = tq_jax.loads(want, dtype=jnp.float32, device=CPU, **run)
        assert_decoded_like(got, want_f32)
        out = np.full(want_f32.shape, -7, np.float32)
        assert tq_jax.load_into(want, out, device=CPU, **run).shape == tuple(shape)
        assert_decoded_like(out, want_f32)


@pytest.mark.parametrize("shape,dtype,kw,block", MATRIX[:2])
def test_only_the_program_runs_on_the_device(shape, dtype, kw, block, on_device, monkeypatch):
    monkeypatch.setattr(blocks_mod, "encode_plan", lambda *a: pytest.fail("host block driver used"))
    monkeypatch.setattr(blocks_mod, "decode_plan", lambda *a: pytest.fail("host block driver used"))
    b = tq_jax.dumps(random_input(shape, dtype), options=options_from(kw), block_vectors=block, executor="program")
    tq_jax.loads(b, block_vectors=block, device=CPU, executor="program")
    assert on_device == {"encoder": 1, "decoder": 1}


def test_a_change_of_options_reaches_both_executors_through_the_plan(monkeypatch):
    """Once the plan is built, neither executor reads the Options: poisoning them
    changes nothing, and what the options said (Hadamard, K4V3, checksum, raw layers)
    is in both executors' bytes."""
    x = random_input((2, 4, 19, 2, 64), "bfloat16", 3)
    plain = plan_mod.for_tensor(x.shape, "bfloat16", tq_jax.encode_options(bits=4))
    changed = plan_mod.for_tensor(x.shape, "bfloat16", tq_jax.encode_options(
        key_bits=4, value_bits=3, rotation="hadamard", checksum=True, skip_last_layers=1))

    def poisoned(*a, **k):
        raise AssertionError("an executor asked the Options again")

    for name in ("header", "codec_config", "serialized_size"):
        monkeypatch.setattr(tq_jax.Options, name, poisoned)
    blobs = {}
    for name, plan in (("plain", plain), ("changed", changed)):
        encoded, raw = blocks_mod.encode_plan(x, plan, 16, [CPU])
        sections = wire.Sections([c for c, _ in encoded], [n.astype(np.float16) for _, n in encoded], tuple(raw))
        host = b"".join(bytes(p) for p in wire.pieces(plan.header, sections))
        written, dev = program_mod.encode(plan, x, 16, CPU)
        assert written is plan and dev.tobytes() == host
        blobs[name] = host
    h = wire.parse(blobs["changed"]).header
    assert (h.rotation, h.bits, h.value_bits, h.checksum, h.skip_last) == ("hadamard", 4, 3, True, 1)
    assert wire.parse(blobs["plain"]).header.version == wire.VERSION_1
    assert len(blobs["plain"]) == plain.nbytes and len(blobs["changed"]) == changed.nbytes


def test_plan_offsets_are_where_the_parser_finds_the_sections():
    opts = options_from(dict(key_bits=4, value_bits=2, skip_first_layers=1, skip_last_layers=1, norm_bits=5,
                         checksum=True, rotation="hadamard"))
    x = random_input((2, 5, 9, 2, 64), "float16", 4)
    b = tq_jax.dumps(x, options=opts)
    p = wire.parse(b)
    plan = plan_mod.for_tensor(x.shape, "float16", opts)
    assert plan == plan_mod.for_header(p.header)  # writing and reading resolve to one plan
    buf = np.frombuffer(b, np.uint8)
    base = buf.ctypes.data
    for s, idx, nrm in zip(plan.segments, p.indices, p.norms):
        assert idx.ctypes.data - base == s.index_offset and idx.size == s.index_nbytes
        assert nrm.ranges.ctypes.data - base == s.norms_offset
    assert p.raw.ctypes.data - base == plan.raw_offset
    assert [(r.group, r.layers) for r in plan.raw] == [(0, (0, 1)), (0, (4, 5)), (1, (0, 1)), (1, (4, 5))]
    assert plan.nbytes == len(b) and plan.checksum
    for off, value in plan.section_lengths():
        assert int.from_bytes(b[off : off + 8], "little") == value
    rows = np.asarray(x).reshape(-1, 64)
    r = plan.raw[1]  # layer 4 of K: raw bytes are those rows of the tensor
    np.testing.assert_array_equal(
        buf[r.offset : r.offset + r.nbytes].view(np.float16), rows[r.row_start : r.row_start + r.rows].reshape(-1)
    )


def test_auto_norms_widen_and_float16_norms_refuse(on_device):
    x = np.full((3, 8, 16), 3e4, np.float32)
    with pytest.raises(tq_jax.NormOverflowError, match="float16"):
        tq_jax.dumps(x, bits=4, norm_dtype="float16", executor="program")
    want = tq_jax.dumps(x, bits=4)  # the host block driver
    got = tq_jax.dumps(x, bits=4, executor="program")
    assert got == want and tq_jax.parse(got).header.norm_dtype == "float32"
    small = bytearray(tq_jax.serialized_size(x.shape, "float32", 4))  # the float16 size
    with pytest.raises(ValueError, match="overflow float16"):
        tq_jax.dump_into(x, small, bits=4, executor="program")
    assert small == bytearray(len(small))  # nothing written


def test_peak_temporary_memory_is_one_block_not_the_tensor():
    """XLA's own memory analysis of the compiled programs: the temporaries stay under
    temp_bound and do not grow with the tensor (4 blocks vs 32 blocks of 512 vectors)."""
    opts = tq_jax.encode_options("turbo-3.5")
    block = 512
    temps = {}
    for tokens in (64, 512):  # 2*4*tokens*2 vectors: 4 and 32 blocks
        shape = (2, 4, tokens, 2, 128)
        plan = plan_mod.for_tensor(shape, "bfloat16", opts)
        x = jnp.zeros(shape, jnp.bfloat16)
        enc = program_mod.encoder(plan, block, CPU, jnp.dtype(jnp.bfloat16)).lower(x).compile().memory_analysis()
        blob = jnp.zeros(plan.nbytes, jnp.uint8)
        coded = tuple(jnp.zeros(s.n_vectors, jnp.float32) for s in plan.segments)
        tables = tuple(tq_jax._src.codec.device_tables(s.config, CPU) for s in plan.segments)
        dec = program_mod.decoder(plan, block, CPU, jnp.dtype(jnp.bfloat16)).lower(blob, coded, tables).compile()
        dec = dec.memory_analysis()
        bound = program_mod.temp_bound(plan, block)
        # on the CPU backend a bfloat16 output is built as uint16 and bitcast at the end:
        # one copy of the output (tq_jax._src.program.decoder); accelerators build it in place
        carried = dec.output_size_in_bytes
        assert enc.temp_size_in_bytes <= bound and dec.temp_size_in_bytes <= bound + carried, (enc, dec, bound)
        assert enc.output_size_in_bytes >= plan.nbytes  # the blob itself is the output
        temps[tokens] = (enc.temp_size_in_bytes, dec.temp_size_in_bytes)
    # 8x the tensor: the temporaries grow by the float32 norms at most (4 bytes per vector)
    grow = 4 * 2 * 4 * (512 - 64) * 2
    assert temps[512][0] <= temps[64][0] + grow + (1 << 16), temps
    assert temps[512][1] <= temps[64][1] + grow + 2 * 4 * (512 - 64) * 2 * 128 * 2 + (1 << 16), temps


def test_programs_compile_once_per_plan_and_stay_cached(compiles, on_device):
    x = jnp.asarray(random_input((2, 2, 40, 2, 64), "bfloat16", 5))
    opts = options_from(dict(preset="turbo-3.5"))
    run = dict(block_vectors=32, executor="program")
    b = tq_jax.dumps(x, options=opts, **run)
    tq_jax.loads(b, device=CPU, **run)
    n = compiles.count
    assert n > 0
    for _ in range(3):
        assert tq_jax.dumps(x, options=opts, **run) == b
        tq_jax.loads(b, device=CPU, **run)
    assert compiles.count == n
    assert program_mod.PROGRAMS.stats().entries >= 2


def test_too_large_for_the_program_takes_the_block_executor(monkeypatch):
    """Blobs past the program's int32 offsets (MAX_BLOB_BYTES) run block by block, same
    bytes, even with the program asked for (``executor="program"`` on CPU devices)."""
    x = random_input((2, 3, 20, 64), "bfloat16", 6)
    want = tq_jax.dumps(x, bits=4, block_vectors=16)
    monkeypatch.setattr(program_mod, "MAX_BLOB_BYTES", len(want) - 1)
    monkeypatch.setattr(program_mod, "encoder", lambda *a: pytest.fail("program used past its limit"))
    monkeypatch.setattr(program_mod, "decoder", lambda *a: pytest.fail("program used past its limit"))
    built = []
    real = resident_mod.encoder
    monkeypatch.setattr(resident_mod, "encoder", lambda *a: built.append(a) or real(*a))
    assert tq_jax.dumps(jnp.asarray(x), bits=4, block_vectors=16, executor="program") == want
    assert built  # the per-block device path ran
    got = tq_jax.loads(want, device=CPU, block_vectors=16, executor="program")
    assert_decoded_like(got, tq_jax.loads(want, block_vectors=16))


def test_plan_is_immutable_and_hashable():
    plan = plan_mod.for_tensor((2, 4, 8, 64), "bfloat16", tq_jax.encode_options(bits=4))
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.nbytes = 0
    assert hash(plan) == hash(plan_mod.for_tensor((2, 4, 8, 64), "bfloat16", tq_jax.encode_options(bits=4)))
    assert plan.overflow == "widen" and plan.widened.norm_dtype == "float32"
    # version 2: a longer header, 2 more bytes per norm, and the (empty) raw section's length
    grown = len(plan.widened.header_bytes) - len(plan.header_bytes) + 2 * plan.rows + 8
    assert plan.widened.nbytes == plan.nbytes + grown
