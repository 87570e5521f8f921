"""TPU without a TPU: the serving step and the codec's device program, lowered for a TPU on
this CPU host (``jax.export`` lowers for a platform the host does not have), and the TPU
kernel run under TPU interpret semantics.

What this proves: the programs lower for a TPU, the kernel among them as one Mosaic
``tpu_custom_call`` (not the Pallas interpreter, whatever the host), with blocks that meet
Mosaic's tiling and fit its scoped VMEM, and no op that needs a chip to lower; the exported
artifact serializes and loads back; in TPU interpret mode (TPU memory spaces, DMA and
semaphore semantics, race detection, a parallel batch axis on two simulated cores) the kernel
gives dense float64 attention's result. What it cannot prove: that the TPU compiler
(Mosaic's layout passes, run in libtpu) accepts the kernel, nor how fast it runs
(docs/tpu.md).

The lowering matrix is a covering design, not a product: its twelve cases hold every pair
of values of head_dim (64/128/256), GQA (1/3/4/8), batch (1/16), q_len (1/4), paging
(none/16/64) and the exact window (on/off) at least once, each with its own K/V bits (2..8,
K != V) or preset.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tq_jax
from kvcache_helpers import D, H, attend_reference, fill
from tq_jax import kvcache
from tq_jax._src import options as tq_options
from tq_jax._src import plan as tq_plan
from tq_jax._src import program
from tq_jax._src.kvcache import exact, pallas_tpu, ragged, scoring, target

KERNEL = "tpu_custom_call"

# (head_dim, GQA, batch, q_len, page_size, window+sinks, bits or preset); every pair of the
# first six axes' values appears in some row (a covering array of strength 2).
MATRIX = [
    (64, 4, 1, 4, 64, True, (2, 3)),
    (128, 3, 16, 1, 16, False, (3, 5)),
    (256, 8, 1, 4, None, False, (4, 6)),
    (64, 1, 16, 1, None, True, (5, 7)),
    (256, 3, 16, 4, 64, True, (6, 8)),
    (128, 1, 1, 4, 16, True, (8, 2)),
    (128, 8, 1, 1, 64, False, (7, 4)),
    (256, 4, 1, 1, 16, False, (4, 4)),
    (64, 3, 1, 1, None, False, "turbo-4"),
    (64, 8, 16, 4, 16, True, "turbo-3.5"),
    (128, 4, 16, 1, None, False, "turbo-2.5"),
    (256, 1, 1, 1, 64, False, (3, 2)),
]
KV_HEADS = 2
MAX_LEN = 2048


def _case_id(case):
    dim, group, batch, q_len, page, exact, bits = case
    b = bits if isinstance(bits, str) else f"k{bits[0]}v{bits[1]}"
    return f"d{dim}-gqa{group}-b{batch}-q{q_len}-page{page}-{'window' if exact else 'coded'}-{b}"


def _cache_shapes(dim, batch, page, exact, bits, kv_heads=KV_HEADS, max_len=MAX_LEN):
    """The cache's leaves as ShapeDtypeStructs (nothing allocated, nothing compiled)."""
    kw = {} if exact else dict(window=0, sinks=0)
    if isinstance(bits, str):
        kw["options"] = bits
    else:
        kw.update(key_bits=bits[0], value_bits=bits[1], rotation="hadamard" if dim == 256 else "haar")
    return jax.eval_shape(lambda: kvcache.init(batch, max_len, kv_heads, dim, page_size=page, **kw))


def _step(impl):
    """A serving step: append this step's K/V, then attend."""

    def step(cache, k, v, q):
        cache = kvcache.append(cache, k, v)
        return cache, kvcache.attend(cache, q, impl=impl)

    return jax.jit(step)


def _step_args(cache, q_len, group):
    cfg = cache.config
    kv = jax.ShapeDtypeStruct((cfg.batch, q_len, cfg.kv_heads, cfg.head_dim), jnp.bfloat16)
    q = jax.ShapeDtypeStruct((cfg.batch, q_len, cfg.kv_heads * group, cfg.head_dim), jnp.bfloat16)
    return cache, kv, kv, q


def _custom_calls(module: str) -> list:
    return re.findall(r"stablehlo\.custom_call @([\w$.]+)", module)


