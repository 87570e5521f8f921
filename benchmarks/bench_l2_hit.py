"""The serde's share of an L2 hit: decoding a long prompt's chunks, one worker or several.

When vLLM asks LMCache for a prefix that only L2 holds, LMCache reads every chunk and
hands each to the serde's ``AsyncSerdeProcessor`` at once (one task per chunk); the
time until the last chunk is decoded is what the serde adds to the time to first token
(docs/vllm.md, "Performance"). This measures it for SmolLM2-135M's CPU chunk
``[30, 256, 384]`` bf16 under ``kv_layout "vllm-cpu"``, 15 chunks (3,840 tokens), per
serde setting and ``max_workers``, interleaved (each round runs every configuration
once; medians over rounds), after a warm-up that compiles the codec's programs. Beside
them, the yardsticks measured in the same run: a memcpy of the 15 raw chunks into a
preallocated buffer, and the float32 ``(n,128)@(128,128)`` GEMM over as many vectors.

    python -m benchmarks.bench_l2_hit [--rounds 5] [--out benchmarks/results/l2_hit_cpu.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings

os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")
warnings.filterwarnings("ignore", category=FutureWarning)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey  # noqa: E402
from lmcache.v1.memory_management import TensorMemoryObj  # noqa: E402

from benchmarks.bench_lmcache import make_obj  # noqa: E402 (aligned MemoryObjs, as L1 hands them out)
from benchmarks.timing import Yardsticks  # noqa: E402
from tq_jax.bridge._src import registry  # noqa: E402

CHUNK = (30, 256, 384)  # SmolLM2-135M on vLLM's CPU backend: [L, T, H*2*D], H=3, D=64
CHUNKS = 15
SETTINGS = {
    "turbo-4 (the default)": {},
    "4/4 + checksum": {"bits": 4},
    "v1 4-bit": {"format": "v1"},
    "turbo-3.5": {"preset": "turbo-3.5"},
}


def key(i: int) -> ObjectKey:
    return ObjectKey(chunk_hash=f"chunk-{i}".encode().ljust(32, b"\0"), model_name="bench", kv_rank=0)


def wait_all(query, tasks) -> bool:
    ok = True
    for t in tasks:
        while (r := query(t)) is None:
            time.sleep(0.0002)
        ok &= bool(r)
    return ok


class Case:
    """One serde setting and worker count: its processor, the stored values, the chunks."""

    def __init__(self, serde: dict, workers: int, chunks: list[TensorMemoryObj]):
        self.proc = registry.make_serde_processor({"head_dim": 64, "kv_layout": "vllm-cpu", "max_workers": workers, **serde})
        layout = MemoryLayoutDesc(shapes=[torch.Size(CHUNK)], dtypes=[torch.bfloat16])
        self.nbytes = self.proc.estimate_serialized_size(layout)
        self.values = [make_obj((self.nbytes,), torch.uint8) for _ in chunks]
        tasks = [self.proc.submit_serialize([c], [v], [key(i)]) for i, (c, v) in enumerate(zip(chunks, self.values))]
        assert wait_all(self.proc.query_serialize_result, tasks)
        self.out = [make_obj(CHUNK, torch.bfloat16) for _ in chunks]

    def load(self) -> float:
        t = time.perf_counter()
        tasks = [self.proc.submit_deserialize([v], [o], [key(i)]) for i, (v, o) in enumerate(zip(self.values, self.out))]
        assert wait_all(self.proc.query_deserialize_result, tasks)
        return time.perf_counter() - t


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--workers", default="1,2")
    p.add_argument("--out")
    args = p.parse_args(argv)
    workers = [int(w) for w in args.workers.split(",")]
    registry.register()
    g = torch.Generator().manual_seed(0)
    chunks = []
    for _ in range(CHUNKS):
        c = make_obj(CHUNK, torch.bfloat16)
        c.tensor.copy_(torch.randn(CHUNK, generator=g).to(torch.bfloat16))
        chunks.append(c)
    cases = {(name, w): Case(serde, w, chunks) for name, serde in SETTINGS.items() for w in workers}
    for c in cases.values():
        c.load()  # compiles the decoders
    yard = Yardsticks(torch.stack([c.tensor for c in chunks]).view(torch.int16).numpy())
    vectors = yard.a.shape[0]
    times = {k: [] for k in cases}
    for _ in range(args.rounds):
        for k, c in cases.items():
            times[k].append(c.load())
        yard.time_round()
    mc, gm = yard.medians()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or "?"
    lines = [
        "# The serde's share of an L2 hit: 15 SmolLM2 chunks decoded (kv_layout vllm-cpu)",
        "",
        f"Commit `{commit}`; `python -m benchmarks.bench_l2_hit {' '.join(argv if argv is not None else sys.argv[1:])}`; "
        f"{platform.machine()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end; "
        f"{args.rounds} interleaved rounds, medians.",
        "",
        f"15 chunks `[30, 256, 384]` bf16 = {CHUNKS * np.prod(CHUNK) * 2 / 2**20:.1f} MiB of KV (3,840 tokens); yardsticks in "
        f"the same rounds: memcpy {mc * 1e3:.1f} ms, float32 `({vectors},128)@(128,128)` GEMM {gm * 1e3:.1f} ms.",
        "",
        "| serde | value bytes | max_workers | all 15 decoded | per chunk | / memcpy | / GEMM |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for (name, w), ts in times.items():
        m = statistics.median(ts)
        lines.append(f"| {name} | {cases[(name, w)].nbytes:,} | {w} | {m * 1e3:.0f} ms | {m / CHUNKS * 1e3:.1f} ms | {m / mc:.0f}x | {m / gm:.1f}x |")
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
