"""KV caches for the SmolLM2 model, one jitted step over them, and cache specs.

Two kinds of cache, each a stacked pytree with one slice per layer (a leading layer
axis), scanned over with ``lax.scan``:

* ``"bf16"``: :class:`DenseCache`, K/V stored as bfloat16 (bit patterns in uint16)
  ``[L, B, max_len, kv_heads, head_dim]``; attention is float32 over the stored
  (bf16-rounded) K/V, an online softmax over the filled blocks.
* ``"tq"``: ``tq_jax.kvcache.KVCache`` stacked over layers (same config, same rotation
  seed in every layer); ``kvcache.append`` then ``kvcache.attend`` on the codes.
  :func:`init_cache` passes its keyword arguments to ``kvcache.init`` unchanged
  (``options=``/a preset name, ``key_bits=``, ``window=``, ``sinks=``, ...), so a new
  cache setting needs no edit here.
* ``"ragged"``: :class:`RaggedCache`, the engine-facing form (``tq_jax.kvcache.ragged``)
  driven as a serving engine drives it: a pool of code pages per layer, a page table
  (here each sequence owns a fixed run of pages), ``ragged.write`` of the flat batch of
  new tokens to their slots and ``ragged.attend`` with the RPA arguments. The keyword
  arguments go to ``ragged.init_pool`` (``options``, ``window``, ``sinks``,
  ``page_size``: default 16).

::

    from examples.smollm2 import caches, model
    params, cfg, tok = model.load_smollm2()
    cache = caches.init_cache(cfg, "tq", 1, 4096, key_bits=4, value_bits=3)   # or "bf16"
    step = jax.jit(caches.make_step(cfg), donate_argnums=1)
    logits, cache = step(params, cache, tokens)   # append tokens' K/V, attend, logits

A cache *spec* is the benchmark's name for one cache (:func:`parse_spec`):
``bf16``, ``tq`` (``kvcache.init``'s defaults), ``tq:4/4`` (key/value bits),
``tq:turbo-3.5`` (a preset name, passed as ``options=``), each optionally followed by
``,window=R,sinks=S,rotation=hadamard,seed=7,norm_correction=true`` (any
``kvcache.init`` keyword with an int, true/false or string value); ``ragged``,
``ragged:4/4``, ``ragged:turbo-4`` likewise (``ragged.init_pool``'s keywords).
``fp8`` names no cache but a stored format (:func:`stored_roundtrip`), for the
loaded-prefix protocol.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tq_jax import kvcache
from tq_jax.kvcache import ragged

from .model import LlamaConfig, decoder_layer, output_logits


class DenseCache(NamedTuple):
    """An uncompressed bfloat16 KV cache for every layer, stacked on axis 0.

    K/V are stored as their bfloat16 bit patterns in uint16 arrays (same bytes as a
    bfloat16 cache): XLA's CPU backend does not update a bfloat16 buffer in place
    inside the layer loop (it converts it), which cost ~0.3 s per decode step at 2.5k
    tokens of capacity; a uint16 buffer is updated in place (~2 ms).
    """

    k: jax.Array  # uint16 (bfloat16 bits) [L, B, max_len, kv_heads, head_dim]
    v: jax.Array  # uint16 (bfloat16 bits) [L, B, max_len, kv_heads, head_dim]
    lengths: jax.Array  # int32 [L, B]


DENSE_BLOCK = 256  # tokens per step of the bf16 cache's online softmax (kvcache's default too)


def _bf16_bits(x):
    return lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)


def _from_bits(x):
    return lax.bitcast_convert_type(x, jnp.bfloat16).astype(jnp.float32)


def _dense_write(cache: DenseCache, layer, k, v) -> DenseCache:
    """Write ``k``/``v [B, T, kv_heads, head_dim]`` at the end of each sequence of layer
    ``layer`` (in place, one sequence at a time: the batch is static and small)."""
    start = cache.lengths[layer]
    kb, vb = _bf16_bits(k), _bf16_bits(v)
    ck, cv = cache.k, cache.v
    for i in range(k.shape[0]):
        at = (layer, i, start[i], 0, 0)
        ck = lax.dynamic_update_slice(ck, kb[i][None, None], at)
        cv = lax.dynamic_update_slice(cv, vb[i][None, None], at)
    lengths = cache.lengths.at[layer].set(jnp.minimum(start + k.shape[1], cache.k.shape[2]))
    return DenseCache(ck, cv, lengths)


def _dense_append_attend(cache: DenseCache, layer, q, k, v):
    """Write ``k``/``v`` at the end of each sequence of layer ``layer``, then attend ``q``
    (the new tokens) over that layer's cache.

    float32 online softmax over blocks of :data:`DENSE_BLOCK` tokens, only as many
    blocks as the longest sequence fills (as ``kvcache.attend`` walks its blocks), so a
    step costs O(length), not O(max_len). Query ``i`` sits at ``lengths - q_len + i``
    (after the append) and sees the tokens up to itself: ``kvcache.attend``'s semantics.
    """
    b, n_q, hq, d = q.shape
    hkv, cap = cache.k.shape[3], cache.k.shape[2]
    new = _dense_write(cache, layer, k, v)
    ck, cv, lengths = new

    blk = min(DENSE_BLOCK, cap)
    qg = q.astype(jnp.float32).reshape(b, n_q, hkv, hq // hkv, d) / np.float32(math.sqrt(d))
    q_pos = lengths[layer][:, None] - n_q + jnp.arange(n_q, dtype=jnp.int32)  # [B, Q]

    def body(j, carry):
        m, l, acc = carry
        t0 = jnp.minimum(j * blk, cap - blk)  # a partial last block re-reads earlier tokens: masked
        kt = _from_bits(lax.dynamic_slice(ck, (layer, 0, t0, 0, 0), (1, b, blk, hkv, d))[0])
        vt = _from_bits(lax.dynamic_slice(cv, (layer, 0, t0, 0, 0), (1, b, blk, hkv, d))[0])
        t = t0 + jnp.arange(blk, dtype=jnp.int32)
        mask = (t[None, None, :] <= q_pos[:, :, None]) & (t[None, None, :] >= j * blk)  # [B, Q, T]
        s = jnp.einsum("bqhgd,bthd->bhgqt", qg, kt)
        s = jnp.where(mask[:, None, None], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(s - m_safe[..., None])
        alpha = jnp.exp(m - m_safe)
        l = alpha * l + jnp.sum(p, axis=-1)
        acc = alpha[..., None] * acc + jnp.einsum("bhgqt,bthd->bhgqd", p, vt)
        return m_new, l, acc

    g = hq // hkv
    init = (jnp.full((b, hkv, g, n_q), -jnp.inf), jnp.zeros((b, hkv, g, n_q)), jnp.zeros((b, hkv, g, n_q, d)))
    n_blocks = (jnp.max(lengths[layer]) + blk - 1) // blk
    _, l, acc = lax.fori_loop(0, n_blocks, body, init)
    out = acc / jnp.where(l == 0, 1.0, l)[..., None]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, n_q, hq, d), new


def _tq_append_attend(cache, q, k, v):
    cache = kvcache.append(cache, k, v)
    return kvcache.attend(cache, q), cache


class RaggedCache(NamedTuple):
    """The engine-facing pool for every layer (stacked on axis 0), with the bookkeeping an
    engine keeps: each sequence's length and page table (the same in every layer)."""

    pool: ragged.Pool  # leaves [L, ...]
    lengths: jax.Array  # int32 [L, B]
    pages: jax.Array  # int32 [L, B, pages_per_seq]


