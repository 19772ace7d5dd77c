"""The one place that decides host or device: from the array itself.

An array is a device array when it exposes ``__cuda_array_interface__`` (CuPy,
Numba device arrays, CUDA torch tensors); this is checked per object, never
cached per type. Host arrays use ``mpigc.kernels.cpu``; device arrays use
``mpigc.kernels.cuda``, imported on first use so that importing mpigc never
touches CUDA.
"""
import importlib

import numpy as np

from ._errors import DTypeError

__all__ = ["is_device_array", "kernels"]

_cuda = None


def is_device_array(a):
    """True for objects that live in CUDA device memory."""
    return not isinstance(a, np.ndarray) and hasattr(a, "__cuda_array_interface__")


def _cuda_kernels():
    global _cuda
    if _cuda is None:
        try:
            _cuda = importlib.import_module("mpigc.kernels.cuda")
        except ImportError as exc:
            raise DTypeError(
                "a CUDA device array was given, but the CUDA kernels are not "
                f"available ({exc}); install them with: pip install 'mpigc[cuda]'"
            ) from exc
    return _cuda


def kernels(a):
    """The kernel module (cpu or cuda) that fits array ``a``."""
    if is_device_array(a):
        return _cuda_kernels()
    from .kernels import cpu
    return cpu
