"""The GPU side of the collectives: CUDA-aware MPI, device selection, staging.

Nothing here runs at import: ``numba.cuda`` is imported the first time a
device array reaches a collective, or one of the public functions below is
called. See ``docs/gpu.md``.

CUDA-aware MPI
    :func:`cuda_aware_mpi` decides, per communicator and once, whether MPI may
    be given device pointers: ``$MPIGC_CUDA_AWARE`` (``1`` / ``0``) wins;
    otherwise "yes" when the MPI-4.1 info key ``mpi_memory_alloc_kinds`` (of
    the communicator, then ``MPI_INFO_ENV``) lists CUDA memory; otherwise
    (no key, or a key without cuda: it lists only what was requested) Open
    MPI's ``MPIX_Query_cuda_support()`` (looked up with ctypes in the loaded
    libmpi); otherwise "no". Without CUDA-aware MPI the packed payloads
    are staged through reusable pinned host buffers (:class:`_StagingPool`),
    and a warning says so once per process.

Device selection
    :func:`select_device` makes one GPU current: ``device=``, else
    ``$MPIGC_DEVICE``, else the node-local rank modulo the visible GPUs. When
    a collective first sees a device array and ``$MPIGC_DEVICE`` is set, it
    calls ``select_device`` itself; otherwise the kernels run on the GPU that
    holds the array (as torch and CuPy report it), or Numba's current one.

Streams
    The engine's kernels and copies run on :func:`engine_stream`, the legacy
    default stream named explicitly (the same stream in every thread, also
    with per-thread default streams on, and torch's default stream). Before a
    foreign array is used, the engine's stream waits for the stream that
    produced it (:func:`wait_for_producer`: the interface's ``stream``, or
    torch's current stream for a torch tensor); :func:`sync` waits for the
    engine's stream before MPI or the caller reads. On a GPU, copies, waits
    and the producer's event go straight to the CUDA driver
    (``mpigc.kernels._driver``; ``MPIGC_DRIVER_LAUNCH=0``: through Numba).

Simulator test seam
    Under ``NUMBA_ENABLE_CUDASIM=1`` a "device array" is a numpy array in a
    wrapper (``FakeCUDAArray``) that MPI cannot take. :func:`mpi_buffer` hands
    MPI the wrapped numpy array there (what a CUDA-aware MPI does with device
    memory), so the CUDA-aware code path runs in the tests; on a GPU it hands
    MPI the device array itself. Nothing else depends on the simulator.
"""
import collections
import contextlib
import ctypes
import os
import sys
import threading

import numpy as np

from ._errors import ConfigError, DTypeError, warn_caller
from .kernels import _driver  # numpy only at import: no CUDA

__all__ = ["CudaAwareness", "cuda_aware_mpi", "select_device"]

#: The decision of :func:`cuda_aware_mpi`: ``aware`` (bool) and ``source``
#: (what decided it, e.g. ``"MPIGC_CUDA_AWARE=0"``).
CudaAwareness = collections.namedtuple("CudaAwareness", "aware source")

_lock = threading.Lock()
_warned_staging = False
_selected = None  # the device select_device() chose, once called


def simulator():
    """True when Numba's CUDA simulator is on (``NUMBA_ENABLE_CUDASIM=1``)."""
    return os.environ.get("NUMBA_ENABLE_CUDASIM", "0").strip() not in ("", "0")


def _numba_cuda():
    try:
        from numba import cuda
    except ImportError as exc:  # pragma: no cover - numba ships numba.cuda
        raise DTypeError(f"a CUDA device array was given, but numba.cuda is not available "
                         f"({exc}); install it with: pip install 'mpigc[cuda]'") from exc
    return cuda


