"""The one place that decides host or device: from the array itself.

An array is a device array when it exposes ``__cuda_array_interface__`` (CuPy,
Numba device arrays, CUDA torch tensors); this is checked per object, never
cached per type. Under Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``
only) the simulator's device arrays count too: they carry Numba's
``__cuda_ndarray__`` marker instead of the interface. Host arrays use ``mpigc.kernels.cpu``; device arrays use
``mpigc.kernels.cuda``, imported on first use so that importing mpigc never
touches CUDA.
"""
import importlib
import os

import numpy as np

from ._errors import DTypeError

__all__ = ["is_device_array", "kernels"]

_cuda = None


def is_device_array(a):
    """True for objects that live in CUDA device memory."""
    if isinstance(a, np.ndarray):
        return False
    if hasattr(a, "__cuda_array_interface__"):
        return True
    # the simulator's FakeCUDAArray: looked up on the type (its instances
    # forward unknown attributes to the numpy array they wrap)
    return (getattr(type(a), "__cuda_ndarray__", False) is True
            and os.environ.get("NUMBA_ENABLE_CUDASIM", "0").strip() not in ("", "0"))


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
