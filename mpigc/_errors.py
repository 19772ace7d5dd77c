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


# The engine's error classes by wire code (code i + 1 is ENGINE_CLASSES[i];
# 0: no error). A collective raises on every rank the class of error that the
# lowest failing rank raised (codes travel in the agreement rows), so
# ``except ValueError`` catches the same thing everywhere. The last class is
# also the code of any exception not in the table.
ENGINE_CLASSES = (ConfigError, InvalidBufferError, DTypeError, StateError, NonFiniteError,
                  MpigcError)
CODES = {0: None, **{i + 1: c for i, c in enumerate(ENGINE_CLASSES)}}


def code_of(exc, classes=ENGINE_CLASSES):
    """The wire code of exception ``exc`` in the table ``classes`` (a tuple of
    exception classes, the same on every rank; its last is the class of
    anything else): 1 + the index of its class (the exact class), else
    ``len(classes)``; 0 for None."""
    if exc is None:
        return 0
    t = type(exc)
    for i, cls in enumerate(classes):
        if t is cls:
            return i + 1
    return len(classes)


def class_of(code, classes=ENGINE_CLASSES):
    """The exception class of wire code ``code`` (> 0) in the table ``classes``
    (see :func:`code_of`); a code outside it is the last class's."""
    code = int(code)
    return classes[code - 1] if 1 <= code <= len(classes) else classes[-1]


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def warn_caller(message, category=RuntimeWarning):
    """``warnings.warn`` attributed to the first frame outside the mpigc
    package, i.e. the user's call, however deep inside mpigc it is raised."""
    level, f = 2, sys._getframe(1)
    while f is not None and os.path.abspath(f.f_code.co_filename).startswith(_PACKAGE):
        f = f.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level)