# Quick tier: one row (paged, window and sinks, a preset, GQA 8, batch 16, q_len 4); the rest in the full suite.
@pytest.mark.parametrize(
    "case", [pytest.param(c, id=_case_id(c), marks=() if i == 9 else pytest.mark.slow) for i, c in enumerate(MATRIX)]
)
def test_serving_step_lowers_for_tpu_with_the_mosaic_kernel(case):
    dim, group, batch, q_len, page, exact, bits = case
    cache = _cache_shapes(dim, batch, page, exact, bits)
    exported = jax.export.export(_step("pallas_tpu"), platforms=["tpu"])(*_step_args(cache, q_len, group))
    assert _custom_calls(exported.mlir_module()) == [KERNEL]  # the kernel, once; append and the rest are XLA
    # the blocks the kernel asked Mosaic for: tiled (partial() refuses otherwise) and within scoped VMEM
    rows = group * q_len
    unit = pallas_tpu.unit_tokens(cache, rows)
    layout = pallas_tpu.blocks(cache, rows, unit)
    assert all(pallas_tpu.tiling_ok(b.block, b.array, b.dtype) for b in layout)
    assert pallas_tpu.vmem_bytes(layout) <= pallas_tpu.VMEM_BUDGET // 2
    assert cache.config.page_tokens % unit == 0


def test_exported_step_serializes_and_loads_back():
    """The TPU artifact survives its bytes, the cache's pytree included."""
    cache = _cache_shapes(128, 16, 16, True, "turbo-3.5")
    exported = jax.export.export(_step("pallas_tpu"), platforms=["tpu"])(*_step_args(cache, 1, 4))
    loaded = jax.export.deserialize(exported.serialize())
    assert loaded.platforms == ("tpu",) and loaded.in_tree == exported.in_tree and loaded.out_tree == exported.out_tree
    assert loaded.in_avals == exported.in_avals and loaded.mlir_module() == exported.mlir_module()
    assert _custom_calls(loaded.mlir_module()) == [KERNEL]
    assert jax.tree_util.tree_unflatten(loaded.in_tree, loaded.in_avals)[0][0].config == cache.config


def _interpreted(cache, q):
    """What attend(impl="pallas_tpu") computed on a CPU before it followed the platform:
    the kernel called with interpret=True."""
    query = scoring.query(cache, q)
    m, l, acc = pallas_tpu.partial(cache, query, interpret=True)
    return exact.finish(cache, q, query, m, l, acc)


@pytest.mark.slow
def test_a_cpu_export_loaded_from_its_bytes_runs_the_interpreter_bit_for_bit():
    """The serving step exported for this CPU and loaded back from its bytes runs here, its
    attention bit for bit the interpreted kernel's (a CPU run still interprets, with the
    same results)."""
    rng = np.random.default_rng(3)
    cache = kvcache.init(3, 48, H, D, key_bits=3, value_bits=4, rotation="haar", seed=11, page_size=8,
                         dtype=jnp.float32, block_tokens=16, window=5, sinks=2)
    cache, _, _ = fill(cache, rng, first=[16, 11, 16], second=[16, 16, 9])
    k = rng.standard_normal((3, 2, H, D)).astype(np.float32)
    q = rng.standard_normal((3, 2, 3 * H, D)).astype(np.float32)
    loaded = jax.export.deserialize(jax.export.export(_step("pallas_tpu"), platforms=["cpu"])(cache, k, k, q).serialize())
    assert _custom_calls(loaded.mlir_module()) == []
    new_cache, out = loaded.call(cache, k, k, q)
    assert new_cache.config == cache.config and np.asarray(new_cache.lengths).tolist() == [34, 29, 27]
    np.testing.assert_array_equal(np.asarray(out), np.asarray(jax.jit(_interpreted)(new_cache, q)))


@pytest.mark.slow
def test_impl_on_a_tpu_pallas_is_the_kernel_and_auto_the_xla_loop():
    cache = _cache_shapes(128, 4, 16, True, (4, 4))
    args = _step_args(cache, 1, 4)
    for impl, calls in (("pallas_tpu", [KERNEL]), ("auto", []), ("xla", [])):
        assert _custom_calls(jax.export.export(_step(impl), platforms=["tpu"])(*args).mlir_module()) == calls, impl
    # head_dim 96: the GPU kernel cannot tile it; "pallas_tpu" still lowers for a TPU
    odd = _cache_shapes(96, 2, None, False, (4, 2))
    exported = jax.export.export(_step("pallas_tpu"), platforms=["tpu"])(*_step_args(odd, 1, 2))
    assert _custom_calls(exported.mlir_module()) == [KERNEL]


