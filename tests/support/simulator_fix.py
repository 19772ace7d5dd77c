"""Fixes for Numba's CUDA simulator, used by the simulator test scripts
(tests/test_cuda_sim.py, tests/mpi/test_gpu_path_mpi.py, the torch simulator
jobs) in their subprocesses: shared arrays under a lock, a launching thread
that yields while it polls and block threads that are reused from launch to
launch (all by :func:`fix_simulator_shared_arrays`), and the GPU's float
min/max (:func:`gpu_float_minmax`)."""
import sys

import numpy as np


def fix_simulator_shared_arrays():
    """Numba's simulator (0.68) gives the threads of a block one shared
    array per ``cuda.shared.array`` call site, found by a dict look-up and an
    insert without a lock: under load two threads can both miss and each get
    its own "shared" array, so the 1bit block sums (and terngrad's stats)
    come out wrong now and then. Same logic, under a lock (tests only).

    Also :func:`yield_while_polling` (every simulator run gets it, the jobs
    of tests/test_gpu_path_sim.py and the torch simulator jobs included),
    with block threads reused (:func:`reuse_block_threads`); returns what
    that returns."""
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
#: the same of its ``BlockThread.__init__`` and ``BlockThread.run``, which
#: :func:`reuse_block_threads` restates
_BLOCK_THREAD = ("e5f1adfdc5ce9a37", "39843339d822a418")


def _block_threads(kernel):
    """A source of the threads that run a block's CUDA threads: ``take(f,
    manager, blockIdx, threadIdx, debug)`` gives one running ``f`` as
    ``kernel.BlockThread(f, ...).start()`` would, and ``done(t)`` says
    whether it has ended (``is_alive()`` of a new thread); ``give(threads)``
    takes back threads that have ended. Reused (``reuse_block_threads``) or
    new each time."""
    import threading

    Dim3 = kernel.Dim3

    class Worker(kernel.BlockThread):
        """A BlockThread that runs one CUDA thread after another: the same
        fields, set afresh for each (BlockThread.__init__), the same
        exception record (BlockThread.run)."""

        def __init__(self):  # noqa: D401 - no super().__init__: no target yet
            threading.Thread.__init__(self, daemon=True)
            self.syncthreads_event = threading.Event()
            self._go = threading.Event()
            self._f = None
            self.finished = True

        def assign(self, f, manager, blockIdx, threadIdx, debug):
            self.syncthreads_event.clear()
            self.syncthreads_blocked = False
            self._manager = manager
            self.blockIdx = Dim3(*blockIdx)
            self.threadIdx = Dim3(*threadIdx)
            self.exception = None
            self.abort = False
            self.debug = debug
            blockDim = Dim3(*manager._block_dim)
            self.thread_id = self.threadIdx.x + (
                blockDim.x * (self.threadIdx.y + blockDim.y * self.threadIdx.z))
            self._f = f
            self.finished = False
            self._go.set()

        def run(self):
            while True:
                self._go.wait()
                self._go.clear()
                old = np.seterr(divide="raise") if self.debug else None
                try:
                    self._f()
                except Exception as e:  # noqa: BLE001 - as BlockThread.run records it
                    tid = "tid=%s" % list(self.threadIdx)
                    ctaid = "ctaid=%s" % list(self.blockIdx)
                    msg = "%s %s" % (tid, ctaid) if str(e) == "" else "%s %s: %s" % (
                        tid, ctaid, e)
                    self.exception = (type(e)(msg), sys.exc_info()[2])
                finally:
                    if old is not None:
                        np.seterr(**old)
                    self._f = None
                    self.finished = True

    idle, lock = [], threading.Lock()

    def take(f, manager, blockIdx, threadIdx, debug):
        with lock:
            t = idle.pop() if idle else None
        if t is None:
            t = Worker()
            t.start()
        t.assign(f, manager, blockIdx, threadIdx, debug)
        return t

    def give(threads):
        with lock:
            idle.extend(threads)

    return take, (lambda t: t.finished), give


def yield_while_polling(reuse=True):
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

    ``reuse``: the block's threads are taken from the threads of earlier
    blocks that have ended, each set up as a new ``BlockThread`` is (its
    indices, events and flags afresh), instead of one new thread each: a
    thread's start cost about as much as the CUDA thread's work (a 2bit pack
    of 3000 values, 12 blocks of 64 threads: 768 thread starts, 86 ms of the
    launch's 100 ms of CPU). Only with numba-cuda 0.30.4's ``BlockThread``
    (the source of its ``__init__`` and ``run``, which this restates).
    Returns whether the simulator was changed."""
    import hashlib
    import inspect
    import time

    import numpy as np
    from numba.cuda.simulator import kernel

    def digest(f):
        return hashlib.sha256(inspect.getsource(f).encode()).hexdigest()[:16]
    if digest(kernel.BlockManager.run) != _BLOCK_MANAGER_RUN:
        return False
    if reuse and (digest(kernel.BlockThread.__init__),
                  digest(kernel.BlockThread.run)) == _BLOCK_THREAD:
        take, done, give = _block_threads(kernel)
    else:  # new threads, as the simulator makes them
        def take(f, manager, blockIdx, threadIdx, debug):
            t = kernel.BlockThread(f, manager, blockIdx, threadIdx, debug)
            t.start()
            return t

        def done(t):
            return not t.is_alive()

        def give(threads):
            pass

    def run(self, grid_point, *args):
        threads = set()
        livethreads = set()
        blockedthreads = set()
        for block_point in np.ndindex(*self._block_dim):

            def target():
                self._f(*args)

            t = take(target, self, grid_point, block_point, self._debug)
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
            livethreads = set([t for t in livethreads if not done(t)])
            if livethreads:
                time.sleep(0)  # let the block's threads run
        for t in threads:
            if t.exception:
                raise t.exception[0].with_traceback(t.exception[1])
        give(threads)  # all ended, none raised (an aborted block's are left to end)

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
