"""Study. Question: how far are the reference's rotation and blobs from tq_jax's, per torch CPU capability?

Answer: torch's AVX2 and AVX-512 capabilities run the same randn kernel, which tq_jax
replays bit for bit; DEFAULT differs by about 1 float32 ulp. The reference's float32 QR
(MKL's code path and thread count) moves its Q by ~1e-6 on every host, so its blobs
differ from tq_jax's (and from each other across hosts) by rare one-level index flips,
and each decodes the other's to ~1e-4. Written in docs/interop.md; the run is
benchmarks/results/capability.md.


The reference (``lmcache-turbo-quant-serde`` 0.1.0 on ``tqai`` 0.6.1) builds its rotation
as ``Q = qr(torch.randn(d, d, generator=manual_seed(seed)))`` in float32 on the machine
that runs it; tq_jax replays torch's AVX2 ``randn`` kernel in numpy and does the QR in
float64 (:mod:`tq_jax._src.rotation`). This script runs the reference in one subprocess per
setting and reports, against tq_jax:

* ``G`` (``torch.randn(d*d)``): bit-equal fraction and max |ΔG|;
* ``Q`` (tqai's ``PolarQuantizer._rotation``, the reference itself): max |ΔQ|;
* the fraction of W1 indices that differ — W1 is one ``[2, 32, 256, 8, 128]`` bfloat16
  chunk of standard normals (``[2, 32, 256, 16, 64]`` at head_dim 64), quantized by
  tq_jax's own quantizer (``_kernels.encode_indices``) once with tq_jax's rotation and once
  with the reference's ``Q``. The codebooks are identical (tests/test_codebook.py), so
  this isolates the rotation; the reference's own encoder at 8 bits would need ~35 GB
  (it builds a ``(..., d, 256)`` distance tensor), so it is not run on W1;
* bytes of real reference blobs (``TurboQuantSerializer.to_bytes``) that differ from
  ``tq_jax.dumps`` of the same bfloat16 input, and how far ``tq_jax.loads`` of the
  reference's blob is from the reference's own ``from_bytes`` of it.

Settings: ``ATEN_CPU_CAPABILITY`` = ``default`` / ``avx2`` / ``avx512`` (each only if
torch reports it back), with MKL as it comes, plus MKL variants under ``avx2``
(``MKL_CBWR``, one thread) — MKL's ``sgeqrf`` gives different float32 ``Q`` bits per
code path and per thread count, so the reference's ``Q`` depends on the host beyond the
capability.

    python benchmarks/studies/capability_distance.py            # writes benchmarks/results/capability.md
    python benchmarks/studies/capability_distance.py --quick    # 2 seeds, no W1 at head_dim 64
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

DIMS = (64, 128)
SEEDS = (42, 0, -5, 7, 123456)
BITS_W1 = (2, 3, 4, 8)
BITS_BLOB = (2, 3, 4)
BLOB_SHAPES = ((2, 4, 16, 2, 128), (1, 8, 32, 1, 64), (2, 2, 64, 4, 128))
W1_SHAPE = (2, 32, 256, 8, 128)
W1_SEED = 42  # the reference's default seed; W1 is quantized with this one only

# (label, environment). "avx512" on a CPU without AVX-512 is honoured by torch's
# dispatcher (get_cpu_capability() says AVX512); only randn runs under it, whose AVX-512
# slot is empty in torch 2.13.0 (normal_stub falls back to the AVX2 kernel).
SETTINGS = (
    ("default", {"ATEN_CPU_CAPABILITY": "default"}),
    ("avx2", {"ATEN_CPU_CAPABILITY": "avx2"}),
    ("avx512", {"ATEN_CPU_CAPABILITY": "avx512"}),
    ("avx2, 1 thread", {"ATEN_CPU_CAPABILITY": "avx2", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}),
    ("avx2, MKL_CBWR=AVX2", {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2"}),
    (
        "avx2, MKL_CBWR=COMPATIBLE, 1 thread",
        {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"},
    ),
)
RANDN_ONLY = {"avx512"}  # on a CPU without AVX-512 nothing else may run under the pin


def _blob_input(shape, k):
    import ml_dtypes

    rng = np.random.default_rng(1000 + k)
    return rng.standard_normal(shape, dtype=np.float32).astype(ml_dtypes.bfloat16)


# ------------------------------------------------------------------------ worker


def worker(spec_path: str) -> None:
    """Runs in the pinned subprocess: torch and the reference only, no tq_jax."""
    import torch

    spec = json.loads(Path(spec_path).read_text())
    out = {"capability": np.array(torch.backends.cpu.get_cpu_capability())}
    for d in spec["dims"]:
        for s in spec["seeds"]:
            g = torch.randn(d * d, generator=torch.Generator("cpu").manual_seed(s), dtype=torch.float32)
            out[f"g_{d}_{s}"] = g.numpy()
    if not spec["randn_only"]:
        from lmcache_turbo_quant_serde import _codec as ref
        from tqai.quantizer import PolarQuantizer

        for d in spec["dims"]:
            for s in spec["seeds"]:
                pq = PolarQuantizer(head_dim=d, bits=4, seed=s)
                out[f"q_{d}_{s}"] = pq.ops.to_numpy(pq._rotation).astype(np.float32)
        inputs = np.load(spec["inputs"])
        for k in range(len(spec["shapes"])):
            x = torch.from_numpy(inputs[f"x{k}"].view(np.int16)).view(torch.bfloat16)
            for bits in spec["bits"]:
                blob = ref.TurboQuantSerializer(bits=bits, seed=W1_SEED).to_bytes(x)
                out[f"blob_{k}_{bits}"] = np.frombuffer(blob, np.uint8)
                dec = ref.TurboQuantDeserializer().from_bytes(blob)
                out[f"dec_{k}_{bits}"] = dec.float().numpy()
    np.savez(spec["out"], **out)


def run_setting(env_extra, tmp: Path, label: str, quick: bool, inputs: Path) -> dict | None:
    name = "".join(c if c.isalnum() else "_" for c in label)
    spec = {
        "dims": list(DIMS),
        "seeds": list(SEEDS[: 2 if quick else None]),
        "bits": list(BITS_BLOB),
        "shapes": [list(s) for s in BLOB_SHAPES],
        "inputs": str(inputs),
        "randn_only": label in RANDN_ONLY,
        "out": str(tmp / f"{name}.npz"),
    }
    spec_path = tmp / f"{name}.json"
    spec_path.write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ATEN_", "MKL_", "OMP_"))}
    env.update(env_extra)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--worker", str(spec_path)], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"[{label}] worker failed (rc {proc.returncode}):\n{proc.stderr[-2000:]}")
        return None
    data = dict(np.load(spec["out"]))
    print(f"[{label}] torch reports {data['capability']} ({time.perf_counter() - t0:.1f} s)")
    return data


# ------------------------------------------------------------------------ analysis


def w1_indices(dim: int, bits: int, q: np.ndarray, w1) -> np.ndarray:
    import jax
    import jax.numpy as jnp

    from tq_jax._src import _kernels, codec

    tabs = codec.tables(codec.CodecConfig(dim=dim, bits=bits, seed=W1_SEED))
    rot = codec.RotationOp(dense=jnp.asarray(q))
    f = jax.jit(lambda x: _kernels.encode_indices(x, rot, tabs.boundaries, tabs.grid)[0])
    return np.asarray(f(w1.reshape(-1, dim)))


def index_bytes(blob: bytes):
    import tq_jax

    h = tq_jax.parse(blob)
    return np.asarray(h.indices[0]).reshape(-1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(Path(__file__).parents[1] / "results" / "capability.md"))
    args = ap.parse_args()
    if args.worker:
        worker(args.worker)
        return

    import jax.numpy as jnp

    import tq_jax
    from tq_jax._src.rotation import haar_rotation, torch_randn

    seeds = SEEDS[: 2 if args.quick else None]
    flags = ""
    if Path("/proc/cpuinfo").exists():
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line
                break
    have = {f: f" {f} " in flags + " " for f in ("avx2", "fma", "avx512f", "avx512bw", "avx512dq", "avx512vl")}
    model = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("model name")), platform.processor())

    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        inputs = tmp / "inputs.npz"
        np.savez(inputs, **{f"x{k}": _blob_input(s, k).view(np.uint16) for k, s in enumerate(BLOB_SHAPES)})
        results = {label: run_setting(env, tmp, label, args.quick, inputs) for label, env in SETTINGS}
    results = {k: v for k, v in results.items() if v is not None}

    rng = np.random.default_rng(0)
    w1_64 = w1_128 = None
    t0 = time.perf_counter()
    w1 = rng.standard_normal(W1_SHAPE, dtype=np.float32).astype(jnp.bfloat16)
    w1_128 = w1
    w1_64 = None if args.quick else w1.reshape(2, 32, 256, 16, 64)
    ours_idx = {}
    for dim, x in ((64, w1_64), (128, w1_128)):
        if x is None:
            continue
        for bits in BITS_W1:
            ours_idx[dim, bits] = w1_indices(dim, bits, haar_rotation(dim, W1_SEED), x)
    print(f"W1 with tq_jax's rotation: {time.perf_counter() - t0:.1f} s")

    lines = []
    add = lines.append
    add("# Distance of the reference's rotation and blobs to tq_jax's, per torch CPU capability")
    add("")
    add(f"Measured by `benchmarks/studies/capability_distance.py` on `{model}`, {os.cpu_count()} CPUs, "
        f"torch {__import__('torch').__version__}, numpy {np.__version__}.")
    add("")
    add("CPU flags: " + ", ".join(f"{f} {'yes' if v else 'no'}" for f, v in have.items()) + ".")
    if not have["avx512f"]:
        add("This CPU has **no AVX-512**: the `avx512` row is torch's dispatcher pinned to AVX512 by "
            "`ATEN_CPU_CAPABILITY=avx512` (torch reports it back) with only `torch.randn` run under it — "
            "its AVX-512 slot for `normal_stub` is empty in torch 2.13.0, so the AVX2 kernel runs, the "
            "same machine code an AVX-512 CPU runs. The reference's QR on a real AVX-512 machine "
            "(MKL's AVX-512 path) is not measured here; the MKL rows below show how far MKL's code path "
            "and thread count alone move the reference's Q.")
    add("")
    add("tq_jax's rotation is the same everywhere: `torch_randn(d*d, seed, kernel=\"avx2\")`, float64 QR, "
        "rounded to float32. Seeds: " + ", ".join(map(str, seeds)) + ". W1 seed: 42.")
    add("")

    add("## Rotation: G = torch.randn(d·d) and Q = tqai's PolarQuantizer._rotation")
    add("")
    add("| setting | torch reports | head_dim | G bit-equal | max abs ΔG | max abs ΔQ |")
    add("|---|---|---:|---:|---:|---:|")
    for label, data in results.items():
        for d in DIMS:
            eq, dg, dq = [], 0.0, 0.0
            for s in seeds:
                g = data[f"g_{d}_{s}"]
                ours = torch_randn(d * d, s)
                eq.append(float(np.mean(g == ours)))
                dg = max(dg, float(np.abs(g - ours).max()))
                if f"q_{d}_{s}" in data:
                    dq = max(dq, float(np.abs(data[f"q_{d}_{s}"] - haar_rotation(d, s)).max()))
            dq_s = f"{dq:.2e}" if f"q_{d}_{seeds[0]}" in data else "(not run)"
            add(f"| {label} | {data['capability']} | {d} | {min(eq):.4f} | {dg:.2e} | {dq_s} |")
    add("")
    base = "avx2"
    if base in results:
        add(f"The reference against itself: max abs ΔQ between its `{base}` run and each other setting "
            "(same CPU, same seeds) — how far the reference moves between hosts.")
        add("")
        add("| setting | " + " | ".join(f"head_dim {d}" for d in DIMS) + " |")
        add("|---|" + "---:|" * len(DIMS))
        for label, data in results.items():
            if label == base or f"q_{DIMS[0]}_{seeds[0]}" not in data:
                continue
            cells = [
                f"{max(float(np.abs(data[f'q_{d}_{s}'] - results[base][f'q_{d}_{s}']).max()) for s in seeds):.2e}"
                for d in DIMS
            ]
            add(f"| {label} | " + " | ".join(cells) + " |")
        add("")

    add("## W1 indices that differ (tq_jax's quantizer, our Q vs the reference's Q, seed 42)")
    add("")
    add("| setting | head_dim | " + " | ".join(f"{b}-bit" for b in BITS_W1) + " |")
    add("|---|---:|" + "---:|" * len(BITS_W1))
    for label, data in results.items():
        if f"q_{DIMS[0]}_{W1_SEED}" not in data:
            continue
        for dim, x in ((64, w1_64), (128, w1_128)):
            if x is None:
                continue
            cells = []
            for bits in BITS_W1:
                theirs = w1_indices(dim, bits, data[f"q_{dim}_{W1_SEED}"], x)
                diff = theirs != ours_idx[dim, bits]
                step = np.abs(theirs.astype(np.int16) - ours_idx[dim, bits].astype(np.int16)).max()
                cells.append(f"{diff.mean():.2e} ({int(diff.sum())}; max step {step})")
            add(f"| {label} | {dim} | " + " | ".join(cells) + " |")
            print(f"W1 {label} d={dim} done")
    add("")
    add(f"Counts in parentheses, out of {int(np.prod(W1_SHAPE)):,} indices; \"max step\" is the "
        "largest |Δindex| (1 = a neighbouring level: the coordinate sat on a decision boundary).")
    add("")

    add("## Real reference blobs vs tq_jax.dumps (bfloat16 input, seed 42)")
    add("")
    add("| setting | shape | bits | blob bytes | bytes differing | tq_jax.loads vs reference decode: max abs Δ / rel. error |")
    add("|---|---|---:|---:|---:|---:|")
    for label, data in results.items():
        if "blob_0_2" not in data:
            continue
        for k, shape in enumerate(BLOB_SHAPES):
            x = _blob_input(shape, k)
            for bits in BITS_BLOB:
                ref = data[f"blob_{k}_{bits}"].tobytes()
                ours = tq_jax.dumps(x, bits=bits, seed=W1_SEED)
                nd = sum(a != b for a, b in zip(ref, ours)) + abs(len(ref) - len(ours))
                got = np.asarray(tq_jax.loads(ref), np.float32)
                dec = data[f"dec_{k}_{bits}"]
                rel = float(np.linalg.norm(got - dec) / np.linalg.norm(dec))
                add(f"| {label} | {tuple(shape)} | {bits} | {len(ref):,} | {nd} | {np.abs(got - dec).max():.2e} / {rel:.1e} |")
    add("")
    add("The decode distance is tq_jax's decode (its own float64-QR rotation) against the "
        "reference's decode (its float32-QR rotation) of the same blob: bfloat16 outputs, so a "
        "difference of one bfloat16 ulp (2**-8 relative) is the floor once the rotations differ at all.")
    add("")
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
