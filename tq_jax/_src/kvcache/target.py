"""Which form of a Pallas kernel a program holds: decided by the platform the program is
lowered for, never by the host that traces it.

A Pallas kernel has two forms: the compiled kernel (Mosaic on a TPU, Triton on a GPU)
and the Pallas interpreter, which runs the same kernel body as XLA ops on a CPU (correct
and slow: for tests). Choosing between them with ``jax.default_backend()`` asks the host,
so a program exported on a CPU host for a TPU (``jax.export.export(...,
platforms=["tpu"])``, or a GPU host's ``jit(f).trace(...).lower(lowering_platforms=("tpu",))``)
would carry the interpreter instead of the kernel. :func:`kernel` stages out both forms
with :func:`jax.lax.platform_dependent`, and lowering keeps the one for the platform it
lowers for: the interpreter where the program executes on a CPU, the compiled kernel on
the platforms the kernel is written for. Lowering for any other platform fails (jax's
``platform_index ... not found for platform`` error). Export for one platform at a time:
lowered for several at once (``platforms=["cpu", "tpu"]``), jax 0.10 lowers every form for
every platform, and the compiled kernel does not lower for a CPU.

The rule, for every Pallas kernel of :mod:`tq_jax._src.kvcache` (and any new one)::

    out = target.kernel(lambda interpret: pl.pallas_call(..., interpret=interpret)(...),
                        platforms=("tpu",))

:func:`staged` is the same rule for a choice among several kernels (``attend``'s ``impl``:
the XLA loop on one platform, a Pallas kernel on another), built from :func:`interpret`.
Every form is traced (once per new shape, far cheaper than a compile); only the one
lowered is compiled. A kernel that needs another interpreter (``pltpu.InterpretParams``
for TPU semantics) is called with it directly, as the tests do; this module only
chooses between "interpreted on a CPU" and "compiled".
"""

from __future__ import annotations

from typing import Callable, Hashable, Mapping, Sequence, TypeVar

from jax import lax

__all__ = ["interpret", "kernel", "staged", "PLATFORMS", "INTERPRETED_ON", "TPU", "GPU"]

T = TypeVar("T")

PLATFORMS = ("cpu", "tpu", "cuda", "rocm")  # lax.platform_dependent's names
INTERPRETED_ON = "cpu"  # the one platform where a kernel runs in the Pallas interpreter
TPU = ("tpu",)  # Mosaic
GPU = ("cuda", "rocm")  # Triton


def interpret(platform: str) -> bool:
    """The rule: a Pallas kernel in a program that executes on ``platform`` runs in the
    Pallas interpreter iff ``platform`` is the CPU; elsewhere it is the compiled kernel."""
    return platform == INTERPRETED_ON


def kernel(build: Callable[[bool], T], *, platforms: Sequence[str]) -> T:
    """``build(True)`` (the interpreter) where the program executes on a CPU,
    ``build(False)`` (the compiled kernel) on each of ``platforms``.

    Args:
        build: ``build(interpret)`` calls the kernel with ``interpret=interpret`` and
            returns its outputs (a pytree; the same structure either way). Traced inside
            the caller's ``jit``, so it may close over the caller's arrays.
        platforms: where ``build(False)`` is lowered, e.g. :data:`TPU` or :data:`GPU`
            (not ``"cpu"``; empty: the program can only run on a CPU).

    Returns:
        The outputs of the form kept for the platform the program runs on.

    Raises:
        ValueError: ``platforms`` names the CPU.
    """
    if INTERPRETED_ON in platforms:
        raise ValueError(
            f"`platforms` must name non-CPU platforms, got {tuple(platforms)}: on the CPU a Pallas kernel always "
            f"runs in the Pallas interpreter (target.interpret)."
        )
    return staged({p: interpret(p) for p in (INTERPRETED_ON, *platforms)}, build)


def staged(forms: Mapping[str, Hashable], build: Callable[[Hashable], T]) -> T:
    """``build(forms[p])()`` where the program executes on platform ``p``: each distinct
    form is traced once (platforms sharing a form share its branch), and one form for
    every platform of :data:`PLATFORMS` needs no conditional at all. A platform missing
    from ``forms`` cannot be lowered for (jax raises ``platform_index ... not found``).

    Args:
        forms: platform name (``"cpu"``, ``"tpu"``, ``"cuda"``, ``"rocm"``) -> a hashable
            description of what runs there, e.g. ``("pallas_tpu", interpret("tpu"))``.
        build: form -> its outputs (a pytree; the same structure for every form).
    """
    by_form: dict = {}
    for p, form in forms.items():
        by_form.setdefault(form, []).append(p)
    if len(by_form) == 1 and set(PLATFORMS) <= set(forms):
        return build(next(iter(by_form)))
    branches = {}
    for form, platforms in by_form.items():
        branch = lambda form=form: build(form)  # noqa: E731  one callable per form: jax joins its platforms
        branches.update({p: branch for p in platforms})
    return lax.platform_dependent(**branches)
