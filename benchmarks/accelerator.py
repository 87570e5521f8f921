"""Accelerator proof: correctness on the device, then the codec, the cache's
decode attention and a SmolLM2-shaped model's decode speed, in one table.

    python -m benchmarks.accelerator                   # whatever accelerator JAX sees; <= 8 min on one GPU
    python -m benchmarks.accelerator --compile-check   # ~1 min: compile + run the GPU kernel once per config
    python -m benchmarks.accelerator --cpu-smoke       # tiny sizes, interpreted Pallas, < 1 min (a CI test)

Options: ``--out DIR`` (default ``tq-jax-results/`` under the current directory, so a run
never overwrites the committed ``benchmarks/results/``; name that to refresh them), ``--commit HASH`` (recorded in the
result file; default ``git rev-parse HEAD`` when the tree is a git checkout),
``--steps 1,2,3,4``, ``--keep-going`` (do not stop on a failed correctness check).
Writes ``<out>/accelerator_<device>.md``: the command, the commit, jax, the device and
the table.

Steps:
1. correctness on the device: the device-resident codec path gives the host path's bytes
   and values; ``kvcache`` append gives ``dumps``' bytes and ``attend`` (XLA and the GPU
   kernel) equals dense float64 attention over the decoded blob. Stops on a failure.
2. the codec on the device (W1 and a 1 GiB tensor; v1 4-bit, turbo-3.5, Hadamard v2
   4-bit), in GiB/s of the bf16 tensor beside a device-to-device copy of the same bytes:
   the device program alone (``tq_jax._src.program``: the blob in device memory, no host
   transfer, both ways); the host-link floor (the blob's bytes alone, each way); the full
   ``dumps(jax.Array)`` / ``loads(device=d)`` with the program and with the per-block
   executor it replaced (``[blocks]``, the calls' ``executor="blocks"``), so that one run
   measures before and after; and the LMCache bridge's data path, ``dump_into`` /
   ``load_into`` of a host chunk with ``device=d`` (what ``bridge/_src/serde.py`` calls), in
   GB/s of raw KV. The full rows give their share of the host-link floor's throughput.
3. the GPU kernel's bf16 mode checked against its accuracy bound on the device (relative
   RMS error at most 1.5x ``jax.nn.dot_product_attention``'s over the same K/V in bf16),
   then decode ``attend`` (the GPU kernel's exact and bf16 modes; the XLA loop at batch 8)
   against dense bf16 attention (``jax.nn.dot_product_attention`` and a plain einsum) at
   8k/32k/128k tokens, batch 1, 8 and 32, 8 KV heads, GQA 4, head_dim 128, 4/4 and
   turbo-3.5, and a tuning sweep of both modes at batch 8, 32k. The cache's codes are
   random bytes (attention's speed does not depend on their values).
4. SmolLM2-135M's architecture decoding at batch 8 and 32 from 4k and 16k tokens of
   context: a bf16 cache attended with ``jax.nn.dot_product_attention`` against the
   compressed caches (4/4, turbo-3.5) with the GPU kernel's two modes, all in the same
   decode step; and the example's own step once. The weights and cache contents are
   random (the GGUF cannot travel to a machine without network, and decode speed does
   not depend on the values).

On a TPU the same command runs unchanged: the TPU kernel (``impl="pallas_tpu"``) takes the
GPU kernel's place in steps 1, 3 and 4 and in ``--compile-check`` (the bf16 mode and the
tuning sweep are the GPU kernel's and are skipped), the device is named by its product
(``TPU v5e`` for JAX's ``TPU v5 lite``) and rows give the ideal time at the chip's
spec-sheet HBM bandwidth (:data:`PEAK_GBS`) beside the measured copy (docs/tpu.md).

Timing: ``block_until_ready``, the first call (compile) excluded, median of ``--reps``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import tq_jax
from tq_jax import kvcache
from tq_jax._src.kvcache import pallas_gpu

ROOT = Path(__file__).resolve().parent.parent
GIB = float(1 << 30)


@dataclasses.dataclass(frozen=True)
class Sizes:
    codec: tuple  # (name, shape) of bf16 tensors
    tokens: tuple  # attend's cache lengths
    batches: tuple  # step 3's batch sizes
    xla_batch: int  # step 3 times the XLA loop (13x slower than the kernel on an H200) at this batch only
    kv_heads: int
    group: int
    dim: int
    reps: int
    model: dict  # LlamaConfig overrides
    model_batches: tuple  # step 4's batch sizes
    contexts: tuple  # step 4's context lengths
    decode_steps: int
    kv_cases: int  # step 1's kvcache cases (of KV_CASES); step 3 checks the bf16 mode's accuracy on them
    model_kinds: int  # step 4's caches (of MODEL_KINDS)
    variants: bool  # step 3 times the kernel's tuning variants (at the second length, batch xla_batch)


FULL = Sizes(
    codec=(("W1", (2, 32, 256, 8, 128)), ("1 GiB", (2, 32, 8192, 8, 128))),
    tokens=(8192, 32768, 131072),
    batches=(1, 8, 32), xla_batch=8, kv_heads=8, group=4, dim=128, reps=10,
    model=dict(vocab_size=49152, hidden=576, layers=30, heads=9, kv_heads=3, head_dim=64, ffn=1536),
    model_batches=(8, 32), contexts=(4096, 16384), decode_steps=16, kv_cases=4, model_kinds=4, variants=True,
)
SMOKE = Sizes(
    codec=(("W1/64", (2, 2, 16, 2, 128)),),
    tokens=(64,),
    batches=(1, 2), xla_batch=2, kv_heads=2, group=4, dim=128, reps=2,
    model=dict(vocab_size=256, hidden=192, layers=2, heads=3, kv_heads=1, head_dim=64, ffn=128),
    model_batches=(2,), contexts=(8,), decode_steps=3, kv_cases=2, model_kinds=3, variants=False,
)
CODEC_OPTIONS = (
    ("v1 4-bit", dict(bits=4)),
    ("turbo-3.5", tq_jax.PRESETS["turbo-3.5"]),
    ("Hadamard v2 4-bit", dict(bits=4, rotation="hadamard")),
)
ATTEND_CACHES = (  # steps 3 and 4's compressed caches: kvcache.init keywords
    ("4/4", dict(key_bits=4, value_bits=4, rotation="haar")),
    ("turbo-3.5", dict(options="turbo-3.5")),  # K4V3, Hadamard, norm correction
)
KERNEL_MODES = (("exact", pallas_gpu.DEFAULT_TUNING), ("bf16", pallas_gpu.BF16_TUNING))
BF16_BOUND = 1.5  # the bf16 mode's error, x jax.nn.dot_product_attention's over the same K/V in bf16


class CheckFailed(RuntimeError):
    pass


# --------------------------------------------------------------------------- helpers


def _ready(x):
    for leaf in jax.tree_util.tree_leaves(x):
        if hasattr(leaf, "block_until_ready"):
            leaf.block_until_ready()
    return x


def median_ms(fn, reps: int) -> float:
    """Median wall time of ``fn()`` in ms, the first (compiling) call excluded."""
    _ready(fn())
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        _ready(fn())
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def gibs(nbytes: int, ms: float) -> float:
    return nbytes / GIB / (ms / 1e3)


def interpret() -> bool:
    return jax.default_backend() == "cpu"


def on_tpu() -> bool:
    return jax.default_backend() == "tpu"


def kernel_impl() -> str:
    """The Pallas kernel this run times: the TPU kernel on a TPU, else the GPU kernel (run
    by the Pallas interpreter on a CPU)."""
    return "pallas_tpu" if on_tpu() else "pallas_gpu"


# Spec-sheet HBM bandwidth per chip, GB/s (10**9 B/s), by device_kind: the yardstick an
# ideal memory-bound step is measured against (the measured device copy is the other).
PEAK_GBS = {
    "TPU v4": 1200, "TPU v5 lite": 819, "TPU v5e": 819, "TPU v5p": 2765, "TPU v5": 2765,
    "TPU v6 lite": 1640, "TPU v6e": 1640, "TPU7x": 7380,
    "NVIDIA A100-SXM4-40GB": 1555, "NVIDIA A100-SXM4-80GB": 2039, "NVIDIA H100 80GB HBM3": 3350,
    "NVIDIA H100 PCIe": 2000, "NVIDIA H200": 4800, "NVIDIA GH200 480GB": 4000, "NVIDIA B200": 8000,
}
TPU_NAMES = {"TPU v5 lite": "TPU v5e", "TPU v6 lite": "TPU v6e", "TPU v5": "TPU v5p"}  # device_kind -> product name


def device_label(dev) -> str:
    """``dev.device_kind``, with the product name where JAX reports another (``TPU v5
    lite`` is sold as v5e)."""
    kind = dev.device_kind
    return f"{TPU_NAMES[kind]} ({kind})" if kind in TPU_NAMES else kind


def peak_gbs(dev) -> float | None:
    """The chip's spec-sheet HBM bandwidth in GB/s, or None for a device not in
    :data:`PEAK_GBS` (the CPU)."""
    return PEAK_GBS.get(dev.device_kind)


def peak_ms(nbytes: int, dev) -> float | None:
    """Time to move ``nbytes`` at the chip's spec-sheet bandwidth."""
    gbs = peak_gbs(dev)
    return None if gbs is None else nbytes / (gbs * 1e9) * 1e3


