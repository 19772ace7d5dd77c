"""Kernel launches and small copies straight to the CUDA driver.

Numba compiles the kernels of :mod:`mpigc.kernels.cuda` and keeps them in its
disk cache; launching one through Numba (``kernel[grid, block, stream](*args)``)
costs about 56 us of host time on an H200's host (typing every argument,
marshalling each array, a context check per driver call), the same
launch through ``cuLaunchKernel`` with a parameter block built once about 6 us
(``benchmarks/gpu_launch.py``, issue 49). This module is that second route:

- a kernel's first launch with a set of argument types goes through Numba
  (which compiles it, or loads it from the disk cache); from the second on,
  the kernel is loaded once from the PTX Numba made for those types
  (``Dispatcher.inspect_asm``, public) by ``cuda.core``
  (``ObjectCode.from_ptx(...).get_kernel(name)``) and launched with
  ``cuLaunchKernel`` (``cuda.bindings.driver``);
- the parameter block follows Numba's kernel ABI: an array is 5 + 2 ndim
  fields (meminfo, parent, nitems, itemsize, data, shape, strides), a
  boolean one byte, a scalar its width, each at its natural alignment. Its
  layout is derived from the Numba signature and checked against the
  ``.param`` list of the PTX (count and widths) before the kernel is used;
  a signature whose layout does not match, or an argument that is not a
  C-contiguous array, a boolean or a number, stays on Numba's route (so
  does everything in the simulator);
- per launch only the values are packed (``struct.pack_into`` into the
  kernel's buffer, under its lock) and the driver called once;
- :func:`memset0`, :func:`to_host`, :func:`copy` and :func:`sync` are the
  small copies and waits of a call (a counter zeroed, an 8-byte count read
  into pinned memory) on the driver's asynchronous calls, in stream order;
  a host wait is an event recorded on the stream and synchronised, so it
  waits for what was queued before it only, not for what other threads
  queue on the stream meanwhile (on the legacy stream: torch's backward
  kernels while a DDP hook's call runs).

``MPIGC_DRIVER_LAUNCH=0`` turns the route off (every launch and copy through
Numba, as before issue 49). :func:`stats` counts the launches of each route.
"""
import os
import re
import struct
import threading

import numpy as np

_lock = threading.Lock()
_state = {"on": None, "drv": None, "cc": None}

#: Whether the route is on: None until :func:`enabled` first decides, then
#: its answer. Callers test ``_driver.ON is not False`` before calling in,
#: so that off the route (the simulator, no GPU) nothing is called at all;
#: the functions below read it first too (``ON or enabled()``), so that on
#: the route they ask :func:`enabled` nothing once it decided.
ON = None
_fns = {}  # (kernel, key) -> _Fn, or None: Numba's route for good
_numba_launches = {}  # (kernel, key) -> launches through Numba so far
_streams = {}  # id(numba stream) -> (stream, driver handle)
_counts = {"driver": 0, "numba": 0, "refused": 0, "copies": 0}

# PTX parameter types and their widths
_PTX_WIDTH = {"u8": 1, "s8": 1, "b8": 1, "u16": 2, "s16": 2, "b16": 2, "f16": 2,
              "u32": 4, "s32": 4, "b32": 4, "f32": 4, "u64": 8, "s64": 8, "b64": 8, "f64": 8}


def enabled():
    """Whether launches and copies go to the driver: a real GPU, the CUDA
    Python bindings importable, and ``MPIGC_DRIVER_LAUNCH`` not ``0``."""
    on = _state["on"]
    if on is None:
        on = False
        if os.environ.get("MPIGC_DRIVER_LAUNCH", "1") != "0":
            from numba import cuda
            try:  # numba-cuda
                from numba.cuda.core import config
            except ImportError:  # numba's bundled CUDA target
                from numba.core import config
            if not getattr(config, "ENABLE_CUDASIM", 0) and cuda.is_available():
                try:
                    from cuda.bindings import driver
                    import cuda.core as cc
                except ImportError:
                    pass
                else:
                    _state["drv"], _state["cc"] = driver, cc
                    on = True
        _state["on"] = on
        global ON
        ON = on
    return on


def stats():
    """Launches and copies so far by route: ``driver``, ``numba``, ``refused``
    (signatures kept on Numba's route), ``copies`` (driver copies and sets)."""
    return dict(_counts)