# -- arrays ------------------------------------------------------------------
def as_device(a, producers=None):
    """``a`` as a Numba device array (no copy), after the work of the stream
    that produced it (:func:`wait_for_producer`; Numba arrays: their own
    stream, synchronised, or, with a stream of mpigc's own, waited for on
    it by an event): the engine's kernels run on another stream
    (:func:`engine_stream`). ``producers`` (a list): where the producer's
    stream is appended when the call's end must order it after the
    engine's work (:func:`finish`)."""
    cuda = _numba_cuda()
    if getattr(type(a), "__cuda_ndarray__", False):  # Numba's own (or the simulator's)
        stream = getattr(a, "stream", 0)
        if stream:
            if own_stream():
                _order(stream, engine_stream())
                if producers is not None and not any(p is stream for p in producers):
                    producers.append(stream)
            else:
                stream.synchronize()
        return a
    wait_for_producer(a, producers)
    if simulator():
        return _simulated_from_interface(a)
    # dtype, shape, strides and the pointer come from the interface (a torch
    # tensor's own .dtype is a torch dtype, not a numpy one); the producer's
    # stream was taken care of above
    return cuda.as_cuda_array(a, sync=False)


def producer_stream(a):
    """The stream whose queued work on foreign device array ``a`` must come
    before the engine's, as an int: the ``stream`` of its
    ``__cuda_array_interface__`` (version 3: ``None`` for none, ``1`` the
    legacy default stream, ``2`` the per-thread default stream, else a
    ``cudaStream_t``); for a torch tensor, whose interface (version 2) has
    no stream, torch's current stream on the tensor's device (torch's rule:
    a tensor is used on the current stream), ``1`` for torch's default
    stream (the legacy stream). ``None`` when there is nothing to wait for."""
    ptr = a.__cuda_array_interface__.get("stream")
    torch = sys.modules.get("torch")
    if ptr is None and torch is not None and isinstance(a, torch.Tensor):
        return torch.cuda.current_stream(a.device).cuda_stream or 1
    if ptr is not None and (isinstance(ptr, bool) or not isinstance(ptr, int) or ptr == 0):
        raise DTypeError(f"__cuda_array_interface__: expected a stream of None, 1, 2 or a "
                         f"cudaStream_t, got {ptr!r} (version 3 does not allow 0)")
    return ptr


def wait_for_producer(a, producers=None):
    """Order the engine's stream after the work queued so far on the stream
    that produced ``a`` (:func:`producer_stream`), without a host wait: an
    event recorded there, waited for on the engine's stream. Nothing to do
    for the legacy stream and a per-thread default stream when the engine
    runs on the legacy stream or on a blocking stream of its own (CUDA's
    rules order them: a blocking stream's work waits for the legacy
    stream's earlier work, and the legacy stream's for every blocking
    stream's); a non-blocking stream of its own waits for them too
    (``MPIGC_CUDA_STREAM=nonblocking``). An array made on another stream
    than the one its interface names (CuPy, torch: the current one) is not
    covered: make that stream current, or synchronise it, before the call.
    ``producers``: as :func:`as_device` (a stream of mpigc's own only)."""
    ptr = producer_stream(a)
    if ptr is None or simulator():
        return  # (the simulator runs every launch and copy to its end at once)
    if ptr in (1, 2) and _mode() != "nonblocking":
        return
    if producers is not None and own_stream() and ptr not in producers:
        producers.append(ptr)
    _order(ptr, engine_stream())


def _order(producer, stream):
    """``stream`` after the work queued so far on ``producer`` (an int
    handle, 1 the legacy and 2 the per-thread default stream, or a Numba
    stream), without a host wait: an event recorded there, waited for on
    ``stream``."""
    if isinstance(producer, int) and _driver.ON is not False \
            and _driver.order_after(producer, stream):
        return
    cuda = _numba_cuda()
    if isinstance(producer, int):
        producer = (cuda.legacy_default_stream() if producer == 1 else
                    cuda.per_thread_default_stream() if producer == 2 else
                    cuda.external_stream(producer))
    ev = _thread_event("order")
    ev.record(producer)
    ev.wait(stream)


_events = threading.local()  # the calling thread's events (Numba's), made once