def gpu_attend(cache, q, tuning=pallas_gpu.DEFAULT_TUNING):
    return _gpu_attend(cache, q, tuning)


@functools.partial(jax.jit, static_argnums=2)
def _gpu_attend(cache, q, tuning):
    return pallas_gpu.attend(cache, q, interpret=interpret(), tuning=tuning)


@jax.jit
def tpu_attend(cache, q):
    return kvcache.attend(cache, q, impl="pallas_tpu")


def dense_attention(q, k, v):
    """Causal softmax attention, float64: q [Q, Hq, D] are the last Q positions of k/v [T, H, D]."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    n_q, q_heads, dim = q.shape
    t, heads = k.shape[:2]
    s = np.einsum("qhgd,thd->hgqt", q.reshape(n_q, heads, q_heads // heads, dim), k) / np.sqrt(dim)
    allowed = np.arange(t)[None, :] <= (t - n_q + np.arange(n_q))[:, None]
    s = np.where(allowed, s, -np.inf)
    top = np.max(s, axis=-1, keepdims=True)
    p = np.where(allowed, np.exp(s - np.where(np.isfinite(top), top, 0)), 0)
    l = p.sum(-1, keepdims=True)
    return np.einsum("hgqt,thd->qhgd", p / np.where(l == 0, 1, l), v).reshape(n_q, q_heads, dim)


def filled_cache(rng, kb, vb, rotation, page_size, group, q_len, dim, heads=2, batch=3, max_len=48):
    """A float32 cache holding ragged random K/V (32, 27, 25 tokens), its per-sequence K/V and a query."""
    cache = kvcache.init(batch, max_len, heads, dim, key_bits=kb, value_bits=vb, rotation=rotation, seed=11,
                         page_size=page_size, window=0, sinks=0,
                         dtype=jnp.float32, block_tokens=16)
    k = rng.standard_normal((batch, 32, heads, dim)).astype(np.float32)
    v = rng.standard_normal((batch, 32, heads, dim)).astype(np.float32)
    first, second = [16, 11, 16][:batch], [16, 16, 9][:batch]
    cache = kvcache.append(cache, k[:, :16], v[:, :16], new_lengths=np.array(first))
    cache = kvcache.append(cache, k[:, 16:], v[:, 16:], new_lengths=np.array(second))
    ks = [np.concatenate([k[b, : first[b]], k[b, 16 : 16 + second[b]]]) for b in range(batch)]
    vs = [np.concatenate([v[b, : first[b]], v[b, 16 : 16 + second[b]]]) for b in range(batch)]
    q = rng.standard_normal((batch, q_len, heads * group, dim)).astype(np.float32)
    return cache, ks, vs, q


def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-30))


# --------------------------------------------------------------------------- step 1: correctness


def check_codec(dev) -> list:
    rows = []
    x = np.random.default_rng(0).standard_normal((2, 2, 40, 8, 128), np.float32).astype(jnp.bfloat16)
    xd = jax.device_put(x, dev)
    for name, kw in CODEC_OPTIONS:
        opts = tq_jax.encode_options(**kw)
        host = tq_jax.dumps(x, options=opts)
        on_dev = tq_jax.dumps(xd, options=opts)
        same = host == on_dev
        diff = "" if same else f", {sum(a != b for a, b in zip(host, on_dev))} of {len(host)} bytes differ"
        rows.append((f"codec {name}: dumps(jax.Array on {dev.platform}) == dumps(numpy)", same, f"{len(host)} B{diff}"))
        back = tq_jax.loads(host, device=dev)
        ref = np.asarray(tq_jax.loads(host), np.float32)
        err = rel_err(np.asarray(back, np.float32), ref)
        ok = err <= 1e-2 and isinstance(back, jax.Array) and back.devices() == {dev}
        rows.append((f"codec {name}: loads(device=d) == loads() (bf16 output)", ok, f"max rel err {err:.1e}"))
    return rows


KV_CASES = [  # (rotation, key_bits, value_bits, group, page_size, q_len, dim)
    ("haar", 4, 4, 4, None, 1, 128),
    ("hadamard", 4, 3, 4, 16, 1, 128),
    ("hadamard", 3, 3, 3, 8, 3, 64),
    ("haar", 2, 4, 1, None, 1, 64),
]


def check_kvcache(n_cases: int) -> list:
    rows = []
    rng = np.random.default_rng(1)
    for rot, kb, vb, group, ps, q_len, dim in KV_CASES[:n_cases]:
        tag = f"kvcache {rot} {kb}/{vb} gqa{group} {'paged' + str(ps) if ps else 'unpaged'} q{q_len} d{dim}"
        cache, ks, vs, q = filled_cache(rng, kb, vb, rot, ps, group, q_len, dim)
        cfg = cache.config
        kw = dict(bits=kb) if kb == vb else dict(key_bits=kb, value_bits=vb)
        refs, same = [], True
        for b in range(len(ks)):
            blob = tq_jax.dumps(np.stack([ks[b], vs[b]])[:, None], seed=cfg.seed, rotation=rot, **kw)
            same &= kvcache.export(cache, seq=b) == blob
            kv = np.asarray(tq_jax.loads(blob, dtype=jnp.float32))
            refs.append(dense_attention(q[b], kv[0, 0], kv[1, 0]))
        rows.append((f"{tag}: export == dumps", same, ""))
        for impl in ("xla", kernel_impl()):
            out = np.asarray(kvcache.attend(cache, q, impl=impl))
            err = max(rel_err(out[b], refs[b]) for b in range(len(refs)))
            rows.append((f"{tag}: attend impl={impl} == dense f64 over loads(export)", err <= 1e-3, f"max rel err {err:.1e}"))
    return rows


def step_correctness(dev, sizes: Sizes, keep_going: bool) -> list:
    rows = check_codec(dev) + check_kvcache(sizes.kv_cases)
    for name, ok, detail in rows:
        print(f"  [{'ok' if ok else 'FAIL'}] {name} {detail}", flush=True)
    bad = [r for r in rows if not r[1]]
    if bad and not keep_going:
        raise CheckFailed(f"{len(bad)} correctness check(s) failed on {dev.device_kind}: " + "; ".join(r[0] for r in bad))
    return rows


# --------------------------------------------------------------------------- step 2: codec


def step_codec(dev, sizes: Sizes, table: list):
    """Codec rows (see the module docstring): the device program alone, the full
    dumps/loads of each executor, the host-link floor, and the bridge's data path."""
    from tq_jax._src import plan as tq_plan
    from tq_jax._src import program

    copy = jax.jit(jnp.copy)
    for shape_name, shape in sizes.codec:
        xd = jax.random.normal(jax.random.key(0), shape, jnp.float32).astype(jnp.bfloat16)
        xd = jax.device_put(xd, dev)
        xh = np.asarray(xd)  # the bridge's L1 chunk: host memory
        nbytes = xd.size * 2
        ms = median_ms(lambda: copy(xd), sizes.reps)
        table.append(("2 codec", f"{shape_name} {list(shape)} bf16", "device-to-device copy", ms, gibs(nbytes, ms), 1.0, None))
        copy_ms = ms
        reps = max(2, sizes.reps // 3)
        raw_up = median_ms(lambda: jax.device_put(xh, dev), sizes.reps)
        raw_down = median_ms(lambda: np.asarray(jax.device_get(xd)), sizes.reps)
        table.append(("2 codec", f"{shape_name} {list(shape)} bf16", "host-link: the tensor host->device", raw_up,
                      gibs(nbytes, raw_up), raw_up / copy_ms, None))
        table.append(("2 codec", f"{shape_name} {list(shape)} bf16", "host-link: the tensor device->host", raw_down,
                      gibs(nbytes, raw_down), raw_down / copy_ms, None))

        def row(case, what, ms, floor_ms=None):
            extra = "" if floor_ms is None else f" ({100 * floor_ms / ms:.0f} % of the host-link floor)"
            table.append(("2 codec", case, what + extra, ms, gibs(nbytes, ms), ms / copy_ms, None))

        for name, kw in CODEC_OPTIONS:
            opts = tq_jax.encode_options(**kw)
            case = f"{shape_name} {name}"
            blob = tq_jax.dumps(xd, options=opts, executor="program")
            plan = tq_plan.for_tensor(shape, "bfloat16", opts)
            block = program.block_vectors(plan, None, dev)
            enc = program.encoder(plan, block, dev, jnp.dtype(jnp.bfloat16))
            ideal = peak_ms(nbytes + len(blob), dev)
            if ideal is not None:  # the memory floor of either direction: the tensor and the blob, each moved once
                row(case, f"ideal: tensor + blob moved once at {peak_gbs(dev):,.0f} GB/s (spec sheet)", ideal)
            ms = median_ms(lambda: enc(xd)[0], sizes.reps)
            row(case, f"device program encode (blob in device memory, block {block})", ms)
            if name == CODEC_OPTIONS[0][0] and shape_name == sizes.codec[-1][0]:  # the block size, swept once
                for coords in (1 << 21, 1 << 25):
                    other = program.block_vectors(plan, max(8, coords // shape[-1]), dev)
                    enc_b = program.encoder(plan, other, dev, jnp.dtype(jnp.bfloat16))
                    ms = median_ms(lambda: enc_b(xd)[0], sizes.reps)
                    row(case, f"device program encode (blob in device memory, block {other})", ms)
            blob_dev = jax.device_put(np.frombuffer(blob, np.uint8), dev)
            coded = ()
            if plan.norm_bits:
                p = tq_jax.parse(blob)
                coded = tuple(jax.device_put(tq_jax._src.norms.decode_log_norms(c.ranges, c.codes, c.bits, c.count), dev)
                              for c in p.norms)
            tables = tuple(tq_jax._src.codec.device_tables(sg.config, dev) for sg in plan.segments)
            dec = program.decoder(plan, block, dev, jnp.dtype(jnp.bfloat16))
            ms = median_ms(lambda: dec(blob_dev, coded, tables), sizes.reps)
            row(case, "device program decode (blob already in device memory)", ms)
            host_blob = np.frombuffer(blob, np.uint8)
            down = median_ms(lambda: np.asarray(jax.device_get(blob_dev)), sizes.reps)
            up = median_ms(lambda: jax.device_put(host_blob, dev), sizes.reps)
            table.append(("2 codec", case, f"host-link floor: the blob's {len(blob)} B device->host", down,
                          gibs(nbytes, down), down / copy_ms, None))
            table.append(("2 codec", case, f"host-link floor: the blob's {len(blob)} B host->device", up,
                          gibs(nbytes, up), up / copy_ms, None))
            out = np.empty(len(blob), np.uint8)
            for ex in ("program", "blocks"):
                assert tq_jax.dumps(xd, options=opts, executor=ex) == blob, f"{ex}: bytes differ from the program's"
                ms = median_ms(lambda: tq_jax.dumps(xd, options=opts, executor=ex), reps)
                row(case, f"dumps(jax.Array) [{ex}]", ms, down)
                ms = median_ms(lambda: tq_jax.loads(blob, device=dev, executor=ex), reps)
                row(case, f"loads(device=d) [{ex}]", ms, up)
                # the bridge's data path (bridge/_src/serde.py): an L1 chunk in host memory in, bytes out
                ms = median_ms(lambda: tq_jax.dump_into(xh, out, options=opts, device=dev, executor=ex), reps)
                row(case, f"bridge encode: dump_into(host chunk, device=d) [{ex}], {nbytes / ms / 1e6:.1f} GB/s of KV",
                    ms, raw_up + down)  # floor: the chunk up, the blob down
                back = np.empty(shape, jnp.bfloat16)
                ms = median_ms(lambda: tq_jax.load_into(blob, back, device=dev, executor=ex), reps)
                row(case, f"bridge decode: load_into(blob, host chunk, device=d) [{ex}], {nbytes / ms / 1e6:.1f} GB/s of KV",
                    ms, up + raw_down)  # floor: the blob up, the tensor down


# --------------------------------------------------------------------------- step 3: attend


def random_fill(cache, key, length: int):
    """``cache`` (one, or a stack with leading axes) holding ``length`` tokens per sequence:
    random code bytes, norms in 0.5..1.5 x sqrt(head_dim), random exact window and sinks
    (attention's speed does not depend on the values)."""
    dim = cache.config.head_dim
    k1, k2, k3, k4, k5, k6, k7, k8 = jax.random.split(key, 8)
    norm = lambda k, x: (jax.random.uniform(k, x.shape, jnp.float32, 0.5, 1.5) * math.sqrt(dim)).astype(x.dtype)  # noqa: E731
    normal = lambda k, x: jax.random.normal(k, x.shape, jnp.float32).astype(x.dtype)  # noqa: E731
    return dataclasses.replace(
        cache,
        k_codes=jax.random.bits(k1, cache.k_codes.shape, jnp.uint8),
        v_codes=jax.random.bits(k2, cache.v_codes.shape, jnp.uint8),
        k_norms=norm(k3, cache.k_norms), v_norms=norm(k4, cache.v_norms),
        k_window=normal(k5, cache.k_window), v_window=normal(k6, cache.v_window),
        k_sinks=normal(k7, cache.k_sinks), v_sinks=normal(k8, cache.v_sinks),
        lengths=jnp.full(cache.lengths.shape, length, jnp.int32),
    )


def random_cache(key, batch, tokens, heads, dim, *, block_tokens=None, **init_kw):
    """A full unpaged cache of ``tokens`` random codes per sequence, the default exact window
    (the last 128 tokens) and sinks; ``init_kw``: ``kvcache.init``'s (bits, options, ...)."""
    c = kvcache.init(batch, tokens, heads, dim, seed=42, block_tokens=block_tokens, **init_kw)
    return random_fill(c, key, tokens)


@jax.jit
def dense_einsum(q, k, v):
    """q [B, H, G, D], k/v [B, H, T, D] bf16: one einsum-softmax-einsum, float32 accumulation."""
    s = jnp.einsum("bhgd,bhtd->bhgt", q, k, preferred_element_type=jnp.float32) / np.float32(math.sqrt(q.shape[-1]))
    p = jax.nn.softmax(s, axis=-1).astype(jnp.bfloat16)
    return jnp.einsum("bhgt,bhtd->bhgd", p, v, preferred_element_type=jnp.float32)


dense_dpa = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v))


def dpa_bf16(q, k, v):
    """``jax.nn.dot_product_attention`` over q ``[Q, Hq, D]``, k/v ``[T, H, D]`` rounded to
    bf16, the queries at the last Q positions (causal); float64 out."""
    n_q, t = q.shape[0], k.shape[0]
    allowed = np.arange(t)[None, :] <= (t - n_q + np.arange(n_q))[:, None]
    bf = lambda x: jnp.asarray(x, jnp.bfloat16)[None]  # noqa: E731
    return np.asarray(jax.nn.dot_product_attention(bf(q), bf(k), bf(v), mask=jnp.asarray(allowed)[None, None])[0], np.float64)


def rms_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.sqrt(np.sum((out - ref) ** 2) / max(np.sum(ref**2), 1e-300)))


