"""In-loop quality: perplexity and next-token KL of each cache against the bf16 cache.

The strict protocol (benchmarks/studies/serving-smollm2.md): ``seqs`` windows of a text run as one
batch; each window's first ``prefix`` tokens are prefilled into an empty cache in one
step, then its tokens are fed one per step (``chunk=1``), each step appending the new
K/V to every layer's cache and then attending over the cache. Every K/V read goes
through the cache under test, prefill included. The prefill's last logits score the
first token after the prefix; ``scored`` tokens per window are scored in all.

The caches under test run **in lockstep** with the bf16 cache: at every step the bf16
cache's log-probs are computed first and each other cache's step returns, besides its
NLL, ``KL(p_bf16 || p_cache)`` at every scored position, so no log-probs are stored.

``chunk > 1`` feeds ``chunk`` tokens per step (causal ``q_len``): much faster, the same
computation in exact arithmetic, but not the strict protocol (float32 summation order
differs, which flips codes now and then; see the doc).
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from .caches import CacheSpec, cache_nbytes, dense_kv, init_cache, load_kv, make_step, stored_roundtrip

TEXT_TOPIC = "specialnames"
SE_BLOCK = 64  # tokens per block of the blocked standard error (neighbouring tokens correlate)


def text_tokens(tok, topic: str = TEXT_TOPIC) -> np.ndarray:
    """Token ids of ``pydoc_data.topics.topics[topic]`` (a text that ships with CPython,
    so it is present offline; the tokenizer adds no BOS)."""
    from pydoc_data.topics import topics

    return np.asarray(tok(topics[topic]).input_ids, np.int32)


def text_windows(ids: np.ndarray, seqs: int, length: int) -> np.ndarray:
    """``[seqs, length]``: consecutive, non-overlapping windows from the text's start.

    Raises:
        ValueError: the text is shorter than ``seqs * length`` tokens.
    """
    if seqs * length > len(ids):
        raise ValueError(
            f"{seqs} windows of {length} tokens need {seqs * length} tokens, but the text has {len(ids)}: "
            "use fewer sequences or shorter windows (prefix + scored)."
        )
    return np.asarray(ids[: seqs * length]).reshape(seqs, length)


def make_scorers(cfg):
    """Jitted ``(prefill, ref_step, test_step)`` (each donates the cache).

    * ``prefill(params, cache, tokens) -> (logits [B, 1, V], cache)``: the last position's.
    * ``ref_step(params, cache, tokens, targets) -> (logp [B, T, V], nll [B, T], cache)``.
    * ``test_step(params, cache, tokens, targets, ref_logp) -> (nll, kl, cache)`` with
      ``kl = KL(exp(ref_logp) || softmax(logits))`` per position, in nats.
    """
    step = make_step(cfg)

    def logp_nll(logits, targets):
        lp = jax.nn.log_softmax(logits, axis=-1)
        return lp, -jnp.take_along_axis(lp, targets[..., None], axis=-1)[..., 0]

    def ref_step(params, cache, tokens, targets):
        logits, cache = step(params, cache, tokens)
        lp, nll = logp_nll(logits, targets)
        return lp, nll, cache

    def test_step(params, cache, tokens, targets, ref_lp):
        logits, cache = step(params, cache, tokens)
        lp, nll = logp_nll(logits, targets)
        kl = jnp.sum(jnp.exp(ref_lp) * (ref_lp - lp), axis=-1)
        return nll, kl, cache

    prefill = jax.jit(make_step(cfg, last_only=True), donate_argnums=1)
    return prefill, jax.jit(ref_step, donate_argnums=1), jax.jit(test_step, donate_argnums=1)


@dataclasses.dataclass
class Scored:
    """Per-token results of one cache: ``nll`` and ``kl`` ``[seqs, scored]`` (kl is 0
    for the bf16 reference), step times (s, compiling steps excluded) and cache bytes."""

    spec: CacheSpec
    nll: np.ndarray
    kl: np.ndarray
    step_s: list
    nbytes: int


def in_loop(params, cfg, windows: np.ndarray, prefix: int, specs: list[CacheSpec], *, chunk: int = 1, scorers=None, log=print,
            loaded: bool = False):
    """Score ``windows [B, N]`` through the bf16 cache and every spec in lockstep.

    Returns ``{label: Scored}``, the bf16 reference first (under label ``"bf16"``; a
    ``bf16`` spec in ``specs`` is the reference itself, not run twice). ``N - prefix``
    tokens per window are scored.

    With ``loaded`` (the loaded-prefix protocol, as vLLM continues after LMCache loads a
    prefix from L2): the bf16 reference prefills the prefix; every spec then starts from
    a bf16 cache whose first ``prefix - 1`` tokens are the reference's K/V as the spec's
    stored format returns them (:func:`~examples.smollm2.caches.stored_roundtrip`: codes
    only, or fp8), runs the last prefix token as its first step (vLLM always computes
    it), and attends to exact bf16 K/V for every token after. Bytes are then the stored
    prefix's (the reference's: its bf16 K/V).
    """
    if not 0 < prefix < windows.shape[1]:
        raise ValueError(f"`prefix` must be in 1..{windows.shape[1] - 1} (the window length - 1), got {prefix}.")
    if chunk < 1:
        raise ValueError(f"`chunk` must be >= 1 (tokens per scoring step), got {chunk}.")
    prefill, ref_step, test_step = scorers or make_scorers(cfg)
    b, n = windows.shape
    ref_spec = CacheSpec("bf16", "bf16")
    tests = [s for s in specs if s.kind != "bf16"]
    x = jnp.asarray(windows)
    all_specs = [ref_spec, *tests]
    if not loaded and any(s.kind == "fp8" for s in tests):
        raise ValueError("fp8 is a stored format, not a cache: run it with the loaded-prefix protocol (--loaded-prefix).")
    caches = [s.init(cfg, b, n - 1) for s in all_specs[: 1 if loaded else None]]
    nbytes = [cache_nbytes(c) for c in caches]
    nll = [[] for _ in all_specs]
    kl = [[] for _ in all_specs]
    times = [[] for _ in all_specs]

    # prefill: the last logits predict windows[:, prefix]
    target0 = x[:, prefix : prefix + 1]
    if loaded:
        _loaded_prefill(params, cfg, x, prefix, all_specs, caches, nbytes, nll, kl, prefill, test_step)
    for i in range(0 if loaded else len(all_specs)):  # loaded: prefilled above
        logits, caches[i] = prefill(params, caches[i], x[:, :prefix])
        lp = jax.nn.log_softmax(logits, axis=-1)
        nll[i].append(np.asarray(-jnp.take_along_axis(lp, target0[..., None], axis=-1)[..., 0]))
        if i == 0:
            ref_lp = lp
        kl[i].append(np.asarray(jnp.sum(jnp.exp(ref_lp) * (ref_lp - lp), axis=-1)))
    seen = set()
    t_start = time.perf_counter()
    for s in range(prefix, n - 1, chunk):
        e = min(s + chunk, n - 1)
        tokens, targets = x[:, s:e], x[:, s + 1 : e + 1]
        timed = e - s in seen  # the first step of each length compiles: not timed
        seen.add(e - s)
        t0 = time.perf_counter()
        ref_lp, r_nll, caches[0] = ref_step(params, caches[0], tokens, targets)
        r_nll = np.asarray(r_nll)
        if timed:
            times[0].append(time.perf_counter() - t0)
        nll[0].append(r_nll)
        kl[0].append(np.zeros_like(r_nll))
        for i in range(1, len(all_specs)):
            t0 = time.perf_counter()
            c_nll, c_kl, caches[i] = test_step(params, caches[i], tokens, targets, ref_lp)
            c_nll, c_kl = np.asarray(c_nll), np.asarray(c_kl)
            if timed:
                times[i].append(time.perf_counter() - t0)
            nll[i].append(c_nll)
            kl[i].append(c_kl)
        done = e - prefix
        if log and (done % 128 == 0 or e == n - 1):
            log(f"  in-loop: {done}/{n - 1 - prefix} steps' tokens, {time.perf_counter() - t_start:.0f} s")
    out = {}
    for i, spec in enumerate(all_specs):
        a, k = np.concatenate(nll[i], axis=1), np.concatenate(kl[i], axis=1)
        assert a.shape == (b, n - prefix), (a.shape, b, n - prefix)
        out[spec.label] = Scored(spec, a, k, times[i], nbytes[i])
    return out


def _loaded_prefill(params, cfg, x, prefix, all_specs, caches, nbytes, nll, kl, prefill, test_step) -> None:
    """:func:`in_loop`'s start under the loaded-prefix protocol: the reference prefills
    ``x[:, :prefix]`` (first in ``caches``), each spec gets a bf16 cache holding the
    reference's first ``prefix - 1`` tokens as its stored format returns them, then steps
    the last prefix token; ``caches``, ``nbytes``, ``nll`` and ``kl`` are filled in order."""
    b, n = x.shape
    logits, caches[0] = prefill(params, caches[0], x[:, :prefix])
    ref_lp = jax.nn.log_softmax(logits, axis=-1)
    target0 = x[:, prefix : prefix + 1]
    nll[0].append(np.asarray(-jnp.take_along_axis(ref_lp, target0[..., None], axis=-1)[..., 0]))
    kl[0].append(np.zeros(nll[0][0].shape, np.float32))
    k, v = dense_kv(caches[0], 0, prefix - 1)
    nbytes[0] = 2 * int(k.size + v.size)
    load = jax.jit(load_kv, donate_argnums=0)
    for i, spec in enumerate(all_specs[1:], 1):
        kd, vd, stored = stored_roundtrip(spec, k, v)
        cache = load(init_cache(cfg, "bf16", b, n - 1), kd, vd)
        c_nll, c_kl, cache = test_step(params, cache, x[:, prefix - 1 : prefix], target0, ref_lp)
        caches.append(cache)
        nbytes.append(stored)
        nll[i].append(np.asarray(c_nll))
        kl[i].append(np.asarray(c_kl))


def blocked_se(x: np.ndarray, block: int = SE_BLOCK) -> float:
    """Standard error of ``x.mean()`` for ``x [seqs, tokens]`` from the means of blocks of
    ``block`` consecutive tokens of one sequence (neighbouring tokens' losses correlate,
    so a per-token standard error would be too small). NaN with fewer than 2 blocks."""
    per = x.shape[1] // block
    if per == 0:
        means = x.mean(axis=1)
    else:
        means = x[:, : per * block].reshape(x.shape[0] * per, block).mean(axis=1)
    return float(np.std(means, ddof=1) / np.sqrt(len(means))) if len(means) > 1 else float("nan")


@dataclasses.dataclass(frozen=True)
class Summary:
    """One cache against the bf16 reference: perplexities, ΔPPL (a fraction) and mean
    KL (nats) with blocked standard errors, median step ms and bytes."""

    label: str
    ppl: float
    d_ppl: float
    d_ppl_se: float
    kl: float
    kl_se: float
    step_ms: float
    nbytes: int
    tokens: int


def summarize(results: dict) -> list[Summary]:
    """A :class:`Summary` per cache (the bf16 reference first, its ΔPPL and KL 0)."""
    ref = results["bf16"].nll
    rows = []
    for label, r in results.items():
        d = r.nll - ref
        dmean = float(d.mean())
        rows.append(
            Summary(
                label=label,
                ppl=float(np.exp(r.nll.mean())),
                d_ppl=float(np.expm1(dmean)),
                d_ppl_se=float(np.exp(dmean) * blocked_se(d)) if label != "bf16" else 0.0,
                kl=float(r.kl.mean()),
                kl_se=blocked_se(r.kl) if label != "bf16" else 0.0,
                step_ms=1e3 * statistics.median(r.step_s) if r.step_s else float("nan"),
                nbytes=r.nbytes,
                tokens=int(r.nll.size),
            )
        )
    return rows


def reference_ppl(params, cfg, windows: np.ndarray, prefix: int) -> float:
    """Perplexity of the same scored tokens from a float32 forward pass without a cache
    (one window at a time, so the logits stay ``[1, N, vocab]``)."""
    from .model import forward

    nlls = []
    for w in windows:
        logits = forward(params, cfg, jnp.asarray(w[None]))
        lp = jax.nn.log_softmax(logits[0, prefix - 1 : -1], axis=-1)
        nlls.append(np.asarray(-jnp.take_along_axis(lp, jnp.asarray(w[prefix:])[:, None], axis=-1)[:, 0]))
    return float(np.exp(np.concatenate(nlls).mean()))
