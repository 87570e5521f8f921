"""The TQ01 wire format, as a reader of untrusted bytes needs it.

:func:`parse` validates a blob and returns its :class:`Header` and zero-copy section
views (:class:`Parsed`); :func:`peek_header` reads the header alone; :func:`blob_nbytes`
is a blob's exact length from its header. Every refusal is a :class:`WireError` (a
``ValueError``), one subclass per cause. The format: docs/TQ01.md (version 1, the
reference's) and docs/TQ01-v2.md. Writing goes through :func:`tq_jax.dumps`.
"""

from tq_jax._src.wire import (
    BadFieldError,
    BadMagicError,
    ChecksumError,
    Header,
    KeyTrailerError,
    LimitError,
    Parsed,
    SectionLengthError,
    TrailingBytesError,
    TruncatedError,
    UnsupportedVersionError,
    WireError,
    blob_nbytes,
    parse,
    peek_header,
)

__all__ = [
    "parse",
    "peek_header",
    "blob_nbytes",
    "Header",
    "Parsed",
    "WireError",
    "TruncatedError",
    "BadMagicError",
    "UnsupportedVersionError",
    "BadFieldError",
    "LimitError",
    "SectionLengthError",
    "TrailingBytesError",
    "KeyTrailerError",
    "ChecksumError",
]