def bf16_accuracy(sizes: Sizes, table: list):
    """The bf16 mode on the device, over step 1's cases with bf16 queries: its relative RMS
    error against float64 attention over the decoded blob, beside
    ``jax.nn.dot_product_attention``'s over the same K/V in bf16; above ``BF16_BOUND`` times
    that, the row says FAILED (step 1 holds the exact mode to float32 level)."""
    rng = np.random.default_rng(3)
    for rot, kb, vb, group, ps, q_len, dim in KV_CASES[: sizes.kv_cases]:
        tag = f"{rot} {kb}/{vb} gqa{group} {'paged' + str(ps) if ps else 'unpaged'} q{q_len} d{dim}"
        cache, ks, vs, q = filled_cache(rng, kb, vb, rot, ps, group, q_len, dim)
        qb = jnp.asarray(q, jnp.bfloat16)
        q64 = np.asarray(qb, np.float64)
        out = np.asarray(gpu_attend(cache, qb, pallas_gpu.BF16_TUNING), np.float64)
        refs, dpas = [], []
        for b in range(len(ks)):
            kv = np.asarray(tq_jax.loads(kvcache.export(cache, seq=b), dtype=jnp.float32))
            refs.append(dense_attention(q64[b], kv[0, 0], kv[1, 0]))
            dpas.append(dpa_bf16(q64[b], kv[0, 0], kv[1, 0]))
        err, dpa_err = rms_err(out, np.stack(refs)), rms_err(np.stack(dpas), np.stack(refs))
        ratio = err / dpa_err
        verdict = "ok" if ratio <= BF16_BOUND else "FAILED"
        what = (f"pallas_gpu bf16 mode accuracy {verdict}: rms err {err:.2e} = {ratio:.2f}x "
                f"jax.nn.dot_product_attention's {dpa_err:.2e} (bound {BF16_BOUND}x)")
        table.append(("3 attend", f"bf16 accuracy {tag}", what, None, None, None, None))
        print(f"  {tag}: {what}", flush=True)


