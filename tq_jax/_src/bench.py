"""Side-by-side codec measurements: tq-jax vs the reference vs an fp8 cast vs memcpy on a KV workload.

``tq-jax bench`` (:func:`run_bench`) and ``benchmarks/bench_codec.py`` (the README's codec
table) are two front ends over this one implementation: the methods, the timing loop, the
quality metrics, the rotation floor and the table rendering all live here, so the CLI
needs nothing from the ``benchmarks/`` tree.

The workload is W1-shaped — LMCache's per-chunk KV layout ``[2, L, T, H, D]`` =
``[2, 32, 256, 8, 128]`` in bfloat16 (32 MiB) — and synthetic, generated from a fixed
seed so nothing is downloaded: keys are Gaussian with a few outlier channels per head
(scaled ×8–×12 and shifted, as real keys have), values are plain Gaussian.

For each method it reports the stored size, the ratio to bf16, the mean per-vector
cosine similarity, the relative error of the attention output
``softmax(q K^T / sqrt(D)) V`` for random queries (per layer and head, on a subset of
layers), and host-to-host encode/decode times with the matching throughput in MB/s of
bf16 input. A row's time is the median of ``repeats`` calls after a warm-up call
(:func:`measure`); the codec table times them in interleaved rounds, ``tq-jax bench``
each method's calls in a row.

Methods:
    * tq-jax at each requested TQ01 v1 bit width and each requested preset of
      ``tq_jax.PRESETS`` (``tq_jax.dumps`` / ``tq_jax.load_into``);
    * the reference plugin (``lmcache-turbo-quant-serde`` + ``tqai``), when installed,
      at the v1 widths whose (…, D, 2**bits) float32 intermediate fits a 2 GiB budget
      (its encoder materialises that tensor; it has no presets);
    * an fp8-style cast: per-vector absmax scale (float16) and float8_e4m3fn values;
    * memcpy of the bf16 bytes into a preallocated buffer (the lossless baseline).

Charts (matplotlib, optional): ``size_vs_quality.png`` and ``throughput.png``; every
axis says which way is better, and every point of the size/quality chart is labelled.
"""

from __future__ import annotations

import functools
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
from typing import Callable, NamedTuple

import numpy as np

from tq_jax._src.options import PRESETS

__all__ = [
    "W1_SHAPE", "QUICK_SHAPE", "PRESET_ROWS", "COLUMNS", "synthetic_kv", "Attention", "attention_setup", "Method",
    "Result", "Measurement", "memcpy_method", "fp8_method", "tq_methods", "reference_methods", "rotation_floor",
    "measure", "render_table", "format_table", "figures", "run_bench",
]

W1_SHAPE = (2, 32, 256, 8, 128)
QUICK_SHAPE = (2, 4, 64, 8, 128)
PRESET_ROWS = ("turbo-4", "turbo-3.5", "turbo-2.5")  # the settings we recommend, shown beside the v1 widths
_REF_BITS = (2, 3, 4, 6, 8)  # the widths the reference plugin implements (TQ01 v1)
_REF_BUDGET = 2 << 30  # the largest (…, D, 2**bits) float32 intermediate the reference may allocate, in bytes
_FP8_MAX = 448.0  # largest finite float8_e4m3fn


def _label(codec: str, setting: str) -> str:
    return f"{codec} {setting}".strip()


class Method(NamedTuple):
    """One row to measure: ``encode()`` stores the workload, ``decode(stored)`` returns it as a bf16 array."""

    codec: str  # "tq-jax", "reference", or a baseline's whole name ("bf16 memcpy")
    setting: str  # "4-bit", a preset name ("turbo-4"), or "" for a baseline
    bits: float | None  # nominal bits per coordinate; a preset's is the mean of its key and value bits
    encode: Callable[[], object]
    decode: Callable[[object], np.ndarray]

    @property
    def name(self) -> str:
        """The row's label: "tq-jax 4-bit", "tq-jax turbo-4", "bf16 memcpy"."""
        return _label(self.codec, self.setting)


class Result(NamedTuple):
    """One measured row. Times are medians of the timed calls; MB/s are of the bf16 input."""

    codec: str
    setting: str
    bits: float | None
    nbytes: int
    bits_per_value: float  # stored bits per element of the workload
    ratio: float  # bf16 bytes / stored bytes
    cosine: float
    attn_err: float
    enc_ms: float
    dec_ms: float
    enc_mbps: float
    dec_mbps: float
    enc_compile_ms: float  # the warm-up call minus the median: compilation and first-touch costs
    dec_compile_ms: float
    peak_mb: float | None = None  # resident memory above the start of one encode or decode; None if not measured

    @property
    def method(self) -> str:
        """The row's label, ``Method.name``."""
        return _label(self.codec, self.setting)


