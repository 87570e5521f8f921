"""torch <-> JAX arrays through DLPack: zero-copy where possible, an explicit copy otherwise.

The LMCache serde hands us torch tensors (``MemoryObj.tensor``); the codec is JAX. This
module moves data across without copying when the memory allows it, and says when it
could not:

* ``to_jax_ex(t)`` returns ``(array, copied)``. ``copied`` is measured, not guessed: it
  is True exactly when the JAX array does not alias ``t``'s memory.
* On CPU, jaxlib aliases a DLPack buffer only if its address is a multiple of
  ``CPU_ALIGNMENT`` (64) bytes; otherwise ``jax.dlpack.from_dlpack`` silently copies
  (and raises "... is not aligned to 64 bytes" under ``copy=False``). We make that copy
  ourselves into a fresh aligned tensor, so the path taken is explicit. LMCache's L1
  objects are 4096-byte aligned by default (``--l1-align-bytes``), so they alias.
* Non-contiguous tensors are made contiguous first (jax would reject arbitrary strides
  and keep transposed layouts as non-default layouts).
* Pinned (page-locked) CPU tensors, as LMCache allocates on GPU hosts, advertise
  themselves as ``kDLCUDAHost``, which JAX routes to its CUDA backend. They are
  presented to JAX as plain CPU memory instead; if the exporter refuses, they are copied.

Aliasing caveat: a JAX array is immutable, a torch tensor is not. While a JAX array
made by ``to_jax`` (or a tensor made by ``to_torch``) is alive, the other side must not
write the shared memory, and JAX dispatch is asynchronous: block on results
(``block_until_ready``) before the source buffer is released or reused.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.dlpack
import ml_dtypes
import numpy as np
import torch
from torch.utils.dlpack import DLDeviceType

__all__ = [
    "CPU_ALIGNMENT",
    "SUPPORTED_DTYPES",
    "JaxConversion",
    "copy_into",
    "numpy_dtype",
    "numpy_view",
    "to_jax",
    "to_jax_ex",
    "to_torch",
]

CPU_ALIGNMENT = 64
"""Bytes. jaxlib's CPU client aliases external buffers only at this alignment."""

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
)

# numpy dtype for a zero-copy view of each supported torch dtype; bf16 goes through int16.
_NUMPY_DTYPES: dict[torch.dtype, np.dtype] = {
    torch.bfloat16: np.dtype(ml_dtypes.bfloat16),
    torch.float16: np.dtype(np.float16),
    torch.float32: np.dtype(np.float32),
    torch.uint8: np.dtype(np.uint8),
    torch.int8: np.dtype(np.int8),
    torch.int16: np.dtype(np.int16),
    torch.int32: np.dtype(np.int32),
}



def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy dtype of a zero-copy view of a torch tensor of ``dtype`` (bf16: ml_dtypes).

    Raises:
        KeyError: ``dtype`` is not one of :data:`SUPPORTED_DTYPES`.
    """
    return _NUMPY_DTYPES[dtype]


_SUPPORTED_NAMES = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
_DTYPE_ERROR = (
    "{what} has dtype {dtype}, which this bridge does not convert: supported dtypes "
    "are " + _SUPPORTED_NAMES + ". 64-bit types are excluded because JAX without "
    "jax_enable_x64 would silently narrow them. Cast the tensor first, e.g. "
    "t.to(torch.float32)."
)


class JaxConversion(NamedTuple):
    """Result of :func:`to_jax_ex`."""

    array: jax.Array
    copied: bool  # True when `array` does not alias the source tensor's memory


def _check_tensor(t: object, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}.")
    if t.dtype not in SUPPORTED_DTYPES:
        raise ValueError(_DTYPE_ERROR.format(what=what, dtype=t.dtype))
    return t


def _aligned_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of `t` whose data starts on a CPU_ALIGNMENT boundary."""
    nbytes = t.numel() * t.element_size()
    raw = torch.empty(nbytes + CPU_ALIGNMENT, dtype=torch.uint8, device=t.device)
    start = -raw.data_ptr() % CPU_ALIGNMENT
    out = raw[start : start + nbytes].view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


class _AsCPU:
    """Presents a pinned CPU tensor to JAX as ``kDLCPU`` memory instead of ``kDLCUDAHost``."""

    def __init__(self, t: torch.Tensor) -> None:
        self._t = t

    def __dlpack_device__(self) -> tuple[DLDeviceType, int]:
        return (DLDeviceType.kDLCPU, 0)

    def __dlpack__(self, stream: object = None, **kwargs: object) -> object:
        return self._t.__dlpack__(
            stream=stream, dl_device=(DLDeviceType.kDLCPU, 0), **kwargs
        )