def step_attend(sizes: Sizes, table: list):
    h, g, d = sizes.kv_heads, sizes.group, sizes.dim
    dev = jax.devices()[0]
    if on_tpu():
        table.append(("3 attend", "bf16 accuracy", "the bf16 mode is the GPU kernel's: not run on a TPU", None, None, None, None))
    else:
        bf16_accuracy(sizes, table)
    copy = jax.jit(jnp.copy)
    for b in sizes.batches:
        for t in sizes.tokens:
            key = jax.random.key(t + b)
            kq, kk, kv_ = jax.random.split(key, 3)
            case = f"batch {b}, {t} tokens"
            q = jax.random.normal(kq, (b, 1, h * g, d), jnp.bfloat16)
            dense_bytes = 2 * b * t * h * d * 2
            kd = jax.random.normal(kk, (b, t, h, d), jnp.bfloat16)
            vd = jax.random.normal(kv_, (b, t, h, d), jnp.bfloat16)
            copy_ms = median_ms(lambda: copy(kd), sizes.reps) * 2  # K and V
            table.append(("3 attend", case, "copy of the bf16 K/V (device)", copy_ms, gibs(dense_bytes, copy_ms), None, None))
            if peak_ms(dense_bytes, dev) is not None:
                table.append(("3 attend", case, f"ideal: the bf16 K/V read once at {peak_gbs(dev):,.0f} GB/s (spec sheet)",
                              peak_ms(dense_bytes, dev), gibs(dense_bytes, peak_ms(dense_bytes, dev)), None, None))
            dpa_ms = median_ms(lambda: dense_dpa(q, kd, vd), sizes.reps)
            table.append(("3 attend", case, "dense bf16: jax.nn.dot_product_attention", dpa_ms, gibs(dense_bytes, dpa_ms), None, 1.0))
            qh = q.reshape(b, h, g, d)
            kt, vt = kd.transpose(0, 2, 1, 3), vd.transpose(0, 2, 1, 3)
            ein_ms = median_ms(lambda: dense_einsum(qh, kt, vt), sizes.reps)
            table.append(("3 attend", case, "dense bf16: einsum", ein_ms, gibs(dense_bytes, ein_ms), None, ein_ms / dpa_ms))
            del kd, vd, kt, vt
            best = min(dpa_ms, ein_ms)
            for cname, ckw in ATTEND_CACHES:
                cache = random_cache(key, b, t, h, d, **ckw)
                cbytes = sum(int(x.size) * x.dtype.itemsize for x in (cache.k_codes, cache.v_codes, cache.k_norms, cache.v_norms))
                if peak_ms(cbytes, dev) is not None:
                    table.append(("3 attend", f"{case} {cname}", f"ideal: codes and norms read once at "
                                  f"{peak_gbs(dev):,.0f} GB/s (spec sheet)", peak_ms(cbytes, dev),
                                  gibs(cbytes, peak_ms(cbytes, dev)), None, peak_ms(cbytes, dev) / best))
                if on_tpu():  # the TPU kernel has no tuning knobs yet
                    cases = [("kvcache pallas_tpu", lambda: tpu_attend(cache, q))]
                else:
                    cases = [(f"kvcache pallas_gpu {mode}", lambda tuning=tuning: gpu_attend(cache, q, tuning))
                             for mode, tuning in KERNEL_MODES]
                if b == sizes.xla_batch:
                    cases.insert(0, ("kvcache xla", lambda: kvcache.attend(cache, q, impl="xla")))
                if sizes.variants and t == sizes.tokens[1] and b == sizes.xla_batch and not on_tpu():  # the GPU sweep at 32k
                    sweep = [("exact", dict(block=128)), ("exact", dict(dot="tf32x3")), ("exact", dict(num_warps=8)),
                             ("bf16", dict(block=64)), ("bf16", dict(block=256)), ("bf16", dict(block=512)),
                             ("bf16", dict(num_warps=8)), ("bf16", dict(block=256, num_warps=8)),
                             ("bf16", dict(num_stages=3)), ("bf16", dict(lookup="select")), ("bf16", dict(lookup="pair")),
                             ("bf16", dict(block=256, lookup="pair")), ("bf16", dict(splits=1))]
                    for mode, tun in sweep:
                        tuning = pallas_gpu.Tuning(mode=mode, **tun)
                        name = ", ".join(f"{k} {v}" for k, v in tun.items())
                        cases.append((f"kvcache pallas_gpu {mode}, {name}", lambda tuning=tuning: gpu_attend(cache, q, tuning)))
                    big = dataclasses.replace(cache, config=dataclasses.replace(cache.config, block_tokens=min(512, t)))
                    cases.append(("kvcache xla, block 512", lambda: kvcache.attend(big, q, impl="xla")))
                for name, fn in cases:
                    try:
                        ms = median_ms(fn, sizes.reps)
                    except Exception as e:  # a variant that does not compile is a row, not the end of the run
                        table.append(("3 attend", f"{case} {cname}", f"{name}: FAILED {type(e).__name__}: {str(e)[:200]}",
                                      None, None, None, None))
                        continue
                    table.append(("3 attend", f"{case} {cname}", name, ms, gibs(cbytes, ms), None, ms / best))
                    print(f"  {case} {cname} {name}: {ms:.3f} ms ({ms / dpa_ms:.2f}x dot_product_attention, "
                          f"{ms / ein_ms:.2f}x einsum)", flush=True)
                del cache


