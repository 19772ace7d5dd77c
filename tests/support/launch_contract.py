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
  numpy array, a foreign object, a Python container; on an array whose
  address is not a multiple of its itemsize (a real load faults with a
  misaligned address: a uint16 view at an odd byte of a payload, say);
- fails on a launch configuration a GPU refuses or that breaks the kernels'
  warp rules, as the simulator's kernel is configured (``kernel[grid, block,
  stream]``): ``gridDim.y`` or ``.z`` above 65535 (the shards of a call are
  ``gridDim.y``), ``gridDim.x`` above 2**31 - 1, a block that is not 1-D, not
  a multiple of 32 threads (a partial warp would miss the full-mask shuffles)
  or above 1024; and a launch on Numba's stream ``0`` instead of a named
  stream (``0`` is a different stream in every thread when per-thread
  default streams are on, see ``kernels.cuda._stream``);
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

:func:`early_returns` checks a rule the simulator cannot see in one run: no
kernel that calls a warp intrinsic or a barrier returns early (an AST walk
of ``kernels/cuda.py``).
"""
import ast
import json
import threading

import numpy as np

__all__ = ["LaunchContractError", "install", "arg_spec", "recorded", "dump", "load",
           "counts", "reset_counts", "check_configuration", "check_aligned",
           "early_returns"]


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


def _address(a):
    """The data address of a (real or simulated) Numba device array."""
    ary = getattr(a, "_ary", None)  # the simulator's FakeCUDAArray wraps numpy
    if isinstance(ary, np.ndarray):
        return ary.__array_interface__["data"][0]
    return a.__cuda_array_interface__["data"][0]


def check_aligned(a):
    """Raise LaunchContractError for a device array whose data address is not
    a multiple of its itemsize (an empty array is never read)."""
    if getattr(type(a), "__cuda_ndarray__", False) is not True or a.size == 0:
        return
    isz = np.dtype(a.dtype).itemsize
    addr = _address(a)
    if addr % isz:
        raise LaunchContractError(
            f"a {np.dtype(a.dtype).name} array at address {addr:#x}, not a multiple of "
            f"its {isz}-byte items (a real load faults: misaligned address)")


MAX_GRID_X = 2**31 - 1
MAX_GRID_YZ = 65535
MAX_BLOCK = 1024


def _dims(d):
    d = list(d) if isinstance(d, (tuple, list)) else [d]
    return tuple(int(v) for v in d) + (1,) * (3 - len(d))


def check_configuration(configuration):
    """Raise LaunchContractError for a launch configuration ``(grid, block[,
    stream[, shared]])`` that a GPU refuses or that breaks the warp rules of
    ``kernels/cuda.py`` (see the module docstring)."""
    grid, block = _dims(configuration[0]), _dims(configuration[1])
    stream = configuration[2] if len(configuration) > 2 else 0
    if min(grid) < 1 or grid[0] > MAX_GRID_X or max(grid[1:]) > MAX_GRID_YZ:
        raise LaunchContractError(
            f"gridDim {grid}: expected x in 1..{MAX_GRID_X} and y, z in 1..{MAX_GRID_YZ} "
            "(more shards than gridDim.y takes need more launches)")
    if block[1:] != (1, 1) or block[0] % 32 or not 0 < block[0] <= MAX_BLOCK:
        raise LaunchContractError(
            f"blockDim {block}: expected (32 k, 1, 1) with 32 k <= {MAX_BLOCK} (whole warps: "
            "a partial warp misses the full-mask shuffles)")
    if stream is None or (isinstance(stream, int) and stream == 0):
        raise LaunchContractError(
            f"stream {stream!r}: expected a named stream (Numba's 0 is a different stream "
            "in every thread when per-thread default streams are on)")


_launching = threading.local()  # the name of the kernel _launch is launching


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
                check_aligned(a)
            except LaunchContractError as exc:
                raise LaunchContractError(f"{name}: argument {i}: {exc}") from None
        with _lock:
            _recorded.setdefault(name, set()).add(tuple(specs))
        _count(f"launch {name}")
        _launching.name = name
        try:
            return original(kernel, blocks, stream, *args)
        finally:
            _launching.name = None

    _launch._contract = True
    kc._launch = _launch
    _install_counters()
    _install_configuration_check()
    return original


def _install_configuration_check():
    """Check the configuration of every kernel that ``_launch`` launches
    (the simulator's ``FakeCUDAKernel.__getitem__``: what the module really
    asks for, not what it meant to)."""
    from numba.cuda.simulator.kernel import FakeCUDAKernel
    getitem = FakeCUDAKernel.__getitem__
    if getattr(getitem, "_checked", False):
        return

    def __getitem__(self, configuration):
        name = getattr(_launching, "name", None)
        if name is not None:
            try:
                check_configuration(configuration)
            except LaunchContractError as exc:
                raise LaunchContractError(f"{name}: {exc}") from None
        return getitem(self, configuration)

    __getitem__._checked = True
    FakeCUDAKernel.__getitem__ = __getitem__


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


# ----------------------------------------------------------------------------
# warp rules in the source: no early return where lanes must meet
# ----------------------------------------------------------------------------
#: ``cuda.*`` calls that all lanes of a warp (or all threads of a block) must
#: reach: the full-mask warp intrinsics and the barriers
COLLECTIVE_INTRINSICS = {"shfl_sync", "shfl_up_sync", "shfl_down_sync", "shfl_xor_sync",
                         "ballot_sync", "all_sync", "any_sync", "eq_sync", "match_any_sync",
                         "match_all_sync", "syncwarp", "syncthreads", "syncthreads_count",
                         "syncthreads_and", "syncthreads_or"}


def _jit_kind(fn):
    """None (not a CUDA function), "kernel" or "device" for a FunctionDef."""
    for d in fn.decorator_list:
        call = d if isinstance(d, ast.Call) else None
        f = call.func if call else d
        if isinstance(f, ast.Attribute) and f.attr == "jit" and getattr(
                f.value, "id", None) == "cuda":
            device = call is not None and any(
                k.arg == "device" and isinstance(k.value, ast.Constant) and k.value.value
                for k in call.keywords)
            return "device" if device else "kernel"
    return None


def _own_nodes(fn):
    """The nodes of ``fn``'s body, not those of functions defined inside it."""
    todo = list(fn.body)
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                todo.append(child)


