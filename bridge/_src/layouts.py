"""How an LMCache KV chunk's axes map to keys, values and layers: the serde's ``kv_layout``.

LMCache hands the serde one tensor per object group, described only by its shape. What
the axes mean depends on the serving engine's attention backend:

=============  ================================  =============================================
``kv_layout``  the chunk LMCache gives           what it holds
=============  ================================  =============================================
``split``      ``[2, L, T, H·D]`` (or ``[1,…]``)  keys in slot 0, values in slot 1 (vLLM's
                                                 FlashInfer and pre-fused layouts, LMCache's
                                                 in-process mode)
``fused``      ``[L, T, H·2·D]``                  each head's key then its value, per token
                                                 (vLLM's GPU FlashAttention, Triton and Flex
                                                 backends: a ``[blocks, H, block, 2·D]`` cache
                                                 that LMCache's multi-process mode gathers as
                                                 ``NL_X_NB_NH_BS_CS``)
``vllm-cpu``   ``[L, T, H·2·D]``                  vLLM's CPU attention backend: the same
                                                 ``[blocks, H, block, 2·D]`` cache, but each
                                                 (block, head) holds all of its keys and then
                                                 all of its values (``cpu_attn.py`` views it as
                                                 ``[blocks, H, 2·block, D]`` and splits axis 2);
                                                 its ``vec``/``vec16`` kernels (x86 without AMX)
                                                 keep a block's keys dimension-major,
                                                 ``[D, block]``, and its values ``[block, D]``
``latent``     ``[L, T, D]``                      one MLA latent vector per token (no values)
``auto``       —                                  ``split`` for ``[2|1, L, T, X]``; for
                                                 ``[L, T, X]``: ``latent`` when ``X == D``, else
                                                 the *paired* layout: ``fused`` (LMCache's own
                                                 description of a single-plane chunk) on a host
                                                 with CUDA, ``vllm-cpu`` without (the registry
                                                 decides, :data:`PAIRED`)
=============  ================================  =============================================

Two stored forms (:class:`Form`):

* **engine order** ``[..., X // D, D]``: the chunk's own axes with the last split into
  vectors. What a version-1 blob holds, byte for byte what the reference plugin writes
  (it treats every vector alike), and what every vector-wise setting needs.
* **K/V order** ``[2, L, ..., D]`` (``[1, L, ..., D]`` for ``latent``): one key or value
  vector of one token per row, K in slot 0 and V in slot 1, as TQ01 v2's KV layout
  addresses them, so that ``key_bits``/``value_bits``, raw edge layers and per-layer norm
  groups apply to the right vectors. ``fused`` stores ``[2, L, T, H, D]``, the very tensor
  a ``split`` engine stores for the same tokens; ``vllm-cpu`` stores the same vectors as
  ``[2, L, T // block, block, H, D]`` (its rank tells the two apart). Version-2 blobs take
  this form whenever the layout has one, and ``vllm-cpu`` blobs always do: its chunk
  order puts one *dimension* of 64 consecutive tokens' keys in a row, and codes of such
  rows cost SmolLM2-135M many times the next-token KL of per-token keys at the same bits
  (docs/vllm.md has the measurement).

Both are one set of values in two orders (a transposed copy each way); the reader
restores the chunk's exact order from either. A blob's shape says which form it is, and
a reader configured for another layout refuses it as a shape mismatch (a miss, never
wrong KV).
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["KV_LAYOUTS", "PAIRED", "Form", "form", "from_stored", "restore_into", "to_stored", "which"]

KV_LAYOUTS = ("auto", "split", "fused", "vllm-cpu", "latent")
PAIRED = ("fused", "vllm-cpu")
"""What ``auto`` may read an ``[L, T, H·2·D]`` chunk as: vLLM's GPU backends fill it as
``fused``, its CPU backend as ``vllm-cpu``; the shapes are the same, so the host decides."""

NOT_DIVISIBLE = (
    "KV group {group} has shape {shape}: its last axis ({hidden}) is not a multiple of "
    "head_dim={head_dim}. The serde splits the last axis into (hidden // head_dim, "
    "head_dim) vectors. Set the serde's head_dim to the model's head size (e.g. 128 for "
    "Llama-3; for MLA layouts [L, T, D] set head_dim to D, e.g. 576)."
)
WRONG_RANK = (
    "KV group {group} has shape {shape}, but kv_layout {layout!r} expects {want}. Set the serde's "
    "kv_layout to the engine's layout ('auto' picks 'split' for [2, L, T, H*D] and 'fused' or "
    "'latent' for [L, T, X]; docs/bridge.md lists them)."
)
NOT_PAIRED = (
    "KV group {group} has shape {shape}: kv_layout {layout!r} packs each head's key and value in "
    "2*head_dim = {pair} values, but the last axis ({hidden}) is not a multiple of it. Check "
    "head_dim (the model's head size, not the packed 2*head_size LMCache reports)."
)
NOT_BLOCKS = (
    "KV group {group} has {tokens} tokens per chunk, not a multiple of block_size={block}: "
    "kv_layout 'vllm-cpu' reads the chunk as whole vLLM blocks. Set the serde's block_size to "
    "vLLM's --block-size (128 by default on CPU) and LMCache's chunk size to a multiple of it."
)
NO_KV_ORDER = (
    "KV group {group} has shape {shape}: under kv_layout {layout!r} its vectors have no key/value "
    "or layer axes, and these settings need them (per-K/V bits, raw edge layers, or v2 norm groups "
    "per layer). Set kv_layout to the engine's layout ('fused' or 'vllm-cpu' for [L, T, H*2*D], "
    "'latent' for one MLA vector per token), or use one `bits` and no raw layers."
)


class Form(NamedTuple):
    """One group's layout, resolved against its shape.

    Attributes:
        layout: the resolved layout (never ``"auto"``).
        shape: the chunk's shape as LMCache gives it.
        engine: the engine-order stored shape ``shape[:-1] + (X // D, D)``.
        kv: the K/V-order stored shape, or None when the layout has none.
        block: vLLM's block size (``vllm-cpu``), else 0.
    """

    layout: str
    shape: tuple
    engine: tuple
    kv: tuple | None
    block: int = 0

    def stored(self, kv_order: bool) -> tuple:
        """The stored shape: K/V order when asked for and available, else engine order."""
        return self.kv if kv_order and self.kv is not None else self.engine


def form(shape, head_dim: int, kv_layout: str = "auto", block_size: int = 128, *, group: int = 0,
         paired: str = "fused") -> Form:
    """The :class:`Form` of a chunk of ``shape`` under ``kv_layout``; ``auto`` reads an
    ``[L, T, H·2·D]`` chunk as ``paired`` (one of :data:`PAIRED`).

    Raises:
        ValueError: the shape does not fit the layout (rank, a last axis that is not a
            multiple of ``head_dim`` or of ``2 * head_dim``, tokens that are not whole
            ``block_size`` blocks); the message names the option to change.

    Examples:
        >>> form((2, 32, 256, 1024), 128).kv
        (2, 32, 256, 8, 128)
        >>> form((30, 256, 384), 64).kv             # auto: fused
        (2, 30, 256, 3, 64)
        >>> form((30, 256, 384), 64, "vllm-cpu").kv
        (2, 30, 2, 128, 3, 64)
        >>> form((61, 256, 576), 576).kv            # auto: latent
        (1, 61, 256, 1, 576)
        >>> form((30, 256, 384), 64, paired="vllm-cpu").layout
        'vllm-cpu'
    """
    shape = tuple(int(s) for s in shape)
    d = int(head_dim)
    if not shape or shape[-1] == 0 or shape[-1] % d:
        raise ValueError(NOT_DIVISIBLE.format(group=group, shape=list(shape), hidden=shape[-1] if shape else None, head_dim=d))
    engine = shape[:-1] + (shape[-1] // d, d)
    split_like = len(shape) >= 3 and shape[0] in (1, 2)
    layout = kv_layout
    if layout == "auto":
        if len(shape) == 3:
            layout = "latent" if shape[-1] == d else (paired if shape[-1] % (2 * d) == 0 else "none")
        else:
            layout = "split" if split_like else "none"
    if layout == "none":
        return Form("none", shape, engine, None)
    if layout == "split":
        if not split_like:
            raise ValueError(WRONG_RANK.format(group=group, shape=list(shape), layout=layout, want="[2 (K, V) or 1, layers, ..., H*head_dim]"))
        return Form(layout, shape, engine, engine)
    if len(shape) != 3:
        want = "[layers, tokens, head_dim]" if layout == "latent" else "[layers, tokens, H*2*head_dim]"
        raise ValueError(WRONG_RANK.format(group=group, shape=list(shape), layout=layout, want=want))
    layers, tokens, hidden = shape
    if layout == "latent":
        return Form(layout, shape, engine, (1,) + engine)
    if hidden % (2 * d):
        raise ValueError(NOT_PAIRED.format(group=group, shape=list(shape), layout=layout, pair=2 * d, hidden=hidden))
    heads = hidden // (2 * d)
    if layout == "fused":
        return Form(layout, shape, engine, (2, layers, tokens, heads, d))
    block = int(block_size)  # vllm-cpu
    if block < 2 or block % 2 or tokens % block:
        raise ValueError(NOT_BLOCKS.format(group=group, tokens=tokens, block=block))
    return Form(layout, shape, engine, (2, layers, tokens // block, block, heads, d), block)


def which(f: Form, stored_shape) -> bool | None:
    """Which form a blob of ``stored_shape`` is: False (engine order), True (K/V order), or
    None (neither: written for another layout, model or chunk size)."""
    stored_shape = tuple(stored_shape)
    if stored_shape in (f.engine, f.shape):  # the chunk's own order (per head, or whole rows)
        return False
    if f.kv is not None and stored_shape == f.kv:
        return True
    return None


def _reorders(f: Form, kv_order: bool) -> bool:
    return kv_order and f.kv is not None and f.layout in ("fused", "vllm-cpu")


def _xp(a):
    """numpy for numpy arrays, jax.numpy otherwise (accelerator chunks arrive as jax arrays)."""
    import numpy as np

    if isinstance(a, np.ndarray):
        return np
    import jax.numpy as jnp

    return jnp


def to_stored(x, f: Form, kv_order: bool):
    """The chunk ``x`` (numpy or jax array of ``f.shape``) as the stored tensor: a view
    (engine order, ``split``, ``latent``), a transposed view (``fused``), or a gathered
    copy (``vllm-cpu``) that the encoder reads once more."""
    if not _reorders(f, kv_order):
        return x.reshape(f.stored(kv_order))
    layers, tokens, _ = f.shape
    if f.layout == "fused":  # (l, t, h, g, d) -> (g, l, t, h, d)
        heads, d = f.kv[3], f.kv[4]
        return x.reshape(layers, tokens, heads, 2, d).transpose(3, 0, 1, 2, 4)
    _, _, blocks, block, heads, d = f.kv
    # Row r of block b, head h holds values [r*2D, (r+1)*2D) of the (b, h) region: first
    # block*D keys, dimension-major [D, block], then block*D values, [block, D].
    region = x.reshape(layers, blocks, block, heads, 2 * d).transpose(0, 1, 3, 2, 4).reshape(layers, blocks, heads, 2, block * d)
    k = region[:, :, :, 0].reshape(layers, blocks, heads, d, block).transpose(0, 1, 4, 2, 3)
    v = region[:, :, :, 1].reshape(layers, blocks, heads, block, d).transpose(0, 1, 3, 2, 4)
    return _xp(x).stack([k, v])


def from_stored(y, f: Form, kv_order: bool):
    """The inverse of :func:`to_stored`: the stored tensor ``y`` back in the chunk's order,
    as an array of ``f.shape`` (numpy or jax, as ``y``)."""
    if not _reorders(f, kv_order):
        return y.reshape(f.shape)
    layers, tokens, _ = f.shape
    if f.layout == "fused":
        return y.transpose(1, 2, 3, 0, 4).reshape(f.shape)
    _, _, blocks, block, heads, d = f.kv
    k = y[0].transpose(0, 1, 3, 4, 2).reshape(layers, blocks, heads, block * d)
    v = y[1].transpose(0, 1, 3, 2, 4).reshape(layers, blocks, heads, block * d)
    region = _xp(y).stack([k, v], axis=3).reshape(layers, blocks, heads, block, 2 * d)
    return region.transpose(0, 1, 3, 2, 4).reshape(f.shape)


def restore_into(y, f: Form, kv_order: bool, out) -> None:
    """:func:`from_stored` written into the numpy array ``out`` (the chunk, ``f.shape``)."""
    import numpy as np

    y = np.asarray(y)
    if not _reorders(f, kv_order):
        np.copyto(out.reshape(f.stored(kv_order)), y.reshape(f.stored(kv_order)), casting="unsafe")
    elif f.layout == "fused":  # one transposed copy straight into the chunk
        layers, tokens, _ = f.shape
        np.copyto(out.reshape(layers, tokens, f.kv[3], 2, f.kv[4]), y.transpose(1, 2, 3, 0, 4), casting="unsafe")
    elif not _restore_cpu_into(y, f, out):
        np.copyto(out, from_stored(y, f, kv_order), casting="unsafe")


def _restore_cpu_into(y, f: Form, out) -> bool:
    """``vllm-cpu``'s K/V order written straight into the chunk's (block, head) regions, one
    strided copy for the keys and one for the values, when ``2*D`` divides the block or
    the block divides ``2*D`` (vLLM's CPU blocks of 128 with head sizes 32..256); False
    otherwise (the caller takes the general path)."""
    import numpy as np

    layers, tokens, _ = f.shape
    _, _, blocks, block, heads, d = f.kv
    half, pair = block // 2, 2 * d
    region = out.reshape(layers, blocks, block, heads, pair).transpose(0, 1, 3, 2, 4)  # [L, NB, H, block, 2D] view
    keys, values = region[:, :, :, :half], region[:, :, :, half:]
    k = y[0]  # [L, NB, block, H, D]: key (t, d) sits at region position d*block + t
    if block % pair == 0:  # row d*(block/2D) + t // 2D, column t % 2D
        j = block // pair
        dst = keys.reshape(layers, blocks, heads, d, j, pair)
        src = k.reshape(layers, blocks, j, pair, heads, d).transpose(0, 1, 4, 5, 2, 3)
    elif pair % block == 0:  # row d // (2D/block), column (d % (2D/block))*block + t
        j = pair // block
        dst = keys.reshape(layers, blocks, heads, half, j, block)
        src = k.reshape(layers, blocks, block, heads, half, j).transpose(0, 1, 3, 4, 5, 2)
    else:
        return False
    np.copyto(dst, src, casting="unsafe")
    # value (t, d) sits at position block*D + t*D + d: row block/2 + t // 2, column (t % 2)*D + d
    src = y[1].reshape(layers, blocks, half, 2, heads, d).transpose(0, 1, 4, 2, 3, 5)
    np.copyto(values.reshape(layers, blocks, heads, half, 2, d), src, casting="unsafe")
    return True