# --------------------------------------------------------------------------- step 4: model


MODEL_KINDS = [  # (label, cache kind, kvcache.init keywords, attend impl, kernel tuning)
    ("bf16 cache, jax.nn.dot_product_attention", "bf16", {}, None, None),
    ("tq 4/4, attend impl=pallas_gpu exact", "tq", ATTEND_CACHES[0][1], "pallas_gpu", pallas_gpu.DEFAULT_TUNING),
    ("tq 4/4, attend impl=pallas_gpu bf16", "tq", ATTEND_CACHES[0][1], "pallas_gpu", pallas_gpu.BF16_TUNING),
    ("tq turbo-3.5, attend impl=pallas_gpu bf16", "tq", ATTEND_CACHES[1][1], "pallas_gpu", pallas_gpu.BF16_TUNING),
    ("tq turbo-3.5, attend impl=pallas_gpu exact", "tq", ATTEND_CACHES[1][1], "pallas_gpu", pallas_gpu.DEFAULT_TUNING),
]


def model_kinds() -> list:
    """:data:`MODEL_KINDS` for this backend: on a TPU the TPU kernel stands in for the GPU
    kernel's two modes (one row per cache)."""
    if not on_tpu():
        return MODEL_KINDS
    kinds = [MODEL_KINDS[0]]
    for name, ckw in ATTEND_CACHES:
        kinds.append((f"tq {name}, attend impl=pallas_tpu", "tq", ckw, "pallas_tpu", None))
    return kinds


