"""``tq-jax bench``: tq-jax vs the reference vs an fp8 cast vs memcpy on a built-in KV workload.

The workload is W1-shaped — LMCache's per-chunk KV layout ``[2, L, T, H, D]`` =
``[2, 32, 256, 8, 128]`` in bfloat16 (32 MiB) — and synthetic, generated from a fixed
seed so nothing is downloaded: keys are Gaussian with a few outlier channels per head
(scaled ×8–×12 and shifted, as real keys have), values are plain Gaussian.

For each method it reports the stored size, the ratio to bf16, the mean per-vector
cosine similarity, the relative error of the attention output
``softmax(q K^T / sqrt(D)) V`` for random queries (per layer and head, on a subset of
layers), and host-to-host encode/decode times (median of ``repeats`` runs after one
warm-up) with the matching throughput in MB/s of bf16 input.

Methods:
    * tq-jax at each requested bit width (``tq_jax.dumps`` / ``tq_jax.load_into``);
    * the reference plugin (``lmcache-turbo-quant-serde`` + ``tqai``), when installed,
      at the widths whose (…, D, 2**bits) float32 intermediate fits a 2 GiB budget —
      its 8-bit encoder would need ~17 GB here;
    * an fp8-style cast: per-vector absmax scale (float16) and float8_e4m3fn values;
    * memcpy of the bf16 bytes (the lossless baseline).

Charts (matplotlib, optional): ``size_vs_quality.png`` and ``throughput.png``; every
axis says which way is better, and every point of the size/quality chart is labelled.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import sys
import time
from typing import Callable, NamedTuple

import numpy as np

__all__ = ["W1_SHAPE", "QUICK_SHAPE", "synthetic_kv", "Result", "run_bench", "format_table"]

W1_SHAPE = (2, 32, 256, 8, 128)
QUICK_SHAPE = (2, 4, 64, 8, 128)
_REF_BUDGET = 2 << 30  # bytes of the reference's (…, D, 2**bits) float32 intermediate
_FP8_MAX = 448.0  # largest finite float8_e4m3fn


class Result(NamedTuple):
    method: str
    bits: float | None  # nominal bits per coordinate (None for baselines)
    nbytes: int
    ratio: float  # bf16 bytes / stored bytes
    cosine: float
    attn_err: float
    enc_ms: float
    dec_ms: float
    enc_mbps: float
    dec_mbps: float


def synthetic_kv(shape=W1_SHAPE, seed: int = 0, outliers: int = 4) -> np.ndarray:
    """A reproducible bf16 KV tensor ``[2, L, T, H, D]``: keys with outlier channels, values Gaussian."""
    import jax.numpy as jnp

    two, n_layers, _, n_heads, dim = shape
    if two != 2:
        raise ValueError(f"the KV workload's first axis must be 2 (keys, values), got shape {shape}")
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal(shape[1:], dtype=np.float32)
    scale = np.ones((n_layers, 1, n_heads, dim), np.float32)
    shift = np.zeros_like(scale)
    for layer in range(n_layers):
        for head in range(n_heads):
            ch = rng.choice(dim, size=min(outliers, dim), replace=False)
            scale[layer, 0, head, ch] = rng.uniform(8.0, 12.0, size=ch.size)
            shift[layer, 0, head, ch] = rng.normal(0.0, 4.0, size=ch.size)
    keys = keys * scale + shift
    values = rng.standard_normal(shape[1:], dtype=np.float32)
    return np.stack([keys, values]).astype(jnp.bfloat16)


# --------------------------------------------------------------------------- metrics


def mean_cosine(x: np.ndarray, y: np.ndarray, block: int = 1 << 16) -> float:
    """Mean cosine similarity of corresponding vectors along the last axis."""
    d = x.shape[-1]
    a = x.reshape(-1, d)
    b = y.reshape(-1, d)
    total = 0.0
    for s in range(0, a.shape[0], block):
        u = a[s : s + block].astype(np.float32)
        v = b[s : s + block].astype(np.float32)
        num = np.einsum("ij,ij->i", u, v)
        den = np.linalg.norm(u, axis=1) * np.linalg.norm(v, axis=1)
        total += float(np.sum(np.where(den > 0, num / np.where(den > 0, den, 1), 1.0)))
    return total / a.shape[0]


class _Attn(NamedTuple):
    layers: np.ndarray
    queries: np.ndarray  # (len(layers), H, nq, D) float32
    reference: np.ndarray  # exact output


def _attention(kv: np.ndarray, layers, queries) -> np.ndarray:
    k = kv[0][layers].astype(np.float32).transpose(0, 2, 1, 3)  # (S, H, T, D)
    v = kv[1][layers].astype(np.float32).transpose(0, 2, 1, 3)
    s = np.einsum("shqd,shtd->shqt", queries, k) / math.sqrt(k.shape[-1])
    s -= s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("shqt,shtd->shqd", p, v)


def attention_setup(kv: np.ndarray, seed: int, n_layers: int = 8, n_queries: int = 32) -> _Attn:
    _, L, _, H, D = kv.shape
    layers = np.unique(np.linspace(0, L - 1, min(L, n_layers)).round().astype(int))
    q = np.random.default_rng(seed + 1).standard_normal((len(layers), H, n_queries, D), dtype=np.float32)
    return _Attn(layers, q, _attention(kv, layers, q))


def attention_error(att: _Attn, kv_hat: np.ndarray) -> float:
    """Mean over (layer, head) of ||O_hat - O|| / ||O|| for the setup's queries."""
    out = _attention(kv_hat, att.layers, att.queries)
    num = np.linalg.norm((out - att.reference).reshape(*out.shape[:2], -1), axis=-1)
    den = np.linalg.norm(att.reference.reshape(*out.shape[:2], -1), axis=-1)
    return float(np.mean(num / den))


