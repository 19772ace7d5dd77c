"""The one place that decides host or device: from the array itself.

An array is a device array when it exposes ``__cuda_array_interface__`` (CuPy,
Numba device arrays, CUDA torch tensors); this is checked per object, never
cached per type. Under Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``
only) the simulator's device arrays count too: they carry Numba's
``__cuda_ndarray__`` marker instead of the interface. Everything else is a
host array: a numpy array, or a CPU array that exposes its memory (torch CPU
tensors, the buffer protocol, ``__array_interface__``, DLPack on the CPU),
which the host backend views through numpy (:func:`mpigc._backend.host_view`;
an object that exposes nothing is refused there). Host arrays use ``mpigc.kernels.cpu``; device arrays use
``mpigc.kernels.cuda``, imported on first use so that importing mpigc never
touches CUDA. :func:`backend` gives the collectives the host or the device
backend (:mod:`mpigc._backend`) for an array.
"""
import importlib
import os
import re

import numpy as np

from ._errors import DTypeError

__all__ = ["is_device_array", "kernels", "backend", "put_bytes"]

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


# numba-cuda releases that compile no kernel with numpy 2.5 or later (they
# call numpy.row_stack, which numpy 2.5 removed): 0.30.4 and older
_NUMBA_CUDA_LAST_WITHOUT_NUMPY_2_5 = (0, 30, 4)


def _release(version):
    """``"2.5.2"`` -> ``(2, 5, 2)``; ``"0.31.0rc1"`` -> ``(0, 31, 0)``."""
    return tuple(int(re.match(r"\d*", p).group() or 0) for p in version.split(".")[:3])


def check_numpy_for_numba_cuda(numba_cuda_version=None, numpy_version=None):
    """Raise DTypeError, naming both versions, where the installed numba-cuda
    cannot compile kernels with the installed numpy."""
    if numba_cuda_version is None:
        from importlib import metadata
        try:
            numba_cuda_version = metadata.version("numba-cuda")
        except metadata.PackageNotFoundError:  # Numba's own CUDA target
            return
    numpy_version = np.__version__ if numpy_version is None else numpy_version
    if (_release(numba_cuda_version) <= _NUMBA_CUDA_LAST_WITHOUT_NUMPY_2_5
            and _release(numpy_version)[:2] >= (2, 5)):
        raise DTypeError(
            f"a CUDA device array was given, but numba-cuda {numba_cuda_version} cannot "
            f"compile kernels with numpy {numpy_version} (it uses numpy.row_stack, removed "
            "in numpy 2.5); install numpy<2.5 (pip install 'numpy<2.5', as the cuda extra "
            "of mpigc does) or a numba-cuda release that supports this numpy")


def _cuda_kernels():
    global _cuda
    if _cuda is None:
        check_numpy_for_numba_cuda()
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


# the host backend's class and kernels, imported on the first host call (an
# import statement per call costs about a microsecond)
_host = None


def backend(a):
    """A new backend (:mod:`mpigc._backend`) for one call on array ``a``:
    the device one for device arrays, the host one otherwise (numpy arrays
    and other CPU arrays, which its ``adopt`` views or refuses)."""
    global _host
    if is_device_array(a):
        from ._backend import DeviceBackend
        return DeviceBackend(_cuda_kernels())
    host = _host
    if host is None:
        from ._backend import HostBackend
        from .kernels import cpu
        host = _host = (HostBackend, cpu)
    return host[0](host[1])


def put_bytes(payload, host_bytes):
    """``payload[:] = host_bytes`` (a host array of bytes), ``payload`` being
    host or device memory (the compressors' marks of an out-of-range payload,
    on the error path only)."""
    if is_device_array(payload):
        payload.copy_to_device(np.ascontiguousarray(host_bytes))
    else:
        payload[...] = host_bytes