def early_returns(source, filename="kernels/cuda.py"):
    """Problems (strings) of the CUDA functions of ``source`` that call a
    warp intrinsic or a barrier, directly or through the module's device
    functions (and its simulator stand-ins of the intrinsics, which share
    their names): a kernel with a ``return`` (every thread must reach every
    full-warp operation; a kernel returns nothing, so any return is early),
    a device function with a ``return`` before its last statement."""
    tree = ast.parse(source, filename)
    funcs = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]
    calls = {}
    collective = set()
    for fn in funcs:
        names = set()
        for node in _own_nodes(fn):
            if isinstance(node, ast.Call):
                f = node.func
                if isinstance(f, ast.Name):
                    names.add(f.id)
                elif (isinstance(f, ast.Attribute) and getattr(f.value, "id", None) == "cuda"
                      and f.attr in COLLECTIVE_INTRINSICS):
                    collective.add(fn.name)
        calls[fn.name] = calls.get(fn.name, set()) | names
    changed = True
    while changed:
        changed = False
        for name, names in calls.items():
            if name not in collective and names & collective:
                collective.add(name)
                changed = True
    problems = []
    for fn in funcs:
        kind = _jit_kind(fn)
        if kind is None or fn.name not in collective:
            continue
        last = fn.body[-1]
        for node in _own_nodes(fn):
            if isinstance(node, ast.Return) and (kind == "kernel" or node is not last):
                problems.append(f"{filename}:{node.lineno}: {kind} {fn.name} returns early; "
                                "it calls warp intrinsics or barriers, which every lane "
                                "must reach")
    return sorted(problems)
