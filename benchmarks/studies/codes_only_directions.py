"""Which change to the codes cuts the codes-only error: a probe in SmolLM2's generation loop.

Answer (benchmarks/results/codes_only_directions_{2k,4k,heldout_2k,loaded_prefix_4k,
loaded_prefix_heldout_2k}_cpu.md,
docs/kvcache.md): at turbo-4's bytes the error is half keys, half values; exact outlier
tokens or an exact first layer change nothing. Sink-aware centring on a mean per
256-token block and an entropy-coded uniform quantiser each cut the KL by about a third.
Together, at 4.27 bits, they reach +0.8 to +1.8 % (KL 0.009-0.014): around +1 %, not
reliably within it. Storing a loaded prefix (--loaded-prefix), the two together move
the model as little as fp8 e4m3 does (KL 0.0013-0.0018 against 0.0016-0.0025) at about
half its bytes. Centring could ship as it is. Entropy-coded pages could have a fixed
size: under a static code table the worst 16-token page strays 0.02 bit from the design
(benchmarks/results/codes_only_page_lengths_cpu.md).

Codes only (no exact window, no exact sinks) every K/V a step reads is a decoded code,
the current token's own included. This probe runs the examples.smollm2 strict in-loop
protocol (prefill ``--prefix`` tokens, then one token per step, ``--scored`` scored,
lockstep KL against the bf16 cache) with a bf16 cache whose writes go through a
*prototype* codec: each K/V vector is encoded and decoded on write (``tq_jax``'s own
codebooks, Hadamard rotation and norm correction, float32 norms), which is what a
per-vector codes-only cache attends over. Candidates change what is coded:

* ``K{b}V{b}``: bits per coordinate of keys and values; ``K-`` / ``V-``: that side exact
  (to split the error between keys and values);
* ``c``: centring, sink-aware: a vector is coded as ``x - mu`` when that lowers its
  norm, else as ``x`` (one flag bit per vector), with ``mu`` the per-(layer, sequence,
  KV head) mean of the prefix's vectors (the bf16 reference's, past the first 4 tokens:
  a serving cache computes it from its own prefill); softmax ignores the constant
  ``q . mu`` only for a global mean, so the flag's choice must be stored;
* ``C``: the same with the mean of each ``BLOCK``-token block of the prefix (a mean per
  LMCache chunk); tokens after the prefix take the last block's;
* ``o{n}``: the ``n`` vectors of largest norm per (layer, sequence, KV head) in the prefix
  stay exact (an outlier-token side table; the attention sink is among them); later
  tokens are coded;
* ``x{n}``: the first ``n`` layers stay exact (which layers the error comes from);
* a bit count with a decimal point (``K4.6V3.4``): instead of the Lloyd-Max codebook, a
  uniform quantiser whose indices an entropy coder would store in that many bits per
  coordinate (for Gaussian coordinates; the table gives the entropy measured on the
  prefix's own vectors as the candidate codes them): at high rate the scalar coder
  that spends a bit best, 1.53 dB from the rate-distortion bound where a fixed-rate
  Lloyd-Max codebook is 4.35 dB from it;
* ``t`` after a side's bits (``K5tV3t``): trellis-coded quantisation at those fixed bits
  (:func:`tcq_quantize`: an 8-state trellis over a doubled codebook, searched by Viterbi
  per vector, decoded per coordinate in parallel): the same bytes as the Lloyd-Max
  codes, with no entropy coder;
* ``--loaded-prefix``: the loaded-prefix protocol instead (``quality --loaded-prefix``):
  the prefix is stored by the candidate and loaded into a bf16 cache, every later token
  exact, as vLLM continues after LMCache loads a prefix; ``--cand fp8`` adds float8 e4m3
  beside the candidates;
* ``--lengths``: no loop; how far each page's code length under a static code strays
  from the design entropy (can entropy-coded pages have a fixed size?).

Bits per value add the flag (1/head_dim), the norm (log-coded 6-bit in turbo presets;
counted as 6/head_dim here, as in ``turbo-4``), the exact outliers' bytes over the
sequence, and ``mu`` (16 bits per coordinate per sequence).

    python -m benchmarks.studies.codes_only_directions --prefix 2048 --scored 256 --seqs 2 \
        --cand K5V3 --cand K5V- --cand K-V3 --cand K5cV3c ...
"""

