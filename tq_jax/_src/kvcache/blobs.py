"""A sequence's codes as a TQ01 blob and back: :func:`export` and :func:`load`.

:func:`export` writes the bytes :func:`tq_jax.dumps` writes for that sequence's K/V;
:func:`load` copies a blob's codes in without re-quantizing.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from tq_jax._src import codec as _codec
from tq_jax._src import norms as _norms
from tq_jax._src import options as _options
from tq_jax._src import wire as _wire
from tq_jax._src.kvcache import scoring as _scoring
from tq_jax._src.kvcache.state import CacheConfig, KVCache
from tq_jax._src.kvcache.write import POOL_EXHAUSTED, write_rows

__all__ = ["export", "load"]


def _check_seq(cache: KVCache, seq) -> int:
    batch = cache.config.batch
    if not isinstance(seq, (int, np.integer)) or isinstance(seq, bool) or not 0 <= seq < batch:
        raise ValueError(f"`seq` must be an int in 0..{batch - 1} (a sequence of the cache), got {seq!r}.")
    return int(seq)


def _span(cache: KVCache, seq: int, page, length: int) -> tuple[int, int]:
    """Token range ``[lo, hi)`` of sequence ``seq`` that ``page`` (None: all) covers."""
    cfg = cache.config
    if page is None:
        return 0, length
    if not cfg.paged:
        raise ValueError("`page=` needs a paged cache: init(..., page_size=...). Omit page to export the whole sequence.")
    if not isinstance(page, (int, np.integer)) or isinstance(page, bool) or not 0 <= page < cfg.pages_per_seq:
        raise ValueError(f"`page` must be an int in 0..{cfg.pages_per_seq - 1}, got {page!r}.")
    return int(page) * cfg.page_tokens, min(length, (int(page) + 1) * cfg.page_tokens)


def _host(x) -> np.ndarray:
    return np.asarray(jax.device_get(x))


def _writer_options(cfg: CacheConfig) -> _options.Options:
    return _options.Options(
        key_bits=cfg.key_bits, value_bits=cfg.value_bits, seed=cfg.seed, rotation=cfg.rotation, norm_dtype="float16",
        trellis=cfg.trellis,
    )


def _gather_impl(cache: KVCache, seq, lo, hi, *, slots: int):
    """Codes and norms of tokens ``lo...lo+slots`` of ``seq`` (one program per ``slots``),
    and whether a page holding one of the tokens ``lo...hi`` has an overflowed norm."""
    cfg = cache.config
    table = cache.page_table[seq]
    pos = lo + jnp.arange(slots, dtype=jnp.int32)
    page = jnp.maximum(table[jnp.clip(pos // cfg.page_tokens, 0, table.shape[0] - 1)], 0)
    off = pos % cfg.page_tokens
    rows = [a[page, off] for a in (cache.k_codes, cache.k_norms, cache.v_codes, cache.v_norms)]
    overflowed = jnp.any(cache.overflow[page] & (pos < hi)[:, None])
    return (*rows, overflowed)


_gather_jit = jax.jit(_gather_impl, static_argnames="slots")


def export(cache: KVCache, seq: int = 0, page: int | None = None) -> bytes:
    """TQ01 bytes of one sequence's K/V (or of one page of it), from the stored codes.

    The blob holds a tensor ``[2 (K, V), 1, T, kv_heads, head_dim]`` of the cache's
    dtype, written as :func:`tq_jax.dumps` writes it with the cache's settings
    (``key_bits``, ``value_bits``, ``rotation``, ``seed``; float16 norms): version 1
    when those are the reference's (one width of 2/3/4/6/8, Haar), version 2 otherwise.

    Args:
        cache: the cache (concrete: call outside ``jit``).
        seq: the sequence.
        page: a page of a paged cache (its tokens ``page*page_size...``), or None for
            the whole sequence.

    Returns:
        The blob. An empty sequence (page=None) gives a valid blob of 0 tokens,
        ``[2, 1, 0, kv_heads, head_dim]``, which :func:`load` turns back into an empty
        sequence.

    Raises:
        ValueError: ``seq``/``page`` out of range, or a page holding no tokens.
        NormOverflowError: a stored vector's norm overflowed float16 (appended under
            ``jit``, where :func:`append` cannot raise).
    """
    cfg = cache.config
    seq = _check_seq(cache, seq)
    length = int(_host(cache.lengths)[seq])
    lo, hi = _span(cache, seq, page, length)
    if page is not None and hi <= lo:
        raise ValueError(
            f"page {page} of sequence {seq} holds no tokens: the sequence has {length} tokens, "
            f"{cfg.page_tokens} per page."
        )

    t = hi - lo
    slots = cfg.page_tokens if page is not None else cfg.pages_per_seq * cfg.page_tokens
    *parts, overflowed = _gather_jit(cache, np.int32(seq), np.int32(lo), np.int32(hi), slots=slots)
    if bool(overflowed):
        raise _wire.NormOverflowError(
            f"sequence {seq} holds vectors whose norm overflowed float16 when appended (stored as inf): "
            f"TQ01 with float16 norms cannot represent them. Re-append them scaled down."
        )
    kc, kn, vc, vn = (_host(a)[:t] for a in parts)
    header = _writer_options(cfg).header((2, 1, t, cfg.kv_heads, cfg.head_dim), cfg.dtype)
    kn, vn = kn.reshape(-1).astype(np.float16), vn.reshape(-1).astype(np.float16)
    if len(header.segments()) == 1:  # one stream: K's vectors then V's
        sections = _wire.Sections([[kc, vc]], [np.concatenate([kn, vn])])
    else:  # a segment per group; no raw layers
        sections = _wire.Sections([[kc], [vc]], [kn, vn])
    return b"".join(_wire.pieces(header, sections))  # every section length checked against the header


def _check_blob(cfg: CacheConfig, h: _wire.Header, limit: int, where: str) -> int:
    """Tokens of a blob that matches ``cfg``; a ValueError naming the mismatch otherwise."""
    want = (2, 1, "T", cfg.kv_heads, cfg.head_dim)
    fix = (
        "export it from a cache with the same settings, or build it with tq_jax.dumps(np.stack([K, V])[:, None], "
        "key_bits=..., value_bits=..., seed=..., rotation=...) using this cache's settings"
    )
    if len(h.shape) != 5 or h.shape[:2] != (2, 1):
        raise ValueError(f"blob holds shape {h.shape}, not the K/V of one sequence {want}: {fix}.")
    value_bits = h.bits if h.value_bits is None else h.value_bits
    checks = [
        ("head_dim", h.shape[4], cfg.head_dim),
        ("kv_heads", h.shape[3], cfg.kv_heads),
        ("key bits", h.bits, cfg.key_bits),
        ("value bits", value_bits, cfg.value_bits),
        ("rotation", h.rotation, cfg.rotation),
        ("seed", h.seed, _wire.seed32(cfg.seed)),
        ("trellis codes", h.trellis, cfg.trellis),
    ]
    for name, got, expect in checks:
        if got != expect:
            raise ValueError(f"blob has {name} {got!r} but the cache uses {expect!r}: its codes mean something else; {fix}.")
    unsupported = [
        ("a QJL residual", h.use_qjl),
        ("raw layers", h.skip_first or h.skip_last),
    ]
    for what, present in unsupported:
        if present:
            raise ValueError(f"blob uses {what}, which the cache (codes and one norm per vector) cannot hold: {fix}.")
    t = h.shape[2]
    if t > limit:
        raise ValueError(f"blob holds {t} tokens but {where} holds at most {limit}.")
    return t


def _float_norms(norms) -> np.ndarray:
    """One segment's norms as floats: float16/float32 as stored, log codes decoded."""
    if isinstance(norms, _wire.NormCodes):
        return _norms.decode_log_norms(norms.ranges, norms.codes, norms.bits, norms.count)
    return norms


