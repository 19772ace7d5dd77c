"""The warning that 2bit's absolute threshold lets almost nothing through,
one implementation for :func:`mpigc.allreduce` (per key) and the torch layer
(per ``GradientSync``/``CommHookState``).

MXNet's absolute mode (``threshold=t``) sends ``+-t`` for values beyond
``+-t`` and keeps the rest in the residuals: on gradients far below ``t``
almost nothing is sent and the model barely trains, silently. A watch counts
the non-zero elements of the results of the first calls and warns once when
fewer than :attr:`ThresholdWatch.FRACTION` of them were non-zero.
"""
import warnings

import numpy as np

from ._backend import host_view
from .compressors import get_compressor

__all__ = ["ThresholdWatch", "observe_allreduce"]


def watched(compressor):
    """Whether ``compressor`` is 2bit in the absolute mode (the one a watch
    is for)."""
    cfg = compressor.get_config()
    return cfg.get("id") == "2bit" and cfg.get("threshold") is not None


class ThresholdWatch:
    """Warns (``UserWarning``, once) when 2bit's absolute threshold lets
    almost nothing through: over the :attr:`STEPS` observed steps after
    :attr:`SETTLE` (while the residuals grow), fewer than :attr:`FRACTION` of
    the results' elements were non-zero. Inactive for every other
    compressor, and after those steps. ``who`` names the caller in the
    warning (``"GradientSync"``, ``"mpigc.allreduce (key 'w')"``)."""

    SETTLE, STEPS, FRACTION = 5, 50, 1e-3

    def __init__(self, compressor, who):
        self.active = watched(compressor)
        self.threshold = compressor.get_config().get("threshold")
        self.who = who
        self.step = self.nonzero = self.total = 0

    def observe_counts(self, nonzero, total, stacklevel=2):
        """One step's results held ``nonzero`` non-zero elements of ``total``.
        Returns whether it warned (``stacklevel`` counts from the caller)."""
        if not self.active:
            return False
        self.step += 1
        if self.step <= self.SETTLE:
            return False
        self.nonzero += int(nonzero)
        self.total += int(total)
        if self.step < self.SETTLE + self.STEPS:
            return False
        self.active = False
        if not (self.total and self.nonzero < self.FRACTION * self.total):
            return False
        warnings.warn(
            f"{self.who}: 2bit's absolute threshold {self.threshold:g} let through "
            f"{self.nonzero / self.total:.2e} of the gradient elements over "
            f"{self.STEPS} steps: these gradients are far below it, so the residuals "
            "hold almost everything and the model barely trains. Use the relative "
            "mode (leave threshold= out: op=\"2bit\" alone is rel_threshold=1.5), or a "
            "threshold of your gradients' scale", UserWarning, stacklevel=stacklevel + 1)
        return True


#: the core API's watches: (key, op, params) -> ThresholdWatch, or None for a
#: call signature that needs none (so that a call costs one dict look-up)
_WATCHES = {}


def _signature(op, params, key):
    try:
        return (repr(key), repr(op), repr(sorted(params.items())))
    except TypeError:  # unorderable parameters: not watched
        return None


def observe_allreduce(buf, op, params, key, stacklevel=2):
    """After a blocking :func:`mpigc.allreduce` of ``buf`` (an array or a
    grouped call's list) with ``op``/``params`` under ``key``: observe its
    results, once per rank per key. Host arrays only, numpy's and the other
    CPU arrays the call takes (a device array is not counted: that would read
    it back)."""
    if isinstance(op, str) and "threshold" not in params:
        return  # never the absolute mode: nothing to watch, no per-call cost
    sig = _signature(op, params, key)
    if sig is None:
        return
    watch = _WATCHES.get(sig, False)
    if watch is None:
        return
    if watch is False:
        try:
            comp = get_compressor(op, **params)
        except Exception:  # noqa: BLE001 (the call accepted it; nothing to watch)
            comp = None
        watch = None
        if comp is not None and watched(comp):
            watch = ThresholdWatch(comp, f"mpigc.allreduce (key {_label(buf, key)})")
        _WATCHES[sig] = watch
        if watch is None:
            return
    arrays = [_host(a) for a in (buf if isinstance(buf, (list, tuple)) else [buf])]
    if any(a is None for a in arrays):
        watch.active = False
        _WATCHES[sig] = None
        return
    nonzero = sum(int(np.count_nonzero(a)) for a in arrays)
    total = sum(a.size for a in arrays)
    watch.observe_counts(nonzero, total, stacklevel=stacklevel + 1)
    if not watch.active:
        _WATCHES[sig] = None


def _host(a):
    """``a`` as a numpy array over its memory (a CPU array the call took: a
    torch CPU tensor, a buffer, ...), or None for a device array (counting it
    would read it back)."""
    if isinstance(a, np.ndarray):
        return a
    if hasattr(a, "__cuda_array_interface__"):
        return None
    try:
        return host_view(a, "allreduce")
    except Exception:  # noqa: BLE001 (not a CPU array: nothing to count)
        return None


def _label(buf, key):
    if key is not None:
        return repr(key)
    if isinstance(buf, (list, tuple)):
        return "None, a grouped call's default keys"
    return f"'auto/{buf.size}/{buf.dtype.name}'" if isinstance(buf, np.ndarray) else "None"
