"""Study. Question: which part of a KV codec loses a passkey cell, keys or values, and does centring help?

Answer: the keys. At 2048 tokens, turbo-2.5's K3 keys alone find 0 % of the keys at
depth 50 % and its V2 values alone 100 %; over five rotation seeds a setting's mean
falls with the key error, not with the total bits. Centring the keys lowers their RMS
error (K3: 0.176 -> 0.130) without finding more, and cost K4V3 a cell. Written in
benchmarks/studies/serving-smollm2.md ("What a passkey cell needs"), tables 1-6 of
benchmarks/results/smollm2_passkey_probe.md.


A probe, not the benchmark (that is ``python -m examples.smollm2 passkey``): one
(context, depth) cell of SmolLM2-135M's passkey task, with the codec applied to the
context's K/V *outside* the cache, so codec variants that ``kvcache`` does not offer can
be tried in minutes on a CPU:

1. the context (everything before the question) is prefilled once, exactly, through the
   bf16 cache (as the benchmark does);
2. for each variant, every context token outside the first ``--sinks`` and the last
   ``--window`` has its K and/or V replaced by ``decode(encode(x))`` of the variant's
   codec (norms rounded to float16, as the cache stores them); that K/V is loaded into a
   bf16 cache, and the question and the answer go one token per step through it.

Reading decoded vectors from a bf16 cache is what ``kvcache.attend`` computes over its
codes up to bf16 rounding of the decoded vectors (and the window's block-granular
edge), so the ``K..V..`` rows reproduce the cache's cells closely; the other rows change
one thing at a time:

* ``keys only`` / ``values only``: the other side stays exact;
* ``K<hi>/<m>+<lo>`` keys (TurboQuant's outlier split): per layer and KV head, the ``m``
  channels of highest mean key energy over the coded span (whole RoPE pairs, so a
  channel's partner at ``i + d/2`` goes with it) are coded at ``hi`` bits, the other
  ``d - m`` at ``lo`` bits, each part with its own rotation and float16 norm;
* ``centred``: each layer and KV head codes ``x - mu``, ``mu`` the mean of the first
  ``--centre-tokens`` context tokens' vectors, and adds ``mu`` back after decoding.
  Attention is invariant to it when exact (``q.(k - mu)`` shifts every logit of a query
  by the same ``q.mu``; the softmax weights sum to 1, so ``sum p (v - mu) + mu`` is
  ``sum p v``): only the quantization error changes, by coding a shorter vector.

    python -m benchmarks.studies.passkey_codec_probe --context 2048 --depth 50 --keys 10   # from the repository root

Prints one markdown table: % of keys answered exactly, and the relative RMS error of
the decoded keys and values over the coded tokens.
"""

from __future__ import annotations

import argparse
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

import tq_jax
from examples.smollm2 import model
from examples.smollm2.caches import dense_kv, init_cache
from examples.smollm2.passkey import ANSWER_TOKENS, Runner, answer, answer_matches, build_prompts, random_keys


def noise(x, *, eps: float, seed: int):
    """``x`` plus isotropic Gaussian noise of relative RMS ``eps`` per vector (``eps *
    |x| * g / sqrt(d)``): any lossy cache whose error is ``eps`` and has no direction."""
    g = jax.random.normal(jax.random.key(seed), x.shape, jnp.float32)
    n = jnp.linalg.norm(x.astype(jnp.float32), axis=-1, keepdims=True)
    return x + np.float32(eps) * n * g / np.float32(np.sqrt(x.shape[-1]))


def codec(x, *, bits: int, rotation: str, seed: int, norm_correction: bool, mu=None):
    """``decode(encode(x))`` along the last axis, norms rounded to float16; ``mu``
    (broadcast against ``x``) is subtracted before and added back after."""
    x = x.astype(jnp.float32)
    if mu is not None:
        x = x - mu
    cfg = tq_jax.CodecConfig(x.shape[-1], bits, seed, rotation, norm_correction)
    enc = tq_jax.encode(x, cfg)
    enc = enc._replace(norms=enc.norms.astype(jnp.float16).astype(jnp.float32))
    y = tq_jax.decode(enc, cfg)
    return y if mu is None else y + mu