def _event():
    """A new Numba event without timing (the simulator's takes no argument)."""
    cuda = _numba_cuda()
    return cuda.event() if simulator() else cuda.event(timing=False)


def _thread_event(kind):
    """The calling thread's event ``kind`` (Numba's, without timing), made
    once: an event may be recorded again once what waited on it took its
    state (a stream wait when it is queued)."""
    ev = getattr(_events, kind, None)
    if ev is None:
        ev = _event()
        setattr(_events, kind, ev)
    return ev


def _simulated_from_interface(a):
    """Under the simulator: a foreign object's ``__cuda_array_interface__`` as
    a simulated device array over the memory it points to (host memory
    there), typed only from the interface (``typestr``, ``shape``,
    ``strides``), as ``cuda.as_cuda_array`` does on a GPU."""
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
    iface = a.__cuda_array_interface__

    class _Memory:
        pass

    mem = _Memory()
    mem.owner = a  # keeps the foreign object alive as long as the view
    mem.__array_interface__ = {"data": tuple(iface["data"]), "shape": tuple(iface["shape"]),
                               "typestr": np.dtype(iface["typestr"]).str,
                               "strides": iface.get("strides"), "version": 3}
    return FakeCUDAArray(np.asarray(mem))


def is_readonly(a):
    """Whether a foreign device array says it is read-only."""
    try:
        return bool(a.__cuda_array_interface__["data"][1])
    except (AttributeError, KeyError, TypeError, IndexError):
        return False


def is_c_contiguous(d):
    """For Numba device arrays (real or simulated)."""
    return d.size <= 1 or bool(d.is_c_contiguous())


def empty(n, dtype):
    return _numba_cuda().device_array(int(n), np.dtype(dtype))


def zeros(n, dtype):
    return _numba_cuda().to_device(np.zeros(int(n), np.dtype(dtype)))


def to_device(h):
    return _numba_cuda().to_device(np.ascontiguousarray(h))


def to_host(d, out=None):
    """Copy device array ``d`` to host (into ``out`` if given): synchronous,
    in order on the engine's stream."""
    if not own_stream() and (_driver.ON or (_driver.ON is None and _driver.enabled())):
        h = np.empty(d.shape, d.dtype) if out is None else out
        if _driver.copy(h, d, engine_stream(), True):
            return h
    if own_stream():  # a synchronous copy would not wait for a stream of its own
        s, h = engine_stream(), None
        if _driver.ON or (_driver.ON is None and _driver.enabled()):
            t = np.empty(d.shape, d.dtype) if out is None else out
            if _driver.copy(t, d, s, False):
                h = t
        if h is None:  # (Numba makes a host array that fits when out is None)
            h = d.copy_to_host(out, stream=s)
        kc = _kc()
        kc._queued[0] += 1
        kc.host_wait(s)
        return h
    if out is None:
        return d.copy_to_host()
    d.copy_to_host(out)
    return out


# -- the engine's stream ---------------------------------------------------------
_MODES = {"": None, "0": None, "off": None, "1": "blocking", "on": "blocking",
          "blocking": "blocking", "nonblocking": "nonblocking"}
_stream_mode = []  # [mode, whether it is one], decided once (tests: _reset_stream_mode)
_own = {}  # device id -> mpigc's stream there


def _mode():
    """``MPIGC_CUDA_STREAM``: None (unset or ``0``: the legacy default
    stream), ``"blocking"`` (``1``: a stream of mpigc's own, which CUDA
    orders with the legacy default stream both ways) or ``"nonblocking"``
    (a non-blocking one: see docs/gpu.md, "Not done yet")."""
    if not _stream_mode:
        env = os.environ.get("MPIGC_CUDA_STREAM", "").strip().lower()
        if env not in _MODES:
            raise ConfigError(f"MPIGC_CUDA_STREAM: expected 0, 1 or nonblocking, got {env!r}")
        _stream_mode[:] = [_MODES[env], _MODES[env] is not None]
    return _stream_mode[0]


