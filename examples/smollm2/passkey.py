"""Passkey retrieval through each cache: can the model find one 5-digit key in filler?

A prompt of exactly ``context`` tokens: a short instruction, filler sentences ("The
grass is green. The sky is blue. ..."), the key sentence ("The pass key is 12345.
Remember it. 12345 is the pass key.") at a depth of 0..100 % of the filler, more
filler, then the question ("What is the pass key? The pass key is"). The model
greedy-decodes :data:`ANSWER_TOKENS` tokens; a prompt scores 1 when the first run of
digits in the answer is exactly the key.

Filler: ``"fixed"`` repeats :data:`FILLER` for every key (the earlier stops' tables: a
cell's keys then differ only in their digits, and they pass or fail together);
``"varied"`` (the default) gives every prompt its own order of :data:`FILLER`'s five
sentences (each repetition a random permutation of them), so a cell's keys are
independent draws of the same text; ``"pool"`` draws every sentence from the 18 of
:data:`FILLER_POOL` instead (a harder haystack: SmolLM2-135M on the bf16 cache finds
under a third of the keys at 2048 tokens with it).

Protocol (benchmarks/studies/serving-smollm2.md): per batch of prompts (one (context, depth) cell,
``keys`` random keys), everything before the question is prefilled **once**, on exact
K/V with the bf16 cache's math, and each layer's resulting K/V are appended to every
cache under test (``caches.load_kv``: ``kvcache.append``, so a compressed cache
quantizes them as usual and keeps only its exact window). The question is then fed
through each cache (one step of all its tokens by default, or one token per step) and
the answer greedy-decoded through it, so the key is found by attention over the cache's
codes. Servers prefill on exact K/V too; with
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
# "varied" filler: neutral sentences without digits, drawn independently for every prompt.
FILLER_POOL = (
    " The grass is green.", " The sky is blue.", " The sun is yellow.", " Here we go.", " There and back again.",
    " The river is wide.", " The wind is calm.", " The road is long.", " The bread is warm.", " The stone is grey.",
    " Birds sing in the trees.", " The lamp is on.", " The door is open.", " The sea is deep.",
    " Snow falls in winter.", " The cat is asleep.", " The tea is hot.", " Leaves move in the wind.",
)
FILLERS = ("varied", "fixed", "pool")
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


def build_prompts(tok, context: int, depth: float, keys, fmt: str = "plain", filler: str = "fixed",
                  filler_seed=0) -> Prompts:
    """``len(keys)`` prompts of exactly ``context`` tokens, the key at ``depth`` (0..1)
    of the filler (snapped to a whole :data:`FILLER` group with ``filler="fixed"``, to
    the nearest sentence boundary otherwise).

    ``filler="varied"`` orders each prompt's sentences (a permutation of :data:`FILLER`'s
    five per repetition), ``"pool"`` draws them from :data:`FILLER_POOL`, both with
    ``np.random.default_rng([*filler_seed, i])`` (``i``: the prompt's index; an int
    seed counts as a 1-tuple), so the prompts do not share one filler.

    ``fmt="chat"`` wraps instruction, haystack and "What is the pass key?" in SmolLM2's
    chat template (user turn) and starts the assistant's turn with "The pass key is".

    Raises:
        ValueError: ``depth`` outside 0..1, an unknown format or filler, or a context
            too short to hold instruction, key and question.
    """
    if filler not in FILLERS:
        raise ValueError(f"`filler` must be one of {FILLERS}, got {filler!r}.")
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
    pool = [_ids(tok, s) for s in FILLER_POOL]
    five = pool[:5]
    assert sum(five, []) == unit, "FILLER_POOL starts with FILLER's sentences"
    seed = list(np.atleast_1d(filler_seed).astype(np.int64))
    rows = []
    for i, key in enumerate(keys):
        key_ids = _ids(tok, KEY_SENTENCE.format(key=key))
        n_fill = context - len(head_ids) - len(key_ids) - len(question)
        if n_fill < 0:
            raise ValueError(
                f"context={context} tokens cannot hold the instruction, key sentence and question "
                f"({context - n_fill} tokens): use a longer context."
            )
        if filler == "fixed":
            fill = (unit * (n_fill // len(unit) + 1))[:n_fill]
            at = min(int(round(depth * n_fill / len(unit))) * len(unit), n_fill)
        else:
            rng = np.random.default_rng([*seed, i])
            fill, bounds = [], [0]
            while len(fill) < n_fill:
                draw = ([pool[int(rng.integers(len(pool)))]] if filler == "pool"
                        else [five[j] for j in rng.permutation(len(five))])
                for sentence in draw:
                    fill += sentence
                    bounds.append(min(len(fill), n_fill))
            fill = fill[:n_fill]
            at = min(bounds, key=lambda b: abs(b - depth * n_fill))
        rows.append(head_ids + fill[:at] + key_ids + fill[at:])
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


def run_cell(params, runner: Runner, prompts: Prompts, specs: list[CacheSpec], *, strict_prefill: bool = False,
             question_steps: bool = False, capacity: int | None = None):
    """Answers (token ids ``[K, ANSWER_TOKENS]``) of every spec on one cell's prompts.

    The bf16 cache prefills the context; its K/V are loaded into every cache under
    test (or, with ``strict_prefill``, each compressed cache prefills the context
    itself); the question then goes through each (one step, or one token per step with
    ``question_steps``) and the answer one token per step. Returns ``{label: answers}``.

    ``capacity`` (default: what the prompts need) sets every cache's size: give cells of
    several contexts one capacity and each cache's decode steps compile once for all of
    them (attention walks only the filled blocks, so a larger capacity costs memory, not
    time).
    """
    cfg = runner.cfg
    k, t = prompts.context.shape
    need = t + len(prompts.question) + ANSWER_TOKENS
    if capacity is None:
        capacity = need
    elif capacity < need:
        raise ValueError(f"capacity={capacity} cannot hold these prompts and answers ({need} tokens).")
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
        out[spec.label] = answer(params, runner, cache, prompts.question, question_steps=question_steps)
    return out


def answer(params, runner: Runner, cache, question, *, question_steps: bool = False) -> np.ndarray:
    """Feed ``question`` (token ids, the same for every sequence) through ``cache``
    (donated), then greedy-decode; the answers' token ids ``[B, ANSWER_TOKENS]``.

    The question goes in one step of all its tokens (each attends over the cache and
    the question's tokens before it, as one token per step would; with an exact window
    of at least the question's length the two differ only in rounding), or one token
    per step with ``question_steps``.
    """
    b = int(cache.lengths.shape[-1])
    tok = None
    chunks = [[q] for q in question] if question_steps else [list(question)]
    for q in chunks:
        tok, cache = runner.decode(params, cache, jnp.tile(jnp.asarray(q, jnp.int32)[None], (b, 1)))
    out = [tok]
    for _ in range(ANSWER_TOKENS - 1):
        tok, cache = runner.decode(params, cache, tok)
        out.append(tok)
    return np.concatenate([np.asarray(a) for a in out], axis=1)
