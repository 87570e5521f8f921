"""Study tool. Question: is a change neutral for the codec's W1 speed on the CPU?

Answer, each time it was asked: yes, within noise, for the module splits, the layer
restructuring with the device path, the resolved plan and the straight load and write
paths (each run was committed with its change as benchmarks/results/w1_*_before_after.md,
since removed from the tree as a record of the process; git history keeps them). Run it
before merging a restructuring of the blob path.

W1 speed of two source trees, interleaved.

W1 = [2, 32, 256, 8, 128] bfloat16 Gaussian (33.5 MB). Each round runs every tree in a
fresh process (``PYTHONPATH`` set to the tree, so ``import tq_jax`` is that tree's),
alternating which tree goes first; within a process each case is warmed up, then timed
best of ``--reps`` (3), by wall clock and by the process's CPU time. The table holds the
median over rounds per tree and the median of the per-round ratios (after / before).
memcpy and a float32 GEMM of W1's vectors by a 128 x 128 matrix are timed in the same
processes as yardsticks of the machine's drift.
Both trees' blobs are checked byte-identical on W1 for every case.

    python benchmarks/studies/bench_w1_trees.py BEFORE_TREE AFTER_TREE --rounds 6 --out benchmarks/results/X.md

A tree is a directory holding ``tq_jax/`` (e.g. ``git archive main | tar -x -C /tmp/main``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

W1 = (2, 32, 256, 8, 128)

# Runs in the child process, against whichever tq_jax PYTHONPATH names.
_CHILD = r"""
import hashlib, json, sys
import jax, jax.numpy as jnp, numpy as np
import tq_jax
sys.path.insert(0, sys.argv[1])  # benchmarks/, for timing.py
from timing import best_wall_and_cpu

REPS = int(sys.argv[2])
best_of = lambda fn: best_wall_and_cpu(fn, REPS)  # noqa: E731

W1 = (2, 32, 256, 8, 128)
x = np.random.default_rng(0).standard_normal(W1, np.float32).astype(jnp.bfloat16)
xd = jax.device_put(x, jax.devices()[0])
buf = np.empty_like(x)
v = np.asarray(x, np.float32).reshape(-1, 128)
m = np.random.default_rng(1).standard_normal((128, 128)).astype(np.float32)
gemm = jax.jit(lambda a: a @ m)
vj = jax.device_put(v)


opts = {
    "v1 4-bit haar": dict(bits=4),
    "v2 4-bit hadamard": dict(bits=4, rotation="hadamard"),
    "turbo-3.5": dict(tq_jax.PRESETS["turbo-3.5"]),
    "turbo-2.5": dict(tq_jax.PRESETS["turbo-2.5"]),
}
out, digests = {}, {}
for name, kw in opts.items():
    blob = tq_jax.dumps(x, **kw)
    digests[name] = hashlib.sha256(blob).hexdigest()
    out[f"{name} encode"] = best_of(lambda kw=kw: tq_jax.dumps(x, **kw))
    out[f"{name} decode"] = best_of(lambda blob=blob: tq_jax.loads(blob))
out["v1 4-bit encode of a jax.Array"] = best_of(lambda: tq_jax.dumps(xd, bits=4))
b4 = tq_jax.dumps(x, bits=4)
out["v1 4-bit loads(device=cpu:0)"] = best_of(lambda: tq_jax.loads(b4, device=jax.devices()[0]))
out["memcpy"] = best_of(lambda: np.copyto(buf, x))
out["float32 GEMM floor"] = best_of(lambda: gemm(vj))
print(json.dumps({"times": out, "digests": digests}))
"""


def run_tree(tree: str, reps: int) -> dict:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree), JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", _CHILD, os.path.dirname(os.path.dirname(os.path.abspath(__file__))), str(reps)], env=env, capture_output=True, text=True, cwd=tree,
                       check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before", help="the tree measured as 'before'")
    ap.add_argument("after", help="the tree measured as 'after'")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--reps", type=int, default=3, help="timed calls per case in a process (the best counts)")
    ap.add_argument("--label", default="", help="what the two trees are, for the table's heading")
    ap.add_argument("--out", help="write the Markdown table here")
    args = ap.parse_args(argv)

    runs = {"before": [], "after": []}
    load0 = os.getloadavg()[0]
    t0 = time.time()
    for i in range(args.rounds):
        order = ("before", "after") if i % 2 == 0 else ("after", "before")
        for which in order:
            runs[which].append(run_tree(getattr(args, which), args.reps))
        print(f"round {i + 1}/{args.rounds} done ({time.time() - t0:.0f} s)", file=sys.stderr)
    digests = {w: {json.dumps(r["digests"], sort_keys=True) for r in rs} for w, rs in runs.items()}
    same = digests["before"] == digests["after"] and len(digests["before"]) == 1
    cases = list(runs["before"][0]["times"])
    lines = [
        f"# W1 before vs after{': ' + args.label if args.label else ''}",
        "",
        f"{args.rounds} rounds, alternating which tree runs first, each tree in a fresh process per round "
        f"(PYTHONPATH to the tree), best of {args.reps} per case and round; medians over rounds, and the median of the "
        f"per-round after/before ratios. W1 = {list(W1)} bf16 Gaussian. Blobs byte-identical between the trees "
        f"for every case: {'yes' if same else 'NO'}. Load average (1 min) {load0:.1f} at the start, "
        f"{os.getloadavg()[0]:.1f} at the end, on {os.cpu_count()} CPUs; {time.time() - t0:.0f} s in all.",
        "",
        "Wall: milliseconds by the clock; CPU: this process's CPU time over all its threads, which moves "
        "less than wall time when other jobs share the machine.",
        "",
        "| case | before wall ms | after wall ms | after/before wall | before CPU ms | after CPU ms | after/before CPU |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in cases:
        cells = []
        for k in (0, 1):  # wall, CPU
            b = [r["times"][c][k] for r in runs["before"]]
            a = [r["times"][c][k] for r in runs["after"]]
            ratio = statistics.median(x / y for x, y in zip(a, b))
            cells += [f"{statistics.median(b):.1f}", f"{statistics.median(a):.1f}", f"{ratio:.3f}"]
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
