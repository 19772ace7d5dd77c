"""The launch contract of ``mpigc.kernels.cuda``, checked in the simulator.

Numba's CUDA simulator runs a kernel with whatever Python objects it is given;
a real launch does not. numba-cuda's dispatcher (``_Kernel._prepare_args``)
takes device arrays and numeric scalars and raises ``NotImplementedError`` on
``None``; a host numpy array is silently copied to the device and back (so a
kernel writing into it would work by accident, slowly). :func:`install` wraps
``kc._launch``, through which every launch of the module goes, so that each
launch of a simulator test:

- fails (:class:`LaunchContractError`) on an argument a real launch rejects or
  that is not device memory where the kernel expects it: ``None``, a host
  numpy array, a foreign object, a Python container;
- records the Numba types the real dispatcher would give the arguments
  (arrays: dtype, ndim, layout; scalars: ``typeof``), per kernel;
- counts what a device call costs besides its bytes (:func:`counts`): the
  launches per kernel, the device synchronisations (``cuda.synchronize``,
  ``stream.synchronize``) and the device-to-host copies of at most 64 bytes
  (the reads of a count, which wait for the device).

:func:`dump` writes the recorded signatures as JSON, and :func:`load` turns
them back into Numba types in a process without the simulator, where
``tests/test_cuda_sim.py`` compiles each one to PTX: the kernels are compiled
with exactly the argument types the engine launches them with.
"""
import json
import threading

import numpy as np

__all__ = ["LaunchContractError", "install", "arg_spec", "recorded", "dump", "load",
           "counts", "reset_counts"]


class LaunchContractError(AssertionError):
    """A kernel was launched with an argument a real GPU launch rejects."""


_lock = threading.Lock()
_recorded = {}  # kernel name -> set of argument specs (tuples)
_counts = {}  # "launch <kernel>", "sync", "small read" -> how many
SMALL_READ = 64  # bytes


def _count(what):
    with _lock:
        _counts[what] = _counts.get(what, 0) + 1


def counts():
    """``{"launch <kernel name>": n, "sync": n, "small read": n}`` since the
    last :func:`reset_counts`."""
    with _lock:
        return dict(_counts)


def reset_counts():
    with _lock:
        _counts.clear()


def arg_spec(a):
    """The argument as the real dispatcher types it: ``("array", dtype, ndim,
    layout)`` or ``("scalar", numba type name)``; raises LaunchContractError
    for anything a real launch rejects or should not get."""
    if a is None:
        raise LaunchContractError("None (numba-cuda's dispatcher raises NotImplementedError: "
                                  "pass an empty device array and a flag)")
    if isinstance(a, np.ndarray):
        raise LaunchContractError(f"a host numpy array ({a.dtype}{a.shape}) where device "
                                  "memory is expected")
    if isinstance(a, (bool, np.bool_)):
        return ("scalar", "boolean")
    if isinstance(a, (int, float, np.integer, np.floating)):
        from numba import typeof
        return ("scalar", str(typeof(a)))
    if getattr(type(a), "__cuda_ndarray__", False) is True:  # a Numba device array
        if a.is_c_contiguous():
            layout = "C"
        elif a.is_f_contiguous():
            layout = "F"
        else:
            layout = "A"
        return ("array", np.dtype(a.dtype).name, int(a.ndim), layout)
    raise LaunchContractError(f"a {type(a).__name__} (expected a Numba device array or a "
                              "numeric scalar)")


def _kernel_name(kc, kernel):
    for name, obj in vars(kc).items():
        if obj is kernel:
            return name
    raise LaunchContractError(f"{kernel!r} is not a kernel of {kc.__name__}")


def install(kc):
    """Wrap ``kc._launch`` (``kc`` = ``mpigc.kernels.cuda``) with the check
    and the recorder; returns the original."""
    original = kc._launch
    if getattr(original, "_contract", False):
        return original

    def _launch(kernel, blocks, stream, *args):
        name = _kernel_name(kc, kernel)
        specs = []
        for i, a in enumerate(args):
            try:
                specs.append(arg_spec(a))
            except LaunchContractError as exc:
                raise LaunchContractError(f"{name}: argument {i}: {exc}") from None
        with _lock:
            _recorded.setdefault(name, set()).add(tuple(specs))
        _count(f"launch {name}")
        return original(kernel, blocks, stream, *args)

    _launch._contract = True
    kc._launch = _launch
    _install_counters()
    return original


def _install_counters():
    """Count device synchronisations and small device-to-host reads (in the
    simulator: its ``synchronize`` functions and ``FakeCUDAArray.copy_to_host``)."""
    from numba import cuda
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
    if getattr(FakeCUDAArray.copy_to_host, "_counted", False):
        return
    sync = cuda.synchronize

    def synchronize():
        _count("sync")
        return sync()

    cuda.synchronize = synchronize
    stream_cls = type(cuda.default_stream())
    ssync = stream_cls.synchronize

    def stream_synchronize(self):
        _count("sync")
        return ssync(self)

    stream_cls.synchronize = stream_synchronize
    to_host = FakeCUDAArray.copy_to_host

    def copy_to_host(self, ary=None, stream=0):
        if self.nbytes <= SMALL_READ:
            _count("small read")
        return to_host(self, ary, stream)

    copy_to_host._counted = True
    FakeCUDAArray.copy_to_host = copy_to_host


def recorded():
    """``{kernel name: set of signatures}`` launched so far in this process."""
    with _lock:
        return {k: set(v) for k, v in _recorded.items()}


def dump(path):
    with open(path, "w") as f:
        json.dump({k: sorted(map(list, v)) for k, v in recorded().items()}, f, indent=1,
                  sort_keys=True)


def load(path):
    """``{kernel name: [tuple of Numba types]}`` from a :func:`dump` file."""
    from numba import types
    with open(path) as f:
        data = json.load(f)
    out = {}
    for name, sigs in data.items():
        out[name] = []
        for sig in sigs:
            tys = []
            for spec in sig:
                if spec[0] == "array":
                    _, dtype, ndim, layout = spec
                    tys.append(types.Array(getattr(types, dtype), ndim, layout))
                else:
                    tys.append(getattr(types, spec[1]))
            out[name].append(tuple(tys))
    return out