def to_jax_ex(t: torch.Tensor) -> JaxConversion:
    """Converts a torch tensor to a JAX array, reporting whether memory was copied.

    Args:
        t: A CPU or CUDA tensor of one of ``SUPPORTED_DTYPES``, any shape and strides.

    Returns:
        ``JaxConversion(array, copied)``. ``array`` has ``t``'s shape and dtype and lives
        on the matching JAX device. ``copied`` is False exactly when ``array`` aliases
        ``t``'s memory (contiguous, and on CPU ``CPU_ALIGNMENT``-aligned).

    Raises:
        TypeError: ``t`` is not a torch.Tensor.
        ValueError: ``t``'s dtype is not supported.

    Examples:
        >>> import torch
        >>> arr, copied = to_jax_ex(torch.zeros(4, dtype=torch.bfloat16))
        >>> (arr.dtype.name, arr.shape, copied)
        ('bfloat16', (4,), False)
    """
    t = _check_tensor(t, "to_jax input").detach()
    copied = False
    if not t.is_contiguous():
        t = t.contiguous()
        copied = True
    if t.device.type == "cpu" and t.data_ptr() % CPU_ALIGNMENT:
        t = _aligned_copy(t)
        copied = True
    src: object = t
    if t.device.type == "cpu" and t.is_pinned():
        src = _AsCPU(t)
    try:
        array = jax.dlpack.from_dlpack(src)
    except (BufferError, RuntimeError, TypeError, ValueError):
        if src is t:
            raise
        t, copied = t.clone(), True  # the pinned export was refused: use pageable memory
        array = jax.dlpack.from_dlpack(t)
    if t.numel() and array.unsafe_buffer_pointer() != t.data_ptr():
        copied = True  # jax copied on its own
    return JaxConversion(array, copied)


def to_jax(t: torch.Tensor) -> jax.Array:
    """Converts a torch tensor to a JAX array, zero-copy where possible (see `to_jax_ex`)."""
    return to_jax_ex(t).array


def to_torch(a: jax.Array) -> torch.Tensor:
    """Converts a single-device JAX array to a torch tensor via DLPack.

    On CPU the tensor aliases the array's buffer: do not write to it (JAX assumes its
    arrays never change).

    Args:
        a: A JAX array on one device.

    Returns:
        A tensor with ``a``'s shape and dtype on the matching torch device.

    Raises:
        TypeError: ``a`` is not a jax.Array.
    """
    if not isinstance(a, jax.Array):
        raise TypeError(f"to_torch input must be a jax.Array, got {type(a).__name__}.")
    return torch.from_dlpack(a)


def copy_into(dst: torch.Tensor, a: jax.Array) -> None:
    """Writes a JAX array into an existing torch tensor, casting to ``dst.dtype``.

    The values are taken in C order, so ``a`` may have a different shape with the same
    number of elements (e.g. ``[..., H, D]`` into ``[..., H*D]``).

    Args:
        dst: Destination tensor, any device, dtype and strides. Written in place.
        a: Source array with ``dst.numel()`` elements.

    Raises:
        TypeError: ``dst`` is not a torch.Tensor or ``a`` is not a jax.Array.
        ValueError: the element counts differ.
    """
    if not isinstance(dst, torch.Tensor):
        raise TypeError(f"copy_into dst must be a torch.Tensor, got {type(dst).__name__}.")
    if not isinstance(a, jax.Array):
        raise TypeError(f"copy_into source must be a jax.Array, got {type(a).__name__}.")
    if a.size != dst.numel():
        raise ValueError(
            f"copy_into: source shape {tuple(a.shape)} has {a.size} elements but dst "
            f"shape {tuple(dst.shape)} has {dst.numel()}: the values are copied in C "
            "order, so both sides need the same element count. Check the shape the "
            "decoder produced against the destination MemoryObj's layout."
        )
    a.block_until_ready()
    with torch.no_grad():
        dst.copy_(to_torch(a).reshape(dst.shape))


def numpy_view(t: torch.Tensor) -> np.ndarray:
    """A writable numpy view of a CPU tensor's memory, without copying.

    bfloat16 tensors are viewed as ``ml_dtypes.bfloat16`` (through int16, which numpy
    knows); the other supported dtypes map directly (uint8 -> uint8, ...).

    Args:
        t: A CPU tensor of one of ``SUPPORTED_DTYPES``; any strides.

    Returns:
        An ndarray sharing ``t``'s memory: writes through it change ``t``.

    Raises:
        TypeError: ``t`` is not a torch.Tensor.
        ValueError: ``t`` is not on the CPU, or its dtype is not supported.
    """
    t = _check_tensor(t, "numpy_view input")
    if t.device.type != "cpu":
        raise ValueError(
            f"numpy_view needs a CPU tensor, got one on {t.device}: numpy can only "
            "address host memory. Copy it first with t.cpu() (that copy is not a view)."
        )
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(_NUMPY_DTYPES[torch.bfloat16])
    return t.numpy()
