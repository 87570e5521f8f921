"""Load on a real redis-server through the tq_jax serde: threads, throughput, latency, correctness.

In each of ``--rounds`` rounds, every configuration runs for ``--seconds / --rounds``
seconds, back to back, in an order rotated per round (so the machine's drift falls on
all of them alike); each configuration gets ``--seconds`` in all. In a run,
``--threads`` threads store and load chunks against one ``redis-server`` (started here on a free 127.0.0.1 port, persistence off,
stopped at the end). Each thread owns distinct keys and also writes and reads a shared
pool of overlapping keys. A store is ``serialize`` (the serializer LMCache would get
from the serde dict, :func:`tq_jax.bridge._src.registry.build_serde`) + ``SET``; a load is
``GET`` + ``deserialize`` into a fresh chunk, and *every* load is compared bit for bit
with the decode of the value stored for that key's chunk (its TQ01 blob decoded
offline): any difference counts as a wrong tensor. The baseline ``raw`` stores the
chunk's bytes with no serde (what LMCache's RESP adapter does without one) and checks
them the same way.

Configurations: raw bytes; ``turbo-3.5``; ``turbo-3.5`` + ``encrypt`` in the ``TQS1`` frame
(AES-256-GCM under the tenant key, a random nonce per value: what the serde wrote before,
written here by :class:`TQS1Serializer`, a copy of that serializer, and opened by the
serde's own deserializer); ``turbo-3.5`` + ``encrypt`` as the serde writes it now (the
``TQS2`` frame: an AES-256-GCM key per value). Threads use two cache salts (tenants). Reported per configuration: the median
over rounds of chunks/s and MB/s of KV (bf16 bytes moved, so the columns compare), p50/p99
latency of stores and loads over all rounds, wrong tensors; and the median over rounds
of each round's ratio of chunks/s, TQS2 / plain turbo-3.5 and TQS2 / TQS1 (they ran
minutes apart at most, seconds apart mostly). The Redis client is redis-py (one connection per
thread), not LMCache's C++ client: the serde's cost is what differs between the rows.

Each round also times, on one thread with no load running, the steps of one value:
the serde's encode (``serialize``) and decode (``deserialize``) of a chunk with
``turbo-3.5``, and the seal and open of its TQ01 blob: ``TQS1`` as the serde did it
before (the tenant's key, a fresh nonce), ``TQS2`` exactly as :mod:`tq_jax.bridge._src.seal`
does it now (its :class:`~tq_jax.bridge._src.seal.KeyRing`: HKDF-Expand of a value key, then
AES-GCM), ``TQS2`` opened by a ring whose *second* key sealed it (during a key
rotation), and AES-GCM-SIV (``cryptography``'s ``AESGCMSIV``, the candidate not chosen)
with a fresh nonce under the tenant key; the ObjectKey is the associated data in each.

    python benchmarks/bench_redis_load.py --threads 8 --seconds 60 --rounds 6 --out benchmarks/results/redis_load.md
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import torch
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.memory_management import MemoryObjMetadata, TensorMemoryObj

from tq_jax.bridge._src import dlpack, registry, seal
from tq_jax._src.frames import KEY_TRAILER_BYTES
from tq_jax.bridge._src.seal import FIELD_BYTES, HEADER_BYTES, OVERHEAD, TAG_BYTES
from tq_jax.bridge._src.serde import describe_key, object_key_bytes, write_bytes

SHAPE = (2, 8, 256, 1024)  # 8 MiB of bf16 per chunk (a quarter of an 8B model's 32 layers)
N_CONTENTS = 8  # distinct chunk contents; key i holds content i % N_CONTENTS
N_SHARED = 8  # overlapping keys every thread stores and loads


def obj_of(shape, dtype) -> TensorMemoryObj:
    n = int(np.prod(shape)) * dtype.itemsize
    raw = torch.empty(n + 4096, dtype=torch.uint8)
    off = -raw.data_ptr() % 4096
    meta = MemoryObjMetadata(torch.Size(shape), dtype, 0, n, 1, shapes=[torch.Size(shape)], dtypes=[dtype])
    return TensorMemoryObj(raw[off : off + n], meta, None)


def start_redis() -> tuple[subprocess.Popen, int, str]:
    path = shutil.which("redis-server")
    if path is None:
        sys.exit("redis-server is not installed (apt-get install -y redis-server)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = tempfile.mkdtemp(prefix="tq_jax-bench-redis-")
    p = subprocess.Popen([path, "--bind", "127.0.0.1", "--port", str(port), "--dir", d, "--save", "",
                          "--appendonly", "no", "--loglevel", "warning"], stdout=subprocess.DEVNULL)
    time.sleep(0.5)
    return p, port, d


class TQS1Serializer:
    """The ``TQS1`` frame as the serde wrote it before ``TQS2`` (a copy of that
    ``SealingSerializer.serialize``: the tenant's key, a fresh random nonce per value)."""

    def __init__(self, sealing: seal.SealingSerializer) -> None:
        self.inner, self.keys = sealing.inner, sealing.keys

    def estimate_serialized_size(self, layout: MemoryLayoutDesc) -> int:
        return self.inner.estimate_serialized_size(layout) + OVERHEAD

    def serialize(self, src, dst, key) -> int:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        layout = MemoryLayoutDesc(shapes=list(src.get_shapes()), dtypes=list(src.get_dtypes()))
        n = self.inner.estimate_serialized_size(layout)
        plain = np.empty(n, np.uint8)
        assert self.inner.encode_into(src, plain, key) == n
        aead = AESGCM(self.keys.v1[0].get_key(key.cache_salt))
        nonce = os.urandom(FIELD_BYTES)

        def fill(out: np.ndarray) -> None:
            out[:4] = np.frombuffer(seal.MAGIC_V1, np.uint8)
            out[4:HEADER_BYTES] = np.frombuffer(nonce, np.uint8)
            aead.encrypt_into(nonce, plain, object_key_bytes(key), out[HEADER_BYTES:])

        return write_bytes(dst, n + OVERHEAD, fill, layout)


class Config:
    def __init__(self, name: str, serde: dict | None, *, tqs1: bool = False) -> None:
        self.name = name
        self.layout = MemoryLayoutDesc(shapes=[torch.Size(SHAPE)], dtypes=[torch.bfloat16])
        self.ser = self.de = None
        if serde is not None:
            self.ser, self.de = registry.build_serde(registry.parse_options(serde))
        if tqs1:
            self.ser = TQS1Serializer(self.ser)
        self.size = self.ser.estimate_serialized_size(self.layout) if self.ser else int(np.prod(SHAPE)) * 2
        self.want: list = []
        self.rounds: list[dict] = []

    def prepare(self, contents) -> None:
        """The correct load of each content: its stored value decoded once, offline."""
        key0 = ObjectKey(chunk_hash=b"\0" * 32, model_name="bench", kv_rank=0)
        for c in contents:
            if self.ser is None:
                self.want.append(c.tensor.clone())
                continue
            dst = obj_of((self.size,), torch.uint8)
            self.ser.serialize(c, dst, key0)
            back = obj_of(SHAPE, torch.bfloat16)
            self.de.deserialize(dst, back, key0)
            self.want.append(back.tensor.clone())


def run(cfg: Config, port: int, contents, threads: int, seconds: float) -> dict:
    import redis

    want = cfg.want
    stop = time.monotonic() + seconds
    lock = threading.Lock()
    stats = {"stores": [], "loads": [], "wrong": 0, "misses": 0}

    def worker(t: int) -> None:
        rc = redis.Redis(host="127.0.0.1", port=port)
        buf, out = obj_of((cfg.size,), torch.uint8), obj_of(SHAPE, torch.bfloat16)
        rng = np.random.default_rng(t)
        st, ld, wrong, misses, i = [], [], 0, 0, 0
        salt = f"tenant-{t % 2}"
        while time.monotonic() < stop:
            shared = rng.random() < 0.5
            idx = int(rng.integers(N_SHARED)) if shared else i
            k = ObjectKey(chunk_hash=(f"s{idx}" if shared else f"t{t}-{idx}").encode().ljust(32, b"\0"),
                          model_name="bench", kv_rank=0, cache_salt=salt)
            c = idx % N_CONTENTS
            name = describe_key(k)
            t0 = time.perf_counter()
            if cfg.ser is None:
                rc.set(name, dlpack.numpy_view(contents[c].tensor).view(np.uint8).tobytes())
            else:
                cfg.ser.serialize(contents[c], buf, k)
                rc.set(name, memoryview(dlpack.numpy_view(buf.tensor)))
            t1 = time.perf_counter()
            v = rc.get(name)
            if v is None or len(v) != cfg.size:
                misses += 1
                continue
            if cfg.ser is None:
                dlpack.numpy_view(out.tensor).view(np.uint8).reshape(-1)[:] = np.frombuffer(v, np.uint8)
            else:
                dlpack.numpy_view(buf.tensor)[:] = np.frombuffer(v, np.uint8)
                try:
                    cfg.de.deserialize(buf, out, k)
                except Exception:  # noqa: BLE001 - a refusal is a miss, never a tensor
                    misses += 1
                    continue
            t2 = time.perf_counter()
            if not torch.equal(out.tensor, want[c]):
                wrong += 1
            st.append(t1 - t0)
            ld.append(t2 - t1)
            i += 1
        with lock:
            stats["stores"] += st
            stats["loads"] += ld
            stats["wrong"] += wrong
            stats["misses"] += misses

    ws = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    t0 = time.perf_counter()
    for w in ws:
        w.start()
    for w in ws:
        w.join()
    wall = time.perf_counter() - t0
    n = len(stats["loads"])
    kv_mb = int(np.prod(SHAPE)) * 2 / 1e6
    return {"pairs": n, "wall": wall, "chunks_s": 2 * n / wall, "mb_s": 2 * n * kv_mb / wall,
            "stores": stats["stores"], "loads": stats["loads"], "wrong": stats["wrong"], "misses": stats["misses"]}


def summarize(cfg: Config) -> dict:
    """A configuration's rounds: medians of the rates, latencies over every sample."""
    rs = cfg.rounds
    pool = lambda f: [x for r in rs for x in r[f]]  # noqa: E731
    ms = lambda xs, q: 1e3 * float(np.percentile(xs, q)) if xs else float("nan")  # noqa: E731
    return {"name": cfg.name, "value_bytes": cfg.size, "pairs": sum(r["pairs"] for r in rs),
            "seconds": sum(r["wall"] for r in rs),
            "chunks_s": float(np.median([r["chunks_s"] for r in rs])),
            "chunks_s_lo": min(r["chunks_s"] for r in rs), "chunks_s_hi": max(r["chunks_s"] for r in rs),
            "mb_s": float(np.median([r["mb_s"] for r in rs])),
            "store_p50": ms(pool("stores"), 50), "store_p99": ms(pool("stores"), 99),
            "load_p50": ms(pool("loads"), 50), "load_p99": ms(pool("loads"), 99),
            "wrong": sum(r["wrong"] for r in rs), "misses": sum(r["misses"] for r in rs)}


STEPS = ("encode (serialize)", "TQS1 seal (before)", "TQS1 open (before)", "TQS2 seal", "TQS2 open",
         "TQS2 open, sealed by the ring's 2nd key", "AES-GCM-SIV seal (not chosen)", "AES-GCM-SIV open (not chosen)",
         "decode (deserialize)")
PAIRS = {"TQS1 (before)": (1, 2), "TQS2": (3, 4), "TQS2, 2nd key of the ring": (3, 5), "AES-GCM-SIV": (6, 7)}


def time_steps(plain: Config, sealed: Config, content, reps: int, master: bytes) -> dict[str, list[float]]:
    """Seconds per call of each of :data:`STEPS` on one value, ``reps`` times each,
    interleaved; TQS2's seal and open with :class:`~tq_jax.bridge._src.seal.KeyRing` as
    :mod:`tq_jax.bridge._src.seal` does them."""
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM, AESGCMSIV

    key = ObjectKey(chunk_hash=b"step".ljust(32, b"\0"), model_name="bench", kv_rank=0, cache_salt="tenant-0")
    ad = object_key_bytes(key)
    blob_obj, back = obj_of((plain.size,), torch.uint8), obj_of(SHAPE, torch.bfloat16)
    blob = dlpack.numpy_view(blob_obj.tensor)
    plain.ser.serialize(content, blob_obj, key)
    n = plain.size - (KEY_TRAILER_BYTES if plain.ser.bind_key else 0)  # the blob, without the key trailer
    body = blob[:n]
    bufs = {v: np.empty(n + TAG_BYTES, np.uint8) for v in ("v1", "v2", "siv")}
    opened = np.empty(n, np.uint8)
    ring = sealed.ser.keys
    rotated = seal.KeyRing([os.urandom(32), master], 256)  # [a newer key, the key that sealed]
    tenant = ring.v1[0].get_key(key.cache_salt)
    field = {}
    out: dict[str, list[float]] = {s: [] for s in STEPS}

    def seal_v1() -> None:
        field["v1"] = os.urandom(FIELD_BYTES)
        AESGCM(ring.v1[0].get_key(key.cache_salt)).encrypt_into(field["v1"], body, ad, bufs["v1"])

    def open_v1() -> None:
        AESGCM(ring.v1[0].get_key(key.cache_salt)).decrypt_into(field["v1"], bufs["v1"], ad, opened)

    def seal_v2() -> None:
        field["v2"] = os.urandom(FIELD_BYTES)
        AESGCM(ring.seal_key(field["v2"], key)).encrypt_into(seal.V2_NONCE, body, ad, bufs["v2"])

    def open_v2(r) -> None:
        for aes_key, nonce in r.open_keys(2, field["v2"], key):  # as OpeningDeserializer does
            try:
                AESGCM(aes_key).decrypt_into(nonce, bufs["v2"], ad, opened)
                return
            except InvalidTag:
                continue
        raise AssertionError("the TQS2 value did not open")

    def seal_siv() -> None:
        field["siv"] = os.urandom(FIELD_BYTES)
        AESGCMSIV(tenant).encrypt_into(field["siv"], body, ad, bufs["siv"])

    def open_siv() -> None:
        AESGCMSIV(tenant).decrypt_into(field["siv"], bufs["siv"], ad, opened)

    fns = [lambda: plain.ser.serialize(content, blob_obj, key), seal_v1, open_v1, seal_v2, lambda: open_v2(ring),
           lambda: open_v2(rotated), seal_siv, open_siv, lambda: plain.de.deserialize(blob_obj, back, key)]
    for _ in range(reps):
        for name, fn in zip(STEPS, fns):
            t0 = time.perf_counter()
            fn()
            out[name].append(time.perf_counter() - t0)
            if " open" in name:
                assert np.array_equal(opened, body), f"{name} did not give back the sealed blob"
                opened[:] = 0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=60, help="seconds per configuration, over all rounds")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--step-reps", type=int, default=5, help="timed calls of each single-value step per round")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    contents = []
    for _ in range(N_CONTENTS):
        o = obj_of(SHAPE, torch.bfloat16)
        o.tensor.copy_(torch.randn(SHAPE, generator=g).to(torch.bfloat16))
        contents.append(o)
    keydir = tempfile.mkdtemp(prefix="tq_jax-bench-key-")
    master = os.path.join(keydir, "master.key")
    master_bytes = os.urandom(32)
    with open(master, "wb") as f:
        f.write(master_bytes)
    enc = {"preset": "turbo-3.5", "encrypt": {"key_provider": "hkdf", "master_key_path": master, "aes_bits": 256}}
    configs = [
        Config("raw bytes (no serde)", None),
        Config("tq_jax turbo-3.5", {"preset": "turbo-3.5"}),
        Config("tq_jax turbo-3.5 + encrypt, TQS1 frame (before: AES-256-GCM, tenant key, random nonces)", enc, tqs1=True),
        Config("tq_jax turbo-3.5 + encrypt, TQS2 frame (now: AES-256-GCM, a key per value)", enc),
    ]
    for cfg in configs:
        cfg.prepare(contents)
    per = args.seconds / args.rounds
    steps: dict[str, list[float]] = {st: [] for st in STEPS}
    ratios, ratios_v1 = [], []
    proc, port, d = start_redis()
    try:
        import redis

        for rnd in range(args.rounds):
            order = configs[rnd % len(configs):] + configs[: rnd % len(configs)]
            for cfg in order:
                r = run(cfg, port, contents, args.threads, per)
                cfg.rounds.append(r)
                redis.Redis(host="127.0.0.1", port=port).flushall()
                print(f"round {rnd + 1}/{args.rounds} {cfg.name}: {r['chunks_s']:.1f} chunks/s, "
                      f"{r['wrong']} wrong, {r['misses']} misses", flush=True)
            ratios.append(configs[3].rounds[-1]["chunks_s"] / configs[1].rounds[-1]["chunks_s"])
            ratios_v1.append(configs[3].rounds[-1]["chunks_s"] / configs[2].rounds[-1]["chunks_s"])
            for st, xs in time_steps(configs[1], configs[3], contents[rnd % N_CONTENTS], args.step_reps, master_bytes).items():
                steps[st] += xs
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
        shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(keydir, ignore_errors=True)
    rows = [summarize(c) for c in configs]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True).stdout.strip()
    kv_bytes = int(np.prod(SHAPE)) * 2
    lines = [
        "# Load on a real redis-server through the tq_jax serde",
        "",
        f"Commit `{commit}`{' (with uncommitted changes)' if dirty else ''}; command: "
        f"`python benchmarks/bench_redis_load.py --threads {args.threads} --seconds {args.seconds:g} "
        f"--rounds {args.rounds} --step-reps {args.step_reps}`; "
        f"{platform.machine()}, {os.cpu_count()} CPUs (shared with other work), redis-server on 127.0.0.1, redis-py clients.",
        "",
        f"Chunk {list(SHAPE)} bf16 ({kv_bytes / 2**20:.0f} MiB); {args.threads} threads; {args.rounds} rounds, "
        f"each running every configuration for {per:g} s back to back in an order rotated per round "
        f"({args.seconds:g} s per configuration in all); each iteration stores then loads one key "
        f"(half distinct per thread, half from {N_SHARED} keys all threads share); every load compared "
        f"bit for bit with the stored chunk's decode. chunks/s and MB/s count stores + loads, MB of KV "
        f"(bf16) moved: the median over rounds (chunks/s: min-max beside it); latencies over all rounds' samples.",
        "",
        "| configuration | bytes / value | chunks/s median (min-max) | MB/s (KV) median | store p50 / p99 ms | load p50 / p99 ms | loads checked | wrong tensors | misses |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['name']} | {r['value_bytes']:,} | {r['chunks_s']:.1f} ({r['chunks_s_lo']:.1f}-{r['chunks_s_hi']:.1f}) | "
                     f"{r['mb_s']:.0f} | {r['store_p50']:.1f} / {r['store_p99']:.1f} | {r['load_p50']:.1f} / {r['load_p99']:.1f} | "
                     f"{r['pairs']:,} | {r['wrong']} | {r['misses']} |")
    base, v1, v2 = rows[1], rows[2], rows[3]
    med = lambda xs: float(np.median(xs))  # noqa: E731
    lines += ["", "Per-round ratio of chunks/s, TQS2 / plain turbo-3.5: " + ", ".join(f"{x:.3f}" for x in ratios)
              + f"; median **{med(ratios):.3f}**. TQS2 / TQS1: " + ", ".join(f"{x:.3f}" for x in ratios_v1)
              + f"; median **{med(ratios_v1):.3f}**. "
              f"Value size: turbo-3.5 {base['value_bytes'] / rows[0]['value_bytes']:.1%} of raw; sealed "
              f"{v1['value_bytes']:,} bytes in both frames ({v2['value_bytes'] - base['value_bytes']:+} against the "
              f"key-bound value).", "",
              f"One value's steps, one thread, no load running ({len(steps[STEPS[0]])} calls each, interleaved "
              f"across the rounds; MB/s over the {base['value_bytes'] - KEY_TRAILER_BYTES:,}-byte TQ01 blob and over the "
              f"{kv_bytes:,} bytes of KV it holds):", "",
              "| step | ms per value (median) | MB/s of the blob | MB/s of KV |", "|---|---:|---:|---:|"]
    m = {st: med(xs) for st, xs in steps.items()}
    blob_bytes = base["value_bytes"] - KEY_TRAILER_BYTES
    for st in STEPS:
        lines.append(f"| {st} | {1e3 * m[st]:.2f} | {blob_bytes / m[st] / 1e6:.0f} | {kv_bytes / m[st] / 1e6:.0f} |")
    codec_ms = 1e3 * (m[STEPS[0]] + m[STEPS[-1]])
    v1_ms = 1e3 * (m[STEPS[1]] + m[STEPS[2]])
    lines += ["", "Seal + open per value (medians of the steps above):", "",
              "| frame | seal + open ms | vs TQS1 | share of encode + decode |", "|---|---:|---:|---:|"]
    for name, (a, b) in PAIRS.items():
        ms = 1e3 * (m[STEPS[a]] + m[STEPS[b]])
        lines.append(f"| {name} | {ms:.2f} | {ms / v1_ms:.2f}x | {ms / codec_ms:.1%} |")
    lines += ["", f"Encode + decode of the same value: {codec_ms:.1f} ms."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