def _cache_norms(norms: np.ndarray, codes: np.ndarray, config: _codec.CodecConfig, corrected: bool) -> np.ndarray:
    """The cache's float16 norms for a blob's norms (float16 kept as they are).

    A norm-corrected blob decodes ``norm * R^T c / |c|``; the cache decodes
    ``norm * R^T c``, so ``norm / |c|`` is stored (one float16 rounding).
    """
    if norms.dtype == np.float16 and not corrected:
        return norms
    n = norms.astype(np.float32)
    if corrected:
        c = np.asarray(_scoring.centroid_norms(codes, config))
        with np.errstate(divide="ignore", invalid="ignore"):
            n = np.where(c > 0, n / c, n)  # an all-zero centroid vector decodes as 0 either way
    with np.errstate(over="ignore"):  # an overflow is reported below, with the facts
        n16 = n.astype(np.float16)
    over = np.isfinite(n) & np.isinf(n16)
    if over.any():
        raise _wire.NormOverflowError(
            f"{int(over.sum())} of the blob's norms exceed float16 (largest {float(n[over].max()):.6g}), "
            f"the cache's norm dtype: they cannot be loaded. Decode the blob with tq_jax.loads instead."
        )
    return n16


def _rows(p: _wire.Parsed, cfg: CacheConfig, t: int):
    """(kc, kn, vc, vn) host arrays ``(t, H, row)`` / ``(t, H)`` of a parsed blob, norms
    as the cache stores them (float16, norm correction folded in)."""
    rk, rv = cfg.key_codec.row_nbytes, cfg.value_codec.row_nbytes
    h = cfg.kv_heads
    norms = [_float_norms(n) for n in p.norms]
    if len(p.indices) == 1:
        stream, norms = p.indices[0], norms[0]
        kc, vc = stream[: t * h * rk], stream[t * h * rk :]
        kn, vn = norms[: t * h], norms[t * h :]
    else:
        (kc, vc), (kn, vn) = p.indices, norms
    kc, vc = kc.reshape(t, h, rk), vc.reshape(t, h, rv)
    nc = p.header.norm_correction
    kn = _cache_norms(kn.reshape(t, h), kc, cfg.key_codec, nc)
    vn = _cache_norms(vn.reshape(t, h), vc, cfg.value_codec, nc)
    return kc, kn, vc, vn