def param_codes(sig):
    """The ``struct`` codes of a kernel's parameters, one per PTX ``.param``,
    for the Numba argument types ``sig``; None where a type is not one this
    route packs."""
    from numba.core import types
    scalar = {types.boolean: "B", types.float32: "f", types.float64: "d",
              types.int64: "q", types.uint64: "Q", types.int32: "i", types.uint32: "I",
              types.int16: "h", types.uint16: "H", types.int8: "b", types.uint8: "B"}
    codes = []
    for t in sig:
        if isinstance(t, types.Array):
            if t.layout != "C":
                return None
            codes += ["Q", "Q", "q", "q", "Q"] + ["q"] * (2 * t.ndim)
        elif t in scalar:
            codes.append(scalar[t])
        else:
            return None
    return codes


def ptx_params(ptx, name):
    """The ``.param`` types of entry ``name`` in ``ptx``, in order."""
    at = ptx.find(name + "(")
    if at < 0:
        return None
    head = ptx[at:ptx.find(")", at)]
    return re.findall(r"\.param\s+\.(\w+)\s+\S", head)


def layout_matches(codes, params):
    """Whether packing ``codes`` gives the parameters ``params`` (count and
    each width)."""
    return (codes is not None and params is not None and len(codes) == len(params)
            and all(struct.calcsize(c) == _PTX_WIDTH.get(p) for c, p in zip(codes, params)))


def _format(codes):
    """A ``struct`` format placing each parameter at its natural alignment,
    and the offsets."""
    fmt, offs, at = ["<"], [], 0
    for c in codes:
        w = struct.calcsize(c)
        pad = -at % w
        if pad:
            fmt.append(f"{pad}x")
            at += pad
        offs.append(at)
        fmt.append(c)
        at += w
    return "".join(fmt), offs, max(at, 1)


class _Fn:
    """A kernel loaded for one signature: its handle, packing format, buffer
    and the array of pointers to each parameter the driver reads."""

    __slots__ = ("kernel", "code", "handle", "fmt", "buf", "ptrs", "addr", "lock")

    def __init__(self, code, kernel, codes):
        import ctypes
        self.code, self.kernel = code, kernel  # kept alive: the library holds the kernel
        self.handle = kernel.handle
        self.fmt, offs, size = _format(codes)
        self.buf = (ctypes.c_char * size)()
        base = ctypes.addressof(self.buf)
        self.ptrs = (ctypes.c_void_p * max(len(offs), 1))(*[base + o for o in offs])
        self.addr = ctypes.addressof(self.ptrs)
        self.lock = threading.Lock()


_PLAIN = {bool, int, float}


def _args(args):
    """The launch's argument kinds and parameter values, in one pass:
    ``(key, values)``, or None where an argument is not for this route.
    Kinds: arrays by dtype and dimensions (C-contiguous only), scalars by
    Python type; values: an array's 5 + 2 ndim fields of Numba's kernel
    ABI, a scalar as a Python number."""
    key, vals = [], []
    for a in args:
        t = type(a)
        if t in _PLAIN:
            key.append(t)
            vals.append(a)
            continue
        if isinstance(a, np.generic):
            key.append(t)
            vals.append(a.item())
            continue
        try:
            shape, strides, dt, gd = a.shape, a.strides, a.dtype, a.gpu_data
        except AttributeError:
            return None
        if len(shape) == 1:
            if shape[0] > 1 and strides[0] != dt.itemsize:
                return None
        elif not a.flags["C_CONTIGUOUS"] or (0 in strides and a.size):
            return None
        key.append((dt, len(shape)))
        vals += (0, 0, a.size, dt.itemsize,
                 0 if gd is None else gd.device_ctypes_pointer.value or 0)
        vals += shape
        vals += strides
    return tuple(key), vals


def _load(dispatcher, args):
    """Load ``dispatcher``'s kernel for the types of ``args`` (compiled by
    Numba's first launch): an :class:`_Fn`, or None (Numba's route)."""
    sig = tuple(dispatcher.typeof_pyval(a) for a in args)
    codes = param_codes(sig)
    if codes is None:
        return None
    try:
        ptx = dispatcher.inspect_asm(sig)
    except Exception:  # noqa: BLE001 - no PTX at hand: Numba's route
        return None
    m = re.search(r"\.entry\s+(\S+)\s*\(", ptx)
    if m is None or not layout_matches(codes, ptx_params(ptx, m.group(1))):
        return None
    cc = _state["cc"]
    dev = device_id()
    if dev is None:  # no context current in this thread: Numba makes one
        from numba import cuda
        dev = cuda.get_current_device().id
    cc.Device(dev).set_current()
    code = cc.ObjectCode.from_ptx(ptx.encode())
    return _Fn(code, code.get_kernel(m.group(1)), codes)


