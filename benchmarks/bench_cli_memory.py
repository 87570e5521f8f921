"""Peak memory of ``tq-jax compress`` / ``decompress`` on a file of >= 1 GB.

Generates a safetensors file in a temporary directory (streamed, chunk by chunk: the
generator never holds the file either) with one W1-layout KV tensor
``[2, 32, 8192, 8, 128]`` bf16 (1 GiB) plus a few small pass-through tensors, runs the
command in a child process and reports the child's peak RSS (``ru_maxrss``) next to
the file size, then deletes everything.

Usage::

    python benchmarks/bench_cli_memory.py [--gib 1.0] [--chunk-mb 64] [--dir /tmp]

Not part of the test suite (it writes ~1.3 GB and takes a minute or so).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from tq_jax._src.batch import DEFAULT_CHUNK_BYTES


def make_file(path: str, gib: float, seed: int = 0) -> int:
    import jax.numpy as jnp

    from tq_jax._src import safetensors_io as st

    tokens = max(8, int(round(gib * 2**30 / (2 * 32 * 8 * 128 * 2))))
    shape = (2, 32, tokens, 8, 128)
    specs = [("kv", "BF16", shape), ("position_ids", "I64", (tokens,)), ("scale", "F32", (32,))]
    rng = np.random.default_rng(seed)
    with st.SafetensorsWriter(path, specs, {"source": "bench_cli_memory"}) as w:
        per_layer = (tokens, 8, 128)
        for _ in range(2 * 32):  # one (T, H, D) slab at a time: 16 MiB of bf16 per GiB of file
            w.write(rng.standard_normal(per_layer, dtype=np.float32).astype(jnp.bfloat16))
        w.write(np.arange(tokens, dtype=np.int64))
        w.write(np.ones(32, np.float32))
    return os.path.getsize(path)


def run(cmd: list[str]) -> tuple[float, float]:
    """Run a child; return (seconds, its peak RSS in MiB)."""
    t = time.perf_counter()
    pid = subprocess.Popen(cmd).pid
    _, status, usage = os.wait4(pid, 0)
    dt = time.perf_counter() - t
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"command failed: {' '.join(cmd)}")
    return dt, usage.ru_maxrss / 1024  # Linux: KiB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0, help="size of the KV tensor in GiB (default 1)")
    ap.add_argument("--chunk-mb", type=float, default=DEFAULT_CHUNK_BYTES / 2**20,
                    help="the command's --chunk-mb (default: the command's default)")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    args = ap.parse_args()

    work = tempfile.mkdtemp(prefix="tq-jax-mem-", dir=args.dir)
    try:
        src = os.path.join(work, "kv.safetensors")
        comp = os.path.join(work, "kv.tq.safetensors")
        back = os.path.join(work, "kv.back.safetensors")
        t = time.perf_counter()
        size = make_file(src, args.gib)
        print(f"generated {src}: {size / 2**20:,.0f} MiB in {time.perf_counter() - t:.1f} s")
        base = [sys.executable, "-m", "tq_jax"]
        opts = ["--chunk-mb", str(args.chunk_mb), "--quiet"]
        dt0, rss0 = run([sys.executable, "-c", "import jax, tq_jax; jax.numpy.zeros(1).block_until_ready()"])
        dt1, rss1 = run(base + ["compress", src, comp, "--bits", str(args.bits)] + opts)
        csize = os.path.getsize(comp)
        dt2, rss2 = run(base + ["decompress", comp, back] + opts)
        print(f"baseline (python + jax + tq_jax imported): peak RSS {rss0:,.0f} MiB")
        print(f"compress   {size / 2**20:,.0f} MiB -> {csize / 2**20:,.0f} MiB in {dt1:.1f} s "
              f"({size / 1e6 / dt1:,.0f} MB/s): peak RSS {rss1:,.0f} MiB ({100 * rss1 * 2**20 / size:.0f}% of the file)")
        print(f"decompress {csize / 2**20:,.0f} MiB -> {os.path.getsize(back) / 2**20:,.0f} MiB in {dt2:.1f} s "
              f"({size / 1e6 / dt2:,.0f} MB/s): peak RSS {rss2:,.0f} MiB ({100 * rss2 * 2**20 / size:.0f}% of the file)")
        print(f"chunk budget {args.chunk_mb:g} MiB, {args.bits} bits, {os.cpu_count()} cpus")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