def own_stream():
    """Whether the engine runs on a stream of mpigc's own (``MPIGC_CUDA_STREAM``)."""
    if _stream_mode:
        return _stream_mode[1]
    return _mode() is not None


def _reset_stream_mode():
    """Read ``MPIGC_CUDA_STREAM`` again (tests); the streams made stay."""
    del _stream_mode[:]


_kcm = []


def _kc():
    """``mpigc.kernels.cuda``, imported on first use."""
    if not _kcm:
        from .kernels import cuda as kc
        _kcm.append(kc)
    return _kcm[0]


def engine_stream():
    """The stream of the engine's kernels and copies: the legacy default
    stream, named explicitly (``mpigc.kernels.cuda.default_stream``), one
    stream per device in every thread whatever the per-thread default
    stream setting, and torch's default stream; with ``MPIGC_CUDA_STREAM``
    set, a stream of mpigc's own on the current GPU, made once per device."""
    kc = _kc()
    if not own_stream():
        return kc.default_stream()
    dev = kc._device_id()
    s = _own.get(dev)
    if s is None:
        with _lock:
            s = _own.get(dev)
            if s is None:
                s = _own[dev] = _new_stream(_mode() == "nonblocking")
    return s


def _new_stream(nonblocking):
    """A stream of mpigc's own on the current GPU, as a Numba stream: a
    blocking one (Numba's ``cuda.stream()``), or a non-blocking one made by
    the driver (``CU_STREAM_NON_BLOCKING``; in the simulator, where streams
    do nothing, Numba's)."""
    cuda = _numba_cuda()
    if not nonblocking or simulator():
        return cuda.stream()
    from cuda.bindings import driver as drv
    err, h = drv.cuStreamCreate(drv.CUstream_flags.CU_STREAM_NON_BLOCKING)
    if err != drv.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"mpigc: cuStreamCreate failed: {err!r}")
    s = cuda.external_stream(int(h))
    s._mpigc_handle = h  # the stream lives as long as the process
    return s


_NO_KW = {}


def stream_kw():
    """The keyword arguments that put a kernel function of
    ``mpigc.kernels.cuda`` on the engine's stream: none on the legacy
    stream (their default), ``cuda_stream=`` a stream of mpigc's own."""
    if not own_stream():
        return _NO_KW
    return {"cuda_stream": engine_stream()}


def finish(producers=()):
    """A call's device work is queued: with the legacy default stream, wait
    for it on the host (:func:`sync`); with a stream of mpigc's own, no host
    wait: an event recorded on that stream, waited for on ``producers`` (the
    streams the call's arrays came from, :func:`as_device`) and, for a
    non-blocking stream, on the legacy default stream (a blocking stream,
    the per-thread default streams included, waits for the legacy stream's
    earlier work; the legacy stream for a blocking stream's), so that work
    queued there after the call reads its results."""
    if not own_stream():
        sync()
        return
    s = engine_stream()
    waiters = list(producers)
    if _mode() == "nonblocking":
        waiters.append(1)
    if not waiters:
        return
    if _driver.ON is not False and all(isinstance(w, int) for w in waiters) \
            and _driver.order_streams(s, waiters):
        return
    cuda = _numba_cuda()
    ev = _thread_event("finish")
    ev.record(s)
    for w in waiters:
        if isinstance(w, int):
            w = (cuda.legacy_default_stream() if w == 1 else
                 cuda.per_thread_default_stream() if w == 2 else
                 cuda.external_stream(w))
        ev.wait(w)