# The engine-facing form (tq_jax._src.kvcache.ragged): a step of write + ragged attend, flat
# batch of 8 query tokens over 4 sequences; (head_dim, page_size, preset, window+sinks).
RAGGED = [(64, 16, None, True), (128, 64, "turbo-3.5", True), (256, 16, "turbo-2.5", False)]


def _ragged_step():
    def step(pool, k, v, slots, positions, q, kv_lens, page_indices, cu_q_lens, num_seqs):
        pool = ragged.write(pool, k, v, slots, positions=positions)
        return pool, ragged.attend(pool, q, kv_lens, page_indices, cu_q_lens, num_seqs, impl="pallas_tpu")

    return jax.jit(step)


def _ragged_args(dim, page, preset, exact_part, tokens=8, max_seqs=4):
    kw = {} if exact_part else {"window": 0, "sinks": 0}
    pool = jax.eval_shape(lambda: ragged.init_pool(64, page, KV_HEADS, dim, preset, max_seqs=max_seqs, **kw))
    ints = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    kv = jax.ShapeDtypeStruct((tokens, KV_HEADS, dim), jnp.bfloat16)
    q = jax.ShapeDtypeStruct((tokens, 3 * KV_HEADS, dim), jnp.bfloat16)
    return pool, kv, kv, ints(tokens), ints(tokens), q, ints(max_seqs), ints(max_seqs, 8), ints(max_seqs + 1), ints(1)


@pytest.mark.parametrize("case", [pytest.param(c, marks=() if i == 0 else pytest.mark.slow)
                                  for i, c in enumerate(RAGGED)], ids=lambda c: f"d{c[0]}-page{c[1]}-{c[2]}")
def test_ragged_step_lowers_for_tpu_with_the_mosaic_kernel_and_interprets_on_cpu(case):
    """ragged.attend follows the same rule as attend: the Mosaic kernel when lowered for a
    TPU, the interpreter (no custom call) when lowered for this CPU."""
    args = _ragged_args(*case)
    exported = jax.export.export(_ragged_step(), platforms=["tpu"])(*args)
    assert _custom_calls(exported.mlir_module()) == [KERNEL]
    assert _custom_calls(_ragged_step().lower(*args).as_text()) == []


def test_a_cpu_program_holds_no_mosaic_call():
    """Lowered for this CPU (what a CPU run compiles), attend(impl="pallas_tpu") is the
    Pallas interpreter: no custom call at all (its results: tests/test_kvcache*.py)."""
    cache = _cache_shapes(64, 3, 8, True, (3, 4))
    q = jax.ShapeDtypeStruct((3, 2, 6, 64), jnp.float32)
    text = jax.jit(lambda c, x: kvcache.attend(c, x, impl="pallas_tpu")).lower(cache, q).as_text()
    assert "custom_call" not in text


def test_target_kernel_keeps_the_form_of_the_platform_lowered_for():
    def build(interpret):
        return jnp.float32(1.0 if interpret else 2.0)

    f = jax.jit(lambda: target.kernel(build, platforms=target.TPU))
    assert float(f()) == 1.0  # run here: the CPU's form
    text = lambda platforms: jax.export.export(f, platforms=platforms)().mlir_module()  # noqa: E731
    assert "2.000000e+00" in text(["tpu"]) and "1.000000e+00" not in text(["tpu"])
    assert "1.000000e+00" in text(["cpu"]) and "2.000000e+00" not in text(["cpu"])
    with pytest.raises(Exception, match="not found for platform cuda"):  # not written for GPUs
        text(["cuda"])
    with pytest.raises(ValueError, match="must name non-CPU platforms, got .'cpu', 'tpu'."):
        target.kernel(build, platforms=("cpu", "tpu"))


