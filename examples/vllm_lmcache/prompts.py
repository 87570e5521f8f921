"""Prompts whose greedy continuation does not sit at a numerical tie.

A free continuation of a 135M model is often a near-tie between two tokens: any change
in the KV (a different kernel order, a prefix loaded instead of computed) can flip it,
and from there the texts part. Copying is different: asked to repeat a passage it has
read, the model's next token is the passage's next token by a wide margin, read through
attention from the stored prefix, so the continuation tests exactly the KV that LMCache
loaded. :func:`copy_prompt` builds such a prompt from a passage.

:data:`PASSAGES` are short texts written for these tests (no outside data); the test
suite uses the first ones, the held-out check the others.
"""

from __future__ import annotations

__all__ = ["PASSAGES", "copy_prompt", "long_prompt"]

PASSAGES = (
    "The lighthouse keeper kept a careful log of every ship that passed the point. In the spring of that year "
    "he counted forty-one schooners, twelve steamers and a single iron barque that flew no flag at all. The "
    "barque anchored for three days in the lee of the island, and each evening a small boat rowed to the "
    "shore, filled two casks at the spring behind the chapel, and rowed back without a word to anyone. On the "
    "fourth morning the anchorage was empty, and the keeper wrote only: wind north-west, sea moderate, the "
    "stranger gone before dawn. Years later a letter arrived from a port on the other side of the ocean, "
    "thanking the people of the island for the water and enclosing a pressed flower that none of them could name.",

    "To make the bread, dissolve a spoonful of yeast in warm water and leave it until the surface foams. Mix "
    "the flour with a little salt in a wide bowl, pour in the yeast and enough water to bring the dough "
    "together, then knead it on a floured board for ten minutes until it is smooth and springs back when "
    "pressed. Cover the bowl with a cloth and let the dough rise in a warm corner for an hour, or until it has "
    "doubled. Knock it back, shape it into a round loaf, and set it on a tray dusted with semolina. After a "
    "second rise of half an hour, slash the top with a sharp knife and bake it in a hot oven for thirty-five "
    "minutes, until the crust is deep brown and the base sounds hollow when tapped.",

    "The committee met on Tuesday to review the proposal for the new footbridge across the river. The "
    "engineer presented three designs: a steel truss, a timber arch and a cable-stayed deck hung from a "
    "single mast. The truss was the cheapest to build but the most expensive to maintain, the arch was the "
    "most popular with residents but could not span the navigation channel, and the cable-stayed design met "
    "every requirement at a cost just inside the budget. After two hours of discussion the committee voted "
    "five to two for the cable-stayed bridge, asked for a revised schedule by the end of the month, and "
    "agreed to hold a public meeting in the library before any contract was signed.",

    "Migrating birds find their way by several senses at once. Young birds on their first journey rely on an "
    "inherited direction and a sense of how long to fly, while older birds also recognise coastlines, "
    "mountain ranges and rivers they have seen before. Many species read the position of the sun during the "
    "day and the rotation of the stars at night, and some can sense the direction and inclination of the "
    "earth's magnetic field. When clouds hide the sky, birds that have lost their bearings often land and "
    "wait, and a sudden change in the weather can bring thousands of them down on a single headland, where "
    "watchers count species that are rarely seen together anywhere else.",

    "The library's reading room opens at nine in the morning and closes at six in the evening, except on "
    "Thursdays, when it stays open until nine. Readers must show a valid card at the desk, leave bags and "
    "coats in the lockers by the stairs, and use pencils only when working with manuscripts or rare books. "
    "Requests for items from the basement store are collected every half hour and delivered to the reader's "
    "seat within forty minutes. Photographs without flash are allowed for personal study, but copies of whole "
    "volumes must be ordered through the reproduction service, which needs five working days and charges by "
    "the page. Questions about the catalogue can be put to the duty librarian at any time.",

    "A pendulum clock keeps time because a swinging weight returns to the same point at nearly the same "
    "interval, whatever the size of the swing, as long as the swing is small. The escapement lets the gear "
    "train advance one tooth at each swing and gives the pendulum a tiny push to replace the energy lost to "
    "friction and air. Temperature changes the length of the rod, and so the rate of the clock: a steel rod "
    "grows longer in summer and the clock loses time. Clockmakers answered this with rods of wood, which "
    "changes little, or with gridirons of brass and steel, whose different expansions cancel, and the best "
    "regulators kept time to within a second a month.",
)


def copy_prompt(passage: str, repeat_fraction: float = 0.5) -> tuple[str, str]:
    """``(prompt, expected)``: the passage, then the start of a word-for-word repeat; the
    rest of the passage is what a faithful copy generates next."""
    words = passage.split(" ")
    cut = max(1, int(len(words) * repeat_fraction))
    head, tail = " ".join(words[:cut]), " ".join(words[cut:])
    prompt = f"Read this passage carefully.\n\n{passage}\n\nNow write the same passage again, word for word.\n\n{head}"
    return prompt, " " + tail


def long_prompt(approx_tokens: int, seed: int = 0) -> str:
    """A prompt of about ``approx_tokens`` tokens (SmolLM2's tokenizer: ~1.3 tokens per
    word of these passages), built from the passages in a seeded order, ending in a
    question about it; distinct seeds give distinct prefixes (so distinct LMCache keys)."""
    import random

    rng = random.Random(seed)
    parts, words = [f"Document {seed}."], 0
    while words * 1.3 < approx_tokens - 40:
        p = rng.choice(PASSAGES)
        parts.append(p)
        words += len(p.split(" "))
    parts.append("Question: which of the passages above mentions a flower? Answer:")
    return "\n\n".join(parts)
