"""tq_jax: the TurboQuant KV-cache codec in JAX, and the TQ01 wire format.

The pipeline, one module each: :mod:`~tq_jax._src.codebook` (Lloyd–Max tables) →
:mod:`~tq_jax._src.rotation` (seeded Haar rotation) → :mod:`~tq_jax._src.packing` (bit
streams) → :mod:`~tq_jax._src.codec` (jit-compiled encode/decode) → :mod:`~tq_jax._src.wire`
(TQ01 layout and parser) → :mod:`~tq_jax._src.blob` (tensors ↔ blobs).

Pure JAX + numpy: importing tq_jax never imports torch. The LMCache bridge lives in
``tq_jax.bridge``.

The public names below load their module on first use (PEP 562), so ``import tq_jax``
itself imports neither numpy nor jax: the ``tq-jax`` command installs its Ctrl-C
handling before JAX's seconds-long import starts.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "CodecConfig": "tq_jax._src.codec",
    "Encoded": "tq_jax._src.codec",
    "Header": "tq_jax._src.wire",
    "NormOverflowError": "tq_jax._src.wire",
    "Options": "tq_jax._src.options",
    "PRESETS": "tq_jax._src.options",
    "WireError": "tq_jax._src.wire",
    "decode": "tq_jax._src.codec",
    "dump_into": "tq_jax._src.blob",
    "dumps": "tq_jax._src.blob",
    "encode": "tq_jax._src.codec",
    "encode_options": "tq_jax._src.options",
    "load_into": "tq_jax._src.blob",
    "loads": "tq_jax._src.blob",
    "parse": "tq_jax._src.wire",
    "peek_header": "tq_jax._src.wire",
    "serialized_size": "tq_jax._src.blob",
}

__all__ = tuple(sorted(_EXPORTS))

# Submodules reachable as attributes (``tq_jax._src.kvcache.init``), imported on first use.
# ``bridge`` needs the ``lmcache`` extra (torch): where it is not installed, reading
# ``tq_jax.bridge.register`` raises an ImportError that names the extra's install command.
_SUBMODULES = ("adapters", "batch", "bridge", "cli", "kvcache", "wire")


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
    elif name in _SUBMODULES or name == "_src":  # the private core: not in dir(), not public
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module 'tq_jax' has no attribute {name!r}")
    globals()[name] = value  # later reads skip this function
    return value


def __dir__():  # the public names and submodules: not the private core, not this module's helpers
    return sorted({"__version__", *_EXPORTS, *_SUBMODULES})


if TYPE_CHECKING:  # static analysers and IDEs see the eager imports
    from tq_jax._src.wire import NormOverflowError as NormOverflowError
    from tq_jax._src.blob import dump_into as dump_into
    from tq_jax._src.blob import dumps as dumps
    from tq_jax._src.blob import load_into as load_into
    from tq_jax._src.blob import loads as loads
    from tq_jax._src.blob import serialized_size as serialized_size
    from tq_jax._src.codec import CodecConfig as CodecConfig
    from tq_jax._src.codec import Encoded as Encoded
    from tq_jax._src.codec import decode as decode
    from tq_jax._src.codec import encode as encode
    from tq_jax._src.options import PRESETS as PRESETS
    from tq_jax._src.options import encode_options as encode_options
    from tq_jax._src.options import Options as Options
    from tq_jax._src.wire import Header as Header
    from tq_jax._src.wire import WireError as WireError
    from tq_jax._src.wire import parse as parse
    from tq_jax._src.wire import peek_header as peek_header