def copy(dst, src):
    """``dst[:] = src`` for same-dtype arrays; either side may be host or
    device (``dst`` device unless ``src`` is).

    To the host: synchronous (MPI or the caller reads ``dst`` next); a
    synchronous copy waits for the legacy stream's earlier work, also when
    it runs on a per-thread default stream (a blocking stream). To the
    device: in order on the engine's stream, without blocking the host (the
    kernels that read ``dst`` follow on that stream; a pinned source buffer
    stays the call's until its final synchronisation, a pageable one is
    taken by the driver before this returns). On a GPU the copies go to the
    driver (``mpigc.kernels._driver``: asynchronous on the engine's stream,
    then a wait for it where the host reads ``dst``)."""
    host = isinstance(dst, np.ndarray)
    if own_stream():  # a synchronous copy would not wait for mpigc's stream
        s, kc = engine_stream(), _kc()
        if _driver.ON is False or not _driver.copy(dst, src, s, False):
            if host:
                src.copy_to_host(dst, stream=s)
            else:
                dst.copy_to_device(src, stream=s)
        kc._queued[0] += 1
        if host:
            kc.host_wait(s)
        return
    if _driver.ON is not False and _driver.copy(dst, src, engine_stream(), host):
        return
    if host:
        src.copy_to_host(dst)
    else:
        dst.copy_to_device(src, stream=engine_stream())


def sync():
    """Wait for the engine's work: its kernels and copies run on the legacy
    default stream (:func:`engine_stream`), so that stream is synchronised,
    not the whole device (work of other non-blocking streams, e.g. torch's
    side streams or the rest of a backward pass queued there, goes on); MPI
    and the caller may read the results afterwards. With a stream of
    mpigc's own: an event recorded there and waited for on the host
    (``mpigc.kernels.cuda.host_wait``), none when nothing was queued there
    since the calling thread's last wait (by any thread: a count read
    waited for the pack, and MPI then reads what it packed)."""
    if own_stream():  # (no wait when nothing was queued since this thread's last)
        _kc().host_wait(engine_stream(), idle_ok=True)
    elif _driver.ON is False or not _driver.sync(engine_stream()):
        engine_stream().synchronize()


def mpi_buffer(d):
    """What MPI is given for device array ``d`` with CUDA-aware MPI: ``d``
    itself (mpi4py takes ``__cuda_array_interface__``), or, in the simulator
    only, the numpy array it wraps (the test seam of the module docstring)."""
    if simulator():
        return d._ary
    return d


# -- staging buffers ---------------------------------------------------------
class _StagingPool:
    """Reusable pinned host buffers (numpy arrays in the simulator), taken by
    a call and given back when it finishes, so concurrent nonblocking calls
    never share one. Sizes are rounded up to a power of two."""

    _KEEP = 8  # buffers kept for reuse

    def __init__(self):
        self._free = []
        self._done = {}  # id(buffer) -> (buffer, its event: where its copies end)
        self.allocated = 0  # how many buffers were ever allocated (tests)

    def take(self, nbytes):
        nbytes = max(int(nbytes), 1)
        with _lock:
            fits = [i for i, b in enumerate(self._free) if b.size >= nbytes]
            if fits:
                i = min(fits, key=lambda i: self._free[i].size)
                b = self._free.pop(i)
                ev = self._done.get(id(b))
            else:
                b = None
        if b is not None:
            # (in the simulator every copy is done when it returns)
            if ev is not None and ev[0] is b and not simulator() and not ev[1].query():
                ev[1].synchronize()  # the engine is still behind: a host wait
            return b
        cap = 1 << (nbytes - 1).bit_length()
        self.allocated += 1
        return _numba_cuda().pinned_array(cap, np.uint8)  # (a numpy array in the simulator)

    def give(self, buf):
        """``buf`` is free again. With a stream of mpigc's own, the call
        that gives it back did not wait for its copies (:func:`finish`): an
        event recorded on the engine's stream marks their end, and
        :meth:`take` waits for it before MPI may write the buffer again."""
        s = engine_stream() if own_stream() else None  # (it may take _lock: not below)
        with _lock:
            if s is not None:
                ev = self._done.get(id(buf))
                if ev is None or ev[0] is not buf:  # one event per buffer, made once
                    ev = self._done[id(buf)] = (buf, _event())
                ev[1].record(s)
            self._free.append(buf)
            if len(self._free) > self._KEEP:  # drop the smallest (by index:
                # numpy arrays compare element-wise)
                i = min(range(len(self._free)), key=lambda i: self._free[i].size)
                self._done.pop(id(self._free.pop(i)), None)