def _pad(a: np.ndarray, n: int) -> np.ndarray:
    out = np.zeros((1, n) + a.shape[1:], a.dtype)
    out[0, : a.shape[0]] = a
    return out


def _load_impl(cache: KVCache, seq, start, count, final, clear_page, kc, kn, vc, vn):
    """Write ``count`` tokens at ``start`` of ``seq``, after clearing the overflow flags
    of the sequence's pages (``clear_page`` < 0: all of them; else that column), then
    set its length to ``final``."""
    table = cache.page_table[seq]
    cols = jnp.arange(table.shape[0])
    clear = (table >= 0) & ((clear_page < 0) | (cols == clear_page))
    pages = jnp.where(clear, table, cache.config.num_pages)
    cache = dataclasses.replace(cache, overflow=cache.overflow.at[pages].set(False, mode="drop"))
    seqs = jnp.reshape(seq, (1,))
    over = jnp.zeros(kn.shape, jnp.bool_)
    cache, _ = write_rows(cache, seqs, jnp.reshape(start, (1,)), jnp.reshape(count, (1,)), kc, kn, vc, vn, over)
    # pages taken by write_rows are fresh: nothing to clear there. The loaded tokens have no
    # exact copy: the window and sinks hold only tokens appended after them.
    exact_from = jnp.maximum(jnp.where(clear_page < 0, 0, cache.exact_from[seq]), start + count)
    return dataclasses.replace(
        cache, lengths=cache.lengths.at[seq].set(final), exact_from=cache.exact_from.at[seq].set(exact_from)
    )


_load_jit = jax.jit(_load_impl)