def model_api():
    """``(LlamaConfig, init_cache, make_step, decoder_layer, output_logits)`` of the SmolLM2
    example (run from the repository root, where ``examples`` is importable)."""
    from examples.smollm2 import LlamaConfig, init_cache, make_step
    from examples.smollm2.model import decoder_layer, output_logits

    return LlamaConfig, init_cache, make_step, decoder_layer, output_logits


def random_params(cfg, key):
    d, hd = cfg.hidden, cfg.head_dim
    shapes = dict(wq=(d, cfg.heads * hd), wk=(d, cfg.kv_heads * hd), wv=(d, cfg.kv_heads * hd), wo=(cfg.heads * hd, d),
                  w_gate=(d, cfg.ffn), w_up=(d, cfg.ffn), w_down=(cfg.ffn, d))
    keys = jax.random.split(key, len(shapes) + 1)
    layers = {n: jax.random.normal(k, (cfg.layers, *s), jnp.float32) * 0.02 for (n, s), k in zip(shapes.items(), keys)}
    layers["attn_norm"] = jnp.ones((cfg.layers, d), jnp.float32)
    layers["mlp_norm"] = jnp.ones((cfg.layers, d), jnp.float32)
    return {"embed": jax.random.normal(keys[-1], (cfg.vocab_size, d), jnp.float32) * 0.02,
            "norm": jnp.ones((d,), jnp.float32), "layers": layers}


def dpa_attend(cache, q, k, v):
    """One decode token on a layer's bf16 cache ``(k [B, cap, H, D], v, n [B])``: write it at
    ``n``, then ``jax.nn.dot_product_attention`` over the first ``n + 1`` tokens (a fused
    kernel: cuDNN's where it applies, else XLA's)."""
    kc, vc, n = cache
    rows = jnp.arange(kc.shape[0])
    kc = kc.at[rows, n].set(k[:, 0].astype(kc.dtype))
    vc = vc.at[rows, n].set(v[:, 0].astype(vc.dtype))
    out = jax.nn.dot_product_attention(q.astype(kc.dtype), kc, vc, key_value_seq_lengths=n + 1)
    return out.astype(q.dtype), (kc, vc, n + 1)


def tq_attend(impl: str, tuning):
    def attend(cache, q, k, v):
        cache = kvcache.append(cache, k, v)
        return kvcache.attend(cache, q, impl=impl, tuning=tuning), cache

    return attend


