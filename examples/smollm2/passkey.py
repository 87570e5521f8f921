"""Passkey retrieval through each cache: can the model find one 5-digit key in filler?

A prompt of exactly ``context`` tokens: a short instruction, filler sentences ("The
grass is green. The sky is blue. ..."), the key sentence ("The pass key is 12345.
Remember it. 12345 is the pass key.") at a depth of 0..100 % of the filler, more
filler, then the question ("What is the pass key? The pass key is"). The model
greedy-decodes :data:`ANSWER_TOKENS` tokens; a prompt scores 1 when the first run of
digits in the answer is exactly the key.

Protocol (docs/serving-smollm2.md): per batch of prompts (one (context, depth) cell,
``keys`` random keys), everything before the question is prefilled **once**, on exact
K/V with the bf16 cache's math, and each layer's resulting K/V are appended to every
cache under test (``caches.load_kv``: ``kvcache.append``, so a compressed cache
quantizes them as usual and keeps only its exact window). The question is then fed one
token per step through each cache and the answer greedy-decoded through it, so the key
is found by attention over the cache's codes. Servers prefill on exact K/V too; with
``strict_prefill`` the context is instead prefilled through the cache under test
(every read from the cache, as in the in-loop protocol).
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np

from .caches import CacheSpec, DenseCache, dense_kv, init_cache, load_kv, make_step

FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
INSTRUCTION = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important info there."
)
KEY_SENTENCE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = " What is the pass key? The pass key is"
ANSWER_TOKENS = 7  # " ", five digits, and one more: SmolLM2's tokenizer splits digits
FORMATS = ("plain", "chat")


@dataclasses.dataclass(frozen=True)
class Prompts:
    """One cell's prompts: ``context [K, T]`` (prefilled), ``question [Q]`` (fed one
    token per step; the same for every prompt) and the keys (strings of 5 digits)."""

    context: np.ndarray
    question: np.ndarray
    keys: tuple


def _ids(tok, text: str) -> list:
    return list(tok(text, add_special_tokens=False).input_ids)


def build_prompts(tok, context: int, depth: float, keys, fmt: str = "plain") -> Prompts:
    """``len(keys)`` prompts of exactly ``context`` tokens, the key at ``depth`` (0..1)
    of the filler (snapped to a whole filler sentence group).

    ``fmt="chat"`` wraps instruction, haystack and "What is the pass key?" in SmolLM2's
    chat template (user turn) and starts the assistant's turn with "The pass key is".

    Raises:
        ValueError: ``depth`` outside 0..1, an unknown format, or a context too short
            to hold instruction, key and question.
    """
    if not 0 <= depth <= 1:
        raise ValueError(f"`depth` must be in 0..1 (a fraction of the filler), got {depth}.")
    if fmt not in FORMATS:
        raise ValueError(f"`fmt` must be one of {FORMATS}, got {fmt!r}.")
    if fmt == "chat":
        marker = "\x00HAYSTACK\x00"
        text = tok.apply_chat_template(
            [{"role": "user", "content": INSTRUCTION + marker + " What is the pass key?"}],
            add_generation_prompt=True,
            tokenize=False,
        )
        head, tail = text.split(marker)
        tail = tail.removeprefix(" What is the pass key?")
        head_ids = _ids(tok, head)
        question = _ids(tok, " What is the pass key?" + tail + "The pass key is")
    else:
        head_ids = _ids(tok, INSTRUCTION)
        question = _ids(tok, QUESTION)
    unit = _ids(tok, FILLER)
    rows = []
    for key in keys:
        key_ids = _ids(tok, KEY_SENTENCE.format(key=key))
        n_fill = context - len(head_ids) - len(key_ids) - len(question)
        if n_fill < 0:
            raise ValueError(
                f"context={context} tokens cannot hold the instruction, key sentence and question "
                f"({context - n_fill} tokens): use a longer context."
            )
        filler = (unit * (n_fill // len(unit) + 1))[:n_fill]
        at = min(int(round(depth * n_fill / len(unit))) * len(unit), n_fill)
        rows.append(head_ids + filler[:at] + key_ids + filler[at:])
    ctx = np.asarray(rows, np.int32)
    assert ctx.shape == (len(keys), context - len(question)), ctx.shape
    return Prompts(ctx, np.asarray(question, np.int32), tuple(keys))


def random_keys(rng: np.random.Generator, n: int) -> list[str]:
    """``n`` random 5-digit keys, 10000..99999."""
    return [str(k) for k in rng.integers(10000, 100000, size=n)]


def answer_matches(text: str, key: str) -> bool:
    """True when the first run of digits in ``text`` is exactly ``key``."""
    m = re.search(r"\d+", text)
    return bool(m) and m.group(0) == key


class Runner:
    """Jitted prefill / load / decode functions for one model, reused across cells."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.prefill = jax.jit(make_step(cfg, last_only=True), donate_argnums=1)
        self.load = jax.jit(load_kv, donate_argnums=0)
        step = make_step(cfg)

        def decode(params, cache, tokens):
            logits, cache = step(params, cache, tokens)
            return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)[:, None], cache

        self.decode = jax.jit(decode, donate_argnums=1)


def run_cell(params, runner: Runner, prompts: Prompts, specs: list[CacheSpec], *, strict_prefill: bool = False):
    """Answers (token ids ``[K, ANSWER_TOKENS]``) of every spec on one cell's prompts.

    The bf16 cache prefills the context; its K/V are loaded into every cache under
    test (or, with ``strict_prefill``, each compressed cache prefills the context
    itself); the question and the answer then go one token per step through each.
    Returns ``{label: answers}``.
    """
    cfg = runner.cfg
    k, t = prompts.context.shape
    capacity = t + len(prompts.question) + ANSWER_TOKENS
    ctx = jnp.asarray(prompts.context)
    kv = None
    if not strict_prefill or any(s.kind == "bf16" for s in specs):
        ref = init_cache(cfg, "bf16", k, capacity)
        _, ref = runner.prefill(params, ref, ctx)
        kv = dense_kv(ref, 0, t)
        del ref
    out = {}
    for spec in specs:
        cache = spec.init(cfg, k, capacity)
        if strict_prefill and spec.kind != "bf16":
            _, cache = runner.prefill(params, cache, ctx)
        else:
            cache = runner.load(cache, *kv)
        assert isinstance(cache, DenseCache) or cache.lengths.shape[-1] == k
        out[spec.label] = answer(params, runner, cache, prompts.question)
    return out


def answer(params, runner: Runner, cache, question) -> np.ndarray:
    """Feed ``question`` (token ids, the same for every sequence) one token per step
    through ``cache`` (donated), then greedy-decode; the answers' token ids ``[B,
    ANSWER_TOKENS]``."""
    b = int(cache.lengths.shape[-1])
    tok = None
    for q in question:
        tok, cache = runner.decode(params, cache, jnp.full((b, 1), q, jnp.int32))
    out = [tok]
    for _ in range(ANSWER_TOKENS - 1):
        tok, cache = runner.decode(params, cache, tok)
        out.append(tok)
    return np.concatenate([np.asarray(a) for a in out], axis=1)
