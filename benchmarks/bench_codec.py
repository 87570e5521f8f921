"""The README's codec table: tq_jax vs the reference plugin vs memcpy on one LMCache chunk (W1), in one process.

A front end over ``tq_jax._src.bench``, the measuring code ``tq-jax bench`` runs; it picks
the workload and the report. W1 = [2, 32, 256, 8, 128] bfloat16 Gaussian (LLaMA-3-8B,
256 tokens, per head): 33.5 MB. For each bit width: blob bytes, mean per-vector cosine,
encode/decode median ms and MB/s (of the bf16 input) after warm-up, peak extra resident
memory (VmHWM over the RSS before a warm call), and compile time (first call minus
median); then the floors timed in the same rounds (memcpy, the rotation GEMM) and
paired speed-ups. Decoding is host to host, as in ``tq-jax bench``: ``tq_jax.load_into``
a preallocated buffer.

    python benchmarks/bench_codec.py            # full table, writes benchmarks/results/codec.md
    python benchmarks/bench_codec.py --quick    # smaller chunk, fewer repeats, prints only

The reference (lmcache-turbo-quant-serde + tqai, torch) runs only if installed. Its
8-bit encode materialises a (..., 128, 256) float32 tensor (~35 GB on W1), so it is
not run at 8 bits.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

import jax

from tq_jax._src import bench

ROOT = Path(__file__).resolve().parent.parent
QUICK_W1 = (2, 32, 32, 8, 128)  # W1 with 32 tokens
SETTLE_S = 0.2  # pause before each timed call: torch's worker threads spin for a while after the reference's
FLOOR = "rotation GEMM"

CODEC_COLUMNS = (
    ("codec", lambda r: r.codec),
    ("bits", lambda r: r.setting.removesuffix("-bit") or "-"),
    ("bytes", lambda r: f"{r.nbytes:,}"),
    ("% of bf16", lambda r: f"{100 / r.ratio:.1f}"),
    ("cosine", lambda r: f"{r.cosine:.4f}"),
    ("encode ms", lambda r: f"{r.enc_ms:.1f}"),
    ("encode MB/s", lambda r: f"{r.enc_mbps:.0f}"),
    ("decode ms", lambda r: f"{r.dec_ms:.1f}"),
    ("decode MB/s", lambda r: f"{r.dec_mbps:.0f}"),
    ("peak extra MB", lambda r: "-" if r.peak_mb is None else f"{r.peak_mb:.0f}"),
    ("compile ms (enc/dec)",  # tq_jax's jitted programs; for the others the warm-up's extra time is noise
     lambda r: f"{r.enc_compile_ms:.0f} / {r.dec_compile_ms:.0f}" if r.codec == "tq-jax" else ""),
)
RATIO_HEADER = ("bits", "encode speed-up vs reference", "decode speed-up vs reference", "encode / memcpy",
                "decode / memcpy", "encode / GEMM", "decode / GEMM", "reference decode / GEMM")


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _ratio_rows(bits_list, rounds):
    """Per width: paired ratios (medians of per-round ratios) and ratios of medians to memcpy's."""
    memcpy = statistics.median(rounds["bf16 memcpy", "encode"])

    def paired(a, b):
        if a not in rounds or b not in rounds:
            return "-"
        return f"{statistics.median(p / q for p, q in zip(rounds[a], rounds[b])):.1f}x"

    for bits in bits_list:
        ours, ref, gemm = f"tq-jax {bits}-bit", f"reference {bits}-bit", (FLOOR, "floor")
        yield [
            str(bits), paired((ref, "encode"), (ours, "encode")), paired((ref, "decode"), (ours, "decode")),
            f"{statistics.median(rounds[ours, 'encode']) / memcpy:.1f}x",
            f"{statistics.median(rounds[ours, 'decode']) / memcpy:.1f}x",
            paired((ours, "encode"), gemm), paired((ours, "decode"), gemm), paired((ref, "decode"), gemm),
        ]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="W1 with 32 tokens, 3 repeats")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--bits", type=int, nargs="+", default=[2, 3, 4, 8])
    ap.add_argument("--no-reference", action="store_true")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "codec.md")
    args = ap.parse_args(argv)

    shape = QUICK_W1 if args.quick else bench.W1_SHAPE
    repeats = args.repeats or (3 if args.quick else 7)
    devices = jax.local_devices()
    x = bench.synthetic_kv(shape, seed=0, outliers=0)
    notes: list[str] = []
    methods = [bench.memcpy_method(x), *bench.tq_methods(x, args.bits, devices)]
    if not args.no_reference:
        methods += bench.reference_methods(x, args.bits, notes.append)
    floor, block = bench.rotation_floor(x, devices)
    m = bench.measure(x, bench.attention_setup(x, seed=0), methods, repeats=repeats, interleaved=True,
                      settle_s=SETTLE_S, floors={FLOOR: floor}, peak_memory=True)
    # Each width's tq_jax row, then the reference's, as in the ratio table below.
    results = sorted(m.results, key=lambda r: (r.codec != "bf16 memcpy", r.bits))
    copies, gemms = m.times["bf16 memcpy", "encode"], m.times[FLOOR, "floor"]

    lines = [
        "# tq_jax vs the reference on W1",
        "",
        f"Commit: {_commit()}. Command: `python benchmarks/bench_codec.py{''.join(' ' + a for a in argv)}`.",
        "",
        f"W1 = {list(shape)} bfloat16 Gaussian, {x.nbytes / 1e6:.1f} MB; jax {jax.__version__} on "
        f"{devices[0].platform} ({len(devices)} device); median of {repeats} interleaved rounds after warm-up; "
        f"decode is `tq_jax.load_into` into a preallocated buffer.",
        "",
        bench.format_table(results, CODEC_COLUMNS, markdown=True),
        "",
        *(f"- {n}" for n in notes),
        *([""] if notes else []),
        f"Floors timed in the same rounds: memcpy of W1 {statistics.median(copies) * 1e3:.1f} ms (fastest "
        f"{min(copies) * 1e3:.1f} ms); the rotation alone (float32 GEMM, W1 in {block}-vector blocks) "
        f"{statistics.median(gemms) * 1e3:.1f} ms. Speed-ups and / GEMM are medians of per-round ratios; / memcpy "
        f"is median / median over all rounds (memcpy into a preallocated buffer).",
        "",
        bench.render_table(RATIO_HEADER, _ratio_rows(args.bits, m.times), markdown=True),
    ]
    text = "\n".join(lines)
    print(text)
    if not args.quick:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