# --------------------------------------------------------------------------- methods


def _median_ms(fn: Callable[[], object], repeats: int) -> tuple[float, object]:
    out = fn()  # warm-up (and compilation)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times), out


def _measure(method, bits, x, att, encode, decode, repeats) -> Result:
    enc_ms, stored = _median_ms(encode, repeats)
    dec_ms, y = _median_ms(lambda: decode(stored), repeats)
    nbytes = stored if isinstance(stored, int) else _stored_nbytes(stored)
    mb = x.nbytes / 1e6
    return Result(
        method, bits, nbytes, x.nbytes / nbytes, mean_cosine(x, y), attention_error(att, y),
        enc_ms, dec_ms, mb / (enc_ms / 1e3), mb / (dec_ms / 1e3),
    )


def _stored_nbytes(stored) -> int:
    if isinstance(stored, (bytes, bytearray, memoryview)):
        return len(stored)
    if isinstance(stored, np.ndarray):
        return stored.nbytes
    return sum(_stored_nbytes(s) for s in stored)


def _tq_methods(x, bits_list, devices):
    import tq_jax

    out = np.empty_like(x)
    for bits in bits_list:
        def enc(bits=bits):
            return tq_jax.dumps(x, bits=bits, device=devices)

        def dec(blob):
            tq_jax.load_into(blob, out, device=devices)
            return out

        yield f"tq-jax {bits}-bit", bits, enc, dec


def _fp8_method(x, devices):
    import jax
    import jax.numpy as jnp

    dev = devices[0]

    @jax.jit
    def enc_k(v):
        v = v.astype(jnp.float32)
        scale = (jnp.max(jnp.abs(v), axis=-1, keepdims=True) / _FP8_MAX).astype(jnp.float16)
        s = scale.astype(jnp.float32)
        q = (v / jnp.where(s > 0, s, 1.0)).astype(jnp.float8_e4m3fn)
        return q, scale

    @jax.jit
    def dec_k(q, scale):
        return (q.astype(jnp.float32) * scale.astype(jnp.float32)).astype(jnp.bfloat16)

    def enc():
        q, s = enc_k(jax.device_put(x, dev))
        return np.asarray(q), np.asarray(s)

    def dec(stored):
        q, s = stored
        return np.asarray(dec_k(jax.device_put(q, dev), jax.device_put(s, dev)))

    return "fp8 e4m3 cast", 8, enc, dec


def _memcpy_method(x):
    def enc():
        return x.copy()

    def dec(stored):
        return stored.copy()

    return "bf16 memcpy", 16, enc, dec


