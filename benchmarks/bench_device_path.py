"""Where the data lives: dumps of a jax.Array and loads(device=) on W1, by path.

W1 = [2, 32, 256, 8, 128] bfloat16 Gaussian (33.5 MB), 4-bit v1 and turbo-3.5.
Every case is timed in the same process, rounds interleaved, median of the rounds'
best-of-3, next to two yardsticks: a memcpy of W1 on the host, and a host round trip
of W1 (``device_get`` + ``device_put``: what an encode or decode that left the device
would add).

Paths:
- host: the pipelined host path (numpy input; ``loads`` into an aligned host buffer).
- device path [program]: one compiled program per blob writes the whole blob on the
  device and only its bytes come back; ``loads(device=d)`` is its mirror
  (``tq_jax._src.program``). This is what an accelerator takes; on the CPU backend it is
  forced here (``executor="program"``).
- device path [blocks]: the per-block dispatch the program replaced (a jax.Array cut
  into blocks on its device, each block its own kernel call; decode assembles the
  blocks' results on the device), kept selectable (``executor="blocks"``).
- XLA concatenate: the resident decode's assembly step alone (its blocks' results
  joined into the tensor by one jitted program).

    python benchmarks/bench_device_path.py                             # prints the table
    python benchmarks/bench_device_path.py --out benchmarks/results/   # + device_path_<platform>.md there
    python benchmarks/bench_device_path.py --quick                     # fewer rounds
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import tq_jax
from tq_jax._src import blocks
from timing import best_of

W1 = (2, 32, 256, 8, 128)
DEVICE_EXECUTORS = ("program", "blocks")  # tq_jax.dumps' executor= values of the device path


def cases(dev):
    x = np.random.default_rng(0).standard_normal(W1, np.float32).astype(jnp.bfloat16)
    xd = jax.device_put(x, dev)
    buf = np.empty_like(x)
    out = {
        "memcpy of W1 (host)": lambda: np.copyto(buf, x),
        "host round trip of W1 (device_get + device_put)": lambda: jax.device_put(jax.device_get(xd), dev),
    }
    for name, opts in (("v1 4-bit", tq_jax.encode_options(bits=4)), ("turbo-3.5", tq_jax.encode_options("turbo-3.5"))):
        b = tq_jax.dumps(x, options=opts)
        assert tq_jax.dumps(xd, options=opts, executor="program") == b
        out[f"{name} dumps(numpy)"] = lambda opts=opts: tq_jax.dumps(x, options=opts, device=dev)
        out[f"{name} dumps(jax.Array), default path"] = lambda opts=opts: tq_jax.dumps(xd, options=opts)
        for ex in DEVICE_EXECUTORS:
            out[f"{name} dumps(jax.Array), device path [{ex}]"] = lambda opts=opts, ex=ex: tq_jax.dumps(
                xd, options=opts, executor=ex)
        out[f"{name} dumps(numpy, device=d), device path [program]"] = lambda opts=opts: tq_jax.dumps(
            x, options=opts, device=dev, executor="program")
        out[f"{name} loads(device=d), default path"] = lambda b=b: tq_jax.loads(b, device=dev)
        for ex in DEVICE_EXECUTORS:
            out[f"{name} loads(device=d), device path [{ex}]"] = lambda b=b, ex=ex: tq_jax.loads(b, device=dev, executor=ex)
        out[f"{name} loads(device=d), host buffer"] = lambda b=b: tq_jax.loads(b, device=[dev])
    # the resident decode's assembly alone: 4096-vector bf16 blocks joined by XLA
    block = blocks.block_vectors_for(W1[-1], None, [dev])
    parts = tuple(jax.device_put(np.zeros((block, W1[-1]), jnp.bfloat16), dev) for _ in range(x.size // W1[-1] // block))
    cat = jax.jit(lambda ps: jnp.concatenate(ps))
    out[f"XLA concatenate of {len(parts)} decoded blocks (W1)"] = lambda: cat(parts)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None, help="directory to write device_path_<platform>.md to")
    args = ap.parse_args()
    dev = jax.devices()[0]
    table = cases(dev)
    rounds = 2 if args.quick else args.rounds
    times = {k: [] for k in table}
    for _ in range(rounds):
        for k, fn in table.items():
            times[k].append(best_of(fn))
    med = {k: statistics.median(v) for k, v in times.items()}
    memcpy = med["memcpy of W1 (host)"]
    lines = [
        "# Device-resident path on W1",
        "",
        f"W1 = {list(W1)} bfloat16 Gaussian, 33.5 MB; jax {jax.__version__}, device {dev.device_kind} "
        f"({dev.platform}); median over {rounds} interleaved rounds of the best of 3.",
        "",
        "| case | ms | / memcpy |",
        "|---|---|---|",
    ]
    lines += [f"| {k} | {v:.1f} | {v / memcpy:.1f}x |" for k, v in med.items()]
    if dev.platform == "cpu":
        lines += [
            "",
            "On the CPU backend device memory is host memory: the round trip costs nothing "
            "(zero-copy both ways). CPU devices take the host pipeline (`blob.takes`); the "
            "device-path rows are the accelerator's executors, forced here for comparison.",
        ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        path = args.out / f"device_path_{dev.platform}.md"
        path.write_text(text)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
