"""Study. Question: how close can any 4-bit key code get to the key precision a passkey cell needs?

Answer: not close enough. At 4/4's 4.25 bits per key element even the ideal per-channel
code (Shannon's reverse water-filling, everything known in advance) is worth 6.3
TurboQuant key bits at 2048 @ 50 %, while the cell needs 7-8; TurboQuant's outlier
split reaches 4.5. Written in benchmarks/studies/serving-smollm2.md ("Nor by a smarter code of the same
bytes"), tables 7-8 of benchmarks/results/smollm2_passkey_probe.md.

The passkey probe (:mod:`benchmarks.studies.passkey_codec_probe`) finds that keys decide the
2048-token cells and that 6-bit keys still lose one. This script asks whether a smarter
key code *at the same 4 bits* could reach that precision, on the quantity attention
actually reads: the error of the logits ``q . k / sqrt(d)`` of the question's queries
over the coded span of SmolLM2-135M's passkey prompt (one prompt: the context and the
question, prefilled exactly, queries and keys after RoPE).

1. **Real codes.** TurboQuant at 3..8 bits (Haar, seed 42, float16 norms), and
   TurboQuant's outlier split (:func:`~benchmarks.studies.passkey_codec_probe.split_codec`:
   the ``m`` highest-energy channels of each layer and KV head at ``hi`` bits, the rest at
   ``lo``). Each row's logit error is also read as the Lloyd-Max bits a plain rotated
   code needs for it ("iso-equivalent bits", interpolated on the 3..8-bit rows).
2. **The ideal per-channel allocation, a bound.** Model each key channel ``c`` of a
   layer and head as Gaussian with the span's energy ``lam_c``, and weight its error by
   the queries' energy ``w_c`` on it (the logit error is ``sum_c w_c err_c``). Shannon's
   reverse water-filling over every channel of every layer and head gives the least
   weighted error any code of ``R`` bits per coordinate can reach, ``sum_c min(theta,
   w_c lam_c)``, knowing every channel's statistics and the queries' in advance; a
   rotated code spreads its error evenly over a head's channels, ``sum_c w_c mean(lam)
   2^-2R``. Their ratio (the *allocation gain*) plus the
   gap between Lloyd-Max scalar codes and Shannon's bound, plus the norm's bits, is the
   most any per-token code of the same budget can gain over TurboQuant's, under the
   Gaussian model.

    python -m benchmarks.studies.passkey_key_floor --context 2048 --depth 50   # from the repository root
    python -m benchmarks.studies.passkey_key_floor --key-bits 3 --norm-bits 6  # turbo-2.5's key budget

Prints two markdown tables. What it does not bound: codes across tokens (the filler
repeats; a code that exploits that is not a per-token KV cache).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from benchmarks.studies.passkey_codec_probe import codec, split_codec
from examples.smollm2 import model
from examples.smollm2.passkey import build_prompts, random_keys
from tq_jax._src import codebook

ISO_BITS = (3, 4, 5, 6, 7, 8)
SPLITS = ((16, 6, 3), (16, 7, 3), (16, 8, 3), (32, 5, 3), (8, 8, 3))  # (m, hi, lo)


def queries_and_keys(params, cfg, tokens):
    """Every layer's queries ``[L, T, heads, d]`` and keys ``[L, T, kv_heads, d]`` (after
    RoPE) of one sequence ``tokens [T]``, exact float32 attention."""
    t = tokens.shape[0]
    pos = jnp.arange(t, dtype=jnp.int32)[None]

    def body(h, p):
        def attend(q, k, v):
            return model.dense_attention(q, k, v, pos, pos), (q[0], k[0])

        return model.decoder_layer(cfg, h, p, pos, attend)

    _, (q, k) = lax.scan(body, params["embed"][tokens[None]], params["layers"])
    return q, k


def logit_error(q, k, k_hat) -> float:
    """RMS of ``q . (k_hat - k) / sqrt(d)`` over layers, heads, queries and keys: q ``[L,
    Q, heads, d]``, k ``[L, T, kv_heads, d]`` (GQA: query head ``h`` reads KV head ``h //
    group``)."""
    l, n_q, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(l, n_q, hkv, hq // hkv, d)
    e = jnp.einsum("lqhgd,lthd->lhgqt", qg, (k_hat - k).astype(jnp.float32)) / np.float32(np.sqrt(d))
    return float(jnp.sqrt(jnp.mean(jnp.square(e))))


def waterfill(weighted: np.ndarray, rate: float) -> float:
    """Least ``sum_c D_c`` over per-channel rates ``R_c >= 0`` averaging ``rate``, with
    ``D_c = weighted_c * 2**(-2 R_c)`` (Gaussian channels, ``weighted_c = w_c lam_c``):
    reverse water-filling, solved by bisection on the water level ``theta``."""
    budget = rate * weighted.size
    lo, hi = 0.0, float(weighted.max())
    for _ in range(200):
        theta = 0.5 * (lo + hi)
        used = np.sum(np.maximum(0.0, 0.5 * np.log2(weighted / theta)))
        lo, hi = (theta, hi) if used > budget else (lo, theta)
    return float(np.sum(np.minimum(weighted, hi)))


def allocation_gain(q, k, rate: float) -> float:
    """The rotated code's weighted error over the ideal allocation's (see the module
    docstring): channel energies ``lam`` from ``k [L, T, H, d]``, query weights ``w``
    from ``q [L, Q, heads, d]``. The rotated code spends ``rate`` bits on every
    coordinate of every layer and head; the ideal one water-fills one budget over all
    of them at once (a token's key is every layer's and head's, so bits may move
    between heads as well as channels)."""
    l, n_q, hq, d = q.shape
    hkv = k.shape[2]
    lam = np.mean(np.square(np.asarray(k, np.float64)), axis=1)  # [L, H, d]
    w = np.mean(np.square(np.asarray(q, np.float64)).reshape(l, n_q, hkv, hq // hkv, d), axis=(1, 3))
    iso = np.sum(np.sum(w, axis=-1) * np.mean(lam, axis=-1)) * 2.0 ** (-2 * rate)
    return float(iso / waterfill((w * lam).ravel(), rate))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--depth", type=float, default=50, help="percent")
    ap.add_argument("--format", default="chat")
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--key-bits", type=int, default=4, help="the TurboQuant key width whose budget the ideal code gets")
    ap.add_argument("--norm-bits", type=int, default=16, help="bits of its norm per vector (16: float16, 4/4; 6: the "
                    "turbo presets' log codes)")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    params, cfg, tok = model.load_smollm2()
    prompts = build_prompts(tok, args.context, args.depth / 100, random_keys(np.random.default_rng(0), 1), args.format)
    tokens = np.concatenate([prompts.context[0], prompts.question])
    q, k = jax.jit(queries_and_keys, static_argnums=1)(params, cfg, jnp.asarray(tokens))
    t_ctx = prompts.context.shape[1]
    lo, hi = args.sinks, t_ctx - args.window
    ks, qs = k[:, lo:hi], q[:, t_ctx:]  # the coded span's keys; the question's queries
    d = ks.shape[-1]
    print(f"prefill {len(tokens)} tokens: {time.perf_counter() - t0:.0f} s; coded span {lo}..{hi}", flush=True)

    rows = []  # (name, bits per element with norms, logit error)
    for b in ISO_BITS:
        rows.append((f"TurboQuant K{b} (rotated, one float16 norm)", b + 16 / d,
                     logit_error(qs, ks, codec(ks, bits=b, rotation="haar", seed=42, norm_correction=False))))
    for m, b_hi, b_lo in SPLITS:
        y = split_codec(ks[:, None], m=m, hi=b_hi, lo=b_lo, rotation="haar", seed=42, norm_correction=False)[:, 0]
        rows.append((f"outlier split {m} ch. at {b_hi} + {d - m} at {b_lo} (two norms)", (m * b_hi + (d - m) * b_lo + 32) / d,
                     logit_error(qs, ks, y)))
    iso_err = np.log2([e for _, _, e in rows[: len(ISO_BITS)]])

    def iso_bits(err: float) -> float:  # log2(err) falls with bits: interpolate on the rotated rows
        return float(np.interp(-np.log2(err), -iso_err, ISO_BITS))

    k4 = rows[ISO_BITS.index(4)][2]
    print(f"\ncontext {args.context}, depth {args.depth:g}%, {len(prompts.question)} question queries, keys "
          f"{lo}..{hi - 1}\n")
    print("| key code | bits/elem | logit RMS error | vs K4 | iso-equivalent bits |")
    print("|---|---:|---:|---:|---:|")
    for name, bits, err in rows:
        print(f"| {name} | {bits:.2f} | {err:.4f} | {err / k4:.2f} | {iso_bits(err):.2f} |")

    b, n = args.key_bits, args.norm_bits
    budget = b + n / d
    gap = 0.5 * np.log2(d * codebook.expected_mse(d, b) / 2.0 ** (-2 * b))  # Lloyd-Max at b bits vs Shannon, in bits
    print(f"\n| what an ideal per-token key code at TurboQuant K{b}'s {budget:.2f} bits/elem ({n}-bit norms) could add "
          "to it (Gaussian model) | gain in logit MSE | bits it is worth |")
    print("|---|---:|---:|")
    parts = [("bit allocation over channels, heads and layers, knowing every key and query statistic in advance",
              allocation_gain(qs, ks, budget)),
             (f"vector quantization: Shannon's bound vs Lloyd-Max at {b} bits", 4**gap),
             ("no norm: its bits spent on codes", 4 ** (n / d))]
    for label, gain in parts:
        print(f"| {label} | {gain:.2f}x | +{0.5 * np.log2(gain):.2f} |")
    total = b + sum(0.5 * np.log2(gain) for _, gain in parts)
    print(f"| **all of it** | | **{total:.2f} iso-equivalent bits** |")


if __name__ == "__main__":
    main()
