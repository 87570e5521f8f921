"""An L2 hit through LMCache's own StorageManager, the first after a server start and warm ones.

What vLLM waits for when LMCache serves a prefix from L2: the prefetch reads every chunk
from the store (here ``fs``: a file per chunk) and the serde decodes them into L1. This
runs LMCache 0.5.6's ``StorageManager``, built by its own config parser with the tq_jax
serde as the server builds it, for SmolLM2-135M's CPU chunk ``[30, 256, 384]`` bf16 and
15 chunks (3,840 tokens):

1. a *writer* process stores the 15 chunks on L2 and exits;
2. a fresh *reader* process (a restarted server, or a new replica) builds the manager,
   times its first prefetch of the 15 chunks from L2 (cold), then deletes them from L1
   and prefetches them again ``--warm`` times (warm).

Per serde setting, with the serde's warm-up on (the default) and off, and for a reader
that remembers the chunk shapes (a restarted server) or not (a new replica, its own
empty ``TQ_JAX_CACHE_DIR``). Beside them, the same reader with LMCache alone: no serde
(raw bf16 values) and LMCache's own ``fp8`` serde, so that LMCache's own first-hit cost
is measured, not estimated. Per prefetch, the reader also sums the deserializer's own
time over its threads and the page faults they take inside it, so the serde's part of a
first hit's extra time is separated from LMCache's. The yardsticks, measured in the
reader: a memcpy of the 15 raw chunks into a preallocated buffer, the float32
``(n,128)@(128,128)`` GEMM over as many coordinates, and the first-touch floor (the
same bytes copied into shared memory never touched before, less a copy into touched
memory), which a first hit pays on LMCache's fresh L1 pages whatever the serde.

    python -m benchmarks.bench_l2_prefetch [--warm 5] [--workers 2] [--baselines ''] [--out benchmarks/results/l2_prefetch_cpu.md]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.timing import Yardsticks, cpu_description

CHUNK = (30, 256, 384)  # SmolLM2-135M on vLLM's CPU backend: [L, T, H*2*D], H=3, D=64
CHUNKS = 15
SETTINGS = {  # the tq_jax serde dicts compared (head_dim and max_workers added)
    "default (turbo-4)": {},
    "4/4 + checksum": {"bits": 4},
    "v1 4-bit (format v1)": {"format": "v1"},
    "turbo-4t (trellis codes)": {"preset": "turbo-4t"},
}
#: What LMCache does without tq_jax, measured beside it: the first hit's ratio to warm ones
#: that LMCache itself shows, with no serde (raw bf16 values) and with its own ``fp8`` serde
#: (plain torch casts, nothing to compile). ``None`` is no serde.
BASELINES = {
    "no serde (LMCache stores raw bf16)": None,
    "LMCache's fp8 serde": {"type": "fp8"},
}


def _keys():
    from lmcache.v1.distributed.api import ObjectKey

    return [ObjectKey(chunk_hash=f"prefetch-{i}".encode().ljust(32, b"\0"), model_name="bench", kv_rank=0)
            for i in range(CHUNKS)]


def _manager(base: str, serde: dict | None):
    """``serde`` is a tq_jax serde dict, a whole serde dict with its ``type``, or ``None``."""
    from tq_jax.bridge._src import registry
    from tq_jax.bridge.smoke import build_manager

    registry.register()
    adapter = {"type": "fs", "base_path": base}
    if serde is not None:
        adapter["serde"] = serde if "type" in serde else {"type": "tq_jax", **serde}
    return build_manager(adapter, l1_gb=0.5)


def _layout():
    import torch
    from lmcache.v1.distributed.api import MemoryLayoutDesc

    return MemoryLayoutDesc(shapes=[torch.Size(CHUNK)], dtypes=[torch.bfloat16])


def write(base: str, serde: dict) -> dict:
    """Stores the 15 chunks on L2 (the writer process)."""
    import torch

    from tq_jax.bridge.smoke import StoreEvents

    events = StoreEvents()
    sm = _manager(base, serde)
    keys = _keys()
    try:
        objs = sm.reserve_write(keys, _layout())
        g = torch.Generator().manual_seed(0)
        for k in keys:
            objs[k].tensor.copy_(torch.randn(CHUNK, generator=g).to(torch.bfloat16))
        since = events.counts()
        sm.finish_write(keys)
        ok, failed = events.wait_stores(len(keys), 300, since)
    finally:
        sm.close()
        events.stop()
    return {"stored": ok, "failed": failed}


class SerdeClock:
    """The deserializer's own share of each prefetch: its calls' summed thread time and
    the minor page faults those threads took inside them (``RUSAGE_THREAD``)."""

    def __init__(self) -> None:
        import threading

        from tq_jax.bridge._src import serde as S

        self.lock, self.seconds, self.faults = threading.Lock(), 0.0, 0
        inner = S.TQJaxDeserializer.decode_from

        def decode_from(de, buf, dst, key):
            f0, t0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt, time.perf_counter()
            try:
                return inner(de, buf, dst, key)
            finally:
                dt, df = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f0
                with self.lock:
                    self.seconds += dt
                    self.faults += df

        S.TQJaxDeserializer.decode_from = decode_from

    def take(self) -> tuple[float, int]:
        with self.lock:
            out, self.seconds, self.faults = (self.seconds, self.faults), 0.0, 0
        return out


def first_touch_floor(nbytes: int, reps: int = 3) -> float:
    """Seconds a copy of ``nbytes`` takes into shared memory never touched before, less the
    same copy into touched memory: the page faults a first L2 hit pays on LMCache's L1 pool
    (POSIX shared memory on a CPU host) and read buffers, whatever the serde (median)."""
    import mmap
    import statistics

    import numpy as np

    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    extra = []
    for _ in range(reps):
        m = mmap.mmap(-1, nbytes, flags=mmap.MAP_SHARED)
        dst = np.frombuffer(m, np.uint8)
        t = time.perf_counter()
        np.copyto(dst, src)
        fresh = time.perf_counter() - t
        t = time.perf_counter()
        np.copyto(dst, src)
        extra.append(fresh - (time.perf_counter() - t))
        del dst
        m.close()
    return statistics.median(extra)


def read(base: str, serde: dict, warm: int) -> dict:
    """Builds the manager, then times the first prefetch and ``warm`` more (the reader)."""
    import numpy as np
    from lmcache.v1.distributed.api import GroupedObjectKeys, PrefetchTaskSpec

    t0 = time.perf_counter()
    sm = _manager(base, serde)
    build_s = time.perf_counter() - t0
    clock = SerdeClock()  # after the build: the warm-up's own calls are not counted
    keys = _keys()
    spec = PrefetchTaskSpec(key_groups=[GroupedObjectKeys(keys=keys, object_group_id=0, layout_desc=_layout())])
    times, l2_hits, serde_s, faults = [], [], [], []
    try:
        for _ in range(1 + warm):
            t = time.perf_counter()
            handle = sm.submit_prefetch_task(spec)
            if not sm.wait_prefetch_status(handle, timeout=300):
                raise TimeoutError("the prefetch did not finish within 300 s")
            times.append(time.perf_counter() - t)
            spent, touched = clock.take()
            serde_s.append(spent)
            faults.append(touched)
            res = sm.query_prefetch_status(handle)
            l2_hits.append(res.l2_hit_count if res is not None else 0)
            with sm.read_prefetched_results(keys):
                pass
            sm.finish_read_prefetched(keys)
            deadline = time.monotonic() + 30
            while sm.delete_l1_keys(keys)[1] and time.monotonic() < deadline:  # locks released just after
                time.sleep(0.01)
    finally:
        sm.close()
    yard = Yardsticks(np.random.default_rng(0).integers(0, 1 << 15, (CHUNKS, *CHUNK), dtype=np.int16))
    for _ in range(5):
        yard.time_round()
    memcpy, gemm = yard.medians()
    value_bytes = sum(f.stat().st_size for f in Path(base).rglob("*.data"))
    floor = first_touch_floor(CHUNKS * int(np.prod(CHUNK)) * 2 + value_bytes)
    return {"build_s": build_s, "times": times, "l2_hits": l2_hits, "memcpy": memcpy, "gemm": gemm,
            "serde_s": serde_s, "faults": faults, "floor": floor}


def _worker(role: str, base: str, serde: dict, warm: int, cache_dir: str) -> dict:
    env = {**os.environ, "TQ_JAX_CACHE_DIR": cache_dir, "LMCACHE_LOG_LEVEL": "ERROR", "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, "-m", "benchmarks.bench_l2_prefetch", "--role", role, "--base", base,
           "--serde", json.dumps(serde), "--warm", str(warm)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if r.returncode:
        raise RuntimeError(f"{role} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--warm", type=int, default=5, help="warm prefetches after the first")
    p.add_argument("--workers", type=int, default=2, help="the serde's max_workers")
    p.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated names of SETTINGS")
    p.add_argument("--baselines", default=",".join(BASELINES),
                   help="comma-separated names of BASELINES (LMCache without tq_jax); '' for none")
    p.add_argument("--out")
    p.add_argument("--role", choices=("write", "read"), help=argparse.SUPPRESS)
    p.add_argument("--base", help=argparse.SUPPRESS)
    p.add_argument("--serde", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.role:
        serde = json.loads(args.serde)  # null: no serde
        print(json.dumps(write(args.base, serde) if args.role == "write" else read(args.base, serde, args.warm)))
        return
    rows = []
    yard = []

    def row(name, value, label, r):
        yard.append((r["memcpy"], r["gemm"], r["floor"]))
        first, warm = r["times"][0], statistics.median(r["times"][1:])
        s_first, s_warm = r["serde_s"][0], statistics.median(r["serde_s"][1:])
        ours = label != "n/a"  # the serde clock and fault count see tq_jax's deserializer only
        serde = f"{s_first * 1e3:.0f} / {s_warm * 1e3:.0f} ms" if ours else "n/a"
        faults = f"{r['faults'][0]:,} / {statistics.median(r['faults'][1:]):,.0f}" if ours else "n/a"
        rows.append(f"| {name} | {value:,} | {label} | {r['build_s']:.1f} s | {first * 1e3:.0f} ms | "
                    f"{warm * 1e3:.0f} ms | {first / warm:.2f}x | {(warm + r['floor']) / warm:.2f}x | "
                    f"{serde} | {faults} | {warm / r['memcpy']:.0f}x | {warm / r['gemm']:.2f}x |")

    with tempfile.TemporaryDirectory(prefix="tq_jax-l2-prefetch-") as tmp:
        for name in [b for b in args.baselines.split(",") if b]:
            serde = BASELINES[name] and {**BASELINES[name], "max_workers": args.workers}
            base = f"{tmp}/{len(rows)}-l2"
            stored = _worker("write", base, serde, 0, tmp)
            assert stored == {"stored": CHUNKS, "failed": 0}, stored
            value = sorted(Path(base).rglob("*.data"))[0].stat().st_size
            r = _worker("read", base, serde, args.warm, tmp)
            assert r["l2_hits"] == [CHUNKS] * (1 + args.warm), r["l2_hits"]
            row(name, value, "n/a", r)
        for name in [n for n in args.settings.split(",") if n]:
            serde = {"head_dim": 64, "max_workers": args.workers, **SETTINGS[name]}
            base, remembered = f"{tmp}/{len(rows)}-l2", f"{tmp}/{len(rows)}-cache"
            stored = _worker("write", base, serde, 0, remembered)
            assert stored == {"stored": CHUNKS, "failed": 0}, stored
            value = sorted(Path(base).rglob("*.data"))[0].stat().st_size
            for label, extra, cache in (("on, restarted server", {}, remembered),
                                        ("on, new replica", {}, tempfile.mkdtemp(dir=tmp)),
                                        ("off", {"warmup": False}, remembered)):
                r = _worker("read", base, {**serde, **extra}, args.warm, cache)
                assert r["l2_hits"] == [CHUNKS] * (1 + args.warm), r["l2_hits"]
                row(name, value, label, r)
    mc, gm, fl = (statistics.median(y[i] for y in yard) for i in range(3))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or "?"
    lines = [
        "# An L2 hit through LMCache's StorageManager: the first after a start, and warm ones",
        "",
        f"Commit `{commit}`; `python -m benchmarks.bench_l2_prefetch {' '.join(argv if argv is not None else sys.argv[1:])}`; "
        f"{platform.machine()} ({cpu_description()}), {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end.",
        "",
        f"15 chunks `[30, 256, 384]` bf16 (SmolLM2-135M's CPU chunk, 3,840 tokens, {CHUNKS * 30 * 256 * 384 * 2 / 2**20:.1f} "
        f"MiB raw) on an `fs` L2, `max_workers` {args.workers}, each reader a fresh process; warm = median of "
        f"{args.warm}. Yardsticks in the readers (medians): memcpy of the raw chunks {mc * 1e3:.1f} ms, float32 "
        f"`(n,128)@(128,128)` GEMM over as many coordinates {gm * 1e3:.1f} ms.",
        "",
        f"First-touch floor {fl * 1e3:.0f} ms: a copy of the raw chunks and the stored values into shared "
        "memory never touched before, less the same copy into touched memory. A restarted server's first hit "
        "writes into L1 pages (LMCache's pool is POSIX shared memory on a CPU host) and read buffers that no "
        "earlier hit touched, whatever the serde; `(warm + floor) / warm` is the ratio a serde with no "
        "first-call cost of its own would show. *serde time* sums the deserializer's calls over its worker "
        "threads (first / warm median); *faults* are the minor page faults those threads took inside them. "
        "The *n/a* rows are LMCache without tq_jax, in the same fresh reader processes: the first / warm ratio "
        "LMCache itself shows with no serde and with its own `fp8` serde, which has nothing to compile.",
        "",
        "| serde | value bytes | warm-up | manager built in | first prefetch | warm prefetch | first / warm "
        "| (warm + floor) / warm | serde time | serde faults | warm / memcpy | warm / GEMM |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
    ]
    text = "\n".join(lines) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