class Measurement(NamedTuple):
    """What :func:`measure` returns: the rows, and the raw times for ratios a report pairs by round."""

    results: list[Result]  # one per method, in the order given
    # seconds of each timed call, by (method, "encode" or "decode") and (floor, "floor")
    times: dict[tuple[str, str], list[float]]


def synthetic_kv(shape=W1_SHAPE, seed: int = 0, outliers: int = 4) -> np.ndarray:
    """A reproducible bf16 KV tensor ``[2, L, T, H, D]``: keys with ``outliers`` outlier channels per head
    (none: plain Gaussian keys), values Gaussian."""
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


class Attention(NamedTuple):
    """Random queries on a subset of layers and the exact attention outputs they give."""

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


def attention_setup(kv: np.ndarray, seed: int, n_layers: int = 8, n_queries: int = 32) -> Attention:
    """``n_queries`` random queries per head on ``n_layers`` evenly spaced layers, and their exact outputs."""
    _, L, _, H, D = kv.shape
    layers = np.unique(np.linspace(0, L - 1, min(L, n_layers)).round().astype(int))
    q = np.random.default_rng(seed + 1).standard_normal((len(layers), H, n_queries, D), dtype=np.float32)
    return Attention(layers, q, _attention(kv, layers, q))


def attention_error(att: Attention, kv_hat: np.ndarray) -> float:
    """Mean over (layer, head) of ||O_hat - O|| / ||O|| for the setup's queries."""
    out = _attention(kv_hat, att.layers, att.queries)
    num = np.linalg.norm((out - att.reference).reshape(*out.shape[:2], -1), axis=-1)
    den = np.linalg.norm(att.reference.reshape(*out.shape[:2], -1), axis=-1)
    return float(np.mean(num / den))


# --------------------------------------------------------------------------- methods


def memcpy_method(x: np.ndarray) -> Method:
    """A copy into a preallocated buffer each way: a fresh ``x.copy()`` would also time page faults."""
    stored, out = np.empty_like(x), np.empty_like(x)

    def enc():
        np.copyto(stored, x)
        return stored

    def dec(src):
        np.copyto(out, src)
        return out

    return Method("bf16 memcpy", "", 16, enc, dec)


def fp8_method(x: np.ndarray, devices) -> Method:
    """A jit-compiled fp8 cast on ``devices[0]``: per-vector absmax scale (float16), float8_e4m3fn values."""
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

    return Method("fp8 e4m3 cast", "", 8, enc, dec)


def tq_methods(x: np.ndarray, settings, devices) -> list[Method]:
    """tq-jax rows: an int in ``settings`` is a TQ01 v1 bit width, a string a name in ``tq_jax.PRESETS``.

    Decoding writes into one preallocated host buffer (``tq_jax.load_into``), shared by the rows.
    """
    import tq_jax

    out = np.empty_like(x)

    def dec(blob):
        tq_jax.load_into(blob, out, device=devices)
        return out

    methods = []
    for setting in settings:
        if isinstance(setting, str):
            preset = PRESETS[setting]
            enc = functools.partial(tq_jax.dumps, x, options=setting, device=devices)
            methods.append(Method("tq-jax", setting, (preset["key_bits"] + preset["value_bits"]) / 2, enc, dec))
        else:
            enc = functools.partial(tq_jax.dumps, x, bits=setting, device=devices)
            methods.append(Method("tq-jax", f"{setting}-bit", setting, enc, dec))
    return methods


