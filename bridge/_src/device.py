"""Where the bridge's codec runs: the serde's ``device`` option mapped to a JAX device.

Kept apart from :mod:`~tq_jax.bridge._src.serde` so that the option table
(:mod:`~tq_jax.bridge._src.schema`) can check a device when LMCache builds the serde,
without importing the serde classes.
"""

from __future__ import annotations

import os
import re

# JAX would otherwise take 75 % of an accelerator's memory when its backend starts, next
# to the inference engine sharing it; this is the bridge's first module to import jax.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402

__all__ = ["DEVICE_CHOICES", "resolve_device"]

DEVICE_CHOICES = ("cpu", "gpu", "tpu", "auto")
"""Values of the ``device`` option; all but ``auto`` may carry an index (``gpu:1``)."""

NO_SUCH_DEVICE = (
    "device={spec!r} asks for JAX platform {platform!r}, but this JAX has no such backend "
    "({why}). Available: {available}. Install the matching jax plugin (e.g. "
    "jax[cuda12]) or set the serde's device to 'cpu'."
)
BAD_DEVICE_INDEX = (
    "device={spec!r}: JAX platform {platform!r} has {count} device(s), so the index must "
    "be in 0..{last}."
)
BAD_DEVICE_SPEC = (
    "device must be one of {choices} (optionally with an index, e.g. 'gpu:1'), got "
    "{spec!r}."
)


_DEVICE_RE = re.compile(r"^(cpu|gpu|tpu|auto)(?::(\d+))?$")


def resolve_device(spec: str = "cpu") -> jax.Device:
    """Maps the serde's ``device`` option to a JAX device, failing early and clearly.

    Args:
        spec: ``"cpu"``, ``"gpu"``, ``"tpu"`` or ``"auto"`` (JAX's default backend),
            optionally followed by ``":index"`` (``"gpu:1"``); case-insensitive.

    Returns:
        The selected ``jax.Device``.

    Raises:
        ValueError: the spec is malformed, the platform does not exist in this JAX
            installation, or the index is out of range.

    Examples:
        >>> resolve_device("cpu").platform
        'cpu'
    """
    m = _DEVICE_RE.match(spec.strip().lower()) if isinstance(spec, str) else None
    if m is None or (m.group(1) == "auto" and m.group(2) is not None):
        raise ValueError(BAD_DEVICE_SPEC.format(choices=DEVICE_CHOICES, spec=spec))
    platform, index = m.group(1), int(m.group(2) or 0)
    try:
        devices = jax.devices() if platform == "auto" else jax.devices(platform)
    except RuntimeError as e:
        available = sorted({d.platform for d in jax.devices()})
        raise ValueError(
            NO_SUCH_DEVICE.format(spec=spec, platform=platform, why=str(e).split("\n")[0], available=available)
        ) from None
    if index >= len(devices):
        raise ValueError(
            BAD_DEVICE_INDEX.format(spec=spec, platform=platform, count=len(devices), last=len(devices) - 1)
        )
    return devices[index]