def test_tiling_rule_per_dtype():
    ok = pallas_tpu.tiling_ok
    assert ok((8, 128), (64, 256), np.float32) and not ok((8, 128), (64, 256), jnp.bfloat16)
    assert ok((16, 128), (64, 256), jnp.bfloat16) and not ok((16, 128), (64, 256), np.uint8)
    assert ok((32, 256), (64, 512), np.uint8) and not ok((32, 64), (64, 512), np.uint8)
    assert ok((1, 8, 64), (4, 8, 64), np.uint8)  # the last two dims are the array's own
    assert not ok((1, 4, 64), (4, 8, 64), np.uint8)
    blk = [pallas_tpu.Block("x", (1, 5, 8, 64), (3, 5, 8, 64), np.uint8)]
    assert pallas_tpu.vmem_bytes(blk) == 2 * 5 * 32 * 128  # (8, 64) bytes padded to one (32, 128) tile, two buffers


def test_f16_bits_convert_exactly_for_every_float16():
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    got = np.asarray(jax.jit(pallas_tpu.f16_bits_to_f32)(bits))
    want = bits.view(np.float16).astype(np.float32)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))  # NaN payloads and signed zeros too


# --------------------------------------------------------------------------- the codec


@pytest.mark.parametrize(
    "preset,dtype",
    [("compat-4bit", jnp.bfloat16), pytest.param("turbo-4", jnp.float32, marks=pytest.mark.slow)],
)
def test_codec_device_program_lowers_for_tpu_in_32_bit_types(preset, dtype):
    """v1 4-bit and turbo-4 (v2: K5V3, Hadamard, log-coded norms), encode and decode, at the
    accelerator block size (several loop iterations and a tail)."""
    plan = tq_plan.for_tensor((2, 4, 40000, 2, 128), jnp.dtype(dtype).name, tq_jax.Options(**tq_options.PRESETS[preset]))
    assert program.block_vectors(plan, None, "tpu") == program.DEVICE_BLOCK_COORDS // 128
    enc, dec = program.export(plan, dtype, "tpu")
    assert enc.platforms == dec.platforms == ("tpu",)
    assert enc.out_avals[0].shape == (plan.nbytes,) and dec.out_avals[0].shape == plan.shape
    for e in (enc, dec):
        values = re.sub(r"dense<[^>]*> : tensor<[^>]*>", "", e.mlir_module())  # drop attributes (padding, ...)
        assert not re.findall(r"tensor<[0-9x]*(?:i|ui|f)64>|: [iuf]64\b", values)  # no 64-bit values
        assert not _custom_calls(e.mlir_module())


@pytest.mark.slow
def test_cli_device_path_programs_lower_for_tpu(tmp_path, monkeypatch):
    """The programs `tq-jax compress`/`decompress` compile on an accelerator host: the CLI
    is run here with the device path taken on the CPU (each unit produced with
    ``executor="program"``), which records
    every (plan, block, dtype) it compiles; each is then exported for a TPU. The files
    are the host block driver's, byte for byte."""
    from tq_jax._src import safetensors_io as st
    from tq_jax._src.batch import run as batch_run
    from tq_jax._src.cli import main

    rng = np.random.default_rng(0)
    src = tmp_path / "kv.safetensors"
    st.save_file({"layer.k": rng.standard_normal((3, 40, 64)).astype(np.float32),
                  "layer.v": rng.standard_normal((300, 64)).astype(jnp.bfloat16)}, str(src))
    built = []
    for name in ("encoder", "decoder"):
        real = getattr(program, name)
        monkeypatch.setattr(program, name, lambda plan, block, device, dtype, real=real, name=name: (
            built.append((name, plan, dtype)) or real(plan, block, device, dtype)))
    real_produce = batch_run.produce
    monkeypatch.setattr(batch_run, "produce", lambda *a, **k: real_produce(*a, **k, executor="program"))
    assert main(["compress", str(src), str(tmp_path / "c.safetensors"), "--head-dim", "64", "-q"]) == 0
    assert main(["decompress", str(tmp_path / "c.safetensors"), str(tmp_path / "d.safetensors"), "-q"]) == 0
    monkeypatch.undo()  # stop recording: exporting builds the programs again
    assert sorted({n for n, _, _ in built}) == ["decoder", "encoder"] and len(built) == 4  # two tensors, each way
    # the host block driver (a CPU host) writes the same files
    assert main(["compress", str(src), str(tmp_path / "c2.safetensors"), "--head-dim", "64", "-q"]) == 0
    assert main(["decompress", str(tmp_path / "c2.safetensors"), str(tmp_path / "d2.safetensors"), "-q"]) == 0
    for a, b in (("c", "c2"), ("d", "d2")):
        assert (tmp_path / f"{a}.safetensors").read_bytes() == (tmp_path / f"{b}.safetensors").read_bytes()
    for name, plan, dtype in built:
        enc, dec = program.export(plan, dtype, "tpu")
        assert (enc if name == "encoder" else dec).platforms == ("tpu",)