def _reference_methods(x, bits_list, note: Callable[[str], None]):
    try:
        from lmcache_turbo_quant_serde import _codec as ref
    except Exception as e:  # ImportError, or a broken install
        note(
            f"reference plugin not available ({type(e).__name__}: {e}); install it with "
            f"`pip install lmcache-turbo-quant-serde==0.1.0 tqai==0.6.1` to compare."
        )
        return
    # The reference works on torch tensors: use the torch it imported itself (tq_jax
    # never imports torch; this optional comparison runs only when the peer is there).
    torch = ref.torch
    TurboQuantSerializer, TurboQuantDeserializer = ref.TurboQuantSerializer, ref.TurboQuantDeserializer
    torch.manual_seed(0)
    xt = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    for bits in bits_list:
        need = x.size * (1 << bits) * 4
        if need > _REF_BUDGET:
            note(
                f"reference {bits}-bit skipped: its encoder materialises a (..., D, {1 << bits}) float32 "
                f"tensor, {need / 2**30:.0f} GiB for this workload."
            )
            continue
        ser = TurboQuantSerializer(bits=bits)
        de = TurboQuantDeserializer()

        def enc(ser=ser):
            return ser.to_bytes(xt)

        def dec(blob, de=de):
            return de.from_bytes(blob).view(torch.int16).numpy().view(x.dtype)

        yield f"reference {bits}-bit", bits, enc, dec


# --------------------------------------------------------------------------- report


COLUMNS = ("method", "bits/value", "bytes", "ratio vs bf16", "mean cosine", "attn rel err",
           "enc ms", "dec ms", "enc MB/s", "dec MB/s")


def _row(r: Result, n_el: int) -> list[str]:
    return [
        r.method, f"{8 * r.nbytes / n_el:.2f}", f"{r.nbytes:,}", f"{r.ratio:.2f}x", f"{r.cosine:.5f}",
        f"{r.attn_err:.4f}", f"{r.enc_ms:.1f}", f"{r.dec_ms:.1f}", f"{r.enc_mbps:,.0f}", f"{r.dec_mbps:,.0f}",
    ]


def format_table(results: list[Result], n_el: int, markdown: bool = False) -> str:
    rows = [list(COLUMNS)] + [_row(r, n_el) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]

    def fmt(row):
        cells = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
        return ("| " + " | ".join(cells) + " |") if markdown else "  ".join(cells)

    sep = ("|" + "|".join("-" * (w + 2) for w in widths) + "|") if markdown else "  ".join("-" * w for w in widths)
    return "\n".join([fmt(rows[0]), sep] + [fmt(r) for r in rows[1:]])


