"""Do serving shapes the tests never use lower for a TPU with the Mosaic kernel?

Question: tests/test_tpu.py exports a covering matrix of head_dim 64/128/256, GQA
1/3/4/8, batch 1/16, q_len 1/4, pages of 16/64 tokens and three ragged pool shapes. Do
the shapes of real models outside that matrix (other GQA ratios, batches, page sizes,
q_len, bit splits, exact-window sizes, and head_dim 96) also lower for
``platforms=["tpu"]`` with exactly one ``tpu_custom_call``, blocks within Mosaic's
tiling, for both forms (``kvcache.append`` + ``attend`` and ``ragged.write`` +
``ragged.attend``)?

Answer: written in benchmarks/results/tpu_lowering_heldout.md, one row per shape with
what the exported module holds. Lowering is not compiling: libtpu's Mosaic passes and
the speed stay unproven without a TPU (docs/tpu.md).

    python -m benchmarks.studies.tpu_heldout_lowering --out benchmarks/results/tpu_lowering_heldout.md
"""

from __future__ import annotations

import argparse
import re
import subprocess
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from tq_jax import kvcache
from tq_jax._src.kvcache import pallas_tpu, ragged

KERNEL = "tpu_custom_call"

# (model the shape is taken from, kv_heads, GQA, head_dim, batch, q_len, page_size, max_len,
#  options, window, sinks); none of these rows is a row of tests/test_tpu.py's MATRIX.
STEPS = [
    ("Llama-3-8B decode", 8, 4, 128, 32, 1, 32, 8192, "turbo-4", None, None),
    ("Llama-3-8B spec. decode", 8, 4, 128, 8, 8, 128, 4096, None, None, None),
    ("Qwen2.5-7B", 4, 7, 128, 4, 2, 32, 16384, "turbo-3.5", 64, 8),
    ("Gemma-2-9B", 8, 2, 256, 2, 1, 128, 8192, {"key_bits": 6, "value_bits": 4}, 0, 0),
    ("Phi-3-mini (head_dim 96)", 32, 1, 96, 4, 1, 32, 4096, "turbo-4", None, None),
    ("SmolLM2-135M", 3, 3, 64, 64, 1, None, 2048, "turbo-2.5", 256, 4),
    ("Mistral-7B unpaged", 8, 4, 128, 1, 16, None, 32768, {"key_bits": 3, "value_bits": 3}, 0, 0),
]

# (model, kv_heads, GQA, head_dim, tokens in the flat batch, max_seqs, page_size, options)
RAGGED = [
    ("Llama-3-8B engine step", 8, 4, 128, 64, 16, 32, "turbo-4"),
    ("Qwen2.5-7B engine step", 4, 7, 128, 24, 8, 128, None),
    ("Gemma-2-9B engine step", 8, 2, 256, 16, 4, 64, "turbo-3.5"),
]


def _custom_calls(module: str) -> list:
    return re.findall(r"stablehlo\.custom_call @([\w$.]+)", module)


def _opts(options):
    return options if isinstance(options, dict) else {"options": options}


def _label(options) -> str:
    if options is None:
        return "4/4"
    if isinstance(options, dict):
        return f"K{options['key_bits']}V{options['value_bits']}"
    return options


