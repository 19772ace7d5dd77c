"""Every driver-level operation of the device path, counted in the simulator.

Numba's CUDA simulator runs every allocation, copy, launch and
synchronisation as Python; on a GPU each is a CUDA driver call, and several
of them make the host wait. :func:`install` wraps what the simulator offers
(the ``numba.cuda`` functions the library calls through the module, the
methods of ``FakeCUDAArray``, of its streams and events, and
``FakeCUDAKernel.__call__``) so that :func:`record` can count, over a window
(one warm call, say), per kind:

- ``alloc``: device and pinned/mapped/managed host allocations
  (``device_array``, ``device_array_like``, ``to_device`` without ``to=``,
  ``pinned_array``, ``pinned_array_like``, ``mapped_array``,
  ``managed_array``); an allocation or a free synchronises the device on a
  GPU;
- ``free``: allocations of this or an earlier window whose memory (the last
  view of it) was released during the window (CPython's reference counts;
  the cyclic collector is off in the window, so the count is the same at
  every run);
- ``launch``: kernel launches (``FakeCUDAKernel.__call__`` outside a kernel);
- ``H2D``, ``D2H``, ``D2D``: copies by direction (``to_device``,
  ``copy_to_device``, ``copy_to_host``); ``setitem``: a host value written
  into device memory by indexing (a copy or a kernel on a GPU);
- ``sync device`` (``cuda.synchronize``), ``sync stream``
  (``stream.synchronize``), ``sync event`` (``event.synchronize``);
- ``host wait``: every operation after which the host has waited for the
  device's queue: the three syncs, a device-to-host copy without a stream or
  into memory not allocated pinned (pageable: the driver returns when the
  copy is done, and so waits for the work queued before it), a
  host-to-device copy without a stream (``cuMemcpyHtoD`` is synchronous);
- ``H2D pageable``: host-to-device copies on a stream from memory not
  allocated pinned (the driver stages them on the host: no wait for the
  device, but a host copy);
- ``array objects``: device array objects created besides allocations
  (views, slices, wrappers of foreign arrays): each is a Python object and a
  descriptor on a GPU too (Numba's slicing was 0.33 of 1.40 s in issue 49's
  profile);
- ``stream create``, ``event create``, ``event record``, ``event wait``;
- Python calls in the recording thread (:func:`record` uses
  ``sys.setprofile``; the simulator's kernel bodies run in threads of their
  own, which are not profiled, as a GPU runs them): ``py calls``, Python
  functions called by a frame whose code lives in ``dirs`` (mpigc's
  package, kernels included); ``c calls``, builtins called by such frames;
  ``mpigc frames``, frames of code in ``dirs`` entered (a generator's
  resumption is one); ``all py calls``, every Python call of the thread
  outside the simulator's own implementation of the operations above.

Details (which function allocated, which kernel launched, which function
``py calls`` went to) are in :attr:`Record.detail`.
"""
import collections
import gc
import os
import sys
import threading
import weakref

import numpy as np

__all__ = ["KINDS", "install", "Record", "record"]

#: the counts of a :class:`Record`, in the order a table prints them
KINDS = ("alloc", "free", "launch", "H2D", "D2H", "D2D", "setitem", "H2D pageable",
         "sync device", "sync stream", "sync event", "host wait", "array objects",
         "stream create", "event create", "event record", "event wait",
         "py calls", "c calls", "mpigc frames", "all py calls")

_ALLOCATORS = ("device_array", "device_array_like", "to_device", "pinned_array",
               "pinned_array_like", "mapped_array", "managed_array")
_PINNED = ("pinned_array", "pinned_array_like", "mapped_array", "managed_array")


class Record:
    """The counts of one window (``counts``: kind -> n) and their details
    (``detail``: kind -> Counter of what: function, kernel, callee)."""

    def __init__(self):
        self.counts = dict.fromkeys(KINDS, 0)
        self.detail = collections.defaultdict(collections.Counter)