staging_pool = _StagingPool()


# -- CUDA-aware MPI ----------------------------------------------------------
def _env_aware():
    env = os.environ.get("MPIGC_CUDA_AWARE")
    if env is None or env.strip() == "":
        return None
    v = env.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"MPIGC_CUDA_AWARE: expected 1 or 0, got {env!r}")


def _alloc_kinds_aware(value):
    """Whether an ``mpi_memory_alloc_kinds`` value (``"mpi,system,cuda:device"``)
    includes CUDA device memory (``cuda`` alone means every CUDA kind)."""
    for kind in value.split(","):
        parts = [p.strip().lower() for p in kind.split(":")]
        if parts[0] == "cuda" and (len(parts) == 1 or "device" in parts[1:]):
            return True
    return False


def _info_get(info, key):
    try:
        if info is None or info == _MPI().INFO_NULL:
            return None
        return info.Get(key)
    except Exception:  # noqa: BLE001 - an MPI before 4.1, or no such key
        return None


def _MPI():
    from mpi4py import MPI
    return MPI


def _loaded_libmpi():
    """Paths of the libmpi shared objects loaded in this process."""
    paths = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                p = line.split()[-1] if line.strip() else ""
                name = os.path.basename(p)
                if name.startswith("libmpi.") or name.startswith("libmpi_"):
                    if p not in paths:
                        paths.append(p)
    except OSError:  # pragma: no cover - not Linux
        pass
    return paths


def _query_ompi_cuda_support():
    """``MPIX_Query_cuda_support()`` of the loaded Open MPI, or None."""
    for path in _loaded_libmpi() + [None]:
        try:
            lib = ctypes.CDLL(path, mode=getattr(os, "RTLD_NOLOAD", 0) | ctypes.RTLD_GLOBAL) \
                if path else ctypes.CDLL(None)
            fn = getattr(lib, "MPIX_Query_cuda_support")
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_int
        fn.argtypes = []
        try:
            return int(fn())
        except Exception:  # noqa: BLE001 - guarded foreign call
            return None
    return None


def _probe(comm):
    """The :class:`CudaAwareness` of a (private) communicator."""
    env = _env_aware()
    if env is not None:
        return CudaAwareness(env, f"MPIGC_CUDA_AWARE={int(env)}")
    MPI = _MPI()
    try:
        info = comm.Get_info()
    except Exception:  # noqa: BLE001
        info = None
    # MPI 4.1: the key lists the kinds the application requested that the
    # library supports; a library that was asked for none reports "mpi,system"
    # although it may take device memory. So a value without cuda is no
    # answer: the next source is asked, and the source says both.
    kinds = []
    try:
        for where, inf in (("communicator info", info), ("MPI_INFO_ENV", MPI.INFO_ENV)):
            v = _info_get(inf, "mpi_memory_alloc_kinds")
            if v:
                src = f"mpi_memory_alloc_kinds={v!r} ({where})"
                if _alloc_kinds_aware(v):
                    return CudaAwareness(True, src)
                kinds.append(src)
    finally:
        if info is not None:
            try:
                info.Free()
            except Exception:  # noqa: BLE001
                pass
    seen = "".join(f"{k} without cuda; " for k in kinds)
    q = _query_ompi_cuda_support()
    if q is not None:
        return CudaAwareness(bool(q), f"{seen}MPIX_Query_cuda_support()={q}")
    if kinds:
        return CudaAwareness(False, f"{seen}no MPIX_Query_cuda_support")
    return CudaAwareness(False, "not detected (no mpi_memory_alloc_kinds, no "
                                "MPIX_Query_cuda_support)")