def step_row(model, kv_heads, group, dim, batch, q_len, page, max_len, options, window, sinks):
    kw = {k: v for k, v in (("window", window), ("sinks", sinks), ("page_size", page)) if v is not None}
    cache = jax.eval_shape(lambda: kvcache.init(batch, max_len, kv_heads, dim, **_opts(options), **kw))
    kv = jax.ShapeDtypeStruct((batch, q_len, kv_heads, dim), jnp.bfloat16)
    q = jax.ShapeDtypeStruct((batch, q_len, kv_heads * group, dim), jnp.bfloat16)

    def step(cache, k, v, q):
        cache = kvcache.append(cache, k, v)
        return cache, kvcache.attend(cache, q, impl="pallas_tpu")

    t0 = time.perf_counter()
    module = jax.export.export(jax.jit(step), platforms=["tpu"])(cache, kv, kv, q).mlir_module()
    seconds = time.perf_counter() - t0
    rows = group * q_len
    unit = pallas_tpu.unit_tokens(cache, rows)
    layout = pallas_tpu.blocks(cache, rows, unit)
    tiled = all(pallas_tpu.tiling_ok(b.block, b.array, b.dtype) for b in layout)
    cfg = cache.config
    paging = f"pages of {page}" if page else "unpaged"
    shape = (f"kv {kv_heads}, GQA {group}, d {dim}, batch {batch}, q_len {q_len}, {paging}, {max_len} tokens, "
             f"window {cfg.window}, sinks {cfg.sinks}")
    return model, "append + attend", shape, _label(options), _custom_calls(module), tiled, \
        pallas_tpu.vmem_bytes(layout), seconds


def ragged_row(model, kv_heads, group, dim, tokens, max_seqs, page, options):
    pool = jax.eval_shape(lambda: ragged.init_pool(max_seqs * 64, page, kv_heads, dim, options, max_seqs=max_seqs))
    ints = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    kv = jax.ShapeDtypeStruct((tokens, kv_heads, dim), jnp.bfloat16)
    q = jax.ShapeDtypeStruct((tokens, kv_heads * group, dim), jnp.bfloat16)

    def step(pool, k, v, slots, positions, q, kv_lens, page_indices, cu_q_lens, num_seqs):
        pool = ragged.write(pool, k, v, slots, positions=positions)
        return pool, ragged.attend(pool, q, kv_lens, page_indices, cu_q_lens, num_seqs, impl="pallas_tpu")

    args = (pool, kv, kv, ints(tokens), ints(tokens), q, ints(max_seqs), ints(max_seqs, 64), ints(max_seqs + 1),
            ints(1))
    t0 = time.perf_counter()
    module = jax.export.export(jax.jit(step), platforms=["tpu"])(*args).mlir_module()
    seconds = time.perf_counter() - t0
    shape = f"kv {kv_heads}, GQA {group}, d {dim}, {tokens} query tokens over {max_seqs} sequences, pages of {page}"
    return model, "ragged write + attend", shape, _label(options), _custom_calls(module), None, None, seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="markdown results file (else printed)")
    args = p.parse_args()
    rows = [step_row(*s) for s in STEPS] + [ragged_row(*s) for s in RAGGED]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    lines = [
        "# Held-out TPU lowering: serving shapes the tests do not use",
        "",
        f"Commit `{commit}`; `python -m benchmarks.studies.tpu_heldout_lowering --out "
        f"benchmarks/results/tpu_lowering_heldout.md`; jax {jax.__version__} on a CPU host, "
        "`jax.export.export(jax.jit(step), platforms=[\"tpu\"])`.",
        "",
        "Each row exports one serving step for a TPU and lists the custom calls in the lowered module: "
        "one `tpu_custom_call` is the Mosaic kernel (append/write and the rest are XLA). `tiled`: every "
        "block the kernel asks for meets Mosaic's tiling (`pallas_tpu.tiling_ok`); VMEM: the kernel's "
        "double-buffered blocks. Lowering proves neither that libtpu compiles the kernel nor its speed.",
        "",
        "| model shape | step | shape | cache | custom calls | tiled | VMEM | export s |",
        "|---|---|---|---|---|---|---:|---:|",
    ]
    for model, kind, shape, label, calls, tiled, vmem, seconds in rows:
        lines.append(
            f"| {model} | {kind} | {shape} | {label} | {', '.join(calls) or 'none'} | "
            f"{'-' if tiled is None else 'yes' if tiled else 'NO'} | "
            f"{'-' if vmem is None else f'{vmem / 2**20:.2f} MiB'} | {seconds:.1f} |"
        )
    ok = all(calls == [KERNEL] and tiled is not False for _, _, _, _, calls, tiled, _, _ in rows)
    lines += ["", f"Every row carries exactly one `{KERNEL}`: {'yes' if ok else 'NO'}."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