def _handle(stream):
    """The driver handle of Numba stream ``stream``."""
    got = _streams.get(id(stream))
    if got is None or got[0] is not stream:
        if len(_streams) >= 256:  # streams made per call by a caller: no growth
            _streams.clear()
        h = stream.handle
        drv = _state["drv"]
        if not isinstance(h, drv.CUstream):
            h = drv.CUstream(int(getattr(h, "value", h) or 0))
        got = _streams[id(stream)] = (stream, h)
    return got[1]


def _check(err, what):
    drv = _state["drv"]
    if err != drv.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"mpigc: {what} failed: {err!r}")


def launch(dispatcher, grid, block, stream, args):
    """Launch ``dispatcher`` on ``grid`` (blocks, or (x, y)) of ``block``
    threads on Numba stream ``stream`` with ``args`` through the driver, and
    return True; False where this launch is for Numba's route (the caller
    launches it there)."""
    if not (ON or enabled()):
        return False
    kv = _args(args)
    if kv is None:
        _counts["numba"] += 1
        return False
    k = (dispatcher, kv[0])
    fn = _fns.get(k, False)
    if fn is False:
        seen = _numba_launches.get(k, 0)
        if not seen:  # the first: Numba compiles, or loads its disk cache
            _numba_launches[k] = 1
            _counts["numba"] += 1
            return False
        with _lock:
            fn = _fns.get(k, False)
            if fn is False:
                fn = _fns[k] = _load(dispatcher, args)
                if fn is None:
                    _counts["refused"] += 1
    if fn is None:
        _counts["numba"] += 1
        return False
    gx, gy = (grid, 1) if isinstance(grid, int) else grid
    hs = _handle(stream)
    vals = kv[1]
    drv = _state["drv"]
    for retry in (False, True):
        with fn.lock:
            struct.pack_into(fn.fmt, fn.buf, 0, *vals)
            err, = drv.cuLaunchKernel(fn.handle, gx, gy, 1, block, 1, 1, 0, hs, fn.addr, 0)
        if err != drv.CUresult.CUDA_ERROR_INVALID_CONTEXT or retry:
            break
        from numba import cuda  # a thread without a context yet: Numba makes it current
        cuda.current_context()
    _check(err, "cuLaunchKernel")
    _counts["driver"] += 1
    return True


def _ptr(d):
    return d.gpu_data.device_ctypes_pointer.value if d.gpu_data is not None else 0


def memset0(d, stream):
    """Zero device array ``d`` in stream order; False: not this route."""
    if not (ON or enabled()) or not _contiguous(d):
        return False
    drv = _state["drv"]
    err, = drv.cuMemsetD8Async(_ptr(d), 0, d.nbytes, _handle(stream))
    _check(err, "cuMemsetD8Async")
    _counts["copies"] += 1
    return True


def to_host(h, d, stream):
    """``h[:] = d`` (pinned or pageable host ``h``), in order on ``stream``,
    then wait for ``stream``; False: not this route."""
    if not (ON or enabled()) or not _contiguous(d) or h.nbytes != d.nbytes:
        return False
    drv = _state["drv"]
    hs = _handle(stream)
    err, = drv.cuMemcpyDtoHAsync(h.ctypes.data, _ptr(d), d.nbytes, hs)
    _check(err, "cuMemcpyDtoHAsync")
    _wait(hs)
    _counts["copies"] += 1
    return True


def _contiguous(d):
    """Whether ``d`` is a Numba device array whose bytes are one run."""
    if not hasattr(d, "gpu_data"):
        return False
    if d.ndim == 1:
        return d.size <= 1 or d.strides[0] == d.dtype.itemsize
    return bool(d.flags["C_CONTIGUOUS"])