from __future__ import annotations

import argparse
import functools
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.studies import report
from examples.smollm2 import caches as C
from examples.smollm2 import quality as Q
from examples.smollm2.model import load_smollm2
from tq_jax._src import codec, rotation

SINK_SKIP = 4  # tokens left out of the mean: the attention sink is far from it
NORM_BITS = 6


def _roundtrip(x, bits: int):
    """Encode and decode ``x [..., d]`` with ``bits`` per coordinate (Hadamard, nc)."""
    cfg = codec.CodecConfig(dim=x.shape[-1], bits=bits, rotation="hadamard", norm_correction=True)
    return codec.decode(codec.encode(x.astype(jnp.float32), cfg), cfg)


def gaussian_step(entropy: float) -> float:
    """The step of a uniform quantiser (cells centred on 0) whose index entropy for a
    unit Gaussian is ``entropy`` bits (bisection on the exact cell probabilities)."""
    from math import erf, sqrt

    def h(step):
        edges = (np.arange(-4000, 4001) + 0.5) * step
        cdf = np.array([0.5 * (1 + erf(e / sqrt(2))) for e in edges])
        p = np.diff(np.concatenate([[0.0], cdf, [1.0]]))
        p = p[p > 0]
        return float(-(p * np.log2(p)).sum())

    lo, hi = 1e-3, 8.0
    for _ in range(60):
        mid = (lo * hi) ** 0.5
        lo, hi = (lo, mid) if h(mid) < entropy else (mid, hi)
    return (lo * hi) ** 0.5


def _rotation(d: int):
    signs = np.random.default_rng(42).choice([-1.0, 1.0], d)
    return jnp.asarray((rotation.hadamard(d) * signs[None, :]).T, jnp.float32)  # columns: rotated axes


def _uniform_roundtrip(x, entropy: float):
    """A uniform quantiser of step :func:`gaussian_step` on the rotated, normalised
    coordinates (``~N(0, 1)``), the indices then entropy-coded (counted as their entropy),
    with norm correction: the scalar coder that spends a bit best at high rate."""
    d = x.shape[-1]
    norm = jnp.linalg.norm(x, axis=-1, keepdims=True)
    y = (x / jnp.where(norm == 0, 1, norm) * np.sqrt(d)) @ _rotation(d)
    step = gaussian_step(entropy)
    yq = jnp.round(y / step) * step
    yq = yq * np.sqrt(d) / jnp.maximum(jnp.linalg.norm(yq, axis=-1, keepdims=True), 1e-12)
    return (yq @ _rotation(d).T) * norm / np.sqrt(d)


# Trellis-coded quantisation (TCQ): fixed rate, every coordinate ``bits`` bits (a branch
# bit and ``bits - 1`` bits of a level in one of four subsets of a doubled Lloyd-Max
# codebook), the levels of a vector chosen jointly by a Viterbi search over an 8-state
# trellis whose state is the last three branch bits. A decoder needs no search and no
# sequence: coordinate t's subset follows from branch bits t-3..t, so every coordinate
# decodes at once (:func:`tcq_decode`).
TCQ_STATES = 8


def _tcq_subset(state, branch):
    """The subset (0..3) of a coordinate in ``state`` taking ``branch``: a state's two
    branches use D0/D2 (even states) or D1/D3 (odd), as set partitioning wants."""
    parity = ((state & 1) ^ ((state >> 2) & 1)) & 1
    return (state & 1) + 2 * (branch ^ parity)


TCQ_SCALES = tuple(round(1.0 - 0.05 * i, 2) for i in range(8))  # 1.00 .. 0.65


