"""The exceptions of mpigc: one base, each subclass also a matching builtin;
and ``warn_caller``, which points a warning at the user's line."""

import os
import sys
import warnings

__all__ = [
    "MpigcError", "ConfigError", "InvalidBufferError", "DTypeError", "MismatchError",
    "NonFiniteError", "StateError",
]


class MpigcError(Exception):
    """Base class of every error mpigc raises on purpose."""


class ConfigError(MpigcError, ValueError):
    """A compressor id or parameter is invalid."""


class InvalidBufferError(MpigcError, ValueError):
    """A buffer cannot be used: empty, read-only, not contiguous, wrong size."""


class DTypeError(MpigcError, TypeError):
    """The buffer's type is not supported (or is not an array at all)."""


class MismatchError(MpigcError, ValueError):
    """Ranks called a collective with different sizes, dtypes or settings."""


class NonFiniteError(MpigcError, FloatingPointError):
    """A gradient held NaN or Inf; the call changed no residual and no buffer."""


class StateError(MpigcError, RuntimeError):
    """Error-feedback state does not fit the call (size, layout, key in use)."""


# Exception classes by wire code. A collective raises on every rank the class
# of error that the failing rank raised (codes travel in the agreement step),
# so ``except ValueError`` catches the same thing everywhere.
CODES = {
    0: None,
    1: ConfigError,
    2: InvalidBufferError,
    3: DTypeError,
    4: StateError,
    5: NonFiniteError,
    6: MpigcError,
}


def code_of(exc):
    """The wire code of an exception (6 for anything unexpected)."""
    for code, cls in CODES.items():
        if cls is not None and code != 6 and type(exc) is cls:
            return code
    return 6


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def warn_caller(message, category=RuntimeWarning):
    """``warnings.warn`` attributed to the first frame outside the mpigc
    package, i.e. the user's call, however deep inside mpigc it is raised."""
    level, f = 2, sys._getframe(1)
    while f is not None and os.path.abspath(f.f_code.co_filename).startswith(_PACKAGE):
        f = f.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level)
