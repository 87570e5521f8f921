"""Entropy-coded codes in fixed-size units: what a per-vector row or a per-page budget
costs over the design entropy, and how fast a JAX decoder reads each.

The codes-only study (``codes_only_directions``) found that an entropy-coded uniform
quantiser (ECSQ) on the rotated, normalised coordinates beats the Lloyd-Max codes at the
same bits, and that a static code table (the Gaussian design's cell probabilities)
prices every page of 16 or more tokens within 0.02 bit of the design entropy. Those are
ideal code lengths; a format needs a real coder and fixed-size units (the serving cache
appends a token at a time and reads any token at random; LMCache needs a value's size
before it is written). This study prices two layouts with real coders:

1. **Rows** (the cache's layout today: a fixed size per vector). A canonical Huffman
   code of the design's cell probabilities, its lengths limited to ``max_len`` bits so
   that one table of ``2**max_len`` entries decodes a symbol from a ``max_len``-bit
   window. Normalising a vector fixes its sum of squares and an ideal code length is
   nearly ``a + b x**2``, so a vector's total ideal length hardly varies; integer code
   lengths break that. The study measures the spread of a vector's total length, with
   Huffman and with ideal lengths, on Gaussian vectors and on anisotropic ones
   (per-channel scales spanning e**±2, then the study's rotation, as the codec sees keys
   with outlier channels), and the share that overflows each row size (a format would
   code those with a coarser step, flagged).
2. **Pages.** One static rANS stream per page of 16 or 64 tokens of one (layer, head):
   the design probabilities quantised to ``2**PREC``, a 32-bit state and 16-bit words.
   The page's budget is the longest page seen.
3. **The decoders.** Jitted JAX decoders into indices, vectorised over rows or pages with
   one step per symbol, timed beside ``tq_jax``'s own decode of the same vectors at the
   fixed-rate bits (unpack, codebook, inverse rotation, norms: the whole decode), side by
   side in one process.

    python -m benchmarks.studies.ecsq_coders [--vectors 46080] [--out benchmarks/results/ecsq_coders_cpu.md]
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import statistics
import sys
import time
from math import erf, sqrt

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.studies import report
from benchmarks.studies.codes_only_directions import _rotation, gaussian_step

D = 64  # SmolLM2's head_dim


def cell_probabilities(entropy: float, clip: float = 6.0) -> tuple[float, np.ndarray, int]:
    """``(step, p, a)``: the uniform quantiser of :func:`gaussian_step` for a unit Gaussian,
    its indices clipped to ``[-a, a]`` (``a`` steps reach ``clip`` sigma; the tails fold
    into the end cells), and their probabilities ``p[i + a]``."""
    step = gaussian_step(entropy)
    a = int(np.ceil(clip / step))
    edges = (np.arange(-a, a) + 0.5) * step
    cdf = np.array([0.5 * (1 + erf(e / sqrt(2))) for e in edges])
    p = np.diff(np.concatenate([[0.0], cdf, [1.0]]))
    return step, p, a


def _huffman(p: np.ndarray) -> np.ndarray:
    tick = itertools.count()
    heap = [(float(pi), next(tick), [i]) for i, pi in enumerate(p)]
    heapq.heapify(heap)
    lengths = np.zeros(len(p), np.int64)
    while len(heap) > 1:
        a, b = heapq.heappop(heap), heapq.heappop(heap)
        for i in a[2] + b[2]:
            lengths[i] += 1
        heapq.heappush(heap, (a[0] + b[0], next(tick), a[2] + b[2]))
    return lengths


def code_lengths(p: np.ndarray, max_len: int) -> np.ndarray:
    """Huffman code lengths of ``p``, limited to ``max_len``: Huffman of ``p + eps`` with the
    least ``eps`` (bisection) whose longest code fits; still a prefix code (Kraft <= 1)."""
    lengths = _huffman(p)
    if lengths.max() <= max_len:
        return lengths
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _huffman(p + mid).max() > max_len else (lo, mid)
    return _huffman(p + hi)


def canonical(lengths: np.ndarray) -> np.ndarray:
    """The canonical code word of each symbol (shorter codes first, then by symbol)."""
    order = np.lexsort((np.arange(len(lengths)), lengths))
    codes = np.zeros(len(lengths), np.int64)
    code, prev = 0, int(lengths[order[0]])
    for n, s in enumerate(order):
        if n:
            code = (code + 1) << (int(lengths[s]) - prev)
        codes[s], prev = code, int(lengths[s])
    return codes


def decode_table(lengths: np.ndarray, codes: np.ndarray, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """``(symbol, length)`` for every ``max_len``-bit window: the symbol whose code word
    starts the window, and its length."""
    sym = np.zeros(1 << max_len, np.int32)
    ln = np.zeros(1 << max_len, np.int32)
    for s, (n, c) in enumerate(zip(lengths, codes)):
        lo = int(c) << (max_len - int(n))
        sym[lo : lo + (1 << (max_len - int(n)))] = s
        ln[lo : lo + (1 << (max_len - int(n)))] = n
    return sym, ln


class Design:
    """One side's row code: ``entropy`` design bits, codes limited to ``max_len`` bits,
    rows of ``row_bytes`` bytes per ``D``-dimensional vector."""

    def __init__(self, entropy: float, max_len: int = 12):
        self.entropy, self.max_len = entropy, max_len
        self.step, self.p, self.a = cell_probabilities(entropy)
        self.lengths = code_lengths(self.p, max_len)
        self.codes = canonical(self.lengths)
        self.sym, self.len = decode_table(self.lengths, self.codes, max_len)

    @property
    def cell_entropy(self) -> float:
        p = self.p[self.p > 0]
        return float(-(p * np.log2(p)).sum())

    @property
    def mean_length(self) -> float:
        return float((self.p * self.lengths).sum())

    def indices(self, x: np.ndarray) -> np.ndarray:
        """Cell indices (``0 .. 2a``) of vectors ``x [N, D]``: normalised to norm ``sqrt(D)``
        (unit variance per coordinate once rotated; ``x`` is taken as already rotated)."""
        norm = np.linalg.norm(x, axis=-1, keepdims=True)
        y = x / np.where(norm == 0, 1, norm) * np.sqrt(x.shape[-1])
        return np.clip(np.round(y / self.step), -self.a, self.a).astype(np.int64) + self.a

    def row_bits(self, idx: np.ndarray) -> np.ndarray:
        """Each vector's total code length in bits."""
        return self.lengths[idx].sum(axis=-1)

    def encode(self, idx: np.ndarray, row_bytes: int) -> tuple[np.ndarray, np.ndarray]:
        """``(rows uint8 [N, row_bytes], fits bool [N])``: each vector's codes, MSB first,
        zero-padded; a vector that overflows its row is left zero (``fits`` False)."""
        n, d = idx.shape
        total = self.row_bits(idx)
        fits = total <= 8 * row_bytes
        bits = np.zeros((n, 8 * row_bytes), np.uint8)
        pos = np.zeros(n, np.int64)
        rows_ok = np.nonzero(fits)[0]
        for j in range(d):
            s = idx[rows_ok, j]
            ln, cw = self.lengths[s], self.codes[s]
            for b in range(int(ln.max())):
                on = b < ln
                bit = (cw >> np.maximum(ln - 1 - b, 0)) & 1
                bits[rows_ok[on], pos[rows_ok[on]] + b] = bit[on]
            pos[rows_ok] += ln
        return np.packbits(bits, axis=1), fits