def load(cache: KVCache, blob, seq: int = 0, page: int | None = None) -> KVCache:
    """Copy a TQ01 blob's codes and norms into one sequence (or one page of it).

    The codes are copied, never re-quantized. A blob with float16 norms (what
    :func:`export` and v1 writers produce) is held exactly, so :func:`export` gives it
    back (when it records the cache's dtype) and :func:`attend` reads what its writer
    stored. Other norm encodings become the cache's float16 norms with one rounding:
    float32 norms, log-coded norms (``norm_bits``, the ``turbo-*`` presets) decoded,
    and norm correction folded into the norm (``norm / |c|``: the cache then decodes
    what the blob's decoder does). Such a sequence exports as float16 norms.

    Args:
        cache: the cache (concrete: call outside ``jit``).
        blob: TQ01 bytes of ``[2, 1, T, kv_heads, head_dim]`` written with the cache's
            ``key_bits``, ``value_bits``, ``rotation`` and ``seed`` (what :func:`export`
            writes, or ``tq_jax.dumps`` with a ``turbo-*`` preset whose bits and
            rotation the cache shares). Its recorded dtype is not checked: the codes
            do not depend on it after encoding.
        seq: the sequence.
        page: None: the blob replaces the whole sequence (its length becomes T).
            A page index of a paged cache: the blob's ``T <= page_size`` tokens go to
            positions ``page*page_size...``; the sequence must already hold every
            token before the page. Loading its last page (or the next one) sets the
            length to ``page*page_size + T``; replacing an interior page needs a
            full page and keeps the length.

    Returns:
        The updated cache.

    Raises:
        WireError: the blob is malformed.
        NormOverflowError: a float32 norm (or folded norm) exceeds float16.
        ValueError: a blob of another shape/head_dim/kv_heads/bits/rotation/seed, with
            QJL or raw layers; longer than
            ``max_len`` (or than a page); a page that would leave a gap; a pool
            without enough free pages.
    """
    cfg = cache.config
    seq = _check_seq(cache, seq)
    p = _wire.parse(blob)
    length = int(_host(cache.lengths)[seq])
    table = _host(cache.page_table)[seq]
    have = int((table >= 0).sum())
    if page is None:
        t = _check_blob(cfg, p.header, cfg.max_len, f"a sequence (max_len={cfg.max_len})")
        start, final, clear_page, slots = 0, t, -1, cfg.pages_per_seq * cfg.page_tokens
    else:
        lo, _ = _span(cache, seq, page, length)
        room = min(cfg.page_tokens, cfg.max_len - lo)
        t = _check_blob(cfg, p.header, room, f"page {page} (page_size={cfg.page_tokens}, max_len={cfg.max_len})")
        if lo > length:
            raise ValueError(
                f"page {page} of sequence {seq} starts at token {lo} but the sequence holds {length} tokens: "
                f"loading it would leave a gap. Load pages in order (or the whole sequence with page=None)."
            )
        interior = length > lo + cfg.page_tokens
        if interior and t != cfg.page_tokens:
            raise ValueError(
                f"page {page} of sequence {seq} is followed by more tokens (length {length}), so it must be "
                f"replaced by a full page of {cfg.page_tokens} tokens, got {t}."
            )
        start, final, clear_page, slots = lo, (length if interior else lo + t), int(page), cfg.page_tokens
    need = max(-(-(start + t) // cfg.page_tokens) - have, 0)
    free = cfg.num_pages - int(cache.next_page)
    if cfg.paged and need > free:
        raise ValueError(
            POOL_EXHAUSTED.format(what="load", need=need, page_size=cfg.page_tokens, free=free, num_pages=cfg.num_pages)
        )
    kc, kn, vc, vn = (_pad(a, slots) for a in _rows(p, cfg, t))
    i32 = lambda x: np.asarray(x, np.int32)  # noqa: E731
    return _load_jit(cache, i32(seq), i32(start), i32(t), i32(final), i32(clear_page), kc, kn, vc, vn)