def _ragged_append_attend(cache: RaggedCache, q, k, v):
    """One layer as an engine runs it: the new tokens ``[B, T]`` flattened into one batch,
    written to the slots of their positions, then ragged paged attention of their queries."""
    b, t, hq, d = q.shape
    ps = cache.pool.config.page_size
    pos = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]  # [B, T]
    slot = jnp.take_along_axis(cache.pages, pos // ps, axis=1) * ps + pos % ps
    flat = lambda x: x.reshape(b * t, *x.shape[2:])  # noqa: E731
    pool = ragged.write(cache.pool, flat(k), flat(v), slot.reshape(-1), positions=pos.reshape(-1))
    lengths = cache.lengths + t
    cu = jnp.arange(b + 1, dtype=jnp.int32) * t
    out = ragged.attend(pool, flat(q), lengths, cache.pages, cu, jnp.array([b], jnp.int32))
    return out.reshape(b, t, hq, d), RaggedCache(pool, lengths, cache.pages)


KINDS = ("bf16", "tq", "ragged")


def init_cache(cfg: LlamaConfig, kind: str, batch: int, max_len: int, **kvcache_kwargs):
    """An empty cache for every layer, stacked on a leading layer axis.

    Args:
        cfg: the model.
        kind: ``"bf16"`` (:class:`DenseCache`) or ``"tq"`` (``tq_jax.kvcache``).
        batch, max_len: sequences and capacity.
        **kvcache_kwargs: for ``"tq"``, passed to ``kvcache.init(batch, max_len,
            kv_heads, head_dim, **kvcache_kwargs)`` unchanged (``options``,
            ``key_bits``, ``value_bits``, ``rotation``, ``seed``, ``window``, ``sinks``,
            ``page_size``, ...); none for ``"bf16"``.

    Raises:
        ValueError: an unknown ``kind``, or keyword arguments given for ``"bf16"``.
        TypeError: a keyword ``kvcache.init`` does not take (named in the message).
    """
    if kind == "bf16":
        if kvcache_kwargs:
            raise ValueError(
                f"the bf16 cache takes no settings, got {sorted(kvcache_kwargs)}: they are kvcache.init's; "
                "use kind='tq' for a compressed cache."
            )
        shape = (cfg.layers, batch, max_len, cfg.kv_heads, cfg.head_dim)
        return DenseCache(jnp.zeros(shape, jnp.uint16), jnp.zeros(shape, jnp.uint16), jnp.zeros((cfg.layers, batch), jnp.int32))
    if kind == "tq":
        try:
            one = kvcache.init(batch, max_len, cfg.kv_heads, cfg.head_dim, **kvcache_kwargs)
        except TypeError as e:
            raise TypeError(
                f"kvcache.init rejected the settings {kvcache_kwargs}: {e}. A cache spec's name=value pairs "
                "are kvcache.init's keyword arguments (options, key_bits, value_bits, rotation, seed, "
                "norm_correction, window, sinks, page_size, ...)."
            ) from e
        return jax.tree.map(lambda x: jnp.broadcast_to(x, (cfg.layers, *x.shape)).copy(), one)
    if kind == "ragged":
        page_size = kvcache_kwargs.pop("page_size", 16)
        pps = -(-max_len // page_size)
        one = ragged.init_pool(batch * pps, page_size, cfg.kv_heads, cfg.head_dim, max_seqs=batch, **kvcache_kwargs)
        pages = jnp.arange(batch * pps, dtype=jnp.int32).reshape(batch, pps)
        stack = lambda x: jnp.broadcast_to(x, (cfg.layers, *x.shape)).copy()  # noqa: E731
        return RaggedCache(jax.tree.map(stack, one), stack(jnp.zeros((batch,), jnp.int32)), stack(pages))
    raise ValueError(f"`kind` must be one of {KINDS}, got {kind!r}.")


def cache_nbytes(cache) -> int:
    """Bytes of a cache's array leaves (K/V storage plus lengths / page tables).

    For a ``"tq"`` stack this equals the sum of ``kvcache.nbytes`` over its layers.
    """
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(cache))


def cache_lengths(cache) -> jax.Array:
    """int32 ``[B]``: tokens held per sequence (layer 0's; every layer holds the same)."""
    return cache.lengths[0]


def make_step(cfg: LlamaConfig, *, last_only: bool = False):
    """``step(params, cache, tokens) -> (logits, cache)``: append ``tokens [B, T]``
    (positions continue from the cache's lengths) to every layer's cache, each layer
    attending over its cache after the append; logits ``[B, T, vocab]`` float32
    (``[B, 1, vocab]``, the last position's, with ``last_only``: a long prefill then
    never builds a ``[B, T, vocab]`` array).

    Prefill (T = prompt length), decode (T = 1) and chunked scoring use the same
    function; jit it with ``donate_argnums=1`` so the cache is updated in place.

    Layers run in one ``lax.scan``. The bf16 cache rides in the scan's carry and each
    layer writes its new tokens in place; the ``kvcache`` stack is scanned as xs -> ys
    (one ``KVCache`` per layer, as its API takes), which measured 16 ms against 96 ms
    for slicing it out of a carry and writing it back (30 layers, 2.5k capacity, CPU).
    """

    def step(params, cache, tokens):
        b, t = tokens.shape
        pos = cache.lengths[0][:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        h = params["embed"][tokens]
        if isinstance(cache, DenseCache):

            def body(carry, xs):
                h, c = carry
                p, i = xs
                h, c = decoder_layer(cfg, h, p, pos, lambda q, k, v: _dense_append_attend(c, i, q, k, v))
                return (h, c), None

            (h, cache), _ = lax.scan(body, (h, cache), (params["layers"], jnp.arange(cfg.layers)))
        else:

            layer_fn = _ragged_append_attend if isinstance(cache, RaggedCache) else _tq_append_attend

            def body(h, xs):
                p, c = xs
                return decoder_layer(cfg, h, p, pos, lambda q, k, v: layer_fn(c, q, k, v))

            h, cache = lax.scan(body, h, (params["layers"], cache))
        if last_only:
            h = h[:, -1:]
        return output_logits(params, cfg, h), cache

    return step


def dense_kv(cache: DenseCache, start: int, stop: int) -> tuple[jax.Array, jax.Array]:
    """bfloat16 K/V ``[L, B, stop - start, kv_heads, head_dim]`` of every layer's
    tokens ``start..stop-1`` (the values a bf16 cache holds, exactly)."""
    as_bf16 = lambda x: lax.bitcast_convert_type(x[:, :, start:stop], jnp.bfloat16)  # noqa: E731
    return as_bf16(cache.k), as_bf16(cache.v)


def load_kv(cache, k, v):
    """Append K/V ``[L, B, T, kv_heads, head_dim]`` (one slice per layer) to every layer
    of a cache stack, as a cached step would have appended them; jit-able.

    A ``"tq"`` stack quantizes them as ``kvcache.append`` always does (and keeps the
    newest in its exact window, if it has one); a :class:`DenseCache` rounds them to
    bfloat16. Used to give every cache under test the same exactly-prefilled context.
    """
    if isinstance(cache, DenseCache):

        def body(c, xs):
            i, kl, vl = xs
            return _dense_write(c, i, kl, vl), None

        cache, _ = lax.scan(body, cache, (jnp.arange(k.shape[0]), k, v))
        return cache
    _, cache = lax.scan(lambda _, xs: (None, kvcache.append(*xs)), None, (cache, k, v))
    return cache


def stored_roundtrip(spec: "CacheSpec", k, v) -> tuple[jax.Array, jax.Array, int]:
    """K/V ``[L, B, T, kv_heads, head_dim]`` as a store gives them back, and the stored bytes.

    What a prefix loaded from LMCache's L2 holds: every token as its stored format
    decodes it, with no exact window. A ``"tq"`` spec encodes the K/V stack
    ``[2, L, B, T, kv_heads, head_dim]`` with ``tq_jax.dumps`` under the spec's codec
    settings (its ``window``/``sinks``, a live cache's exact tokens, do not apply to a
    stored value) and decodes it with ``tq_jax.loads``. An ``"fp8"`` spec rounds to
    float8 e4m3 with scale 1, vLLM's fp8 KV cache without calibrated scales (clamped
    to +-448, as vLLM's conversion saturates).

    Raises:
        ValueError: a spec of another kind, or a ``"tq"`` spec that names no bits or preset.
    """
    if spec.kind == "fp8":
        fp8 = lambda x: jnp.clip(x.astype(jnp.float32), -448, 448).astype(jnp.float8_e4m3fn).astype(jnp.bfloat16)  # noqa: E731
        return fp8(k), fp8(v), int(k.size + v.size)
    if spec.kind != "tq":
        raise ValueError(f"cache spec {spec.label!r}: a stored prefix is tq:... (codes) or fp8, not {spec.kind!r}.")
    import tq_jax

    settings = {n: x for n, x in spec.settings.items() if n not in ("window", "sinks", "page_size")}
    if "options" not in settings and not {"bits", "key_bits", "value_bits"} & settings.keys():
        raise ValueError(f"cache spec {spec.label!r}: a stored prefix needs bits or a preset (tq:4/4, tq:turbo-4).")
    blob = tq_jax.dumps(np.stack([np.asarray(k), np.asarray(v)]), **settings)
    back = tq_jax.loads(blob)
    return back[0], back[1], len(blob)


# --------------------------------------------------------------------------- specs


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """One cache of a benchmark: a label, a kind and ``kvcache.init``'s keyword arguments.

    ``kwargs`` is a tuple of ``(name, value)`` pairs (hashable); :attr:`settings` is it
    as a dict.
    """

    label: str
    kind: str
    kwargs: tuple = ()

    @property
    def settings(self) -> dict:
        return dict(self.kwargs)

    def init(self, cfg: LlamaConfig, batch: int, max_len: int):
        """:func:`init_cache` for this spec."""
        return init_cache(cfg, self.kind, batch, max_len, **self.settings)

    def with_settings(self, **defaults) -> "CacheSpec":
        """This spec with ``defaults`` added where it does not set them itself (a
        ``"tq"`` spec only; values of None are dropped). The label lists what was added."""
        if self.kind in ("bf16", "fp8"):
            return self
        own = self.settings
        add = {k: v for k, v in defaults.items() if v is not None and k not in own}
        if not add:
            return self
        label = self.label + "".join(f",{k}={v}" for k, v in add.items())
        return CacheSpec(label, self.kind, tuple({**own, **add}.items()))


_BITS = re.compile(r"^(?:(\d)/(\d)|[Kk](\d)[Vv](\d))$")
_INT = re.compile(r"^-?\d+$")
_BOOLS = {"true": True, "false": False}

SPEC_HELP = (
    "a cache spec is bf16, tq (kvcache.init's defaults), tq:K/V bits (tq:4/4, tq:K4V3) or "
    "tq:PRESET (tq:turbo-3.5, passed as options=), optionally followed by ,name=value for any "
    "kvcache.init keyword: int, true/false or a string (tq:4/4,window=64,sinks=4,rotation=hadamard, "
    "tq:K6V4,rotation=hadamard,norm_correction=true); fp8 (float8 e4m3) is a stored format, for "
    "quality --loaded-prefix only"
)


def parse_spec(text: str) -> CacheSpec:
    """A :class:`CacheSpec` from its command-line form (see the module docstring).

    Raises:
        ValueError: an unknown kind, a malformed bits/preset part or ``name=value``.
    """
    head, *extras = text.strip().split(",")
    kind, _, conf = head.partition(":")
    kwargs: dict = {}
    if kind in ("bf16", "fp8"):
        if conf or extras:
            raise ValueError(f"cache spec {text!r}: the {kind} cache takes no settings ({SPEC_HELP}).")
        return CacheSpec(kind, kind)
    if kind not in ("tq", "ragged"):
        raise ValueError(f"cache spec {text!r}: unknown kind {kind!r}, expected one of {(*KINDS, 'fp8')} ({SPEC_HELP}).")
    if conf:
        m = _BITS.match(conf)
        if m:
            kb, vb = (int(x) for x in (m.group(1, 2) if m.group(1) else m.group(3, 4)))
            kwargs.update(key_bits=kb, value_bits=vb)
        elif re.match(r"^[A-Za-z][\w.\-]*$", conf):
            kwargs["options"] = conf
        else:
            raise ValueError(f"cache spec {text!r}: {conf!r} is neither K/V bits (4/4, K4V3) nor a preset name ({SPEC_HELP}).")
    for extra in extras:
        name, eq, value = extra.partition("=")
        if not eq or not name.isidentifier():
            raise ValueError(f"cache spec {text!r}: {extra!r} is not name=value ({SPEC_HELP}).")
        kwargs[name] = int(value) if _INT.match(value) else _BOOLS.get(value.lower(), value)
    return CacheSpec(text.strip(), kind, tuple(kwargs.items()))