SEED_BLOCK = 64  # tokens per rotation with seeds="block"


def _coded(x, *, bits, rotation, seed, norm_correction, mu, seeds: str, lo: int):
    """:func:`codec` of ``x [L, B, T, H, D]`` (tokens ``lo..``), one rotation for all
    (``seeds="shared"``, what a cache does), one per layer (``"layer"``: seed + 7919 *
    layer), or one per layer and block of :data:`SEED_BLOCK` positions (``"block"``:
    also + 104729 * block)."""
    kw = dict(bits=bits, rotation=rotation, norm_correction=norm_correction)
    if seeds == "shared":
        return codec(x, seed=seed, mu=mu, **kw)
    out = []
    for i in range(x.shape[0]):
        mi = None if mu is None else mu[i]
        if seeds == "layer":
            out.append(codec(x[i], seed=seed + 7919 * i, mu=mi, **kw))
            continue
        parts, t = [], 0
        while t < x.shape[2]:
            blk = (lo + t) // SEED_BLOCK
            n = min(x.shape[2] - t, (blk + 1) * SEED_BLOCK - (lo + t))
            parts.append(codec(x[i, :, t:t + n], seed=seed + 7919 * i + 104729 * blk, mu=mi, **kw))
            t += n
        out.append(jnp.concatenate(parts, axis=1))
    return jnp.stack(out)


