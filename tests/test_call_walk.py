"""``loads`` and ``dumps`` are straight paths: ``loads`` parses once, plans from the parse and
runs one executor downward; ``dumps`` resolves its options, plans with one call to wire for the
header's layout, runs one executor downward and writes the sections to that layout.

The walk (:mod:`tools.call_walk`) is the sequence of tq_jax modules whose functions run,
a return counted only when the caller calls on; a climb is a step into a higher layer.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import tq_jax
from tools.call_walk import summary, walk


def test_loads_of_a_v1_blob_walks_straight_down():
    x = np.random.default_rng(0).standard_normal((2, 2, 16, 2, 64)).astype(jnp.bfloat16)
    blob = tq_jax.dumps(x, bits=4)
    tq_jax.loads(blob)  # warm: compiling is not the walk
    seq = walk(tq_jax.loads, blob)
    s = summary(seq)
    assert s["stops"] <= 12 and s["modules"] <= 5 and s["climbs"] <= 3, s
    assert [m for m in seq if m != "tq_jax._src.blob"] == ["tq_jax._src.wire", "tq_jax._src.plan", "tq_jax._src.blocks", "tq_jax._src.codec"], s["walk"]
    out = np.empty_like(x)
    tq_jax.load_into(blob, out)
    assert summary(walk(tq_jax.load_into, blob, out))["walk"] == s["walk"]


def test_dumps_of_a_v1_blob_walks_straight_down():
    x = np.random.default_rng(0).standard_normal((2, 2, 16, 2, 64)).astype(jnp.bfloat16)
    tq_jax.dumps(x, bits=4)  # warm: compiling is not the walk
    seq = walk(tq_jax.dumps, x, bits=4)
    s = summary(seq)
    # options (the settings front door) and the writer after the encoder are two stops loads has no need of
    assert s["stops"] <= 12 and s["modules"] <= 6 and s["climbs"] <= 4, s
    assert [m for m in seq if m != "tq_jax._src.blob"] == [
        "tq_jax._src.options", "tq_jax._src.plan", "tq_jax._src.wire", "tq_jax._src.blocks", "tq_jax._src.codec", "tq_jax._src.wire"], s["walk"]


def test_the_walk_counts_returns_that_call_on_and_climbs():
    assert summary(["tq_jax._src.blob", "tq_jax._src.wire", "tq_jax._src.blob", "tq_jax._src.blocks", "tq_jax._src.codec", "tq_jax._src.blob"]) == {
        "stops": 6, "modules": 4, "climbs": 2, "walk": "blob → wire → blob → blocks → codec → blob"}
