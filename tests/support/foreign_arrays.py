"""Foreign arrays: objects that behave like CUDA torch tensors, as far as mpigc
may look at them (the simulator tests), and CPU arrays that expose their
memory by one protocol only (``tests/test_cpu_buffers.py``,
``tests/mpi/test_cpu_buffers_mpi.py``).

A CUDA torch tensor exports ``__cuda_array_interface__`` (version 3, numpy
``typestr``, ``shape``, ``strides`` None when contiguous, ``data`` pointer and
read-only flag, its ``stream``), but its own ``.dtype`` is a torch dtype that
numpy cannot interpret and its ``.shape`` a ``torch.Size``. mpigc must take
dtype, shape, strides and read-only from the interface only. Under the
simulator the pointer is host memory (a simulated device array's numpy
array), which ``mpigc._cuda.as_device`` maps back without a copy.
"""
import array
import types

import numpy as np
import pytest

__all__ = ["TorchDtype", "TorchLikeTensor", "InterfaceOnly", "DLPackOnly", "OtherDevice",
           "CPU_KINDS"]


class TorchDtype:
    """Like ``torch.float32``: not a numpy dtype (``np.dtype(it)`` raises
    ``TypeError: Cannot interpret 'torch.float32' as a data type``)."""

    def __init__(self, name):
        self.name = name
        self.is_floating_point = True

    def __repr__(self):
        return f"torch.{self.name}"


class TorchLikeTensor:
    """A CUDA tensor over the memory of simulated device array ``d``."""

    def __init__(self, d, readonly=False, stream=1):
        self._d = d  # keeps the memory alive
        self._ary = d._ary if hasattr(d, "_ary") else d  # the simulator's numpy array
        self._readonly = readonly
        self._stream = stream
        self.dtype = TorchDtype(np.dtype(self._ary.dtype).name)
        self.shape = tuple(self._ary.shape)  # torch.Size is a tuple subclass
        self.device = types.SimpleNamespace(type="cuda", index=0)
        self.is_cuda = True

    @property
    def __cuda_array_interface__(self):
        a = self._ary
        return {"typestr": a.dtype.str, "shape": tuple(a.shape), "strides": None,
                "data": (a.ctypes.data, self._readonly), "version": 3,
                "stream": self._stream}

    # torch's names for what numpy calls size and ndim: mpigc must not need them
    def numel(self):
        return int(self._ary.size)

    def dim(self):
        return self._ary.ndim

    def __getattr__(self, name):  # no numpy attributes leak through
        raise AttributeError(f"'TorchLikeTensor' object has no attribute {name!r}")


class _Only:
    """A CPU array over numpy array ``a``'s memory, exposing it by one
    protocol only (no buffer protocol, no ``__array__``, no numpy
    attributes)."""

    def __init__(self, a):
        self._a = a  # keeps the memory alive

    def __getattr__(self, name):  # no numpy attributes leak through
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


class InterfaceOnly(_Only):
    """Only ``__array_interface__`` (version 3, its read-only flag that of
    ``a``)."""

    @property
    def __array_interface__(self):
        a = self._a
        return {"typestr": a.dtype.str, "shape": tuple(a.shape),
                "strides": None if a.flags.c_contiguous else a.strides,
                "data": (a.ctypes.data, not a.flags.writeable), "version": 3}


class DLPackOnly(_Only):
    """Only ``__dlpack__`` and ``__dlpack_device__`` (numpy's export of ``a``:
    DLPack 1.0 when asked for it, with its read-only flag)."""

    def __dlpack__(self, **kwargs):
        return self._a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


class OtherDevice(_Only):
    """A DLPack array on a device that is neither the CPU nor CUDA with
    ``__cuda_array_interface__`` (DLPack device type 8, Metal)."""

    def __dlpack__(self, **kwargs):
        raise AssertionError("mpigc must not export an array of another device")

    def __dlpack_device__(self):
        return (8, 0)


# -- CPU arrays that are not numpy arrays (issue 45 item 3) -------------------
# Each maker takes a numpy array g and returns (an object of its kind holding
# a copy of g, a function giving a numpy view of that object's memory).
def _torch(g):
    torch = pytest.importorskip("torch")  # imported here: the GPU jobs need it not
    t = torch.from_numpy(g.copy())
    return t, t.numpy  # the tensor's memory, read through numpy


def _memoryview(g):
    if g.dtype == np.float16:  # memoryview.cast has no 'e': a numpy array's buffer
        raw = g.copy()
        return memoryview(raw), lambda: raw
    raw = bytearray(g.tobytes())
    return memoryview(raw).cast(g.dtype.char), lambda: np.frombuffer(raw, g.dtype)


def _array(g):
    if g.dtype.char not in "fd":
        pytest.skip("array.array has no float16")
    arr = array.array(g.dtype.char, g.tolist())
    return arr, lambda: np.frombuffer(arr, g.dtype)


def _interface(g):
    a = g.copy()
    return InterfaceOnly(a), lambda: a


def _dlpack(g):
    a = g.copy()
    return DLPackOnly(a), lambda: a


CPU_KINDS = {"torch": _torch, "memoryview": _memoryview, "array": _array,
             "interface": _interface, "dlpack": _dlpack}
