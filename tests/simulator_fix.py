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