def layered_step(cfg, layer_attend, decoder_layer, output_logits):
    """A jitted decode step over one cache per layer (a list, layers unrolled, so each layer's
    cache is its own buffer, updated in place): ``step(params, caches, pos [B, 1], tok [B, 1])``."""

    def step(params, caches, pos, tok):
        h = params["embed"][tok]
        new = []
        for i, c in enumerate(caches):
            p = jax.tree.map(lambda x, i=i: x[i], params["layers"])
            h, c = decoder_layer(cfg, h, p, pos, lambda q, k, v, c=c: layer_attend(c, q, k, v))
            new.append(c)
        return output_logits(params, cfg, h), new

    return jax.jit(step, donate_argnums=1)


def time_decode(step, params, caches, batch: int, ctx: int, steps: int):
    """Median ms of ``steps - 1`` decode steps after a compiling one, from ``ctx`` tokens."""
    tok = jnp.zeros((batch, 1), jnp.int32)
    logits, caches = step(params, caches, jnp.full((batch, 1), ctx, jnp.int32), tok)
    _ready(logits)
    ts = []
    for i in range(1, steps):
        tok = jnp.argmax(logits[:, -1:], axis=-1).astype(jnp.int32)
        t0 = time.perf_counter()
        logits, caches = step(params, caches, jnp.full((batch, 1), ctx + i, jnp.int32), tok)
        _ready(logits)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def step_model(sizes: Sizes, table: list):
    """SmolLM2-135M's architecture (random weights) decoding from ``ctx`` tokens of random
    cache contents: a bf16 cache attended with ``jax.nn.dot_product_attention`` against the
    compressed caches with the GPU kernel's modes, each in the same decode step (one cache
    buffer per layer); then the example's own step (``examples.smollm2.make_step``: layers in a
    ``lax.scan``, ``attend``'s default impl) at the first size."""
    LlamaConfig, init_cache, make_step, decoder_layer, output_logits = model_api()
    names = {f.name for f in dataclasses.fields(LlamaConfig)}
    kw = dict(rope_theta=100000.0, rms_eps=1e-5, context_length=65536, tied_embeddings=True, **sizes.model)
    cfg = LlamaConfig(**{k: v for k, v in kw.items() if k in names})
    params = random_params(cfg, jax.random.key(5))
    steps, hkv, hd = sizes.decode_steps, cfg.kv_heads, cfg.head_dim
    for bi, b in enumerate(sizes.model_batches):
        for ci, ctx in enumerate(sizes.contexts):
            cap = ctx + steps + 8
            case = f"batch {b}, {ctx} tokens of context"
            base_ms = None
            for label, kind, ckw, impl, tuning in model_kinds()[: sizes.model_kinds]:
                keys = jax.random.split(jax.random.key(ctx + b), 2 * cfg.layers)
                if kind == "bf16":
                    caches = [(jax.random.normal(keys[2 * i], (b, cap, hkv, hd), jnp.bfloat16),
                               jax.random.normal(keys[2 * i + 1], (b, cap, hkv, hd), jnp.bfloat16),
                               jnp.full((b,), ctx, jnp.int32)) for i in range(cfg.layers)]
                    step = layered_step(cfg, dpa_attend, decoder_layer, output_logits)
                else:
                    caches = [random_fill(kvcache.init(b, cap, hkv, hd, **ckw), keys[2 * i], ctx) for i in range(cfg.layers)]
                    step = layered_step(cfg, tq_attend(impl, tuning), decoder_layer, output_logits)
                nbytes = sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(caches))
                try:
                    ms = time_decode(step, params, caches, b, ctx, steps)
                except Exception as e:  # a kind that does not compile is a row, not the end of the run
                    table.append(("4 model", case, f"{label}: FAILED {type(e).__name__}: {str(e)[:200]}", None, None, None, None))
                    continue
                finally:
                    del caches
                base_ms = ms if kind == "bf16" else base_ms
                table.append(("4 model", case, f"{label}: {b / (ms / 1e3):.0f} tokens/s, cache {nbytes / 2**20:.0f} MiB",
                              ms, None, None, ms / base_ms if base_ms else None))
                print(f"  {case} {label}: {ms:.2f} ms/step", flush=True)
            if bi == 0 and ci == 0:  # what examples.smollm2 itself runs: one stacked cache in a lax.scan
                cache = random_fill(init_cache(cfg, "tq", b, cap, **ATTEND_CACHES[0][1]), jax.random.key(7), ctx)
                nbytes = sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(cache))
                ex = jax.jit(make_step(cfg), donate_argnums=1)
                ms = time_decode(lambda p, c, pos, tok: ex(p, c, tok), params, cache, b, ctx, steps)
                label = "tq 4/4 in examples.smollm2's make_step (lax.scan over stacked layers), attend impl=auto"
                table.append(("4 model", case, f"{label}: {b / (ms / 1e3):.0f} tokens/s, cache {nbytes / 2**20:.0f} MiB",
                              ms, None, None, ms / base_ms if base_ms else None))
                print(f"  {case} {label}: {ms:.2f} ms/step", flush=True)
                del cache


# --------------------------------------------------------------------------- compile check