_state = threading.local()  # .inside: depth of wrapped operations (not counted twice)
_active = None  # the Record being filled, or None
_pinned = weakref.WeakValueDictionary()  # id -> host array allocated pinned
_installed = []
_block_thread = [()]  # the simulator's thread class of a CUDA thread, once installed


def _inside():
    return getattr(_state, "inside", 0)


class _Inside:
    """Marks the calling thread as inside one wrapped operation: what the
    simulator does there is the driver's work, not counted again."""

    def __enter__(self):
        _state.inside = _inside() + 1

    def __exit__(self, *exc):
        _state.inside -= 1


def _count(kind, what=None, n=1, always=False):
    """Count one operation of the window, unless it is part of another
    wrapped operation (``always``: count it anyway) or comes from a thread of
    the simulator's kernels (what a kernel does is not the host's)."""
    rec = _active
    if rec is None or (_inside() and not always) or isinstance(
            threading.current_thread(), _block_thread[0]):
        return
    rec.counts[kind] += n
    if what is not None:
        rec.detail[kind][what] += n


def _root(a):
    """The array that owns ``a``'s memory (the last ``.base`` that is an ndarray)."""
    while isinstance(getattr(a, "base", None), np.ndarray):
        a = a.base
    return a


def _freed(what):
    _count("free", what, always=True)


def _track(result, what):
    """Count the freeing of an allocation's memory, whenever it comes."""
    ary = getattr(result, "_ary", result)
    if isinstance(ary, np.ndarray):
        weakref.finalize(_root(ary), _freed, what)


def _is_pinned(h):
    return isinstance(h, np.ndarray) and _pinned.get(id(_root(h))) is _root(h)


def _wrap_allocator(cuda, name):
    original = getattr(cuda, name)

    def allocate(*args, **kwargs):
        if name == "to_device" and kwargs.get("to") is not None:
            src = args[0] if args else kwargs.get("ary")
            stream = args[1] if len(args) > 1 else kwargs.get("stream", 0)
            _h2d(src, stream)
            with _Inside():
                return original(*args, **kwargs)
        _count("alloc", name)
        if name == "to_device":
            stream = args[1] if len(args) > 1 else kwargs.get("stream", 0)
            _count("H2D", "to_device")
            if not stream:
                _count("host wait", "H2D without a stream")
            elif not _is_pinned(args[0] if args else kwargs.get("ary")):
                _count("H2D pageable", "to_device")
        with _Inside():
            out = original(*args, **kwargs)
        if name in _PINNED and isinstance(out, np.ndarray):
            _pinned[id(_root(out))] = _root(out)
        _track(out, name)
        return out

    allocate.__name__ = name
    allocate._device_ops = True
    setattr(cuda, name, allocate)


def _h2d(src, stream):
    if getattr(type(src), "__cuda_ndarray__", False):
        _count("D2D", "copy_to_device")
        return
    _count("H2D", "copy_to_device")
    if not stream:
        _count("host wait", "H2D without a stream")
    elif not _is_pinned(src):
        _count("H2D pageable", "copy_to_device")