def awareness(cs):
    """The decision for :class:`mpigc._comm.CommState` ``cs``, made once."""
    if cs.cuda_aware is None:
        cs.cuda_aware = _probe(cs.comm)
    return cs.cuda_aware


def cuda_aware_mpi(comm=None):
    """Whether mpigc hands device memory to MPI on ``comm``, and why.

    Decided once per communicator: ``$MPIGC_CUDA_AWARE`` (``1`` or ``0``)
    wins; otherwise what the MPI library reports: yes when the MPI-4.1 info
    key ``mpi_memory_alloc_kinds`` has ``cuda`` or ``cuda:device`` among the
    kinds; else (no key, or kinds without cuda, which may only mean that
    nobody requested them) Open MPI's ``MPIX_Query_cuda_support()``;
    otherwise no. When no,
    device collectives stage their packed payloads through pinned host
    buffers. Touches no GPU. Collective the first time mpigc sees ``comm``
    (it is duplicated then), like every mpigc call.

    Returns
    -------
    CudaAwareness
        ``(aware, source)``, e.g.
        ``CudaAwareness(aware=False, source='MPIX_Query_cuda_support()=0')``.

    Examples
    --------
    >>> mpigc.cuda_aware_mpi()                          # doctest: +SKIP
    CudaAwareness(aware=True, source="mpi_memory_alloc_kinds='mpi,system,cuda' ...")
    """
    from . import _comm
    return awareness(_comm.resolve(comm))


def warn_staging_once(decision):
    """The one warning that payloads are staged through host memory (not
    when ``$MPIGC_CUDA_AWARE=0`` asked for it)."""
    global _warned_staging
    if _warned_staging or decision.source.startswith("MPIGC_CUDA_AWARE"):
        return
    _warned_staging = True
    warn_caller(
        f"mpigc: MPI is not known to accept CUDA device memory ({decision.source}); "
        "device collectives stage their packed payloads through pinned host memory. "
        "Set MPIGC_CUDA_AWARE=1 if this MPI is CUDA-aware, or MPIGC_CUDA_AWARE=0 to "
        "silence this warning.", RuntimeWarning)


# -- device selection ----------------------------------------------------------
def _env_device():
    env = os.environ.get("MPIGC_DEVICE")
    if env is None or env.strip() == "":
        return None
    try:
        d = int(env)
        if d < 0:
            raise ValueError
    except ValueError:
        raise ConfigError(f"MPIGC_DEVICE: expected a GPU index >= 0, got {env!r}") from None
    return d


def select_device(comm=None, device=None):
    """Make one GPU current for this rank and return its index.

    ``device`` if given; else ``$MPIGC_DEVICE``; else the node-local rank of
    this process in ``comm`` (default ``MPI.COMM_WORLD``) modulo the number
    of visible GPUs, i.e. one GPU per rank on a node. The GPU becomes current
    for Numba (the mpigc kernels) and, when they are already imported, for
    torch and CuPy. Call it once at start, before allocating on the GPU.
    Collective the first time mpigc sees ``comm``; nothing else is.

    Examples
    --------
    >>> dev = mpigc.select_device()                     # doctest: +SKIP
    >>> grad = torch.zeros(1000, device=f"cuda:{dev}")  # doctest: +SKIP
    """
    global _selected
    from . import _comm
    if device is None:
        device = _env_device()
    if device is None:
        cs = _comm.resolve(comm)
        count = _device_count()
        device = cs.local_rank % max(1, count)
    elif isinstance(device, bool) or not isinstance(device, (int, np.integer)) or device < 0:
        raise ConfigError(f"device: expected a GPU index >= 0, got {device!r}")
    device = int(device)
    cuda = _numba_cuda()
    cuda.select_device(device)
    torch = sys.modules.get("torch")
    if torch is not None and getattr(torch, "cuda", None) is not None \
            and torch.cuda.is_available():
        torch.cuda.set_device(device)
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        cupy.cuda.Device(device).use()
    _selected = device
    return device