def split_codec(x, *, m: int, hi: int, lo: int, rotation: str, seed: int, norm_correction: bool):
    """TurboQuant's outlier split of ``x [L, B, T, H, D]``: per layer and head, the ``m``
    channels of highest mean energy (in whole RoPE pairs ``(i, i + D/2)``) coded at ``hi``
    bits and the rest at ``lo`` bits, two codecs (seeds ``seed`` and ``seed + 1``)."""
    d = x.shape[-1]
    if m % 2 or not 0 < m < d:
        raise SystemExit(f"outlier split: m={m} must be even and in 2..{d - 2} (whole RoPE pairs)")
    energy = jnp.mean(jnp.square(x.astype(jnp.float32)), axis=(1, 2))  # [L, H, D]
    pairs = energy[..., : d // 2] + energy[..., d // 2:]
    ranked = jnp.argsort(-pairs, axis=-1)
    top, rest = ranked[..., : m // 2], ranked[..., m // 2:]
    order = jnp.concatenate([top, top + d // 2, rest, rest + d // 2], axis=-1)  # [L, H, D]: outliers first
    perm = jnp.broadcast_to(order[:, None, None], x.shape)
    xp = jnp.take_along_axis(x.astype(jnp.float32), perm, axis=-1)
    kw = dict(rotation=rotation, norm_correction=norm_correction)
    yp = jnp.concatenate([codec(xp[..., :m], bits=hi, seed=seed, **kw), codec(xp[..., m:], bits=lo, seed=seed + 1, **kw)],
                         axis=-1)
    return jnp.take_along_axis(yp, jnp.argsort(perm, axis=-1), axis=-1)


NORM_BITS = 16  # the cache's float16 norm: what each coded group of a vector costs besides its codes


def waterfill_bits(energy, bits: int, *, norm_bits: int = NORM_BITS, max_bits: int = 8):
    """Integer bits per RoPE pair (``energy [P]``: the pairs' mean key energy) at the
    bytes of a ``bits``-bit TurboQuant key (``bits * 2P`` code bits and one norm):
    greedy reverse water-filling (each step gives one more bit to both channels of the
    pair whose Gaussian distortion ``e * 4**-b`` is largest; 0 bits: the pair is read as
    0), with ``norm_bits`` charged for each group of equal nonzero bits (each group is
    coded apart, with its own norm). The fewest groups whose allocation fits."""
    energy = np.asarray(energy, np.float64)
    total = bits * 2 * len(energy) + norm_bits
    for groups in range(1, max_bits + 1):
        b = np.zeros(len(energy), np.int64)
        for _ in range((total - norm_bits * groups) // 2):
            gain = np.where(b < max_bits, energy * 4.0 ** -b, -1.0)
            b[int(np.argmax(gain))] += 1
        if len(set(b[b > 0].tolist())) <= groups:
            return b
    raise AssertionError("no allocation fits")  # groups = max_bits always does


def waterfill_codec(x, *, bits: int, rotation: str, seed: int, norm_correction: bool, calib: int = 256,
                    norm_bits: int = NORM_BITS):
    """Key bits water-filled over RoPE pairs, per layer and head, at ``bits``-bit keys'
    bytes (:func:`waterfill_bits`): the pairs' energies from the first ``calib`` coded
    tokens (a calibration pass), each group of equal bits coded apart (its own rotation,
    seed ``seed + b``, and float16 norm). ``norm_bits=0`` charges the groups' norms
    nothing (a bound: what the allocation alone could give). Returns the decoded ``x`` and
    the mean bits per element spent (codes and norms)."""
    x = np.asarray(x, np.float32)
    L, d = x.shape[0], x.shape[-1]
    energy = np.mean(np.square(x[:, :, :calib]), axis=(1, 2))  # [L, H, D]
    pairs = energy[..., : d // 2] + energy[..., d // 2:]
    y, spent = np.zeros_like(x), []
    for layer in range(L):
        for h in range(x.shape[3]):
            b = waterfill_bits(pairs[layer, h], bits, norm_bits=norm_bits)
            spent.append((2 * b.sum() + NORM_BITS * len(set(b[b > 0].tolist()))) / d)
            for level in sorted(set(b[b > 0].tolist())):
                p = np.flatnonzero(b == level)
                idx = np.concatenate([p, p + d // 2])
                y[layer, :, :, h][..., idx] = np.asarray(codec(jnp.asarray(x[layer, :, :, h][..., idx]), bits=int(level),
                                                             rotation=rotation, seed=seed + int(level),
                                                             norm_correction=norm_correction))
    return jnp.asarray(y), float(np.mean(spent))


def variant_kv(k, v, *, key_bits, value_bits, rotation, seed, norm_correction, sinks, window, centre_tokens, layers=None,
               seeds: str = "shared"):
    """Context K/V ``[L, B, T, H, D]`` with the coded span replaced by its decoded
    vectors (``None`` bits: that side exact; a float in (0, 1) instead of bits: Gaussian
    noise of that relative RMS, see :func:`noise`; a tuple ``(m, hi, lo)``: the outlier
    split, see :func:`split_codec`; ``layers``: a slice of the layers coded, the rest
    exact)."""
    t = k.shape[2]
    lo, hi = sinks, max(sinks, t - window)
    out = []
    for side, (x, bits) in enumerate(((k, key_bits), (v, value_bits))):
        x = x.astype(jnp.float32)
        if bits is None or hi <= lo:
            out.append(x)
            continue
        mu = jnp.mean(x[:, :, :centre_tokens], axis=2, keepdims=True) if centre_tokens else None
        if isinstance(bits, float):
            y = noise(x[:, :, lo:hi], eps=bits, seed=seed + 1_000_003 * side)
        elif isinstance(bits, str):  # "wf<bits>", or "wf0n<bits>": group norms not charged
            y, spent = waterfill_codec(x[:, :, lo:hi], bits=int(bits[-1]), rotation=rotation, seed=seed,
                                       norm_correction=norm_correction, norm_bits=0 if "0n" in bits else NORM_BITS)
            print(f"  water-filled keys: {spent:.3f} bits per element (codes and float16 norms)", flush=True)
        elif isinstance(bits, tuple):
            y = split_codec(x[:, :, lo:hi], m=bits[0], hi=bits[1], lo=bits[2], rotation=rotation, seed=seed,
                            norm_correction=norm_correction)
        else:
            y = _coded(x[:, :, lo:hi], bits=bits, rotation=rotation, seed=seed, norm_correction=norm_correction, mu=mu,
                       seeds=seeds, lo=lo)
        y = x.at[:, :, lo:hi].set(y)
        if layers is not None:
            y = x.at[layers].set(y[layers])
        out.append(y)
    return out


# The probe's named variants, each a codec in :func:`parse_variant`'s grammar.
ALIASES = {
    "K3V2 (turbo-2.5)": "K3V2 hadamard nc",
    "K3 keys only": "K3V- hadamard nc",
    "V2 values only": "K-V2 hadamard nc",
    "K3V2 centred": "K3V2 hadamard nc centred",
    "K4V3 (turbo-3.5)": "K4V3 hadamard nc",
    "K4V3 centred": "K4V3 hadamard nc centred",
    "K4V2": "K4V2 hadamard nc",
    "4/4 Haar": "K4V4 haar",
    "4/4 Haar keys only": "K4V- haar",
    "4/4 Haar values only": "K-V4 haar",
    "4/4 Hadamard": "K4V4 hadamard",
    "4/4 Haar centred": "K4V4 haar centred",
}


def parse_variant(name: str, centre_tokens: int = 256) -> dict:
    """:func:`variant_kv`'s settings for a variant: a name in :data:`ALIASES`, a codec
    named ``K<bits>V<bits> <rotation>[ nc][ centred][ per-layer| per-block]`` (``K5V3
    hadamard nc``; ``-`` for bits leaves that side exact; key bits ``<hi>/<m>+<lo>``: the
    outlier split, ``m`` channels at ``hi`` bits and the rest at ``lo``, see
    :func:`split_codec`; ``centred``: over the first
    ``centre_tokens``; the last suffix: a rotation seed per layer, or per layer and
    64-token block, see :func:`_coded`), or noise named ``noise K<eps> V<eps>`` (``noise
    K0.01 V0.01``: relative RMS error of each side; ``-`` exact)."""
    name = ALIASES.get(name, name)
    m = re.fullmatch(r"noise K([0-9.]+|-) V([0-9.]+|-)", name)
    if m:
        eps = [None if e == "-" else float(e) for e in m.group(1, 2)]
        return dict(key_bits=eps[0], value_bits=eps[1], rotation="none", seed=42, norm_correction=False, centre_tokens=0)
    m = re.fullmatch(r"K([1-8-]|[1-8]/\d+\+[1-8]|wf(?:0n)?[1-8])V([1-8-]) (haar|hadamard)( nc)?( centred)?( per-layer| per-block)?",
                     name)
    if not m:
        raise SystemExit(f"unknown variant {name!r}: one of {sorted(ALIASES)}, K<bits>V<bits> haar|hadamard[ nc][ centred]"
                         "[ per-layer| per-block] (key bits may be an outlier split <hi>/<m>+<lo>) or noise K<eps> V<eps>")
    bits = [None if b == "-" else int(b) if b.isdigit() else b if b.startswith("wf") else _split(b) for b in m.group(1, 2)]
    if isinstance(bits[0], (tuple, str)) and (m.group(5) or m.group(6)):
        raise SystemExit(f"variant {name!r}: an outlier split or water-filled keys take neither centring nor "
                         "per-layer/-block seeds")
    if isinstance(bits[0], str) and m.group(3) != "haar":
        raise SystemExit(f"variant {name!r}: water-filled keys' groups have any size: use haar (Hadamard needs a "
                         "power of two)")
    seeds = {None: "shared", " per-layer": "layer", " per-block": "block"}[m.group(6)]
    return dict(key_bits=bits[0], value_bits=bits[1], rotation=m.group(3), seed=42, norm_correction=bool(m.group(4)),
                centre_tokens=centre_tokens if m.group(5) else 0, seeds=seeds)


def _split(text: str) -> tuple:
    """``"7/16+3"`` -> ``(16, 7, 3)``: (channels, their bits, the other channels' bits)."""
    hi, m, lo = (int(x) for x in re.fullmatch(r"(\d)/(\d+)\+(\d)", text).groups())
    return m, hi, lo


def rel_rms(x, y, lo, hi):
    a, b = np.asarray(x[:, :, lo:hi], np.float64), np.asarray(y[:, :, lo:hi], np.float64)
    return float(np.sqrt(np.sum((a - b) ** 2) / np.sum(a**2)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--depth", type=float, default=50, help="percent")
    ap.add_argument("--keys", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0, help="key draw")
    ap.add_argument("--format", default="chat")
    ap.add_argument("--filler", default="fixed", choices=["fixed", "varied", "pool"],
                    help="passkey.build_prompts' filler (default %(default)s: the tables below; varied: the grid's)")
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--centre-tokens", type=int, default=256)
    ap.add_argument("--variants", default="all", help="comma list of variant names, or all")
    ap.add_argument("--seeds", default="", help="comma list of rotation seeds: each chosen variant (other "
                    "than bf16) runs once per seed instead of at seed 42")
    ap.add_argument("--key-layers", default="", help="also: K3 keys only on each of these layer ranges "
                    "(space-separated start:stop), the other layers exact")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    if args.context <= args.sinks + args.window + 64:
        ap.error(f"--context {args.context} leaves (almost) no token between the {args.sinks} sinks and the "
                 f"{args.window}-token window to code: use a longer context or a shorter --window.")
    params, cfg, tok = model.load_smollm2()
    keys = random_keys(np.random.default_rng(args.seed), args.keys)
    prompts = build_prompts(tok, args.context, args.depth / 100, keys, args.format, args.filler,
                            filler_seed=(args.seed, args.context, int(args.depth)))
    runner = Runner(cfg)
    n, t = prompts.context.shape
    capacity = t + len(prompts.question) + ANSWER_TOKENS
    ref = init_cache(cfg, "bf16", n, capacity)
    _, ref = runner.prefill(params, ref, jnp.asarray(prompts.context))
    k, v = dense_kv(ref, 0, t)
    del ref
    print(f"prefill {n} x {t} tokens: {time.perf_counter() - t0:.0f} s", flush=True)

    c = args.centre_tokens
    want = ["bf16", *ALIASES] if args.variants == "all" else [w.strip() for w in args.variants.split(",") if w.strip()]
    variants = {name: None if name == "bf16" else parse_variant(name, c) for name in want}
    if args.seeds:
        variants = {
            (f"{name}, seed {sd}" if spec else name): (dict(spec, seed=sd) if spec else spec)
            for name, spec in variants.items()
            for sd in ([int(x) for x in args.seeds.split(",")] if spec else [None])
        }
    for r in args.key_layers.split():
        a, b = (int(x) for x in r.split(":"))
        variants[f"K3 keys only, layers {a}..{b - 1}"] = dict(parse_variant("K3 keys only"), layers=slice(a, b))
    lo, hi = args.sinks, max(args.sinks, t - args.window)
    rows = []
    for name, spec in variants.items():
        t1 = time.perf_counter()
        if spec is None:
            kk, vv = k, v
        else:
            kk, vv = variant_kv(k, v, sinks=args.sinks, window=args.window, **spec)
        cache = runner.load(init_cache(cfg, "bf16", n, capacity), kk, vv)
        ids = answer(params, runner, cache, prompts.question)
        texts = [tok.decode(list(r)) for r in ids]
        acc = 100 * np.mean([answer_matches(s, key) for s, key in zip(texts, keys)])
        ek, ev = rel_rms(k, kk, lo, hi), rel_rms(v, vv, lo, hi)
        rows.append((name, acc, ek, ev, texts[0]))
        print(f"{name}: {acc:.0f}% (K err {ek:.3f}, V err {ev:.3f}) {texts[0]!r} [{time.perf_counter() - t1:.0f} s]", flush=True)
    print(f"\ncontext {args.context}, depth {args.depth:g}%, {n} keys, sinks {args.sinks}, window {args.window}, "
          f"centring over the first {c} tokens\n")
    print("| codec on the coded span | % correct | K rel. RMS error | V rel. RMS error |")
    print("|---|---:|---:|---:|")
    for name, acc, ek, ev, _ in rows:
        print(f"| {name} | {acc:.0f} | {ek:.3f} | {ev:.3f} |")


if __name__ == "__main__":
    main()