def compile_check() -> bool:
    """Compile and run the backend's kernel once per configuration (and, on a GPU, tuning);
    compare with XLA."""
    rng = np.random.default_rng(2)
    ok_all = True
    tunings = [("default", pallas_gpu.DEFAULT_TUNING)] + [
        (n, pallas_gpu.Tuning(**kw)) for n, kw in (("gather lookup", dict(lookup="gather")), ("tf32x3 dots", dict(dot="tf32x3")),
                                                    ("ieee dots", dict(dot="ieee")), ("block 128", dict(block=128)),
                                                    ("8 warps", dict(num_warps=8)), ("3 splits", dict(splits=3)))
    ]
    if on_tpu():
        tunings = [("default", None)]
    cases = [(c, tunings if i == 0 else tunings[:1]) for i, c in enumerate(KV_CASES)]
    cases.append((("haar", 4, 4, 3, None, 40, 64), tunings[:1]))  # 120 rows: two row tiles (a prefill)
    for (rot, kb, vb, group, ps, q_len, dim), tuns in cases:
        cache, _, _, q = filled_cache(rng, kb, vb, rot, ps, group, q_len, dim)
        ref = np.asarray(kvcache.attend(cache, q, impl="xla"))
        for name, tun in tuns:
            tag = f"{rot} {kb}/{vb} gqa{group} {'paged' + str(ps) if ps else 'unpaged'} q{q_len} d{dim}, {name}"
            t0 = time.perf_counter()
            try:
                out = np.asarray(tpu_attend(cache, q) if on_tpu() else gpu_attend(cache, q, tun))
            except Exception as e:
                ok_all &= name != "default"
                print(f"  [FAIL] {tag}: {type(e).__name__}: {str(e)[:2000]}", flush=True)
                continue
            err = rel_err(out, ref)
            ok = err <= 1e-3
            ok_all &= ok or name != "default"
            print(f"  [{'ok' if ok else 'FAIL'}] {tag}: max rel err vs xla {err:.1e}, compile+run {time.perf_counter() - t0:.1f} s", flush=True)
    for name, ok, detail in check_codec(jax.devices()[0]):
        ok_all &= ok
        print(f"  [{'ok' if ok else 'FAIL'}] {name} {detail}", flush=True)
    return ok_all


# --------------------------------------------------------------------------- main


def commit_of(arg: str | None) -> str:
    if arg:
        return arg
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                               text=True, check=True).stdout.strip()
        return head + (" (with uncommitted changes)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout: pass --commit)"


def render(table: list) -> list:
    lines = ["| step | case | what | ms | GiB/s | x copy | x dense bf16 |", "|---|---|---|---|---|---|---|"]
    fmt = lambda x, f: "" if x is None else format(x, f)  # noqa: E731
    for step, case, what, ms, gbs, xcopy, xdense in table:
        lines.append(f"| {step} | {case} | {what} | {fmt(ms, '.3f')} | {fmt(gbs, '.1f')} | {fmt(xcopy, '.2f')} | {fmt(xdense, '.2f')} |")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("tq-jax-results"),
                    help="directory of the result file (default: %(default)s, under the current directory; "
                         "--out benchmarks/results refreshes the committed results)")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on CPU, interpreted Pallas (a CI test)")
    ap.add_argument("--compile-check", action="store_true", help="only compile + check the GPU kernel per config")
    ap.add_argument("--steps", default="1,2,3,4")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--commit", default=None)
    ap.add_argument("--keep-going", action="store_true")
    args = ap.parse_args(argv)
    dev = jax.devices()[0]
    print(f"jax {jax.__version__} on {device_label(dev)} ({dev.platform}), python {platform.python_version()}", flush=True)
    if args.compile_check:
        return 0 if compile_check() else 1
    if dev.platform == "cpu" and not args.cpu_smoke:
        print("no accelerator: run with --cpu-smoke for the tiny CPU run", file=sys.stderr)
        return 2
    sizes = SMOKE if args.cpu_smoke else FULL
    if args.reps:
        sizes = dataclasses.replace(sizes, reps=args.reps)
    steps = {int(s) for s in args.steps.split(",") if s}
    table, checks, t_start = [], [], time.perf_counter()
    step_fns = {2: lambda: step_codec(dev, sizes, table), 3: lambda: step_attend(sizes, table), 4: lambda: step_model(sizes, table)}
    status = 0
    try:
        if 1 in steps:
            print("step 1: correctness", flush=True)
            t0 = time.perf_counter()
            checks = step_correctness(dev, sizes, args.keep_going)
            print(f"step 1: {time.perf_counter() - t0:.0f} s", flush=True)
        for s in sorted(steps - {1}):
            print(f"step {s}", flush=True)
            t0 = time.perf_counter()
            step_fns[s]()
            print(f"step {s}: {time.perf_counter() - t0:.0f} s", flush=True)
    except CheckFailed as e:
        print(f"STOPPED: {e}", flush=True)
        status = 1
    device = re.sub(r"[^a-z0-9]+", "_", ("cpu_smoke" if args.cpu_smoke else dev.device_kind).lower()).strip("_")
    lines = [
        f"# Accelerator proof on {device_label(dev)}",
        "",
        f"Command: `python -m benchmarks.accelerator {' '.join(argv if argv is not None else sys.argv[1:])}`  ",
        f"Commit: {commit_of(args.commit)}  ",
        f"jax {jax.__version__}, {dev.platform}, python {platform.python_version()}; "
        f"{time.perf_counter() - t_start:.0f} s in all. Times: median of {sizes.reps} calls after a warm-up call. "
        + (f"Spec-sheet HBM bandwidth of this chip: {peak_gbs(dev):,.0f} GB/s." if peak_gbs(dev) else
           "No spec-sheet HBM bandwidth known for this device (benchmarks/accelerator.py PEAK_GBS)."),
        "",
        "Step 1 (correctness on the device): "
        + (f"{sum(ok for _, ok, _ in checks)} of {len(checks)} checks passed." if checks else "not run.")
        + ("" if status == 0 else " **Stopped on a failure.**"),
        "",
    ]
    lines += [f"- {'ok' if ok else 'FAIL'}: {name} {detail}" for name, ok, detail in checks if not ok]
    lines += ["", *render(table), "",
              "GiB/s: the bytes a case reads (step 2: the bf16 tensor; step 3: the cache's codes and norms, or the "
              "dense bf16 K/V) per second. x copy: time / a device-to-device copy of the same tensor. x dense bf16: "
              "time / the faster dense bf16 attention at that length (step 3), or / the bf16 cache's step (step 4). "
              "Step 3's caches hold random codes; step 4's model is SmolLM2-135M's architecture with random weights "
              "(decode speed does not depend on the values), prefilled with random tokens."]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"accelerator_{device}.md"
    path.write_text(text)
    print(f"wrote {path}")
    return status


if __name__ == "__main__":
    sys.exit(main())
