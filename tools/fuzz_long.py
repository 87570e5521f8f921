"""Long fuzz run of the TQ01 parser, the blob decoder and the LMCache bridge deserializer.

    python tools/fuzz_long.py                       # 120k cases + 30k atheris runs
    python tools/fuzz_long.py --cases 2000 --atheris-runs 0   # a quick look

Every case is a byte string built one of four ways from a corpus of valid TQ01 blobs
(version 1 at 2/3/4/6/8 bits, a version-1 QJL blob, version 2 with per-K/V bits, raw
layers, both rotations, float32 norms, norm correction, with and without CRC32):

* ``random``: random bytes, sometimes behind a valid magic and version;
* ``mutate``: a valid blob with 1-4 of: bit flips, byte sets, truncation, extension,
  byte insertion/deletion, an edited section-length field, an edited header field
  (shape entries, ndim, dtype, bits, flags, rotation, raw layers, seed, version) set
  to boundary values (0, 1, -1, 2**31, 2**40, 2**62, 2**63 - 1, ...); when the blob
  had a CRC32, half the cases recompute it so the mutation reaches the fields behind it;
* ``synth``: a structure-aware blob: a random (often valid) header with sections of
  exactly the implied length holding random bytes (random float16/32 bit patterns as
  norms: NaN, Inf, subnormals), optionally with a CRC32 — this drives the decoder with
  shapes, head_dims, bit widths and flags no seed blob has;
* ``synth+mutate``: a synth blob, then mutated.

Oracles, per case:

1. ``wire.parse``, ``wire.peek_header`` and ``tq_jax.loads`` raise only
   ``tq_jax.WireError`` subclasses;
2. a blob that parses decodes, to an array of exactly the header's shape and dtype;
3. a synth blob built valid must parse (no false rejections);
4. memory: the traced peak (tracemalloc, numpy's allocations included) of
   ``loads`` stays under ``3 × 32 × len(blob)`` (32 = float32 bytes per coordinate
   × 8 one-bit coordinates per byte: the largest output a blob of that length can
   describe) plus the codec tables the header may ask for within the named limits
   (a Haar rotation of at most ``wire.MAX_DENSE_DIM``, a QJL matrix) plus 4 MiB;
   and a header whose tables would exceed those limits is reported, not run;
5. the LMCache bridge (every ``--bridge-every``-th case): ``TQJaxDeserializer``
   on a uint8 ``MemoryObj`` holding the blob, sometimes followed by junk bytes (as in
   a buffer sized by another layout), into a KV ``MemoryObj`` of the blob's merged
   shape: it raises only ``WireError`` or its documented shape-mismatch
   ``ValueError``, and when it succeeds the destination equals ``tq_jax.loads``.

RSS is sampled through the run to catch growth (caches keyed by header fields).
``--atheris-runs N`` then runs coverage-guided fuzzing (atheris/libFuzzer, when
installed) of ``parse`` + ``loads`` from the same seed corpus, instrumenting tq_jax.

Results go to stdout and, as Markdown, to ``--out`` (default
``benchmarks/results/fuzz_long.md``). Inputs that break an oracle are saved under
``benchmarks/results/fuzz_findings/``.
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import resource
import struct
import subprocess
import sys
import time
import tracemalloc
import zlib
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

INTERESTING_I64 = [0, 1, 2, 3, 7, 8, 16, 255, 256, 2**16, 2**31 - 1, 2**31, 2**32, 2**40, 2**62, 2**63 - 1,
                   -1, -2, -(2**31), -(2**63)]
INTERESTING_U8 = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 16, 17, 127, 128, 255]
MIB = 1 << 20


# ----------------------------------------------------------------------------- corpus


def seed_corpus(np, tq_jax):
    """Valid blobs: (name, bytes)."""
    rng = np.random.default_rng(1234)
    out = []

    def x(shape, dtype="float32", scale=1.0):
        a = rng.standard_normal(shape).astype(np.float32) * scale
        return a.astype(tq_jax._src.blob.jnp.dtype(dtype))

    for bits in (2, 3, 4, 6, 8):
        out.append((f"v1-b{bits}", tq_jax.dumps(x((2, 3, 4, 16)), bits=bits)))
    out.append(("v1-bf16", tq_jax.dumps(x((2, 2, 5, 2, 8), "bfloat16"), bits=4)))
    out.append(("v1-f16-odd", tq_jax.dumps(x((3, 7), "float16"), bits=3)))
    out.append(("v1-1d", tq_jax.dumps(x((8,)), bits=2)))
    out.append(("v1-qjl", qjl_blob(np, rng, (2, 3, 16), m=8)))
    out.append(("v2-k4v3-skip", tq_jax.dumps(x((2, 4, 3, 16)), key_bits=4, value_bits=3, skip_first_layers=1)))
    out.append(("v2-k8v2-crc", tq_jax.dumps(x((2, 4, 3, 16), "bfloat16"), key_bits=8, value_bits=2,
                                            skip_last_layers=1, checksum=True)))
    out.append(("v2-b1-hadamard", tq_jax.dumps(x((2, 2, 3, 24)), bits=1, rotation="hadamard")))
    out.append(("v2-b5-f32norms-nc", tq_jax.dumps(x((4, 16), "float16"), bits=5, norm_dtype="float32",
                                                 norm_correction=True)))
    out.append(("v2-b4-crc", tq_jax.dumps(x((2, 3, 16)), bits=4, checksum=True)))
    out.append(("v2-b7-mla-crc", tq_jax.dumps(x((1, 3, 2, 40)), bits=7, rotation="hadamard",
                                             skip_first_layers=1, checksum=True)))
    out.append(("v2-huge-norm", tq_jax.dumps(x((2, 8), scale=1e5), bits=4)))  # auto -> float32 norms
    return out


def qjl_blob(np, rng, shape, m):
    """A structurally valid v1 blob with the QJL residual (tq_jax reads these, never writes them)."""
    n_vec, n_el = math.prod(shape[:-1]), math.prod(shape)
    hdr = struct.pack("<4sBBBHi", b"TQ01", 1, 4, 1, m, 7) + struct.pack(f"<B{len(shape)}q", len(shape), *shape)
    hdr += bytes([7]) + b"float32"
    idx = rng.integers(0, 256, (n_el * 4 + 7) // 8, dtype=np.uint8).tobytes()
    norms = rng.uniform(0.5, 2, n_vec).astype(np.float16).tobytes()
    sketch = rng.integers(-1, 2, n_vec * m, dtype=np.int8).tobytes()
    rn = rng.uniform(0, 0.3, n_vec).astype(np.float16).tobytes()
    return b"".join([hdr] + [struct.pack("<q", len(s)) + s for s in (idx, norms, sketch, rn)])


# ----------------------------------------------------------------------------- structure


def field_map(blob: bytes, wire):
    """Offsets of a valid blob's header fields and section-length fields.

    Returns (fields, section_length_offsets, crc): fields maps a name to (offset, struct fmt);
    ``"dtype"`` (fmt None) is the dtype name.
    """
    fields, lengths, crc = wire.field_offsets(blob)
    fields["dtype"] = (fields["dtype_len"][0] + 1, None)
    return fields, lengths, crc


def fix_crc(b: bytearray) -> bytearray:
    if len(b) >= 8:
        struct.pack_into("<I", b, len(b) - 4, zlib.crc32(bytes(b[:-4])))
    return b


def mutate(blob: bytes, rng, wire, structure=None) -> tuple[bytes, str]:
    b = bytearray(blob)
    try:
        fields, lens, crc = structure or field_map(blob, wire)
    except Exception:
        fields, lens, crc = {}, [], False
    ops = []
    for _ in range(int(rng.integers(1, 5))):
        op = rng.choice(["flip", "flip", "set", "truncate", "extend", "insert", "delete", "len", "field", "field"])
        if not b:
            b = bytearray(b"TQ01")
        if op == "flip":
            for _ in range(int(rng.integers(1, 4))):
                i = int(rng.integers(len(b) * 8))
                b[i // 8] ^= 1 << (i % 8)
        elif op == "set":
            i = int(rng.integers(len(b)))
            b[i] = int(rng.choice([0, 0xFF, int(rng.integers(256))]))
        elif op == "truncate":
            b = b[: int(rng.integers(len(b) + 1))]
        elif op == "extend":
            b += bytes(rng.integers(0, 256, int(rng.integers(1, 64)), dtype="uint8"))
        elif op == "insert":
            i = int(rng.integers(len(b) + 1))
            b[i:i] = bytes(rng.integers(0, 256, int(rng.integers(1, 9)), dtype="uint8"))
        elif op == "delete":
            i = int(rng.integers(len(b)))
            del b[i : i + int(rng.integers(1, 9))]
        elif op == "len" and lens:
            off = int(rng.choice(lens))
            if off + 8 <= len(b):
                (cur,) = struct.unpack_from("<q", b, off)
                new = int(rng.choice([cur + 1, cur - 1, cur * 2, 0, -cur, *INTERESTING_I64]))
                struct.pack_into("<q", b, off, max(-(2**63), min(2**63 - 1, new)))
        elif op == "field" and fields:
            name = str(rng.choice(list(fields)))
            off, fmt = fields[name]
            if fmt is None:  # dtype name
                new = rng.choice([b"float32", b"float16", b"bfloat16", b"int8", b"float64", b"\xff" * 7])
                b[off : off + len(new)] = new
            elif off + struct.calcsize(fmt) <= len(b):
                size = struct.calcsize(fmt)
                if fmt == "<q":
                    v = int(rng.choice(INTERESTING_I64))
                else:
                    lim = 1 << (8 * size)
                    v = int(rng.choice(INTERESTING_U8 + [lim - 1, lim // 2, int(rng.integers(lim))]))
                    if fmt == "<i":
                        v = v - lim if v >= lim // 2 else v
                struct.pack_into(fmt, b, off, v)
        else:
            continue
        ops.append(op)
    if crc and rng.random() < 0.5:
        b = fix_crc(b)
        ops.append("crc")
    return bytes(b), "+".join(ops)


def synth(rng, np, wire) -> tuple[bytes, bool, str]:
    """A structure-aware blob: (bytes, built_valid, description)."""
    valid = True
    v2 = rng.random() < 0.6
    dims = [2, 3, 5, 7, 8, 16, 24, 33, 40, 64]
    if rng.random() < 0.02:
        dims = [80, 96, 100, 128, 257, 576, 1024]
    d = int(rng.choice(dims))
    dtype = str(rng.choice(["float32", "float16", "bfloat16"]))
    flags, qjl_m, use_qjl, rot, s0, s1 = 0, 64, 0, 0, 0, 0
    if v2:
        flags = int(rng.integers(0, 16))
        kv = bool(flags & wire.FLAG_KV)
        rot = int(rng.integers(0, 2))
        kb = int(rng.integers(1, 9))
        vb = int(rng.integers(1, 9)) if kv else kb
    else:
        kv = False
        kb = vb = int(rng.choice(wire.READ_BITS_V1))
        if rng.random() < 0.1:
            use_qjl, qjl_m = 1, int(rng.choice([1, 2, 8, 64]))
    ndim = int(rng.integers(3 if kv else 1, 6))
    budget = max(1, 2048 // d)
    lead = []
    for i in range(ndim - 1):
        lead.append(int(rng.integers(1, 5)) if rng.random() < 0.95 else 0)
    if kv:
        lead[0] = int(rng.integers(1, 3))
        lead[1] = int(rng.integers(1, 5))
        s0 = int(rng.integers(0, lead[1] + 1))
        s1 = int(rng.integers(0, lead[1] - s0 + 1))
    while math.prod(lead) > budget:
        lead[int(np.argmax(lead))] //= 2
    if kv:
        lead[0] = max(lead[0], 1)
        s0 = min(s0, lead[1])
        s1 = min(s1, lead[1] - s0)
    shape = tuple(lead) + (d,)
    # Occasionally an invalid field (these must be refused, not crash).
    bad = rng.random() < 0.1
    if bad:
        valid = False
        which = int(rng.integers(0, 5))
        if which == 0:
            dtype = "float64"
        elif which == 1:
            kb = 0 if v2 else 5
        elif which == 2:
            rot = 2 if v2 else rot
            valid = not v2 and True
        elif which == 3:
            shape = shape[:-1] + (1,)
        else:
            flags |= 0x10 if v2 else 0
            valid = not v2 and True
    # A few seeds keep the rotation caches warm; 2 % fresh seeds exercise cache growth.
    seed = int(rng.integers(0, 4)) if rng.random() < 0.98 else int(rng.integers(-(2**31), 2**31))
    if use_qjl and seed + 999999 < 0:
        valid = False  # numpy cannot seed this blob's QJL matrix: the parser refuses it
    if v2:
        prefix = struct.pack("<4sBBBBBHHi", b"TQ01", 2, flags, rot, kb, vb, s0, s1, seed)
    else:
        prefix = struct.pack("<4sBBBHi", b"TQ01", 1, kb, use_qjl, qjl_m, seed)
    hdr = prefix + struct.pack(f"<B{len(shape)}q", len(shape), *shape) + bytes([len(dtype)]) + dtype.encode()
    n_vec = math.prod(shape[:-1])
    parts = [hdr]

    def section(nbytes, payload=None):
        if payload is None:
            payload = rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes()
        parts.append(struct.pack("<q", nbytes) + payload)

    def norms(n, f32):
        if rng.random() < 0.7:
            vals = rng.lognormal(0, 3, n).astype(np.float32 if f32 else np.float16)
            return vals.tobytes()
        return rng.integers(0, 256, n * (4 if f32 else 2), dtype=np.uint8).tobytes()

    itemsize = {"float32": 4, "float16": 2, "bfloat16": 2}.get(dtype, 2)
    if not v2:
        section((n_vec * d * kb + 7) // 8)
        section(2 * n_vec, norms(n_vec, False))
        if use_qjl:
            section(n_vec * qjl_m, rng.integers(-1, 2, n_vec * qjl_m, dtype=np.int8).tobytes())
            section(2 * n_vec, norms(n_vec, False))
    else:
        f32 = bool(flags & wire.FLAG_NORMS_F32)
        if kv:
            per_layer = math.prod(shape[2:-1])
            segs = [(kb if g == 0 else vb, (shape[1] - s0 - s1) * per_layer) for g in range(shape[0])]
            raw = shape[0] * (s0 + s1) * per_layer * d * itemsize
        else:
            segs, raw = [(kb, n_vec)], 0
        for bits, n in segs:
            section((n * d * max(bits, 1) + 7) // 8)
            section(n * (4 if f32 else 2), norms(n, f32))
        section(raw)
        if flags & wire.FLAG_CHECKSUM:
            body = b"".join(parts)
            parts.append(struct.pack("<I", zlib.crc32(body)))
    desc = f"v{2 if v2 else 1} shape={shape} bits={kb}/{vb} flags={flags:#x} rot={rot} skip={s0},{s1} {dtype}"
    return b"".join(parts), valid, desc


# ----------------------------------------------------------------------------- oracles


def table_allowance(h, wire) -> tuple[int, str | None]:
    """Bytes the codec tables for header ``h`` may take while built, and a finding if
    the header asks for more than the named limits allow."""
    if h.num_vectors == 0:
        return 0, None  # nothing to decode: no tables needed
    d = h.dim
    m = d
    if h.rotation == "hadamard":
        while m % 2 == 0:
            m //= 2
    limit = getattr(wire, "MAX_DENSE_DIM", 1024)
    note = None
    if m > limit:
        note = f"dense rotation of {m} (> {limit}) demanded by a {h.shape} header"
    # Haar build: float64 G, QR workspace, Q: ~ 64 m^2 bytes measured (258 MB at m = 2048).
    allowance = 80 * min(m, limit) ** 2 + 16 * d * (2**h.bits)
    if h.use_qjl:
        allowance += 16 * h.qjl_sketch_size * d
    return allowance, note


def compiled_programs(tq_jax) -> int:
    return tq_jax._src.blob.compiled_programs()


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MIB


class Runner:
    def __init__(self, args):
        import numpy as np

        import tq_jax
        from tq_jax._src import wire

        self.np, self.tq_jax, self.wire = np, tq_jax, wire
        self.args = args
        self.rng = np.random.default_rng(args.seed)
        self.corpus = seed_corpus(np, tq_jax)
        self.structures = [field_map(b, wire) for _, b in self.corpus]
        self.outcomes = collections.Counter()
        self.by_kind = collections.Counter()
        self.seconds = collections.Counter()
        self.findings = []
        self.max_ratio = (0.0, "")
        self.slowest = (0.0, "")
        self.bridge = None
        if args.bridge_every:
            try:
                self.bridge = BridgeCheck(np, tq_jax)
            except Exception as e:  # torch/lmcache missing
                print(f"bridge check disabled: {type(e).__name__}: {e}")
        self.finding_dir = Path(args.findings)

    def finding(self, kind, blob, msg):
        self.findings.append((kind, msg))
        self.finding_dir.mkdir(parents=True, exist_ok=True)
        (self.finding_dir / f"{len(self.findings):04d}-{kind}.bin").write_bytes(blob)
        print(f"FINDING [{kind}] {msg}", flush=True)

    def case(self, i):
        np, rng = self.np, self.rng
        r = rng.random()
        valid = None
        if r < 0.1:
            kind = "random"
            n = int(rng.integers(0, 200))
            blob = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
            if rng.random() < 0.5:
                blob = b"TQ01" + bytes([int(rng.integers(1, 3))]) + blob
            desc = f"random {len(blob)}"
        elif r < 0.6:
            kind = "mutate"
            j = int(rng.integers(len(self.corpus)))
            blob, ops = mutate(self.corpus[j][1], rng, self.wire, self.structures[j])
            desc = f"{self.corpus[j][0]} {ops}"
        else:
            blob, valid, desc = synth(rng, np, self.wire)
            kind = "synth"
            if rng.random() < 0.3:
                blob, ops = mutate(blob, rng, self.wire)
                kind, valid, desc = "synth+mutate", None, desc + " " + ops
        self.by_kind[kind] += 1
        t0 = time.perf_counter()
        self.check(blob, valid, desc, bridge=self.bridge is not None and i % self.args.bridge_every == 0)
        self.seconds[kind] += time.perf_counter() - t0

    def check(self, blob, valid, desc, bridge=False):
        wire, tq_jax = self.wire, self.tq_jax
        try:
            p = wire.parse(blob)
        except wire.WireError as e:
            self.outcomes[f"refused: {type(e).__name__}"] += 1
            if valid:
                self.finding("false-reject", blob, f"{desc}: {type(e).__name__}: {e}")
            for fn in (wire.peek_header, tq_jax.loads):
                try:
                    fn(blob)
                except wire.WireError:
                    pass
                except Exception as e2:  # noqa: BLE001
                    self.finding("escape", blob, f"{desc}: {fn.__name__} raised {type(e2).__name__}: {e2}")
            if bridge:
                self.bridge.check(self, blob, None, desc)
            return
        except Exception as e:  # noqa: BLE001
            self.finding("escape", blob, f"{desc}: parse raised {type(e).__name__}: {e}")
            return
        h = p.header
        if wire.peek_header(blob) != h:
            self.finding("peek", blob, f"{desc}: peek_header disagrees with parse")
        allowance, note = table_allowance(h, wire)
        if note:
            self.finding("resource", blob, f"{desc}: {note}; not decoded")
            self.outcomes["decoded: skipped (resource)"] += 1
            return
        bound = 3 * 32 * len(blob) + allowance + 4 * MIB
        tracemalloc.start()
        t0 = time.perf_counter()
        try:
            y = tq_jax.loads(blob)
        except wire.WireError as e:
            tracemalloc.stop()
            self.finding("parse-ok-load-fails", blob, f"{desc}: loads raised {type(e).__name__}: {e}")
            return
        except Exception as e:  # noqa: BLE001
            tracemalloc.stop()
            self.finding("escape", blob, f"{desc}: loads raised {type(e).__name__}: {e}")
            return
        dt = time.perf_counter() - t0
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        self.outcomes["decoded"] += 1
        if tuple(y.shape) != h.shape or str(y.dtype) != h.dtype:
            self.finding("shape", blob, f"{desc}: decoded {y.shape} {y.dtype}, header says {h.shape} {h.dtype}")
        if peak > bound:
            self.finding("memory", blob, f"{desc}: traced peak {peak / MIB:.1f} MiB > bound {bound / MIB:.1f} MiB")
        ratio = peak / max(1, len(blob))
        if ratio > self.max_ratio[0] and allowance == 0:
            self.max_ratio = (ratio, desc)
        if dt > self.slowest[0]:
            self.slowest = (dt, desc)
        if bridge:
            self.bridge.check(self, blob, y, desc)


class BridgeCheck:
    """TQJaxDeserializer on real LMCache MemoryObjs."""

    def __init__(self, np, tq_jax):
        import torch

        from lmcache.v1.memory_management import MemoryObjMetadata, TensorMemoryObj  # noqa: PLC0415

        from tq_jax.bridge._src import dlpack, serde  # noqa: PLC0415

        def make_obj(shapes, dtypes):
            """A TensorMemoryObj over fresh 4096-byte-aligned memory (LMCache's L1 alignment)."""
            shapes = [torch.Size(x) for x in shapes]
            n = sum(x.numel() * d.itemsize for x, d in zip(shapes, dtypes))
            raw = torch.empty(n + 4096, dtype=torch.uint8)
            off = -raw.data_ptr() % 4096
            meta = MemoryObjMetadata(shapes[0], dtypes[0], 0, n, 1, shapes=shapes, dtypes=list(dtypes))
            return TensorMemoryObj(raw[off : off + n], meta, None)

        self.np, self.torch, self.tq_jax = np, torch, tq_jax
        self.byte_obj, self.make_obj, self.dlpack = (lambda n: make_obj([(n,)], [torch.uint8])), make_obj, dlpack
        self.de = serde.TQJaxDeserializer()
        self.shape_mismatch = serde.SHAPE_MISMATCH.split("{")[0]
        self.count = collections.Counter()
        self.dtypes = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

    def check(self, run, blob, decoded, desc):
        np, torch, wire = self.np, self.torch, run.wire
        junk = bytes(run.rng.integers(0, 256, int(run.rng.integers(0, 3)) * 37, dtype=np.uint8))
        src = self.byte_obj(max(1, len(blob) + len(junk)))
        src.tensor[: len(blob) + len(junk)].copy_(torch.frombuffer(bytearray(blob + junk), dtype=torch.uint8)
                                                  if blob + junk else torch.empty(0, dtype=torch.uint8))
        if decoded is not None:
            shape = tuple(decoded.shape)
            merged = shape[:-2] + (shape[-2] * shape[-1],) if len(shape) >= 2 else shape
            dt = self.dtypes[str(decoded.dtype)]
        else:
            merged, dt = (2, 3, 4, 16), torch.float32
            try:  # a blob parse refuses may still carry a usable header (trailing bytes)
                h = wire.peek_header(blob)
                merged, dt = h.shape[:-2] + (h.shape[-2] * h.shape[-1],) if len(h.shape) >= 2 else h.shape, \
                    self.dtypes[h.dtype]
            except Exception:  # noqa: BLE001
                pass
        if math.prod(merged) > 1 << 22 or len(merged) == 0:
            return
        dst = self.make_obj([merged], [dt])
        dst.tensor.fill_(-7)
        try:
            self.de.deserialize(src, dst, None)
        except wire.WireError as e:
            self.count[f"refused: {type(e).__name__}"] += 1
            if decoded is not None:
                run.finding("bridge-false-reject", blob + junk,
                            f"{desc} (+{len(junk)} junk bytes): bridge raised {type(e).__name__}: {e}")
            return
        except ValueError as e:
            if str(e).startswith(self.shape_mismatch):
                self.count["refused: shape mismatch"] += 1
                return
            run.finding("bridge-escape", blob + junk, f"{desc}: bridge raised ValueError: {e}")
            return
        except Exception as e:  # noqa: BLE001
            run.finding("bridge-escape", blob + junk, f"{desc}: bridge raised {type(e).__name__}: {e}")
            return
        self.count["decoded"] += 1
        if decoded is None:
            # By design the bridge reads a blob's length from its header and ignores the
            # rest of LMCache's buffer: fine if the buffer's first blob is valid (a blob
            # refused for trailing bytes, or a truncated one completed by the junk).
            data = blob + junk  # what the bridge was given
            try:
                n = run.wire.blob_nbytes(run.wire.peek_header(data))
                run.wire.parse(data[:n])
                self.count["decoded (bytes after the blob ignored)"] += 1
                self.count["decoded"] -= 1
            except Exception:  # noqa: BLE001
                run.finding("bridge-accepts-invalid", blob + junk, f"{desc}: the bridge decoded a blob parse refuses")
            return
        want = np.asarray(decoded).reshape(merged)
        got = self.dlpack.numpy_view(dst.tensor).reshape(merged)
        if not np.array_equal(want.view(np.uint8), got.view(np.uint8)):
            run.finding("bridge-differs", blob + junk, f"{desc}: bridge output differs from tq_jax.loads")


# ----------------------------------------------------------------------------- leak check


def leak_check(n: int) -> str:
    """Decode ``n`` blobs, each with a fresh seed (as a v1 seed bit flip would make), plus
    refused ones, with no new compiled programs: our own state must not grow."""
    import gc

    import numpy as np

    import tq_jax
    from tq_jax._src import wire

    x = np.random.default_rng(0).standard_normal((2, 3, 4, 16)).astype(np.float32)
    blobs = [tq_jax.dumps(x, bits=b, seed=s) for b in (2, 4) for s in range(3)]
    blobs += [tq_jax.dumps(x, key_bits=4, value_bits=3, skip_first_layers=1, checksum=True, seed=s) for s in range(3)]
    bad = [b[:-3] for b in blobs] + [b"TQ01\x01" + b"\0" * 40]
    for b in blobs:
        tq_jax.loads(b)
    gc.collect()
    tracemalloc.start()
    rss0, t0 = rss_mib(), tracemalloc.get_traced_memory()[0]
    rng = np.random.default_rng(1)
    samples = []
    for i in range(n):
        b = bytearray(blobs[i % len(blobs)])
        off = 9 if b[4] == 1 else 13
        b[off : off + 4] = int(rng.integers(0, 2**31)).to_bytes(4, "little")
        if b[4] == 2 and b[5] & wire.FLAG_CHECKSUM:
            b = fix_crc(b)
        tq_jax.loads(bytes(b))
        for bb in bad:
            try:
                tq_jax.loads(bb)
            except wire.WireError:
                pass
        if i % max(1, n // 4) == max(1, n // 4) - 1:
            gc.collect()
            samples.append((i + 1, round((tracemalloc.get_traced_memory()[0] - t0) / MIB, 2), round(rss_mib() - rss0, 1)))
    tracemalloc.stop()
    return (f"- leak check: {n} decodes with fresh seeds + {n * len(bad)} refused blobs; growth (decodes, traced MiB, "
            f"RSS MiB) {samples}; device-table cache {len(tq_jax._src.codec.CACHES['device tables'])} entries")


# ----------------------------------------------------------------------------- atheris


def atheris_main(runs: int, corpus_dir: str) -> None:
    import atheris

    with atheris.instrument_imports(include=["tq_jax"]):
        import tq_jax
        from tq_jax._src import wire

    def target(data: bytes) -> None:
        try:
            p = wire.parse(data)
        except wire.WireError:
            return
        allowance, note = table_allowance(p.header, wire)
        if note:
            raise RuntimeError(note)
        y = tq_jax.loads(data)
        assert tuple(y.shape) == p.header.shape, (y.shape, p.header.shape)

    atheris.Setup([sys.argv[0], f"-runs={runs}", "-max_len=2048", "-rss_limit_mb=6144",
                   "-print_final_stats=1", corpus_dir], target)
    atheris.Fuzz()


def run_atheris(args, corpus) -> dict:
    try:
        import atheris  # noqa: F401
    except ImportError:
        return {"status": "atheris not installed"}
    cdir = Path(args.findings).parent / "fuzz_atheris_corpus"
    cdir.mkdir(parents=True, exist_ok=True)
    for name, b in corpus:
        (cdir / f"seed-{name}").write_bytes(b)
    t0 = time.time()
    proc = subprocess.run(
        [sys.executable, __file__, "--atheris-child", str(args.atheris_runs), str(cdir)],
        capture_output=True, text=True, cwd=str(Path(args.findings).parent),
    )
    tail = (proc.stdout + proc.stderr).strip().splitlines()
    stats = [ln for ln in tail if ln.startswith("stat::") or "DONE" in ln or "Done" in ln]
    crash = [ln for ln in tail if "Uncaught Python exception" in ln or "ERROR" in ln or "Error" in ln]
    return {"status": f"exit {proc.returncode}", "seconds": round(time.time() - t0, 1),
            "stats": stats[-8:], "errors": crash[:10], "tail": tail[-15:]}


# ----------------------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", type=int, default=120_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bridge-every", type=int, default=10, help="run the bridge check on every Nth case (0: never)")
    ap.add_argument("--atheris-runs", type=int, default=30_000)
    ap.add_argument("--leak-check", type=int, default=0, help="then decode N fresh-seed blobs and report growth")
    ap.add_argument("--clear-jit-every", type=int, default=10_000,
                    help="jax.clear_caches() every N cases (0: never); see the RSS note in the output")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "fuzz_long.md"))
    ap.add_argument("--findings", default=str(ROOT / "benchmarks" / "results" / "fuzz_findings"))
    ap.add_argument("--atheris-child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.atheris_child:
        atheris_main(int(args.atheris_child[0]), args.atheris_child[1])
        return 0

    t_start = time.time()
    run = Runner(args)
    import jax

    rss0 = rss_mib()
    rss_samples = []
    programs = 0
    for i in range(args.cases):
        run.case(i)
        if args.clear_jit_every and i % args.clear_jit_every == args.clear_jit_every - 1:
            # JAX caches one compiled program (~1.4 MiB resident on CPU) per decode
            # signature; clearing them separates that bounded LRU from our own state.
            programs += compiled_programs(run.tq_jax)
            jax.clear_caches()
        if i % max(1, args.cases // 20) == 0:
            rss_samples.append((i, round(rss_mib(), 1)))
            print(f"[{i}/{args.cases}] {time.time() - t_start:.0f}s rss {rss_samples[-1][1]} MiB "
                  f"programs {programs + compiled_programs(run.tq_jax)} device tables "
                  f"{len(run.tq_jax._src.codec.CACHES['device tables'])} findings {len(run.findings)} "
                  f"seconds {dict((k, round(v)) for k, v in run.seconds.items())}", flush=True)
    programs += compiled_programs(run.tq_jax)
    rss_samples.append((args.cases, round(rss_mib(), 1)))
    elapsed = time.time() - t_start
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    ath = run_atheris(args, run.corpus) if args.atheris_runs else {"status": "not run"}
    leak = leak_check(args.leak_check) if args.leak_check else "- leak check: not run"

    lines = [
        "# Long fuzz run (tools/fuzz_long.py)",
        "",
        f"Command: `python tools/fuzz_long.py --cases {args.cases} --seed {args.seed} "
        f"--bridge-every {args.bridge_every} --atheris-runs {args.atheris_runs} "
        f"--clear-jit-every {args.clear_jit_every} --leak-check {args.leak_check}`  ",
        f"jax {jax.__version__}, {os.cpu_count()} CPUs; {elapsed:.0f} s for {args.cases} cases "
        f"({args.cases / elapsed:.0f}/s).",
        "",
        "| case kind | count |", "|---|---|",
        *[f"| {k} | {v} |" for k, v in sorted(run.by_kind.items())],
        "",
        "| outcome | count |", "|---|---|",
        *[f"| {k} | {v} |" for k, v in sorted(run.outcomes.items())],
    ]
    if run.bridge:
        lines += ["", "| bridge deserialize outcome | count |", "|---|---|",
                  *[f"| {k} | {v} |" for k, v in sorted(run.bridge.count.items())]]
    lines += [
        "",
        f"- findings: {len(run.findings)}",
        *[f"  - [{k}] {m[:300]}" for k, m in run.findings[:40]],
        f"- largest traced-peak / blob-length ratio (cases needing no new tables): "
        f"{run.max_ratio[0]:.0f} ({run.max_ratio[1]})",
        f"- slowest decode: {run.slowest[0] * 1e3:.0f} ms ({run.slowest[1]})",
        f"- compiled programs (decode signatures met, summed over JIT clears every "
        f"{args.clear_jit_every} cases): {programs}; device-table cache at the end: "
        f"{len(run.tq_jax._src.codec.CACHES['device tables'])} entries",
        f"- RSS: {rss0:.0f} MiB after start-up, samples (case, MiB) {rss_samples}, ru_maxrss {maxrss:.0f} MiB",
        "- time by case kind (s): " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(run.seconds.items())),
        leak,
        f"- atheris: {ath.get('status')}" + (f", {ath.get('seconds')} s" if "seconds" in ath else ""),
        *[f"  - `{s}`" for s in ath.get("stats", [])],
        *[f"  - error: `{s}`" for s in ath.get("errors", [])],
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if ath.get("tail"):
        print("\n".join(ath["tail"]))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    return 1 if run.findings else 0


if __name__ == "__main__":
    sys.exit(main())