# --------------------------------------------------------------------------- TPU interpret mode


def _races_found() -> bool:
    """Whether TPU interpret mode's race detector saw a race in the last kernel (jax keeps
    the flag in a private module; jax's own Pallas tests read it there)."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call

    return interpret_pallas_call.races is not None and interpret_pallas_call.races.races_found


def _tpu_interpret(cache, q, params):
    def attend(c, x):
        query = scoring.query(c, x)
        m, l, acc = pallas_tpu.partial(c, query, interpret=params)
        return exact.finish(c, x, query, m, l, acc)

    return np.asarray(jax.jit(attend)(cache, q))


# (rotation, key bits, value bits, GQA, page_size, window, sinks, q_len, head_dim)
INTERPRET = [
    pytest.param("hadamard", 4, 3, 3, 8, 5, 2, 2, D, id="paged8-k4v3-gqa3-window5-sinks2-q2"),
    pytest.param("haar", 3, 2, 1, 16, 8, 4, 3, D, marks=pytest.mark.slow, id="paged16-k3v2-gqa1-window8-sinks4-q3"),
    pytest.param("hadamard", 8, 5, 8, None, 0, 3, 1, 128, marks=pytest.mark.slow, id="unpaged-k8v5-gqa8-sinks3-d128"),
]


@pytest.mark.parametrize("rotation,kb,vb,group,page_size,window,sinks,q_len,dim", INTERPRET)
def test_tpu_interpret_mode_matches_dense_attention_without_races(rotation, kb, vb, group, page_size, window, sinks,
                                                                    q_len, dim):
    from jax.experimental.pallas import tpu as pltpu

    rng = np.random.default_rng(kb * 10 + vb)
    cache = kvcache.init(3, 48, H, dim, key_bits=kb, value_bits=vb, rotation=rotation, seed=11, page_size=page_size,
                         dtype=jnp.float32, block_tokens=16, window=window, sinks=sinks)
    k = rng.standard_normal((3, 32, H, dim)).astype(np.float32)
    v = rng.standard_normal((3, 32, H, dim)).astype(np.float32)
    first, second = [16, 11, 16], [16, 16, 9]  # ragged: 32, 27, 25 tokens
    cache = kvcache.append(cache, k[:, :16], v[:, :16], new_lengths=np.array(first))
    cache = kvcache.append(cache, k[:, 16:], v[:, 16:], new_lengths=np.array(second))
    q = rng.standard_normal((3, q_len, H * group, dim)).astype(np.float32)
    # two simulated cores take the batch axis (parallel); uninitialised memory reads as NaN
    out = _tpu_interpret(cache, q, pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2))
    assert not _races_found()
    for b in range(3):
        ks = np.concatenate([k[b, : first[b]], k[b, 16 : 16 + second[b]]])
        vs = np.concatenate([v[b, : first[b]], v[b, 16 : 16 + second[b]]])
        np.testing.assert_allclose(out[b], attend_reference(ks, vs, cache.config, q[b]), rtol=2e-5, atol=2e-5)


@pytest.mark.slow
def test_race_detector_sees_a_race_when_the_unit_axis_is_made_parallel(monkeypatch):
    """The check above can fail: marking the unit axis parallel too (the two cores split the
    grid's 3 x 6 points in halves, so both write sequence 1's resident softmax state) is
    caught as a race."""
    from jax.experimental.pallas import tpu as pltpu

    rng = np.random.default_rng(1)
    cache = kvcache.init(3, 48, H, D, key_bits=4, value_bits=4, rotation="haar", seed=11, page_size=8,
                         dtype=jnp.float32, block_tokens=16, window=0, sinks=0)
    cache, _, _ = fill(cache, rng, first=[16, 11, 16], second=[16, 16, 9])
    q = rng.standard_normal((3, 1, H, D)).astype(np.float32)
    monkeypatch.setattr(pallas_tpu, "compiler_params",
                        lambda: pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")))
    _tpu_interpret(cache, q, pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2))
    assert _races_found()
    pltpu.reset_tpu_interpret_mode_state()