def copy(dst, src, stream, wait):
    """``dst[:] = src`` of equal bytes, host (contiguous numpy) or device
    (Numba's) on either side, in order on ``stream``; with ``wait``, then
    wait for ``stream``. False: not this route (the caller copies through
    Numba, which also raises on what does not fit)."""
    if not (ON or enabled()):
        return False
    dh, sh = isinstance(dst, np.ndarray), isinstance(src, np.ndarray)
    if (dh and sh) or dst.nbytes != src.nbytes:
        return False
    if (dh and not dst.flags.c_contiguous) or (sh and not src.flags.c_contiguous):
        return False
    if (not dh and not _contiguous(dst)) or (not sh and not _contiguous(src)):
        return False
    drv = _state["drv"]
    hs = _handle(stream)
    n = dst.nbytes
    if n:
        if dh:
            err, = drv.cuMemcpyDtoHAsync(dst.ctypes.data, _ptr(src), n, hs)
        elif sh:
            err, = drv.cuMemcpyHtoDAsync(_ptr(dst), src.ctypes.data, n, hs)
        else:
            err, = drv.cuMemcpyDtoDAsync(_ptr(dst), _ptr(src), n, hs)
        _check(err, "cuMemcpyAsync")
    if wait:
        _wait(hs)
    _counts["copies"] += 1
    return True


def sync(stream):
    """Wait for the work queued on ``stream`` so far; False: not this
    route."""
    if not (ON or enabled()):
        return False
    _wait(_handle(stream))
    return True


def _event(kind):
    """The calling thread's event ``kind`` in its current context, made
    once (an event may be recorded again once what waited on it took its
    state: a stream wait at its queueing, a host wait at its return)."""
    drv = _state["drv"]
    err, ctx = drv.cuCtxGetCurrent()
    _check(err, "cuCtxGetCurrent")
    key = (kind, threading.get_ident(), int(ctx))
    ev = _events.get(key)
    if ev is None:
        err, ev = drv.cuEventCreate(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING)
        _check(err, "cuEventCreate")
        _events[key] = ev
    return ev


def _wait(hs):
    """Wait on the host for the work queued on stream ``hs`` so far: an
    event recorded there and waited for (``cuEventSynchronize``), not the
    whole stream (``cuStreamSynchronize`` would also wait for what other
    threads queue on it meanwhile: on the legacy stream, torch's backward
    kernels queued while a DDP hook's call runs)."""
    drv = _state["drv"]
    ev = _event("wait")
    err, = drv.cuEventRecord(ev, hs)
    _check(err, "cuEventRecord")
    err, = drv.cuEventSynchronize(ev)
    _check(err, "cuEventSynchronize")


_events = {}  # (kind, thread id, context) -> an event of that thread (re-recorded)


def order_after(producer, stream):
    """Order ``stream`` after the work queued so far on the stream whose
    driver handle is the int ``producer``, without a host wait: an event
    recorded there, waited for on ``stream`` (one event per thread and
    context, made once: the wait takes the event's state when it is
    queued). False: not
    this route."""
    if not (ON or enabled()):
        return False
    drv = _state["drv"]
    ev = _event("order")
    err, = drv.cuEventRecord(ev, drv.CUstream(producer))
    _check(err, "cuEventRecord")
    err, = drv.cuStreamWaitEvent(_handle(stream), ev, 0)
    _check(err, "cuStreamWaitEvent")
    return True


def order_streams(stream, waiters):
    """Order each of ``waiters`` (int driver handles: 1 the legacy, 2 the
    per-thread default stream) after the work queued so far on Numba stream
    ``stream``, without a host wait: one event recorded there, waited for on
    each. False: not this route."""
    if not (ON or enabled()):
        return False
    drv = _state["drv"]
    ev = _event("finish")
    err, = drv.cuEventRecord(ev, _handle(stream))
    _check(err, "cuEventRecord")
    for w in waiters:
        err, = drv.cuStreamWaitEvent(drv.CUstream(w), ev, 0)
        _check(err, "cuStreamWaitEvent")
    return True


def device_id():
    """The ordinal of the GPU whose context is current in the calling
    thread (``cuCtxGetDevice``: well under a microsecond, where Numba's
    ``get_current_device`` takes tens), or None: no context current, or not
    this route (the caller asks Numba, which makes one current)."""
    if not (ON or enabled()):
        return None
    err, dev = _state["drv"].cuCtxGetDevice()
    if err != _state["drv"].CUresult.CUDA_SUCCESS:
        return None
    return int(dev)
