"""The walk a call takes through tq_jax's modules: stops, modules and climbs.

A *walk* is the sequence of tq_jax modules whose functions run during one call, in time
order: each call's module, and the caller's again when it calls on after a return (a
return that only passes a result up is not a stop); frames of other packages (jax,
numpy) are transparent; only module-level functions count, each the first time it runs;
consecutive repeats merged, and the walk ends back where it started. *Stops* is its length, *modules* the distinct modules in it,
and a *climb* is a step into a module of a higher layer than the one it leaves
(docs/architecture.md's layer table; a lower layer calling up, or a return to a caller
that then goes down again, both count). A straight path goes down once and comes back
once.

    python -m tools.call_walk            # loads and dumps of a W1-shaped v1 blob and a turbo-4 one
"""

from __future__ import annotations

import sys

# Layers (docs/architecture.md); the modules beside the layers sit with the layer they serve.
LAYER = {
    "tq_jax._src.codebook": 1, "tq_jax._src.rotation": 2, "tq_jax._src.packing": 3, "tq_jax._src._kernels": 3.5, "tq_jax._src.norms": 3.5, "tq_jax._src.trellis": 3.5,
    "tq_jax._src.codec": 4, "tq_jax._src.frames": 5, "tq_jax._src.wire": 5, "tq_jax._src.options": 5.5,
    "tq_jax._src.blocks": 6, "tq_jax._src.plan": 6, "tq_jax._src.program": 6, "tq_jax._src.resident": 6, "tq_jax._src._lru": 6,
    "tq_jax._src.blob": 7, "tq_jax": 8,
}


def walk(fn, *args, **kwargs) -> list[str]:
    """The modules ``fn(*args, **kwargs)`` runs through, in order (repeats merged).

    Only module-level functions count (methods, properties and comprehensions are
    transparent), and each function only the first time it is entered: a loop over
    blocks visits its callees once, as a reader of the code follows them.
    """
    seq: list[str] = []
    stack: list[str | None] = []
    seen: set = set()

    def at(mod):
        if mod is not None and (not seq or seq[-1] != mod):
            seq.append(mod)

    def prof(frame, event, arg):
        if event not in ("call", "return"):
            return
        code = frame.f_code
        name = frame.f_globals.get("__name__", "")
        ours = (name == "tq_jax" or name.startswith("tq_jax.")) and "." not in code.co_qualname and not code.co_name.startswith("<")
        if event == "return":
            if stack:
                stack.pop()
            return
        if ours and code in seen:
            ours = False  # a second visit: the reader has already followed it
        if ours:
            seen.add(code)
            at(next((m for m in reversed(stack) if m is not None), None))  # the caller goes on: back to it
            at(name)
        stack.append(name if ours else None)

    sys.setprofile(prof)
    try:
        fn(*args, **kwargs)
    finally:
        sys.setprofile(None)
    if seq:
        at(seq[0])  # the call returns to where it started
    return seq


def summary(seq: list[str]) -> dict:
    climbs = sum(1 for a, b in zip(seq, seq[1:]) if LAYER.get(b, 0) > LAYER.get(a, 0))
    return {"stops": len(seq), "modules": len(set(seq)), "climbs": climbs,
            "walk": " → ".join(m.removeprefix("tq_jax._src.").removeprefix("tq_jax.") for m in seq)}


def main() -> None:
    import jax.numpy as jnp
    import numpy as np

    import tq_jax

    x = np.random.default_rng(0).standard_normal((2, 4, 256, 8, 128)).astype(jnp.bfloat16)
    for name, kw in (("v1 4-bit", dict(bits=4)), ("turbo-4", tq_jax.PRESETS["turbo-4"])):
        blob = tq_jax.dumps(x, **kw)
        tq_jax.loads(blob)  # warm: compiled programs and tables are not part of the walk
        for what, seq in (("loads", walk(tq_jax.loads, blob)), ("dumps", walk(tq_jax.dumps, x, **kw))):
            s = summary(seq)
            print(f"{what} {name}: {s['stops']} stops, {s['modules']} modules, {s['climbs']} climbs\n  {s['walk']}")


if __name__ == "__main__":
    main()
