"""Foreign device arrays for the simulator tests: objects that behave like CUDA
torch tensors, as far as mpigc may look at them.

A CUDA torch tensor exports ``__cuda_array_interface__`` (version 3, numpy
``typestr``, ``shape``, ``strides`` None when contiguous, ``data`` pointer and
read-only flag, its ``stream``), but its own ``.dtype`` is a torch dtype that
numpy cannot interpret and its ``.shape`` a ``torch.Size``. mpigc must take
dtype, shape, strides and read-only from the interface only. Under the
simulator the pointer is host memory (a simulated device array's numpy
array), which ``mpigc._cuda.as_device`` maps back without a copy.
"""
import types

import numpy as np

__all__ = ["TorchDtype", "TorchLikeTensor"]


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