def reference_methods(x: np.ndarray, bits_list, note: Callable[[str], None]) -> list[Method]:
    """The reference plugin's rows at the widths of ``bits_list`` it implements, or none (with a note) if absent.

    A width whose float32 intermediate would exceed the budget is skipped with a note.
    """
    try:
        from lmcache_turbo_quant_serde import _codec as ref
    except Exception as e:  # ImportError, or a broken install
        note(
            f"reference plugin not available ({type(e).__name__}: {e}); install it with "
            f"`pip install lmcache-turbo-quant-serde==0.1.0 tqai==0.6.1` to compare."
        )
        return []
    # The reference works on torch tensors: use the torch it imported itself (tq_jax
    # never imports torch; this optional comparison runs only when the peer is there).
    torch = ref.torch
    torch.manual_seed(0)
    xt = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    methods = []
    for bits in (b for b in bits_list if b in _REF_BITS):
        need = x.size * (1 << bits) * 4
        if need > _REF_BUDGET:
            note(
                f"reference {bits}-bit skipped: its encoder materialises a (..., D, {1 << bits}) float32 "
                f"tensor, {need / 2**30:.0f} GiB for this workload."
            )
            continue
        ser, de = ref.TurboQuantSerializer(bits=bits), ref.TurboQuantDeserializer()

        def dec(blob, de=de):
            return de.from_bytes(blob).view(torch.int16).numpy().view(x.dtype)

        methods.append(Method("reference", f"{bits}-bit", bits, functools.partial(ser.to_bytes, xt), dec))
    return methods