def figures(results: list[Result], n_el: int, title: str) -> dict:
    """The charts as matplotlib figures: {file name: Figure} (the caller closes them)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def family(r):
        return r.method.split()[0]

    styles = {"tq-jax": ("C0", "o-"), "reference": ("C1", "s--"), "fp8": ("C2", "D"), "bf16": ("C7", "^")}
    hollow = {"reference": {"markerfacecolor": "none", "markersize": 10, "markeredgewidth": 1.5}}
    point_labels = {"tq-jax": lambda r: f"{int(r.bits)}b", "fp8": lambda r: "fp8"}
    figs = {}

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, metric, label in (
        (axes[0], lambda r: 1.0 - r.cosine, "1 − mean cosine similarity (lower is better)"),
        (axes[1], lambda r: r.attn_err, "attention output relative error (lower is better)"),
    ):
        for fam in ("tq-jax", "reference", "fp8"):
            rs = sorted((r for r in results if family(r) == fam), key=lambda r: r.nbytes)
            if not rs:
                continue
            color, style = styles[fam]
            xs = [8 * r.nbytes / n_el for r in rs]
            ys = [max(metric(r), 1e-9) for r in rs]
            kw = hollow.get(fam, {"markersize": 6})
            ax.plot(xs, ys, style, color=color, label=fam if fam != "fp8" else "fp8 e4m3 cast", **kw)
            if fam in point_labels:  # the reference's points sit on tq-jax's (same bytes, same values)
                for r, xv, yv in zip(rs, xs, ys):
                    ax.annotate(point_labels[fam](r), (xv, yv), textcoords="offset points", xytext=(5, 5),
                                fontsize=8, color=color)
        ax.axvline(16, color=styles["bf16"][0], linestyle=":", label="bf16 (lossless)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("stored bits per value (log scale; left = smaller files)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"size vs quality — {title} (best: bottom left)", fontsize=10)
    fig.tight_layout()
    figs["size_vs_quality.png"] = fig

    fig, ax = plt.subplots(figsize=(8, 0.45 * len(results) + 1.5))
    ys = np.arange(len(results))
    ax.barh(ys - 0.2, [r.enc_mbps for r in results], height=0.4, label="encode", color="C0")
    ax.barh(ys + 0.2, [r.dec_mbps for r in results], height=0.4, label="decode", color="C3")
    ax.set_yticks(ys, [r.method for r in results])
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("MB/s of bf16 KV (host to host, log scale; higher is better)")
    ax.grid(True, axis="x", which="both", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"throughput — {title} (longer bars are faster)", fontsize=10)
    fig.tight_layout()
    figs["throughput.png"] = fig
    return figs


def _plots(results: list[Result], n_el: int, out_dir: str, title: str) -> list[str]:
    figs = figures(results, n_el, title)  # ImportError without matplotlib
    import matplotlib.pyplot as plt

    paths = []
    for name, fig in figs.items():
        path = os.path.join(out_dir, name)
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def run_bench(*, quick: bool = False, bits=(2, 3, 4, 8), repeats: int = 3, seed: int = 0,
              reference: bool = True, plots: bool = True, out_dir: str = "tq-jax-bench",
              devices=None, echo: Callable[[str], None] = print) -> dict:
    """Run the benchmark, print the table, write bench.md, bench.json and the charts.

    Returns:
        The JSON document written to ``out_dir/bench.json``.
    """
    import jax

    devices = list(devices) if devices else jax.local_devices()
    shape = QUICK_SHAPE if quick else W1_SHAPE
    notes: list[str] = []
    t0 = time.perf_counter()
    x = synthetic_kv(shape, seed)
    att = attention_setup(x, seed)
    n_el = x.size
    workload = (
        f"W1-shaped synthetic KV {list(shape)} bf16 ({x.nbytes / 2**20:.1f} MiB), seed {seed}: keys Gaussian "
        f"with 4 outlier channels per head, values Gaussian; attention error over {len(att.layers)} layers x "
        f"{shape[3]} heads x {att.queries.shape[2]} random queries; times are host-to-host medians of "
        f"{repeats} runs after a warm-up on {len(devices)} x {devices[0].platform} device(s)"
    )
    echo(f"workload: {workload}")

    methods = [_memcpy_method(x), _fp8_method(x, devices)]
    methods += list(_tq_methods(x, bits, devices))
    if reference:
        methods += list(_reference_methods(x, [b for b in bits if b in (2, 3, 4, 6, 8)], notes.append))
    else:
        notes.append("reference skipped (--no-reference).")

    results = []
    for name, b, enc, dec in methods:
        results.append(_measure(name, b, x, att, enc, dec, repeats))
    table = format_table(results, n_el)
    echo("")
    echo(table)
    for n in notes:
        echo(f"note: {n}")

    os.makedirs(out_dir, exist_ok=True)
    charts = []
    if plots:
        try:
            charts = _plots(results, n_el, out_dir, f"{list(shape)} bf16")
        except ImportError:
            notes.append("matplotlib is not installed: no charts (pip install -e '.[cli]' in a clone).")
            echo(f"note: {notes[-1]}")
    doc = {
        "workload": workload,
        "shape": list(shape),
        "seed": seed,
        "repeats": repeats,
        "devices": [str(d) for d in devices],
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, python {sys.version.split()[0]}, jax {jax.__version__}",
        "results": [r._asdict() for r in results],
        "notes": notes,
        "charts": [os.path.basename(c) for c in charts],
        "seconds": time.perf_counter() - t0,
    }
    with open(os.path.join(out_dir, "bench.json"), "w") as f:
        json.dump(doc, f, indent=2)
    with open(os.path.join(out_dir, "bench.md"), "w") as f:
        f.write(f"# tq-jax bench\n\n{workload}.\n\n{doc['machine']}\n\n")
        f.write(format_table(results, n_el, markdown=True) + "\n\n")
        f.writelines(f"- {n}\n" for n in notes)
        f.writelines(f"\n![{c}]({os.path.basename(c)})\n" for c in charts)
    echo(f"\nwrote {', '.join(['bench.md', 'bench.json'] + [os.path.basename(c) for c in charts])} "
         f"to {out_dir} ({doc['seconds']:.1f} s)")
    return doc