@functools.lru_cache(maxsize=None)
def tcq_levels(d: int, bits: int) -> jnp.ndarray:
    """``[4, 2**(bits-1)]``: the doubled codebook split into four subsets by index mod 4.

    The doubled codebook is ``lloyd_max(d, bits + 1)`` (for a unit vector's rotated
    coordinates) scaled by the factor of :data:`TCQ_SCALES` that gives the least error on
    2,048 Gaussian vectors (seed 0): the trellis reaches levels a scalar quantiser cannot
    use, so its best codebook is narrower than Lloyd-Max's."""
    from tq_jax._src import codebook

    base = np.asarray(codebook.lloyd_max(d, bits + 1).centroids, np.float64)
    y = np.random.default_rng(0).standard_normal((2048, d))
    y = y / np.linalg.norm(y, axis=-1, keepdims=True)

    def err(scale):
        levels = jnp.asarray((base * scale).reshape(-1, 4).T, jnp.float32)
        yj = jnp.asarray(y, jnp.float32)
        return float(jnp.sum((tcq_decode(*tcq_quantize(yj, levels), levels) - yj) ** 2))

    with jax.ensure_compile_time_eval():  # first called while a step is traced
        best = min(TCQ_SCALES, key=err)
        return jnp.asarray((base * best).reshape(-1, 4).T, jnp.float32)


@jax.jit
def tcq_quantize(y, levels):
    """Viterbi over the trellis: ``y [N, d]`` -> ``(branch int32 [N, d], index int32 [N, d])``
    minimising the squared error of :func:`tcq_decode`'s output; the path starts in state 0."""
    n, d = y.shape
    ns = jnp.arange(TCQ_STATES)
    pred = jnp.stack([(ns >> 1) | (k << 2) for k in (0, 1)], axis=1)  # [S, 2]: states that lead to ns
    sub = _tcq_subset(pred, (ns & 1)[:, None])  # [S, 2]: the subset of that step
    bounds = (levels[:, 1:] + levels[:, :-1]) / 2  # [4, M-1]

    def nearest(v):  # v [N] -> index, error [N, 4]
        idx = jax.vmap(lambda b: jnp.searchsorted(b, v), out_axes=1)(bounds)
        err = (v[:, None] - jnp.take_along_axis(levels.T[None], idx[:, None, :], axis=1)[:, 0]) ** 2
        return idx, err

    def step(cost, v):
        idx, err = nearest(v)
        total = cost[:, pred] + err[:, sub]  # [N, S, 2]
        k = jnp.argmin(total, axis=2)
        best = jnp.take_along_axis(total, k[..., None], axis=2)[..., 0]
        chosen = jnp.take_along_axis(idx[:, sub], k[..., None], axis=2)[..., 0]  # level index per next state
        return best, (k, chosen)

    cost0 = jnp.full((n, TCQ_STATES), jnp.inf).at[:, 0].set(0.0)
    cost, (back, chosen) = jax.lax.scan(step, cost0, y.T)  # [d, N, S]

    def trace(state, t):
        k, c = back[t][jnp.arange(n), state], chosen[t][jnp.arange(n), state]
        return pred[state, k], (state & 1, c)

    _, (branch, index) = jax.lax.scan(trace, jnp.argmin(cost, axis=1), jnp.arange(d - 1, -1, -1))
    return branch[::-1].T.astype(jnp.int32), index[::-1].T.astype(jnp.int32)


@jax.jit
def tcq_decode(branch, index, levels):
    """Every coordinate at once: its state is the previous three branch bits (0 before
    the start), its subset :func:`_tcq_subset` of that state and its own branch bit."""
    prev = [jnp.pad(branch, ((0, 0), (k, 0)))[:, : branch.shape[1]] for k in (1, 2, 3)]
    state = (prev[0] << 0) | (prev[1] << 1) | (prev[2] << 2)
    return levels[_tcq_subset(state, branch), index]


def _tcq_roundtrip(x, bits: int):
    """TCQ of the rotated unit vector at ``bits`` per coordinate, with norm correction:
    the tq_jax pipeline with the per-coordinate codebook lookup replaced by the trellis."""
    d = x.shape[-1]
    flat = x.reshape(-1, d)
    norm = jnp.linalg.norm(flat, axis=-1, keepdims=True)
    y = (flat / jnp.where(norm == 0, 1, norm)) @ _rotation(d)
    levels = tcq_levels(d, bits)
    yq = tcq_decode(*tcq_quantize(y, levels), levels)
    yq = yq / jnp.maximum(jnp.linalg.norm(yq, axis=-1, keepdims=True), 1e-12)
    return ((yq @ _rotation(d).T) * norm).reshape(x.shape)