def current_device_id():
    """The GPU current in the calling thread (in the simulator, whose
    devices carry no id, that of its current context: 0, unless a test gives
    it more devices)."""
    if _driver.ON is not False:
        d = _driver.device_id()
        if d is not None:
            return d
    cuda = _numba_cuda()
    if simulator():
        return cuda.current_context().id
    return cuda.get_current_device().id


_thread_device = threading.local()


def make_current(device_id):
    """Make GPU ``device_id`` current in the calling thread (the progress
    thread, before it advances a device call). A thread starts with no CUDA
    context, and Numba would then use GPU 0: a rank on GPU 1 would allocate
    and launch there. Once per thread and device."""
    if getattr(_thread_device, "id", None) == device_id:
        return
    _numba_cuda().select_device(device_id)
    _thread_device.id = device_id


_thread_on = threading.local()  # the GPU on_gpu() made current here, while it is


@contextlib.contextmanager
def on_gpu(device_id, current=None):
    """Make GPU ``device_id`` current in the calling thread for the block and
    the GPU current before it again after: for work on a key's device
    residuals outside a call (the residual store's copies, evictions and
    records), which must run on the GPU that holds them, whatever GPU the
    calling thread has current (one process may drive several). Nothing
    for ``device_id`` None (host residuals), nor when it is current already:
    ``current``, the GPU the caller knows is current (a call's: no driver
    ask), or inside an ``on_gpu`` block of the same GPU; otherwise one ask
    (:func:`current_device_id`). On a GPU the switch pushes the GPU's
    primary context and pops it after, so a context made current by
    another library (torch, CuPy) is current again."""
    if device_id is None or device_id == current \
            or getattr(_thread_on, "id", None) == device_id:
        yield
        return
    before = current_device_id()
    if before == device_id:
        _thread_on.id, outer = device_id, getattr(_thread_on, "id", None)
        try:
            yield
        finally:
            _thread_on.id = outer
        return
    cuda = _numba_cuda()
    if simulator():  # no context stack there: select it, then the one before
        cuda.select_device(device_id)
        pop = lambda: cuda.select_device(before)  # noqa: E731
    else:
        from numba.cuda.cudadrv import devices
        pop = devices.get_context(device_id).pop  # pushed: popped at the end
    outer, _thread_on.id = getattr(_thread_on, "id", None), device_id
    try:
        yield
    finally:
        _thread_on.id = outer
        pop()


def _device_count():
    cuda = _numba_cuda()
    try:
        return len(cuda.gpus)
    except Exception:  # noqa: BLE001 - no driver: select_device will say so
        return 1


def _array_device(a):
    """The GPU index a foreign array reports (torch, CuPy), or None."""
    dev = getattr(a, "device", None)
    idx = getattr(dev, "index", None)  # torch.device
    if idx is None:
        idx = getattr(dev, "id", None)  # cupy.cuda.Device
    return idx if isinstance(idx, int) else None


def host_copy(a):
    """A host copy of device array ``a``: Numba's, or any
    ``__cuda_array_interface__`` object (CuPy, a CUDA torch tensor), copied
    with the GPU that holds it current where it says which (torch, CuPy:
    :func:`on_gpu`), whatever GPU the calling thread has current."""
    with on_gpu(_array_device(a)):
        return to_host(as_device(a))


def ensure_device(a, cs):
    """Before the first kernel on ``a``: the device rule of the module
    docstring. Raises DTypeError when the array lives on another GPU than the
    one mpigc was told to use."""
    if simulator():
        return
    if _selected is None and _env_device() is not None:
        select_device(cs.comm)
    idx = _array_device(a)
    if idx is None:
        return
    if _selected is not None and idx != _selected:
        raise DTypeError(f"the array lives on GPU {idx}, but mpigc uses GPU {_selected} "
                         "(select_device / MPIGC_DEVICE): allocate after select_device(), "
                         "or select the GPU that holds it")
    cuda = _numba_cuda()
    if cuda.get_current_device().id != idx:
        cuda.select_device(idx)
