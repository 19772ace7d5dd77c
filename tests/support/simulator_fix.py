"""Fixes for Numba's CUDA simulator, used by the simulator test scripts
(tests/test_cuda_sim.py, tests/mpi/test_gpu_path_mpi.py, the torch simulator
jobs) in their subprocesses: shared arrays under a lock, a launching thread
that yields while it polls (both by :func:`fix_simulator_shared_arrays`), and
the GPU's float min/max (:func:`gpu_float_minmax`)."""
import sys

import numpy as np


def fix_simulator_shared_arrays():
    """Numba's simulator (0.68) gives the threads of a block one shared
    array per ``cuda.shared.array`` call site, found by a dict look-up and an
    insert without a lock: under load two threads can both miss and each get
    its own "shared" array, so the 1bit block sums (and terngrad's stats)
    come out wrong now and then. Same logic, under a lock (tests only).

    Also :func:`yield_while_polling` (every simulator run gets it, the jobs
    of tests/test_gpu_path_sim.py and the torch simulator jobs included);
    returns what that returns."""
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
    return yield_while_polling()


#: sha256 (first 16 hex digits) of the source of numba-cuda 0.30.4's
#: ``numba.cuda.simulator.kernel.BlockManager.run``, which
#: :func:`yield_while_polling` copies
_BLOCK_MANAGER_RUN = "54626c6819f55d51"


def yield_while_polling():
    """Numba's simulator runs a CUDA block as one Python thread per CUDA
    thread, and the launching thread watches them (which are blocked in
    ``syncthreads``, which raised, which ended) in a loop that never waits:
    it holds the GIL for a whole switch interval at a time while the block's
    threads, the ones with work to do, wait for it. This is numba-cuda
    0.30.4's ``BlockManager.run`` with one change: the watching thread gives
    up the GIL (``time.sleep(0)``) after each look at the threads. What a
    block does is unchanged (the same threads, the same release of a
    ``syncthreads`` when every live thread waits in it, the same abort on
    an exception); the simulator groups took 30-60% less CPU time (a
    ``stats`` launch 360 -> 110 ms, ``pack_1bit`` 510 -> 350 ms). Another
    numba-cuda (another source of that function) is left as it is.
    Returns whether the simulator was changed."""
    import hashlib
    import inspect
    import time

    import numpy as np
    from numba.cuda.simulator import kernel
    src = inspect.getsource(kernel.BlockManager.run)
    if hashlib.sha256(src.encode()).hexdigest()[:16] != _BLOCK_MANAGER_RUN:
        return False

    def run(self, grid_point, *args):
        threads = set()
        livethreads = set()
        blockedthreads = set()
        for block_point in np.ndindex(*self._block_dim):

            def target():
                self._f(*args)

            t = kernel.BlockThread(target, self, grid_point, block_point, self._debug)
            t.start()
            threads.add(t)
            livethreads.add(t)
        while livethreads:
            for t in livethreads:
                if t.syncthreads_blocked:
                    blockedthreads.add(t)
                elif t.exception:
                    for t_other in threads:
                        t_other.abort = True
                        t_other.syncthreads_blocked = False
                        t_other.syncthreads_event.set()
                    raise t.exception[0].with_traceback(t.exception[1])
            if livethreads == blockedthreads:
                for t in blockedthreads:
                    t.syncthreads_blocked = False
                    t.syncthreads_event.set()
                blockedthreads = set()
            livethreads = set([t for t in livethreads if t.is_alive()])
            if livethreads:
                time.sleep(0)  # the one change: let the block's threads run
        for t in threads:
            if t.exception:
                raise t.exception[0].with_traceback(t.exception[1])

    kernel.BlockManager.run = run
    return True


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