def decoder(design: Design, row_bytes: int, d: int = D):
    """The jitted decoder: rows uint8 ``[N, row_bytes]`` -> cell indices int32 ``[N, d]``.

    Rows are read as big-endian 32-bit words (padded by one word); each step takes a
    ``max_len``-bit window at every vector's bit offset from two words, looks its
    symbol and length up in one table, and advances the offset."""
    words = -(-row_bytes // 4) + 1
    sym = jnp.asarray(design.sym)
    ln = jnp.asarray(design.len)
    m = design.max_len

    def run(rows):
        n = rows.shape[0]
        padded = jnp.zeros((n, 4 * words), jnp.uint8).at[:, :row_bytes].set(rows)
        w = padded.reshape(n, words, 4).astype(jnp.uint32)
        w = (w[..., 0] << 24) | (w[..., 1] << 16) | (w[..., 2] << 8) | w[..., 3]

        def step(pos, _):
            i, off = pos >> 5, (pos & 31).astype(jnp.uint32)
            hi = jnp.take_along_axis(w, i[:, None], axis=1)[:, 0]
            lo = jnp.take_along_axis(w, (i + 1)[:, None], axis=1)[:, 0]
            window = (hi << off) | jnp.where(off == 0, jnp.uint32(0), lo >> (jnp.uint32(32) - off))
            key = (window >> jnp.uint32(32 - m)).astype(jnp.int32)
            return pos + ln[key], sym[key]

        _, out = jax.lax.scan(step, jnp.zeros(n, jnp.int32), None, length=d)
        return out.T

    return jax.jit(run)


# --------------------------------------------------------------------------- pages: static rANS
#
# One stream per page of P tokens of one (layer, head): its P*D indices, token-major, coded
# with rANS under the design's probabilities quantised to 2**PREC, a 32-bit state kept in
# [2**16, 2**32) by 16-bit words. A page is a fixed number of words; the encoder writes
# the stream at the page's end so the decoder reads words forward from the start.

PREC = 12


def frequencies(p: np.ndarray) -> np.ndarray:
    """The design probabilities as integer frequencies summing to ``2**PREC``, each >= 1."""
    f = np.maximum(1, np.round(p * (1 << PREC))).astype(np.int64)
    f[np.argmax(f)] += (1 << PREC) - f.sum()
    return f


class PageCode:
    """Static rANS over pages of ``page`` tokens for one side's design."""

    def __init__(self, design: Design, page: int = 16):
        self.design, self.page = design, page
        self.freq = frequencies(design.p)
        self.cum = np.concatenate([[0], np.cumsum(self.freq)[:-1]])
        self.slot_sym = np.repeat(np.arange(len(self.freq)), self.freq).astype(np.int32)

    @property
    def static_bits(self) -> float:
        """Bits per coordinate the quantised table spends on the design distribution."""
        return float(-(self.design.p * np.log2(self.freq / (1 << PREC))).sum())

    def encode(self, idx: np.ndarray, words: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``idx [pages, page*D]`` -> ``(uint16 [pages, words], fits bool [pages], used words [pages])``.
        A page that needs more than ``words`` words is left zero (``fits`` False); with
        ``words`` None, only the words each page uses (the others None)."""
        n, m = idx.shape
        out = np.zeros((n, m // 2 + 4), np.uint16)  # room for any page (< 16 bits a symbol)
        top = np.full(n, out.shape[1], np.int64)
        x = np.full(n, 1 << 16, np.uint64)
        rows = np.arange(n)
        for j in range(m - 1, -1, -1):
            s = idx[:, j]
            f, c = self.freq[s].astype(np.uint64), self.cum[s].astype(np.uint64)
            spill = x >= (f << np.uint64(32 - PREC))
            top[spill] -= 1
            out[rows[spill], top[spill]] = (x[spill] & np.uint64(0xFFFF)).astype(np.uint16)
            x[spill] >>= np.uint64(16)
            x = ((x // f) << np.uint64(PREC)) + (x % f) + c
        for shift in (0, 16):  # the final state, high word first when read forward
            top -= 1
            out[rows, top] = ((x >> np.uint64(shift)) & np.uint64(0xFFFF)).astype(np.uint16)
        used = out.shape[1] - top
        if words is None:
            return None, None, used
        fits = used <= words
        pages = np.zeros((n, words), np.uint16)
        for i in np.nonzero(fits)[0]:
            pages[i, : used[i]] = out[i, top[i] :]
        return pages, fits, used


def page_decoder(code: PageCode, words: int):
    """The jitted decoder: pages uint16 ``[pages, words]`` -> indices int32 ``[pages, page*D]``:
    one step per symbol, every page's state and word pointer advanced together."""
    m = code.page * D
    freq = jnp.asarray(code.freq, jnp.uint32)
    cum = jnp.asarray(code.cum, jnp.uint32)
    slot_sym = jnp.asarray(code.slot_sym)
    mask = jnp.uint32((1 << PREC) - 1)

    def run(pages):
        w = jnp.concatenate([pages, jnp.zeros((pages.shape[0], 1), pages.dtype)], axis=1).astype(jnp.uint32)
        x0 = (w[:, 0] << 16) | w[:, 1]

        def step(carry, _):
            x, ptr = carry
            slot = x & mask
            s = slot_sym[slot.astype(jnp.int32)]
            x = freq[s] * (x >> PREC) + slot - cum[s]
            low = x < jnp.uint32(1 << 16)
            nxt = jnp.take_along_axis(w, jnp.minimum(ptr, words)[:, None], axis=1)[:, 0]
            x = jnp.where(low, (x << 16) | nxt, x)
            return (x, ptr + low.astype(jnp.int32)), s

        _, out = jax.lax.scan(step, (x0, jnp.full(pages.shape[0], 2, jnp.int32)), None, length=m)
        return out.T

    return jax.jit(run)


def _timed(fn, *args, reps: int = 15) -> float:
    for _ in range(3):
        jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vectors", type=int, default=46080, help="vectors per side (a SmolLM2 CPU chunk: 46,080)")
    p.add_argument("--sample", type=int, default=200_000, help="vectors for the spread and overflow counts")
    p.add_argument("--max-len", type=int, default=12)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from tq_jax._src import codec

    rng = np.random.default_rng(0)
    gauss = rng.standard_normal((args.sample, D))
    scales = np.exp(rng.uniform(-2, 2, D))
    rotate = np.asarray(_rotation(D), np.float64)
    t0 = time.perf_counter()
    spread, budgets, speed, pages_rows = [], [], [], []
    for side, entropy, fixed_bits in (("K", 4.7, 5), ("V", 3.5, 3), ("K", 4.6, 5), ("V", 3.4, 3)):
        des = Design(entropy, args.max_len)
        spread.append(f"| {side} | {entropy:.2f} | {des.cell_entropy:.4f} | {des.mean_length:.4f} | "
                      f"{des.mean_length - des.cell_entropy:+.4f} | {int(des.lengths.max())} |")
        ideal = -np.log2(np.maximum(des.p, 1e-300))  # what an arithmetic coder spends, flush aside
        for name, x, price in (("Gaussian", gauss, des.lengths), ("anisotropic, rotated", (gauss * scales) @ rotate, des.lengths),
                               ("Gaussian, ideal lengths", gauss, ideal)):
            per = price[des.indices(x)].sum(axis=-1) / D
            q = np.quantile(per, [0.99, 0.999])
            for row_bytes in sorted({int(np.ceil(des.mean_length * D / 8)), int(np.ceil(q[1] * D / 8)),
                                     int(np.ceil(per.max() * D / 8))}):
                over = float((per * D > 8 * row_bytes).mean())
                budgets.append(f"| {side} | {entropy:.2f} | {name} | {per.mean():.4f} | {per.std():.4f} | "
                               f"{q[0]:.4f} | {q[1]:.4f} | {per.max():.4f} | {row_bytes} | {8 * row_bytes / D:.3f} | "
                               f"{over:.2e} |")
        row_bytes = int(np.ceil(np.quantile(des.row_bits(des.indices(gauss)), 0.999) / 8))
        x = rng.standard_normal((args.vectors, D))
        idx = des.indices(x)
        rows, fits = des.encode(idx, row_bytes)
        dec = decoder(des, row_bytes)
        got = np.asarray(dec(jnp.asarray(rows)))
        assert np.array_equal(got[fits], idx[fits]), "the decoder disagrees with the encoder"
        cfg = codec.CodecConfig(dim=D, bits=fixed_bits, rotation="hadamard", norm_correction=True)
        stream, norms = codec.encode_block(jnp.asarray(x, jnp.float32), cfg)
        stream, norms = np.asarray(stream), np.asarray(norms)
        rows_j = jnp.asarray(rows)
        t_ecsq = _timed(dec, rows_j)
        t_fixed = _timed(lambda s, nr: codec.decode_block(s, nr, cfg, jnp.bfloat16), stream, norms)
        t_ecsq2 = _timed(dec, rows_j)
        t_fixed2 = _timed(lambda s, nr: codec.decode_block(s, nr, cfg, jnp.bfloat16), stream, norms)
        te, tf = min(t_ecsq, t_ecsq2), min(t_fixed, t_fixed2)
        speed.append(f"| {side} | {entropy:.2f} | rows of {row_bytes} bytes (Huffman) | {args.vectors:,} | {te * 1e3:.2f} ms | "
                     f"{fixed_bits} | {tf * 1e3:.2f} ms | {te / tf:.1f}x |")
        for page in (16, 64):
            code = PageCode(des, page)
            n_pages = args.sample // page
            _, _, used = code.encode(des.indices(gauss[: n_pages * page]).reshape(n_pages, page * D), None)
            words = int(used.max())
            per = used * 16 / (page * D)
            pages_rows.append(f"| {side} | {entropy:.2f} | {page} | {code.static_bits:.4f} | {n_pages:,} | {per.mean():.4f} | "
                              f"{per.max():.4f} | {(used > words - 1).mean():.2e} | {words} | {16 * words / (page * D):.4f} |")
            n_pages = args.vectors // page
            idx = des.indices(x[: n_pages * page]).reshape(n_pages, page * D)
            enc, fits, _ = code.encode(idx, words)
            dec = page_decoder(code, words)
            got = np.asarray(dec(jnp.asarray(enc)))
            assert np.array_equal(got[fits], idx[fits]), "the page decoder disagrees with the encoder"
            enc_j = jnp.asarray(enc)
            tp = min(_timed(dec, enc_j), _timed(dec, enc_j))
            speed.append(f"| {side} | {entropy:.2f} | pages of {page} tokens, {words} words (rANS) | {n_pages * page:,} | "
                         f"{tp * 1e3:.2f} ms | {fixed_bits} | {tf * 1e3:.2f} ms | {tp / tf:.1f}x |")
    # The fixed-rate alternative: trellis levels from unpacked branch bits and indices,
    # beside the Lloyd-Max codebook gather from unpacked indices (both on [vectors, D]).
    from benchmarks.studies import codes_only_directions as cod
    from tq_jax._src import codebook

    lookups = []
    for bits in (5, 3):
        levels = cod.tcq_levels(D, bits)
        y = rng.standard_normal((args.vectors, D))
        y = jnp.asarray(y / np.linalg.norm(y, axis=-1, keepdims=True), jnp.float32)
        branch, index = cod.tcq_quantize(y, levels)
        centroids = jnp.asarray(codebook.lloyd_max(D, bits).centroids)
        idx = jnp.asarray(rng.integers(0, 1 << bits, (args.vectors, D)), jnp.int32)
        gather = jax.jit(lambda i, c: jnp.take(c, i))
        t_tcq = min(_timed(cod.tcq_decode, branch, index, levels), _timed(cod.tcq_decode, branch, index, levels))
        t_lm = min(_timed(gather, idx, centroids), _timed(gather, idx, centroids))
        lookups.append(f"| {bits} | {args.vectors:,} | {t_lm * 1e3:.2f} ms | {t_tcq * 1e3:.2f} ms | {t_tcq / t_lm:.1f}x |")
    device = jax.devices()[0]
    lines = [
        "# Entropy-coded codes in fixed-size rows and pages: the budget and the decoder",
        "",
        f"`python -m benchmarks.studies.ecsq_coders {' '.join(argv if argv is not None else sys.argv[1:])}` at "
        f"`{report.commit()}`; {time.perf_counter() - t0:.0f} s; jax {jax.__version__} on {device.platform} "
        f"({device.device_kind}).",
        "",
        f"The code: a canonical Huffman code of the Gaussian design's cell probabilities "
        f"(uniform step for the design entropy, indices clipped at 6 sigma), lengths limited to "
        f"{args.max_len} bits (one table of {1 << args.max_len:,} entries decodes a symbol).",
        "",
        "| side | design entropy | cell entropy | mean code length | redundancy | longest code |",
        "|---|---:|---:|---:|---:|---:|",
        *spread,
        "",
        f"The row budget: each vector's {D} code lengths summed, in bits per coordinate, over "
        f"{args.sample:,} vectors (Gaussian; anisotropic = per-channel scales e**U(-2, 2), then the "
        "study's Hadamard rotation, as the codec sees keys with outlier channels), and the share that "
        "overflows a row of `row bytes`. *Ideal lengths* prices the Gaussian vectors at `-log2 p` per "
        "cell instead of the Huffman lengths: what an arithmetic coder would spend before its flush.",
        "",
        "| side | design | data | mean | std | 99th pct | 99.9th pct | max | row bytes | row bits / coord | overflow |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        *budgets,
        "",
        f"Pages: one static rANS stream per page of `page` tokens of one (layer, head) (its "
        f"indices token-major; the design probabilities quantised to 2**{PREC}; 32-bit state, 16-bit "
        f"words, the state flushed at the end), over the Gaussian sample. *Table bits* is what the "
        f"quantised table spends per coordinate on the design distribution; a page's length includes its "
        f"flush; the budget is the longest page seen, and *overflow* the share that would not fit one "
        f"word less.",
        "",
        "| side | design | page (tokens) | table bits | pages | mean bits | max bits | overflow at one word less | page words | budget bits / coord |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *pages_rows,
        "",
        f"The decoders, side by side in one process: the row and page decoders (indices only) against "
        f"`tq_jax`'s whole fixed-rate decode of the same vectors (Hadamard, norm correction, "
        f"bfloat16 out), medians of 15 after warm-up, the faster of two interleaved rounds.",
        "",
        "| side | design | layout | vectors | decode (indices) | fixed bits | tq_jax decode (whole) | ratio |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        *speed,
        "",
        "A fixed-rate alternative needs no entropy decoder: trellis-coded quantisation "
        "(`codes_only_directions.tcq_quantize`, 8 states) stores a branch bit and `bits - 1` index bits "
        "per coordinate, and a coordinate's level follows from its own and the three previous branch "
        "bits. Its level lookup from unpacked fields, beside the Lloyd-Max codebook gather from "
        "unpacked indices (the rest of a decode is the same):",
        "",
        "| bits | vectors | Lloyd-Max gather | trellis levels | ratio |",
        "|---:|---:|---:|---:|---:|",
        *lookups,
    ]
    text = "\n".join(lines) + "\n"
    if args.out:
        open(args.out, "w").write(text)
    print(text)


if __name__ == "__main__":
    main()
