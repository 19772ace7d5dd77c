"""mpigc: compressed collectives with error feedback for data-parallel training.

>>> import numpy as np, mpigc
>>> grad = np.ones(1000, np.float32)
>>> mpigc.allreduce(grad, op="2bit", key="grad")   # doctest: +SKIP

Importing mpigc makes no MPI call beyond what mpi4py does, creates no CUDA
context and prints nothing.
"""
from ._errors import (ConfigError, DTypeError, InvalidBufferError, MismatchError,
                      MpigcError, NonFiniteError, StateError)
from ._version import __version__
from .allreduce import allreduce, iallreduce
from ._wire import reset_traffic, traffic
from ._sched import Request
from ._cuda import CudaAwareness, cuda_aware_mpi, select_device
from .compressors import (BF16, FP16, Compressor, NoCompression, OneBit, TernGrad,
                          TwoBit, available_compressors, get_compressor, register_compressor)
from .feedback import ErrorFeedback, get_default_feedback, shard_bounds
from .reduce_scatter import ireduce_scatter, reduce_scatter
from ._auto import AutoRequest, last_decision as last_auto_decision
from . import diagnostics

__all__ = [
    "__version__",
    "allreduce", "iallreduce", "reduce_scatter", "ireduce_scatter", "Request",
    "AutoRequest", "last_auto_decision",
    "traffic", "reset_traffic", "diagnostics", "timeline",
    "cuda_aware_mpi", "CudaAwareness", "select_device",
    "get_compressor", "register_compressor", "available_compressors",
    "Compressor", "NoCompression", "FP16", "BF16", "TwoBit", "OneBit", "TernGrad",
    "ErrorFeedback", "get_default_feedback", "shard_bounds",
    "MpigcError", "ConfigError", "InvalidBufferError", "DTypeError", "MismatchError",
    "NonFiniteError", "StateError",
    "save_checkpoint", "load_checkpoint",
]


def __getattr__(name):
    # mpigc.checkpoint (and h5py) load on first use, which also keeps
    # ``python -m mpigc.checkpoint`` free of runpy's double-import warning
    if name in ("save_checkpoint", "load_checkpoint"):
        from . import checkpoint
        return getattr(checkpoint, name)
    if name == "timeline":  # loads on first use too: python -m mpigc.timeline
        import importlib
        return importlib.import_module(".timeline", __name__)
    raise AttributeError(f"module 'mpigc' has no attribute {name!r}")