def measured_entropy(x, entropy: float) -> float:
    """Bits per coordinate of the indices :func:`_uniform_roundtrip` gives ``x [..., d]``
    (their empirical entropy, what an entropy coder would spend)."""
    x = np.asarray(x, np.float32).reshape(-1, x.shape[-1])
    d = x.shape[-1]
    norm = np.linalg.norm(x, axis=-1, keepdims=True)
    y = (x / np.where(norm == 0, 1, norm) * np.sqrt(d)) @ np.asarray(_rotation(d))
    _, counts = np.unique(np.round(y / gaussian_step(entropy)).astype(np.int64), return_counts=True)
    p = counts / counts.sum()
    return float(-(p * np.log2(p)).sum())


def static_code_bits(x, entropy: float) -> np.ndarray:
    """Bits each coordinate of ``x [..., d]`` costs under a *static* code: the indices of
    :func:`_uniform_roundtrip` priced at ``-log2 p`` of the Gaussian design's cell
    probabilities (what an arithmetic coder with a fixed table spends; no statistics of
    the data are sent). Shape ``x.shape``."""
    from math import erf, sqrt

    x = np.asarray(x, np.float32)
    d = x.shape[-1]
    norm = np.linalg.norm(x, axis=-1, keepdims=True)
    y = (x / np.where(norm == 0, 1, norm) * np.sqrt(d)) @ np.asarray(_rotation(d))
    step = gaussian_step(entropy)
    q = np.round(y / step).astype(np.int64)
    idx = np.arange(q.min(), q.max() + 1)
    cdf = np.vectorize(lambda e: 0.5 * (1 + erf(e / sqrt(2))))
    p = cdf((idx + 0.5) * step) - cdf((idx - 0.5) * step)
    return (-np.log2(np.maximum(p, 1e-300)))[q - idx[0]]


