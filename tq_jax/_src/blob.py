"""Tensors ↔ TQ01 blobs: :func:`dumps`, :func:`dump_into`, :func:`serialized_size`,
:func:`loads`, :func:`load_into`.

Every call first resolves its request once into a :class:`~tq_jax._src.plan.Plan`
(:func:`tq_jax._src.plan.for_tensor` from shape, dtype and options; :func:`tq_jax._src.plan.for_header`
from a parsed header); the executors read only the plan.

The host pipeline: a tensor's vectors run block by block through the codec
(:mod:`tq_jax._src.blocks` cuts, pads to bucket sizes and dispatches them) and the codec's
output is written through :mod:`tq_jax._src.wire`'s write API. Data for an accelerator — a
``jax.Array`` living there, a host tensor with ``device=`` one, ``loads(device=)`` or
``load_into(device=)`` of one — takes the device path instead: one compiled program writes
the whole blob in device memory (:mod:`tq_jax._src.program`), or reads it there, and the
per-block dispatch of :mod:`tq_jax._src.resident` runs what the program does not. Which
executor runs a call is chosen in one place (:func:`_executor`) from the device, unless
the call's ``executor=`` pins one. The bytes do not depend on the path.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from tq_jax._src import blocks as _blocks
from tq_jax._src import codec as _codec
from tq_jax._src import norms as _norms
from tq_jax._src import options as _options
from tq_jax._src import plan as _plan
from tq_jax._src import program as _program
from tq_jax._src import resident as _resident
from tq_jax._src import wire as _wire
from tq_jax._src.blocks import DEFAULT_BLOCK_COORDS, bucket  # re-exported: part of blob's API
from tq_jax._src.resident import CACHES, cache_stats, clear_caches  # noqa: F401 (blob.CACHES: its compiled programs)
from tq_jax._src.wire import NORM_OVERFLOW, NormOverflowError  # the format's limit; re-exported here

__all__ = [
    "dumps",
    "dump_into",
    "loads",
    "load_into",
    "NormOverflowError",
    "bucket",
    "serialized_size",
    "DEFAULT_BLOCK_COORDS",
    "EXECUTORS",
]

EXECUTORS = ("host", "program", "blocks")  # the values of the calls' ``executor=``; None chooses



def compiled_programs() -> int:
    """Block programs the driver has dispatched so far (encode + decode), for tests
    and long-running checks: :func:`tq_jax._src.codec.compiled_programs`."""
    return _codec.compiled_programs()


# --------------------------------------------------------------------------- helpers


def _host_view(x) -> np.ndarray:
    """A host numpy view (no copy for numpy input or CPU jax arrays)."""
    if isinstance(x, np.ndarray):
        return x
    if isinstance(x, jax.Array):
        return np.asarray(x)
    if hasattr(x, "__array__") or isinstance(x, (list, tuple)):
        return np.asarray(x)
    raise TypeError(f"expected a numpy or jax array, got {type(x).__name__}")


def _check_tensor(x: np.ndarray) -> str:
    dtype = np.dtype(x.dtype).name
    if dtype not in _wire.DTYPES:
        raise ValueError(
            f"can only encode bfloat16, float16 or float32 tensors, got {x.dtype}: cast it "
            f"first (TQ01 records one of those three as the tensor's original dtype)."
        )
    if x.ndim < 1 or x.shape[-1] < 2:
        raise ValueError(
            f"the last axis must be head_dim >= 2, got shape {x.shape}: reshape so each "
            f"vector to quantize is a row along the last axis."
        )
    if x.ndim > _wire.MAX_NDIM or x.shape[-1] > _wire.MAX_DIM:
        raise ValueError(f"shape {x.shape} exceeds the TQ01 limits (ndim <= {_wire.MAX_NDIM}, head_dim <= {_wire.MAX_DIM}).")
    return dtype


# --------------------------------------------------------------------------- encode


def _norm_overflow(norms: list) -> tuple[int, int, float]:
    count, total, largest = 0, 0, 0.0
    for n in norms:
        big = np.isfinite(n) & (n >= 65520.0)  # rounds to inf in float16
        count += int(big.sum())
        total += n.size
        if big.any():
            largest = max(largest, float(n[big].max()))
    return count, total, largest


def _single_device(x, device):
    """The one device a ``jax.Array`` input is encoded on (``device``, else the one it
    lives on), or None: numpy input, a sharded array, a device sequence."""
    if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
        return None
    if device is not None and not isinstance(device, jax.Device):
        return None
    try:
        held = x.devices()
    except Exception:  # a deleted or otherwise unplaced array: the host path says why
        return None
    if len(held) != 1:
        return None
    return device if device is not None else next(iter(held))


# A host tensor bigger than this that is to be encoded on an accelerator goes there
# block by block (the host block driver) rather than whole, so that the device never
# holds more than a few blocks of it (the program needs the input, the blob and one
# block's temporaries in device memory at once).
HOST_INPUT_LIMIT = 1 << 30


def takes(device, executor: str | None = None) -> bool:
    """Whether data for ``device`` (a ``jax.Device``) take the device path: with
    ``executor`` None, accelerators do and CPU devices do not (on the CPU backend the
    host block driver already reads and writes device memory in place,
    benchmarks/results/device_path_cpu.md); ``"program"`` or ``"blocks"`` send every
    device there, CPU devices included (tests, benchmarks); ``"host"`` none."""
    if executor is None:
        return device.platform != "cpu"
    return executor != "host"


def _check_executor(executor) -> str | None:
    if executor is not None and executor not in EXECUTORS:
        raise ValueError(
            f"executor must be None (chosen by the device) or one of {', '.join(map(repr, EXECUTORS))}, got "
            f"{executor!r}: 'host' is the host block driver, 'program' one compiled program per blob on the "
            f"device, 'blocks' the per-block device path."
        )
    return executor


def _device_of(device):
    """``device`` as one ``jax.Device`` (None: JAX's default, ``jax.default_device``
    contexts included), or None for a sequence of devices (the host driver's)."""
    if device is None:
        d = jax.config.jax_default_device
        return jax.devices(d)[0] if isinstance(d, str) else d if d is not None else jax.devices()[0]
    return device if isinstance(device, jax.Device) else None


def _executor(plan, device, executor: str | None) -> tuple[str, object]:
    """The one choice of what runs a plan on ``device`` (a ``jax.Device`` or None):
    ``("host", None)``, the host block driver (:mod:`tq_jax._src.blocks`); ``("program", d)``,
    one compiled program on ``d`` (:mod:`tq_jax._src.program`); or ``("blocks", d)``, the
    per-block device path (:mod:`tq_jax._src.resident`: QJL blobs, blobs of 2 GiB or more, or
    ``executor="blocks"``). ``executor`` is the call's (:data:`EXECUTORS`, None: by device)."""
    if device is None or not takes(device, executor):
        return "host", None
    if executor != "blocks" and _program.fits(plan):
        return "program", device
    return "blocks", device


def _program_device(x, device, executor):
    """The device on which ``x`` is encoded (:func:`_executor` then says how), or None
    for the host block driver: a ``jax.Array`` on an accelerator (or ``device=`` one),
    or host data of at most :data:`HOST_INPUT_LIMIT` bytes with ``device=`` an
    accelerator (or none given and JAX's default one is), for the program executor."""
    dev = _single_device(x, device)
    if dev is None:
        if isinstance(x, jax.Array) or not (device is None or isinstance(device, jax.Device)):
            return None  # sharded or traced input, or a sequence of devices: blocks in turn
        if executor == "blocks" or x.nbytes > HOST_INPUT_LIMIT:
            return None
        dev = _device_of(device)
    return dev if takes(dev, executor) else None


def _encode(x, options: _options.Options, block_vectors, device, executor):
    """Encode ``x`` under ``options``: (the plan written, its bytes as ``wire.pieces``
    or one host uint8 array)."""
    if not isinstance(x, (np.ndarray, jax.Array)):
        x = _host_view(x)
    dev = _program_device(x, device, _check_executor(executor))
    arr = x if dev is not None and isinstance(x, jax.Array) else np.asarray(_host_view(x), order="C")  # 0-d stays 0-d
    plan = _plan.for_tensor(tuple(arr.shape), _check_tensor(arr), options)  # the one read of the options
    how, dev = _executor(plan, dev, executor)
    if how == "program":
        return _program.encode(plan, arr, block_vectors, dev)
    if how == "blocks":
        encoded, raw = _resident.encode(arr, plan, block_vectors, dev)
    else:
        encoded, raw = _blocks.encode(arr, plan, block_vectors, device)
    if plan.overflow != "keep":
        count, total, largest = _norm_overflow([n for _, n in encoded])
        if count and plan.overflow == "raise":
            raise NormOverflowError(NORM_OVERFLOW.format(count=count, total=total, largest=largest))
        if count:
            plan = plan.widened
    norm_sections = []
    for (_, norms), s in zip(encoded, plan.segments):
        if plan.norm_bits:
            ranges, codes = _norms.encode_log_norms(norms, s.norm_groups, plan.norm_bits)
            norm_sections.append(_wire.NormCodes(ranges, codes, plan.norm_bits, s.n_vectors))
        else:
            norm_sections.append(norms.astype(np.float32 if plan.norm_dtype == "float32" else np.float16))
    sections = _wire.Sections([chunks for chunks, _ in encoded], norm_sections, tuple(raw))
    return plan, _wire.pieces(plan.layout, sections)  # checked when planned; the CRC32 trailer when asked for


def _resolve(bits, options, kwargs: dict) -> _options.Options:
    """The one :class:`~tq_jax.Options` of a call (:func:`tq_jax._src.options.encode_options`):
    ``options=`` (a preset name or an Options) with ``bits`` and keyword fields on top."""
    if isinstance(bits, (_options.Options, str)):
        said = f"{bits!r}" if isinstance(bits, str) else "tq_jax.Options(...)"
        raise ValueError(
            f"`bits` is a width (1..8), got {said}: settings go in `options=`, e.g. "
            f"tq_jax.dumps(x, options={said}), with keywords such as bits= or seed= on top."
        )
    return _options.encode_options(options, bits, **kwargs)


def serialized_size(shape, dtype, bits=None, *, options=None, **kwargs) -> int:
    """Exact blob length for a tensor of ``shape``/``dtype`` under ``bits``/``options``.

    Computed from the layout alone. With ``norm_dtype="auto"`` (the default) this is
    the length when every norm fits float16; an overflowing tensor is written with
    float32 norms instead (2 more bytes per vector). Pin ``norm_dtype`` when the size
    must be known in advance (the LMCache bridge does).

    Examples:
        >>> serialized_size((2, 32, 256, 8, 128), "bfloat16", 4)
        8650831
        >>> serialized_size((2, 32, 256, 8, 128), "bfloat16", options="turbo-4")
        8487536
    """
    return _resolve(bits, options, kwargs).serialized_size(shape, dtype)


def dumps(x, bits=None, *, options=None, block_vectors: int | None = None, device=None, executor=None,
          **kwargs) -> bytes:
    """Encode a tensor into a TQ01 blob.

    With the reference's settings (one ``bits`` of 2, 3, 4, 6 or 8, Haar rotation,
    norms that fit float16) the blob is version 1, byte-compatible with
    ``lmcache-turbo-quant-serde``; any other setting writes version 2.

    Args:
        x: numpy or jax array ``(..., head_dim)`` of bfloat16, float16 or float32. With
            per-group bits or raw layers: ``[2 (K, V) or 1, layers, ..., head_dim]``.
        bits: bits per coordinate for every vector (keys and values), on top of
            ``options``.
        options: the starting settings: a preset name of :data:`tq_jax.PRESETS`
            (``"turbo-4"``) or a :class:`~tq_jax.Options`; ``bits`` and keyword fields
            override it (:func:`tq_jax._src.options.encode_options`, the front door every
            API shares).
        block_vectors: vectors per kernel call (default: ~2**19 coordinates on CPU, 2**20 elsewhere).
        device: JAX device to compute on (default: where a single-device
            ``jax.Array`` lives, else JAX's default device), or a sequence of
            devices that take blocks in turn; the bytes do not depend on where or
            on how many devices the work runs. A ``jax.Array`` on an accelerator
            is cut into blocks and encoded there; only the packed result comes to
            the host.
        executor: what runs the work: None (the default) chooses by device: the host
            block driver on CPU devices, on an accelerator one compiled program per
            blob (the per-block device path for QJL blobs and blobs of 2 GiB or more).
            ``"host"``, ``"program"`` or ``"blocks"`` pins one; ``"program"`` and
            ``"blocks"`` then run the device path on a CPU device too. The bytes are the same.
        **kwargs: :class:`~tq_jax.Options` fields: ``seed`` (42), ``key_bits``,
            ``value_bits``, ``skip_first_layers``, ``skip_last_layers``, ``rotation``
            ("haar"), ``norm_dtype`` ("auto"), ``norm_correction``, ``checksum``, ``norm_bits`` (0).

    Returns:
        The blob.

    Raises:
        ValueError: unsupported bits/dtype/shape/option; an unknown keyword or preset
            (the message names the closest valid name and the presets).
        NormOverflowError: ``norm_dtype="float16"`` and a finite norm exceeds 65504.
    """
    plan, pieces = _encode(x, _resolve(bits, options, kwargs), block_vectors, device, executor)
    out = pieces.tobytes() if isinstance(pieces, np.ndarray) else b"".join(pieces)  # one allocation, no extra copy
    if len(out) != plan.nbytes:
        raise AssertionError(f"tq_jax wrote {len(out)} bytes, its header implies {plan.nbytes}")
    return out


def dump_into(x, out, bits=None, *, options=None, block_vectors: int | None = None, device=None, executor=None,
              **kwargs) -> int:
    """Like :func:`dumps`, but write into ``out`` (a writable bytes-like/uint8 buffer).

    Nothing is written unless the whole blob fits and encoding succeeded.

    Returns:
        The number of bytes written.

    Raises:
        ValueError: ``out`` is too small (the message gives the size needed), or as
            :func:`dumps`.
    """
    mv = memoryview(out.reshape(-1)) if isinstance(out, np.ndarray) else memoryview(out).cast("B")
    if mv.readonly:
        raise ValueError("dump_into needs a writable buffer, got a read-only one")
    opts = _resolve(bits, options, kwargs)
    arr = x if isinstance(x, (np.ndarray, jax.Array)) else _host_view(x)  # a jax.Array stays put
    need = opts.serialized_size(arr.shape, _check_tensor(arr))
    if len(mv) < need:
        raise ValueError(
            f"output buffer holds {len(mv)} bytes but this blob needs {need}: allocate "
            f"tq_jax.serialized_size(shape, dtype, ...) bytes."
        )
    plan, pieces = _encode(arr, opts, block_vectors, device, executor)
    if plan.nbytes > len(mv):  # "auto" norms grew to float32
        raise ValueError(
            f"output buffer holds {len(mv)} bytes but this blob needs {plan.nbytes}: some "
            f"norms overflow float16, so they are stored as float32. Pin norm_dtype to size buffers in advance."
        )
    return _wire.write_into([pieces] if isinstance(pieces, np.ndarray) else pieces, mv)


# --------------------------------------------------------------------------- decode


def _blob_bytes(blob) -> np.ndarray:
    """A parsed blob's bytes as a 1-D uint8 array (a view when it already is one)."""
    if isinstance(blob, np.ndarray):
        return np.ascontiguousarray(blob).reshape(-1)
    return np.frombuffer(memoryview(blob).cast("B"), np.uint8)


def _check_out_dtype(dtype):
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        dt = None
    if dt is None or not jnp.issubdtype(dt, jnp.floating):
        raise ValueError(f"dtype must be a floating dtype (e.g. jnp.bfloat16, jnp.float32), got {dtype!r}")
    return dt


def loads(blob, *, dtype=None, block_vectors: int | None = None, device=None, executor=None) -> jax.Array:
    """Decode a TQ01 blob (version 1 or 2; every blob the reference writes, QJL included).

    Args:
        blob: bytes-like object or 1-D uint8 numpy array.
        dtype: output dtype; default: the dtype recorded in the blob.
        block_vectors: vectors per kernel call (default: ~2**19 coordinates on CPU, 2**20 elsewhere).
        device: JAX device for the computation and the result (default: JAX's
            default device), or a sequence of devices that take blocks in turn
            (the result lands on the first). On an accelerator the blob's sections
            go to the device and the tensor is decoded and assembled there, with
            no host output buffer; on the CPU backend the result is the aligned
            host buffer the blocks were decoded into, adopted without a copy.
        executor: what runs the work: None (the default) chooses by device: the host
            block driver on CPU devices, on an accelerator one compiled program per
            blob (the per-block device path for QJL blobs and blobs of 2 GiB or more).
            ``"host"``, ``"program"`` or ``"blocks"`` pins one; ``"program"`` and
            ``"blocks"`` then run the device path on a CPU device too. The bytes are the same.

    Returns:
        ``jax.Array`` of the blob's shape.

    Raises:
        WireError: the blob is malformed or corrupt (one subclass per cause).
    """
    p = _wire.parse(blob)  # the one parse: header, sections, the header's own bytes
    plan = _plan.for_parsed(p)
    dt = _check_out_dtype(p.header.dtype if dtype is None else dtype)
    how, target = _executor(plan, _device_of(device), _check_executor(executor))
    if how == "program":  # decoded where it will live
        return _program.decode(plan, p, _blob_bytes(blob), dt, block_vectors, target)
    if how == "blocks":
        return _resident.decode(p, plan, dt, block_vectors, target)
    return _blocks.decode(p, plan, dt, block_vectors, device)


def load_into(blob, out: np.ndarray, *, block_vectors: int | None = None, device=None,
              executor=None) -> _wire.Header:
    """Decode a TQ01 blob into an existing writable numpy array of any float dtype.

    ``out`` must have the blob's number of elements and its last axis must be a
    multiple of the blob's head_dim (so ``[..., H*D]`` receives ``[..., H, D]``).
    ``block_vectors``, ``device`` and ``executor`` as in :func:`loads`; a device path
    other than the compiled program decodes on the host, into ``out``.

    Returns:
        The blob's :class:`~tq_jax._src.wire.Header`.
    """
    p = _wire.parse(blob)
    h = p.header
    n_el = math.prod(h.shape)
    if not isinstance(out, np.ndarray) or not out.flags.writeable or not out.flags.c_contiguous:
        raise ValueError("load_into needs a writable C-contiguous numpy array")
    _check_out_dtype(out.dtype)
    if out.size != n_el or (out.ndim and out.shape[-1] % h.dim):
        raise ValueError(
            f"blob holds shape {h.shape} ({n_el} values) but the output has shape {out.shape}: "
            f"the destination must have the same number of values and a last axis that is a "
            f"multiple of head_dim={h.dim}."
        )
    plan = _plan.for_parsed(p)
    how, target = _executor(plan, _device_of(device), _check_executor(executor))
    if how == "program":  # one transfer in, one program, one transfer back into `out`
        arr = _program.decode(plan, p, _blob_bytes(blob), out.dtype, block_vectors, target)
        out.reshape(plan.shape)[...] = np.asarray(jax.device_get(arr))
        return h
    _blocks.decode_into(p, plan, out, block_vectors, device)
    return h
