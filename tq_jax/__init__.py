"""tq_jax: the TurboQuant KV-cache codec in JAX, and the TQ01 wire format.

The pipeline, one module each: :mod:`~tq_jax.codebook` (Lloyd–Max tables) →
:mod:`~tq_jax.rotation` (seeded Haar rotation) → :mod:`~tq_jax.packing` (bit
streams) → :mod:`~tq_jax.codec` (jit-compiled encode/decode) → :mod:`~tq_jax.wire`
(TQ01 layout and parser) → :mod:`~tq_jax.blob` (tensors ↔ blobs).

Pure JAX + numpy: importing tq_jax never imports torch. The LMCache bridge lives in
``tq_jax.bridge``.
"""

from tq_jax.blob import NormOverflowError as NormOverflowError
from tq_jax.blob import dump_into as dump_into
from tq_jax.blob import dumps as dumps
from tq_jax.blob import load_into as load_into
from tq_jax.blob import loads as loads
from tq_jax.blob import serialized_size as serialized_size
from tq_jax.codec import CodecConfig as CodecConfig
from tq_jax.codec import Encoded as Encoded
from tq_jax.codec import decode as decode
from tq_jax.codec import encode as encode
from tq_jax.options import PRESETS as PRESETS
from tq_jax.options import Options as Options
from tq_jax.wire import Header as Header
from tq_jax.wire import WireError as WireError
from tq_jax.wire import parse as parse
from tq_jax.wire import peek_header as peek_header

__version__ = "0.1.0"

__all__ = (
    "CodecConfig",
    "Encoded",
    "Header",
    "NormOverflowError",
    "Options",
    "PRESETS",
    "WireError",
    "decode",
    "dump_into",
    "dumps",
    "encode",
    "load_into",
    "loads",
    "parse",
    "peek_header",
    "serialized_size",
)