def rotation_floor(x: np.ndarray, devices) -> tuple[Callable[[], None], int]:
    """The codec's compute floor: its rotation alone, as a call to time next to the methods.

    A float32 ``(n, D) @ (D, D)`` GEMM over as many vectors as ``x`` holds, in blocks of the
    size the codec uses on ``devices``, on ``devices[0]``.

    Returns:
        ``(call, vectors per block)``; the call waits for its results.
    """
    import jax
    import jax.numpy as jnp

    from tq_jax._src import blocks

    dim = x.shape[-1]
    block = blocks.block_vectors_for(dim, None, devices)
    rng = np.random.default_rng(1)
    parts = [jax.device_put(rng.standard_normal((block, dim), np.float32), devices[0])
             for _ in range(max(1, x.size // dim // block))]
    rot = jax.device_put(np.linalg.qr(rng.standard_normal((dim, dim)))[0].astype(np.float32), devices[0])
    gemm = jax.jit(lambda a: jnp.matmul(a, rot, precision=jax.lax.Precision.HIGHEST))

    def call():
        jax.block_until_ready([gemm(a) for a in parts])

    return call, block


# --------------------------------------------------------------------------- measuring


def _timed(fn: Callable[[], object]) -> tuple[object, float]:
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def _stored_nbytes(stored) -> int:
    if isinstance(stored, (bytes, bytearray, memoryview)):
        return len(stored)
    if isinstance(stored, np.ndarray):
        return stored.nbytes
    return sum(_stored_nbytes(s) for s in stored)


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _peak_extra_mb(fn: Callable[[], object]) -> float | None:
    """Peak resident memory of one call of ``fn`` above the memory before it (Linux), else None."""
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM, the peak, to the current resident size
    except OSError:
        return None
    base = _rss_kb("VmRSS")
    fn()
    return max(0, _rss_kb("VmHWM") - base) / 1024


def measure(x: np.ndarray, att: Attention, methods: list[Method], *, repeats: int, interleaved: bool = False,
            settle_s: float = 0.0, floors: dict[str, Callable[[], object]] | None = None,
            peak_memory: bool = False) -> Measurement:
    """Measure each method on ``x``: quality from a warm-up round trip, times from ``repeats`` calls each.

    Each method is first run once (encode, then decode of what it stored): that round trip
    gives the size and quality, and its extra time over the median is the compile time.
    Then every encode, decode and floor is timed ``repeats`` times: one after another, or
    in interleaved rounds that time each of them once, back to back, so drift in the
    machine's speed reaches all of them alike and per-round ratios can be paired.

    Args:
        x: the bf16 workload ``[2, L, T, H, D]``.
        att: :func:`attention_setup` of ``x``: the queries and the exact attention outputs.
        methods: the rows, in the order they are timed.
        repeats: timed calls of each encode, decode and floor.
        interleaved: time in rounds (above) rather than each call's repeats in a row.
        settle_s: seconds to sleep before each timed call, so worker threads that spin after
            a call (torch's, under the reference) are idle when the next call starts; rounds
            that interleave the reference with the others need it.
        floors: yardsticks timed like the methods (:func:`rotation_floor`), by name.
        peak_memory: also measure each method's peak extra memory (one more encode and decode each).

    Returns:
        The results, and every timed call's seconds (per round when ``interleaved``).
    """
    timers, firsts, rows = {}, {}, []
    for m in methods:
        stored, firsts[m.name, "encode"] = _timed(m.encode)
        decode = functools.partial(m.decode, stored)
        y, firsts[m.name, "decode"] = _timed(decode)
        rows.append((m, _stored_nbytes(stored), mean_cosine(x, y), attention_error(att, y)))
        timers[m.name, "encode"], timers[m.name, "decode"] = m.encode, decode
    for name, fn in (floors or {}).items():
        fn()  # warm-up (and compilation)
        timers[name, "floor"] = fn
    keys = list(timers)
    times = {key: [] for key in keys}
    for key in keys * repeats if interleaved else [key for key in keys for _ in range(repeats)]:
        time.sleep(settle_s)
        times[key].append(_timed(timers[key])[1])

    mb = x.nbytes / 1e6
    results = []
    for m, nbytes, cosine, attn_err in rows:
        enc_s, dec_s = statistics.median(times[m.name, "encode"]), statistics.median(times[m.name, "decode"])
        peak = None
        if peak_memory:
            peaks = [_peak_extra_mb(timers[m.name, phase]) for phase in ("encode", "decode")]
            peak = None if None in peaks else max(peaks)
        results.append(Result(
            m.codec, m.setting, m.bits, nbytes, 8 * nbytes / x.size, x.nbytes / nbytes, cosine, attn_err,
            1e3 * enc_s, 1e3 * dec_s, mb / enc_s, mb / dec_s,
            1e3 * (firsts[m.name, "encode"] - enc_s), 1e3 * (firsts[m.name, "decode"] - dec_s), peak,
        ))
    return Measurement(results, times)


# --------------------------------------------------------------------------- report


COLUMNS = (  # the `tq-jax bench` table: (header, cell of a Result)
    ("method", lambda r: r.method),
    ("bits/value", lambda r: f"{r.bits_per_value:.2f}"),
    ("bytes", lambda r: f"{r.nbytes:,}"),
    ("ratio vs bf16", lambda r: f"{r.ratio:.2f}x"),
    ("mean cosine", lambda r: f"{r.cosine:.5f}"),
    ("attn rel err", lambda r: f"{r.attn_err:.4f}"),
    ("enc ms", lambda r: f"{r.enc_ms:.1f}"),
    ("dec ms", lambda r: f"{r.dec_ms:.1f}"),
    ("enc MB/s", lambda r: f"{r.enc_mbps:,.0f}"),
    ("dec MB/s", lambda r: f"{r.dec_mbps:,.0f}"),
)


def render_table(header, rows, markdown: bool = False) -> str:
    """Text rows as an aligned plain-text table (first column left, others right) or a markdown one."""
    rows = [list(header)] + [list(r) for r in rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]

    def fmt(row):
        cells = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
        return ("| " + " | ".join(cells) + " |") if markdown else "  ".join(cells)

    sep = ("|" + "|".join("-" * (w + 2) for w in widths) + "|") if markdown else "  ".join("-" * w for w in widths)
    return "\n".join([fmt(rows[0]), sep] + [fmt(r) for r in rows[1:]])


def format_table(results: list[Result], columns=COLUMNS, markdown: bool = False) -> str:
    """One row per result, one column per ``(header, cell)`` of ``columns``."""
    return render_table([h for h, _ in columns], [[cell(r) for _, cell in columns] for r in results], markdown)


def figures(results: list[Result], title: str) -> dict:
    """The charts as matplotlib figures: {file name: Figure} (the caller closes them)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def series(r):
        return "tq-jax presets" if r.codec == "tq-jax" and r.setting in PRESETS else r.codec

    styles = {"tq-jax": ("C0", "o-"), "tq-jax presets": ("C3", "v"), "reference": ("C1", "s--"),
              "fp8 e4m3 cast": ("C2", "D"), "bf16 memcpy": ("C7", "^")}
    hollow = {"reference": {"markerfacecolor": "none", "markersize": 10, "markeredgewidth": 1.5}}
    point_labels = {"tq-jax": lambda r: r.setting.removesuffix("-bit") + "b", "tq-jax presets": lambda r: r.setting,
                    "fp8 e4m3 cast": lambda r: "fp8"}
    label_offsets = {"tq-jax presets": (5, -12)}  # below their points, clear of the v1 widths' labels above
    figs = {}

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, metric, label in (
        (axes[0], lambda r: 1.0 - r.cosine, "1 − mean cosine similarity (lower is better)"),
        (axes[1], lambda r: r.attn_err, "attention output relative error (lower is better)"),
    ):
        for name in ("tq-jax", "tq-jax presets", "reference", "fp8 e4m3 cast"):
            rs = sorted((r for r in results if series(r) == name), key=lambda r: r.nbytes)
            if not rs:
                continue
            color, style = styles[name]
            xs = [r.bits_per_value for r in rs]
            ys = [max(metric(r), 1e-9) for r in rs]
            ax.plot(xs, ys, style, color=color, label=name, **hollow.get(name, {"markersize": 6}))
            if name in point_labels:  # the reference's points sit on tq-jax's (same bytes, same values)
                for r, xv, yv in zip(rs, xs, ys):
                    ax.annotate(point_labels[name](r), (xv, yv), textcoords="offset points",
                                xytext=label_offsets.get(name, (5, 5)), fontsize=8, color=color)
        ax.axvline(16, color=styles["bf16 memcpy"][0], linestyle=":", label="bf16 (lossless)")
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


def _plots(results: list[Result], out_dir: str, title: str) -> list[str]:
    figs = figures(results, title)  # ImportError without matplotlib
    import matplotlib.pyplot as plt

    paths = []
    for name, fig in figs.items():
        path = os.path.join(out_dir, name)
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def run_bench(*, quick: bool = False, bits=(2, 3, 4, 8), presets=PRESET_ROWS, repeats: int = 3, seed: int = 0,
              reference: bool = True, plots: bool = True, out_dir: str = "tq-jax-bench",
              devices=None, echo: Callable[[str], None] = print) -> dict:
    """Run the benchmark, print the table, write bench.md, bench.json and the charts.

    Rows: memcpy, the fp8 cast, tq-jax at each of ``bits`` (TQ01 v1) and each of
    ``presets``, then the reference at the widths of ``bits`` it can run.

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
    workload = (
        f"W1-shaped synthetic KV {list(shape)} bf16 ({x.nbytes / 2**20:.1f} MiB), seed {seed}: keys Gaussian "
        f"with 4 outlier channels per head, values Gaussian; attention error over {len(att.layers)} layers x "
        f"{shape[3]} heads x {att.queries.shape[2]} random queries; times are host-to-host medians of "
        f"{repeats} runs after a warm-up on {len(devices)} x {devices[0].platform} device(s)"
    )
    echo(f"workload: {workload}")

    methods = [memcpy_method(x), fp8_method(x, devices), *tq_methods(x, [*bits, *presets], devices)]
    if reference:
        methods += reference_methods(x, bits, notes.append)
    else:
        notes.append("reference skipped (--no-reference).")
    if presets:
        notes.append(f"{', '.join(presets)}: tq-jax presets (tq_jax.PRESETS, `tq-jax compress --preset`); "
                     f"the reference has no presets.")

    results = measure(x, att, methods, repeats=repeats).results
    echo("")
    echo(format_table(results))
    for n in notes:
        echo(f"note: {n}")

    os.makedirs(out_dir, exist_ok=True)
    charts = []
    if plots:
        try:
            charts = _plots(results, out_dir, f"{list(shape)} bf16")
        except ImportError:
            notes.append("matplotlib is not installed: no charts (pip install -e '.[cli]' in a clone).")
            echo(f"note: {notes[-1]}")
    doc = {
        "workload": workload,
        "shape": list(shape),
        "seed": seed,
        "repeats": repeats,
        "devices": [str(d) for d in devices],
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, python {sys.version.split()[0]}, "
                   f"jax {jax.__version__}",
        "results": [{"method": r.method, **r._asdict()} for r in results],
        "notes": notes,
        "charts": [os.path.basename(c) for c in charts],
        "seconds": time.perf_counter() - t0,
    }
    with open(os.path.join(out_dir, "bench.json"), "w") as f:
        json.dump(doc, f, indent=2)
    with open(os.path.join(out_dir, "bench.md"), "w") as f:
        f.write(f"# tq-jax bench\n\n{workload}.\n\n{doc['machine']}\n\n")
        f.write(format_table(results, markdown=True) + "\n\n")
        f.writelines(f"- {n}\n" for n in notes)
        f.writelines(f"\n![{c}]({os.path.basename(c)})\n" for c in charts)
    echo(f"\nwrote {', '.join(['bench.md', 'bench.json'] + [os.path.basename(c) for c in charts])} "
         f"to {out_dir} ({doc['seconds']:.1f} s)")
    return doc