def page_bits(bits: np.ndarray, page: int) -> np.ndarray:
    """Mean bits per coordinate of each page of ``page`` tokens of one (layer, sequence,
    head): ``bits [L, B, P, H, d]`` -> a flat array, one entry per page."""
    n_l, n_b, n_p, n_h, d = bits.shape
    n = n_p // page * page
    per = bits[:, :, :n].reshape(n_l, n_b, n_p // page, page, n_h, d).transpose(0, 1, 2, 4, 3, 5)
    return per.reshape(-1, page * d).mean(axis=1)


def _mean_at(mu, centre: str, pos):
    """The mean each position is centred on: ``mu [..., H, d]`` (``"c"``, one mean) or the
    block means ``mu [..., n_blocks, H, d]`` (``"C"``), position ``p`` taking block
    ``min(p // BLOCK, n_blocks - 1)``'s; ``pos [T]`` -> ``[..., T or 1, H, d]``."""
    if centre == "C":
        return jnp.take(mu, jnp.minimum(pos // BLOCK, mu.shape[-3] - 1), axis=-3)
    return mu[..., None, :, :]


def _sink_aware(x, m):
    """``(use, x - m)``: the flag is set where centring lowers the vector's norm."""
    r = x - m
    return jnp.sum(r * r, -1, keepdims=True) < jnp.sum(x * x, -1, keepdims=True), r


def _code(x, bits, mu, centre: str, pos, trellis: bool = False):
    """``x [B, T, H, d]`` as the candidate stores it: coded plainly, or centred
    (:func:`_mean_at`, :func:`_sink_aware`) with ``mu`` the means ``[B, H, d]`` or block
    means ``[B, n_blocks, H, d]``; ``pos [T]``; ``trellis``: by :func:`_tcq_roundtrip`."""
    if bits is None:
        return x
    if trellis:
        code = lambda y: _tcq_roundtrip(y, bits)  # noqa: E731
    elif isinstance(bits, float):
        code = lambda y: _uniform_roundtrip(y, bits)  # noqa: E731
    else:
        code = lambda y: _roundtrip(y, bits)  # noqa: E731
    if not centre:
        return code(x)
    m = _mean_at(mu, centre, pos)
    use, r = _sink_aware(x, m)
    return jnp.where(use, code(r) + m, code(x))


BLOCK = 256  # tokens per block mean (an LMCache chunk)
_CAND = re.compile(r"^K(?P<kb>\d(?:\.\d+)?|-)(?P<kt>t?)(?P<kc>[cC]?)V(?P<vb>\d(?:\.\d+)?|-)(?P<vt>t?)(?P<vc>[cC]?)"
                   r"(?:o(?P<o>\d+))?(?:x(?P<x>\d+))?$")


class Candidate:
    """A duck-typed ``CacheSpec`` for ``quality.in_loop``: a bf16 cache whose writes code."""

    kind = "fakequant"

    def __init__(self, label: str, means, exact_mask):
        m = _CAND.match(label)
        if not m:
            raise ValueError(f"candidate {label!r}: expected K<bits|->[t][c|C]V<bits|->[t][c|C][o<n>][x<n>], e.g. K5cV3")
        if (m["kt"] and "." in m["kb"]) or (m["vt"] and "." in m["vb"]):
            raise ValueError(f"candidate {label!r}: a trellis (t) codes whole bits, not an entropy-coded rate")
        self.label = label
        kb, vb = m["kb"], m["vb"]
        number = lambda t: None if t == "-" else float(t) if "." in t else int(t)  # noqa: E731
        self.kbits, self.vbits = number(kb), number(vb)
        self.kc, self.vc = m["kc"], m["vc"]
        self.outliers = int(m["o"] or 0)
        self.exact_layers = int(m["x"] or 0)
        self.kt, self.vt = bool(m["kt"]), bool(m["vt"])
        kbits, vbits, kc, vc, kt, vt = self.kbits, self.vbits, self.kc, self.vc, self.kt, self.vt
        use_exact = self.outliers > 0
        mu_k = means["C" if kc == "C" else "c"][0]
        mu_v = means["C" if vc == "C" else "c"][1]
        exact_layers = self.exact_layers

        def transform(layer, k, v, start):
            pos = start[0] + jnp.arange(k.shape[1])  # the windows run in lockstep: one start
            kq = _code(k.astype(jnp.float32), kbits, mu_k[layer], kc, pos, kt)
            vq = _code(v.astype(jnp.float32), vbits, mu_v[layer], vc, pos, vt)
            if exact_layers:
                kq = jnp.where(layer < exact_layers, k.astype(jnp.float32), kq)
                vq = jnp.where(layer < exact_layers, v.astype(jnp.float32), vq)
            if use_exact:  # exact_mask [L, B, P, H]: the prefix's outlier tokens
                t = k.shape[1]
                keep = jax.lax.dynamic_slice_in_dim(exact_mask[layer], 0, t, axis=1) if t > 1 else None
                if keep is not None:
                    kq = jnp.where(keep[..., None], k.astype(jnp.float32), kq)
                    vq = jnp.where(keep[..., None], v.astype(jnp.float32), vq)
            return kq, vq

        self.cls = type(f"FakeQuant_{len(_TYPES)}", (C.DenseCache,), {"transform": staticmethod(transform)})
        _TYPES.append(self.cls)

    def init(self, cfg, batch, max_len):
        return self.cls(*C.init_cache(cfg, "bf16", batch, max_len))

    def roundtrip(self, k, v):
        """``stored_roundtrip`` for the loaded-prefix protocol: the prefix's K/V
        ``[L, B, T, H, d]`` as this candidate stores them, and their bytes."""
        start = jnp.zeros((k.shape[1],), jnp.int32)
        pairs = [self.cls.transform(layer, k[layer], v[layer], start) for layer in range(k.shape[0])]
        kd = jnp.stack([a for a, _ in pairs]).astype(jnp.bfloat16)
        vd = jnp.stack([b for _, b in pairs]).astype(jnp.bfloat16)
        n_l, _, n_t, _, d = k.shape
        stored = int(self.bits_per_value(d, n_t, n_l) * (k.size + v.size) / 8)
        return kd, vd, stored

    def bits_per_value(self, d: int, seq_len: int, layers: int) -> float:
        per = []
        for bits, centred in ((self.kbits, self.kc), (self.vbits, self.vc)):
            if bits is None:
                per.append(16.0)
                continue
            mean_bits = {"": 0, "c": 16 / seq_len, "C": 16 / BLOCK}[centred]
            b = bits + NORM_BITS / d + (1 / d if centred else 0) + mean_bits + self.outliers * 16 / seq_len
            per.append((b * (layers - self.exact_layers) + 16 * self.exact_layers) / layers)
        return sum(per) / 2


class Fp8(C.CacheSpec):
    """``fp8``: float8 e4m3 with scale 1 (``quality --loaded-prefix``'s own), beside the
    candidates under ``--loaded-prefix``; 8 bits per value."""

    kbits = vbits = None
    kc = vc = ""

    def __init__(self):
        super().__init__("fp8", "fp8")

    def bits_per_value(self, d: int, seq_len: int, layers: int) -> float:
        return 8.0


_TYPES: list = []
_dense_write = C._dense_write


def _write(cache, layer, k, v):
    """``examples.smollm2.caches._dense_write``, coding K/V first for a candidate's cache."""
    transform = getattr(type(cache), "transform", None)
    if transform is not None:
        k, v = transform(layer, k, v, cache.lengths[layer])
    return type(cache)(*_dense_write(C.DenseCache(*cache), layer, k, v))


def prefix_stats(params, cfg, windows, prefix: int, outliers: int):
    """Per (layer, sequence, KV head): the mean K and V of the prefix past its first
    ``SINK_SKIP`` tokens (``"c"``) and of each of its ``BLOCK``-token blocks (``"C"``), and
    a mask of its ``outliers`` tokens of largest key norm."""
    prefill = jax.jit(C.make_step(cfg, last_only=True), donate_argnums=1)
    cache = C.init_cache(cfg, "bf16", windows.shape[0], windows.shape[1] - 1)
    _, cache = prefill(params, cache, jnp.asarray(windows[:, :prefix]))
    k, v = C.dense_kv(cache, 0, prefix)  # [L, B, P, H, d]
    k, v = k.astype(jnp.float32), v.astype(jnp.float32)
    mu_k, mu_v = k[:, :, SINK_SKIP:].mean(2), v[:, :, SINK_SKIP:].mean(2)
    n_blocks = prefix // BLOCK
    blocks = lambda x: x[:, :, : n_blocks * BLOCK].reshape(*x.shape[:2], n_blocks, BLOCK, *x.shape[3:])  # noqa: E731
    bk, bv = blocks(k), blocks(v)
    # the first block's mean leaves out the sink tokens, like the global one
    bmu_k = jnp.concatenate([bk[:, :, :1, SINK_SKIP:].mean(3), bk[:, :, 1:].mean(3)], axis=2)
    bmu_v = jnp.concatenate([bv[:, :, :1, SINK_SKIP:].mean(3), bv[:, :, 1:].mean(3)], axis=2)
    mask = jnp.zeros(k.shape[:-1], bool)
    if outliers:
        norm = jnp.linalg.norm(k, axis=-1)  # [L, B, P, H]
        kth = -jnp.sort(-norm, axis=2)[:, :, outliers - 1 : outliers]
        mask = norm >= kth
    return {"c": (mu_k, mu_v), "C": (bmu_k, bmu_v), "kv": (k, v)}, mask


def _centred(x, means, side: int, centre: str):
    """The prefix's vectors ``x [L, B, P, H, d]`` as a centring candidate codes them."""
    if not centre:
        return x
    use, r = _sink_aware(x, _mean_at(means[centre][side], centre, jnp.arange(x.shape[2])))
    return jnp.where(use, r, x)


def _lengths(args, argv, means, cands) -> None:
    """The ``--lengths`` report: per entropy-coded candidate, side and page size, how far
    the pages' static-code lengths stray from the design entropy."""
    import sys

    lines = [
        "# Entropy-coded codes in fixed-size pages: how much each page's code length strays",
        "",
        f"`python -m benchmarks.studies.codes_only_directions {' '.join(argv or sys.argv[1:])}` at `{report.commit()}`. "
        f"Text `{args.topic}`, {args.seqs} windows, the prefix's {args.prefix} tokens of every layer and KV "
        "head as each candidate codes them (centred where it centres), priced by a static code "
        "(`static_code_bits`: the Gaussian design's cell probabilities, no statistics sent). One page "
        "is one (layer, sequence, KV head) and `page` consecutive tokens.",
        "",
        "| candidate | side | design bits | page (tokens) | pages | mean bits | std | 99.9th pct | max | max - design |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in cands:
        for side, (bits, centre) in enumerate(((c.kbits, c.kc), (c.vbits, c.vc))):
            if not isinstance(bits, float):
                continue
            cost = static_code_bits(_centred(means["kv"][side], means, side, centre), bits)
            for page in (16, 64, 256):
                per = page_bits(cost, page)
                lines.append(f"| {c.label} | {'KV'[side]} | {bits:.2f} | {page} | {per.size:,} | {per.mean():.4f} | "
                             f"{per.std():.4f} | {np.quantile(per, 0.999):.4f} | {per.max():.4f} | "
                             f"{per.max() - bits:+.4f} |")
    report.write(lines, args.out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prefix", type=int, default=2048)
    p.add_argument("--scored", type=int, default=256)
    p.add_argument("--seqs", type=int, default=2)
    p.add_argument("--topic", default=Q.TEXT_TOPIC)
    p.add_argument("--cand", action="append", required=True)
    p.add_argument("--loaded-prefix", action="store_true",
                   help="the loaded-prefix protocol (quality --loaded-prefix): the prefix from codes, every later token exact")
    p.add_argument("--lengths", action="store_true",
                   help="only the code lengths of the entropy-coded candidates' pages (no loop)")
    p.add_argument("--out")
    args = p.parse_args(argv)
    C._dense_write = _write
    params, cfg, tok = load_smollm2()
    ids = Q.text_tokens(tok, args.topic)
    windows = Q.text_windows(ids, args.seqs, args.prefix + args.scored)
    outliers = max([int(m["o"] or 0) for m in map(_CAND.match, args.cand) if m] + [0])
    means, mask = prefix_stats(params, cfg, windows, args.prefix, outliers)
    cands = []
    for label in args.cand:
        if label == "fp8":  # the stored-format yardstick of the loaded-prefix protocol
            cands.append(Fp8())
            continue
        m = _CAND.match(label)
        n = int(m["o"] or 0) if m else 0
        if n == outliers:
            own = mask
        elif n == 0:
            own = jnp.zeros_like(mask)
        else:
            own = prefix_stats(params, cfg, windows, args.prefix, n)[2]
        cands.append(Candidate(label, means, own))
    if args.lengths:
        return _lengths(args, argv, means, cands)
    t0 = time.perf_counter()
    if args.loaded_prefix:
        stored = Q.stored_roundtrip
        Q.stored_roundtrip = lambda spec, k, v: spec.roundtrip(k, v) if isinstance(spec, Candidate) else stored(spec, k, v)
    results = Q.in_loop(params, cfg, windows, args.prefix, cands, loaded=args.loaded_prefix)
    rows = Q.summarize(results)
    seq_len = args.prefix + args.scored
    lines = [
        "# A prefix loaded from codes, then exact tokens: prototype codecs" if args.loaded_prefix
        else "# Codes only in SmolLM2's loop: prototype codecs on write",
        "",
        f"`python -m benchmarks.studies.codes_only_directions {' '.join(argv or __import__('sys').argv[1:])}` "
        f"at `{report.commit()}`; {time.perf_counter() - t0:.0f} s. Text `{args.topic}`, {args.seqs} windows, prefix "
        f"{args.prefix}, {args.scored} scored per window, one token per step. Bits per value at head_dim "
        f"{cfg.head_dim} over {seq_len} tokens (module docstring).",
        "",
        "| candidate | bits / value | entropy measured (K, V) | ΔPPL vs bf16 | KL (nats) |",
        "|---|---:|---:|---:|---:|",
    ]
    by_label = {c.label: c for c in cands}
    for r in rows:
        if r.label == "bf16":
            continue
        c = by_label[r.label]
        bpv = c.bits_per_value(cfg.head_dim, seq_len, cfg.layers)
        ent = [f"{measured_entropy(_centred(x, means, side, centre), b):.3f}" if isinstance(b, float) else ""
               for side, (x, b, centre) in enumerate(zip(means["kv"], (c.kbits, c.vbits), (c.kc, c.vc)))]
        lines.append(f"| {r.label} | {bpv:.3f} | {', '.join(ent) if any(ent) else ''} | "
                     f"{100 * r.d_ppl:+.2f}% ± {100 * r.d_ppl_se:.2f} | "
                     f"{r.kl:.4f} ± {r.kl_se:.4f} |")
    report.write(lines, args.out)


if __name__ == "__main__":
    main()