def install():
    """Wrap the simulator (``NUMBA_ENABLE_CUDASIM=1``) once per process."""
    if _installed:
        return
    from numba import cuda
    from numba.cuda.simulator import kernel as simkernel
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
    _block_thread[0] = simkernel.BlockThread
    for name in _ALLOCATORS:
        if hasattr(cuda, name):  # (the simulator has no managed_array)
            _wrap_allocator(cuda, name)

    init = FakeCUDAArray.__init__

    def __init__(self, ary, stream=0):
        _count("array objects")
        init(self, ary, stream)

    FakeCUDAArray.__init__ = __init__
    to_host = FakeCUDAArray.copy_to_host

    def copy_to_host(self, ary=None, stream=0):
        _count("D2H", "copy_to_host")
        if not stream or ary is None or not _is_pinned(ary):
            _count("host wait", "D2H " + ("without a stream" if not stream
                                          else "into pageable memory"))
        with _Inside():
            return to_host(self, ary, stream)

    FakeCUDAArray.copy_to_host = copy_to_host
    to_dev = FakeCUDAArray.copy_to_device

    def copy_to_device(self, ary, stream=0):
        _h2d(ary, stream)
        with _Inside():
            return to_dev(self, ary, stream)

    FakeCUDAArray.copy_to_device = copy_to_device
    setitem = FakeCUDAArray.__setitem__

    def __setitem__(self, idx, val):
        _count("setitem")
        with _Inside():
            return setitem(self, idx, val)

    FakeCUDAArray.__setitem__ = __setitem__

    call = simkernel.FakeCUDAKernel.__call__

    def launch(self, *args):
        if self._device or simkernel._kernel_context is not None:
            return call(self, *args)
        _count("launch", getattr(self, "__name__", "?"))
        with _Inside():
            return call(self, *args)

    simkernel.FakeCUDAKernel.__call__ = launch

    sync = cuda.synchronize

    def synchronize():
        _count("sync device")
        _count("host wait", "sync device")
        with _Inside():
            return sync()

    cuda.synchronize = synchronize

    stream_cls = type(cuda.default_stream())
    ssync, sinit = stream_cls.synchronize, stream_cls.__init__

    def stream_synchronize(self):
        _count("sync stream")
        _count("host wait", "sync stream")
        with _Inside():
            return ssync(self)

    def stream_init(self, *a, **kw):
        _count("stream create")
        sinit(self, *a, **kw)

    stream_cls.synchronize = stream_synchronize
    stream_cls.__init__ = stream_init

    event_cls = cuda.event
    esync, erecord, ewait = event_cls.synchronize, event_cls.record, event_cls.wait
    einit = event_cls.__init__

    def event_synchronize(self):
        _count("sync event")
        _count("host wait", "sync event")
        return esync(self)

    def event_record(self, stream=0):
        _count("event record")
        return erecord(self, stream)

    def event_wait(self, stream=0):
        _count("event wait")
        return ewait(self, stream)

    def event_init(self, *a, **kw):
        _count("event create")
        einit(self, *a, **kw)

    event_cls.synchronize, event_cls.record = event_synchronize, event_record
    event_cls.wait, event_cls.__init__ = event_wait, event_init
    _installed.append(True)


def _profiler(dirs, rec):
    """A ``sys.setprofile`` function counting the Python calls of the thread
    (see the module docstring), outside the wrapped operations."""
    mine = tuple(os.path.join(os.path.realpath(d), "") for d in dirs)
    counts, detail = rec.counts, rec.detail
    own = {}  # code object -> whether it lives in dirs

    def is_mine(code):
        r = own.get(code)
        if r is None:
            r = own[code] = os.path.realpath(code.co_filename).startswith(mine)
        return r

    def profile(frame, event, arg):
        if _inside():
            return
        if event == "call":
            counts["all py calls"] += 1
            code = frame.f_code
            if is_mine(code):
                counts["mpigc frames"] += 1
            caller = frame.f_back
            if caller is not None and is_mine(caller.f_code):
                counts["py calls"] += 1
                if code.co_filename == __file__:  # a wrapper: the numba function
                    what = f"numba.cuda op ({code.co_name})"
                else:
                    what = f"{os.path.basename(code.co_filename)}:{code.co_name}"
                detail["py calls"][what] += 1
        elif event == "c_call" and is_mine(frame.f_code):
            counts["c calls"] += 1
            detail["c calls"][getattr(arg, "__qualname__", repr(arg))] += 1

    return profile


def record(fn, dirs):
    """Run ``fn()`` and return ``(its result, Record)``: every operation of
    the module docstring, and the Python calls of this thread made by frames
    whose code lives under one of ``dirs``."""
    global _active
    if not _installed:
        raise RuntimeError("device_ops.install() first")
    rec = Record()
    enabled = gc.isenabled()
    gc.disable()
    _active = rec
    sys.setprofile(_profiler(dirs, rec))
    try:
        out = fn()
    finally:
        sys.setprofile(None)
        _active = None
        if enabled:
            gc.enable()
    return out, rec
