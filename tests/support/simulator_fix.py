"""A fix for Numba's CUDA simulator, used by the simulator test scripts
(tests/test_cuda_sim.py, tests/mpi/test_gpu_path_mpi.py) in their subprocesses."""
import sys

import numpy as np


def fix_simulator_shared_arrays():
    """Numba's simulator (0.68) gives the threads of a block one shared
    array per ``cuda.shared.array`` call site, found by a dict look-up and an
    insert without a lock: under load two threads can both miss and each get
    its own "shared" array, so the 1bit block sums (and terngrad's stats)
    come out wrong now and then. Same logic, under a lock (tests only)."""
    import threading

    from numba.core import types
    from numba.np import numpy_support
    from numba.cuda.simulator import kernelapi

    lock = threading.Lock()
    dynamic = kernelapi.FakeCUDAShared.array

    def array(self, shape, dtype):
        if shape == 0:
            return dynamic(self, shape, dtype)
        if isinstance(dtype, types.Type):
            dtype = numpy_support.as_dtype(dtype)
        f = sys._getframe(1)
        caller = (f.f_code.co_filename, f.f_lineno)
        with lock:
            res = self._allocations.get(caller)
            if res is None:
                res = self._allocations[caller] = np.empty(shape, dtype)
        return res

    kernelapi.FakeCUDAShared.array = array


def _is_float(v):
    return isinstance(v, (float, np.floating))


def _gpu_minmax2(a, b, larger):
    """``max(a, b)`` (``larger``) or ``min(a, b)`` as a GPU computes it for
    floats (``max.f32``/``max.f64``, libdevice ``fmax``; ``min``: ``fmin``):
    a NaN operand gives the other operand (NaN only when both are); +0.0
    above -0.0."""
    if a != a:
        return b
    if b != b:
        return a
    if a == b:
        return a if np.signbit(a) != larger else b
    return a if (a > b) == larger else b


def gpu_float_minmax(module):
    """Give the code of ``module`` (``mpigc.kernels.cuda``: its kernels and
    device functions, which the simulator runs as Python with the module's
    globals) the float ``min`` and ``max`` of a GPU. numba-cuda lowers a
    float ``min``/``max`` to ``min.f64``/``max.f64`` (libdevice ``fmin``/
    ``fmax``), which return the non-NaN operand; the CPU kernels (Numba's
    ``min``/``max``: Python's rule, a compare and a select) and the
    simulator (plain Python) keep a NaN that comes first. Module globals
    named ``min`` and ``max`` shadow the builtins for that module only;
    integer arguments (grid sizes, block bounds) go to the builtins.
    Returns a function that puts the builtins back."""
    import builtins
    import functools

    def make(pair, plain):
        def f(*args, **kw):
            vals = tuple(args[0]) if len(args) == 1 else args
            if kw or not any(_is_float(v) for v in vals):
                return plain(*args, **kw)
            return functools.reduce(pair, vals)
        return f

    had = {k: module.__dict__[k] for k in ("min", "max") if k in module.__dict__}
    module.max = make(functools.partial(_gpu_minmax2, larger=True), builtins.max)
    module.min = make(functools.partial(_gpu_minmax2, larger=False), builtins.min)

    def restore():
        for k in ("min", "max"):
            if k in had:
                setattr(module, k, had[k])
            else:
                delattr(module, k)
    return restore
