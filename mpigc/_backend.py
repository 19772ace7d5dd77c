"""Where a collective's arrays live: one backend object per side.

The engine (:mod:`mpigc._collective`) owns MPI and nothing else; everything
that differs between host (numpy) and device (CUDA) arrays is here, behind
the same methods, as array-API code asks one namespace instead of branching
on the array kind at every line. :func:`mpigc._dispatch.backend` picks the
side from the array itself.

- :class:`HostBackend`: numpy arrays, ``mpigc.kernels.cpu``; MPI reads and
  writes the arrays themselves. Other CPU arrays (torch CPU tensors, the
  buffer protocol, ``__array_interface__``, DLPack) are taken as numpy views
  of their memory, made in one place, :func:`host_view`, when the backend
  adopts them: the engine sees numpy arrays only, and the results land in
  the caller's object.
- :class:`DeviceBackend`: CUDA device arrays, ``mpigc.kernels.cuda``; MPI gets
  device buffers when it is CUDA-aware, otherwise staging buffers (pinned
  host memory from a pool) that the backend fills and empties; a timeline
  being recorded (:mod:`mpigc._timeline`) shows each such copy, ``staging to
  host`` and ``staging to device``, with its bytes.

A backend instance serves one call (it holds the call's staging buffers).
"""
import numpy as np

from . import _cuda
from . import _timeline
from ._errors import DTypeError, InvalidBufferError

__all__ = ["HostBackend", "DeviceBackend", "part", "host_view"]


def part(a, lo, hi):
    """``a[lo:hi]`` of a 1-d array, or ``a`` itself when that is all of it: a
    Numba device array's slice costs tens of microseconds of Python (a call
    that is one chunk of whole shards would make several per call)."""
    return a if lo == 0 and hi == a.shape[0] else a[lo:hi]


class HostBackend:
    """numpy arrays (other CPU arrays as numpy views: :func:`host_view`); MPI
    takes them as they are."""

    device = False
    side = "host"  # in messages
    device_id = None  # no GPU to make current (DeviceBackend: the call's)
    #: decode the senders' payloads as they arrive, one call each (the CPU
    #: overlaps decoding with the transfers); the device backend decodes them
    #: all with one launch once they are all there
    batch_decode = False

    def __init__(self, kernels):
        self.kernels = kernels
        self.given = self.view = None  # the buffer adopt took, and its view

    # -- the input -------------------------------------------------------------
    def adopt(self, buf, kind, cs):
        """``buf`` as a numpy array over its memory (no copy; see
        :func:`host_view`), or raise."""
        a = buf if isinstance(buf, np.ndarray) else host_view(buf, kind)
        self.given, self.view = buf, a  # what is_writable reads
        return a

    def is_c_contiguous(self, buf, a):
        return bool(a.flags.c_contiguous)

    def is_writable(self, buf):
        """Whether ``buf`` may be written (the view :meth:`adopt` made of it
        says so: a read-only buffer, ``__array_interface__`` or DLPack export
        gives a read-only view)."""
        if isinstance(buf, np.ndarray):
            return bool(buf.flags.writeable)
        a = self.view if buf is self.given else host_view(buf, "buf")
        return bool(a.flags.writeable)

    def take_member(self, other):
        """A grouped call's member adopted by ``other``: nothing to take on
        the host."""

    def quick_members(self, bufs, start, dtype, writable):
        """A grouped call's members ``bufs[start:k]`` flat, ``k`` the first
        that does not pass every check of :meth:`adopt` and the group's at a
        glance (a C-contiguous, non-empty numpy array of ``dtype``, writable
        if ``writable``): those need no backend of their own (the others are
        adopted as the first member was)."""
        out = []
        ndarray = np.ndarray
        for b in bufs[start:]:
            if type(b) is not ndarray:
                break
            f = b.flags  # one flags object per member (each read makes one)
            bdt = b.dtype
            if ((bdt is not dtype and bdt != dtype) or not f.c_contiguous or not b.size
                    or (writable and not f.writeable)):
                break
            # a 1-d member is its own flat view (reshape would make a new one)
            out.append(b if b.ndim == 1 else b.reshape(b.size))
        return out

    def adopt_out(self, out, n, dtype):
        """reduce_scatter's ``out=``: a numpy array over ``out``'s memory (a
        numpy array, or a CPU array that exposes its memory: :func:`host_view`),
        or raise."""
        if _is_device(out):
            raise InvalidBufferError(
                f"out: expected a host array like buf, got {_side(out)}: host and device "
                "arrays cannot be mixed in one call")
        if not isinstance(out, np.ndarray):
            try:
                out = host_view(out, "out")
            except DTypeError as exc:  # out= is refused as a buffer, whatever its fault
                raise InvalidBufferError(str(exc)) from exc
        if (out.dtype != dtype or out.size != n or not out.flags.c_contiguous
                or not out.flags.writeable):
            raise InvalidBufferError(f"out: expected a writable contiguous array of {n} "
                                     f"{dtype} values")
        return out

    # -- arrays ----------------------------------------------------------------
    def empty(self, n, dtype):
        return np.empty(n, dtype)

    def zeros(self, n, dtype):
        return np.zeros(n, dtype)

    def converted(self, a, dtype):
        """``a.astype(dtype)``."""
        return a.astype(dtype)

    def assign(self, dst, src):
        """``dst[...] = src`` with numpy's casting."""
        dst[...] = src

    def divide(self, a, d):
        np.divide(a, d, out=a)

    def place_members(self, fused, members, place, to_fused):
        """A grouped call's ``members`` to (``to_fused``) or from their places
        in ``fused``, ``place`` a placement of :class:`mpigc._group._Layout`:
        piece by piece, or one concatenation where every member follows the
        one before whole (a plain allreduce's group)."""
        pieces, _, nshards = place
        if to_fused:
            if nshards == 1 and len(pieces) == len(members):
                np.concatenate(members, out=fused)
            else:
                for i, lo, hi, at in pieces:
                    fused[at:at + hi - lo] = members[i][lo:hi]
        elif nshards == 1 and len(pieces) == len(members):
            # each piece a whole member: no slice of the member (64 of 4 KiB:
            # a sixth less time)
            for m, (_, _, hi, at) in zip(members, pieces):
                m[...] = fused[at:at + hi]
        else:
            for i, lo, hi, at in pieces:
                members[i][lo:hi] = fused[at:at + hi - lo]

    def fill_nan(self, a):
        a[...] = np.nan

    def count_nonfinite(self, a):
        return self.kernels.count_nonfinite(a)

    def stats(self, x, e_in):
        """``(sum, sum of squares, max |v|, non-finite count)`` of ``v = x +
        e_in`` (``e_in`` None: ``x``), as float64 sums in the kernels' order:
        terngrad's scale and the exact count of non-finite values."""
        return self.kernels.stats(x, e_in)

    # -- what MPI touches ------------------------------------------------------
    def sync(self):
        """Wait for the kernels before MPI or the host reads their results."""

    def ready_for_mpi(self):
        """What MPI reads next (through :meth:`wire`) is complete: nothing to
        wait for on the host."""

    def wire(self, a, send=None):
        """What MPI reads or writes for ``a``: ``a`` itself here."""
        return a

    def stage(self, wire, a, lo, hi):
        """Before a send from ``wire[lo:hi]`` (from :meth:`wire` of ``a``):
        ``a[lo:hi]`` there."""

    def unstage(self, dst, wire):
        """After a receive into ``wire`` (from :meth:`wire`): into ``dst``."""

    # -- a whole call on the host (hierarchical calls: the node's shared window) --
    def host_copy(self, a):
        """The values of ``a`` in host memory, for steps that run on the host:
        ``a`` itself here."""
        return a

    def for_engine(self, h, fill=None):
        """Host array ``h`` as a flat call takes it on this side, with its
        ``fill(lo, hi)`` hook (which writes ``h`` just in time): both as
        they are here."""
        return h, fill

    def to_host(self, a, out=None):
        """A flat call's result ``a`` on the host, into ``out`` if given (the
        host array :meth:`for_engine` made ``a`` of: there already here);
        returns it."""
        return a if out is None else out

    def to_side(self, h):
        """Host array ``h`` as a new array of this side: ``h`` here."""
        return h

    def put(self, dst, h):
        """Host values ``h`` into ``dst`` (of this side), synchronised."""
        if dst is not h:
            dst.reshape(-1)[...] = h

    def release(self):
        """The call is over: give back what it took."""


class DeviceBackend:
    """CUDA device arrays (Numba's, or anything with
    ``__cuda_array_interface__``, read through the interface only)."""

    device = True
    side = "device"
    batch_decode = True  # one launch per stage for all shards / senders

    def __init__(self, kernels):
        self.kernels = kernels
        self.aware = None  # CudaAwareness of the call's communicator
        self.device_id = None  # the GPU current in the caller's thread
        self.staged = []  # staging buffers taken from the pool
        # the streams the call's arrays came from, ordered after its work at
        # its end (a stream of mpigc's own: _cuda.finish), and the keywords
        # that put the kernels on the engine's stream (none: the legacy one)
        self.producers = []
        self.kw = _cuda.stream_kw()

    # -- the input -------------------------------------------------------------
    def adopt(self, buf, kind, cs):
        """Device array ``buf`` as a Numba device array (no copy), typed from
        ``__cuda_array_interface__``; decides CUDA-aware MPI for ``cs``."""
        self.aware = _cuda.awareness(cs)
        if not self.aware.aware:
            _cuda.warn_staging_once(self.aware)
        _cuda.ensure_device(buf, cs)
        # the GPU of the call: the progress thread makes it current before it
        # advances the call
        self.device_id = _cuda.current_device_id()
        self.kw = _cuda.stream_kw()  # (the stream of the GPU made current above)
        return _cuda.as_device(buf, self.producers)

    def is_c_contiguous(self, buf, a):
        return _cuda.is_c_contiguous(a)

    def quick_members(self, bufs, start, dtype, writable):
        """None at a glance: every member of a device group is adopted (its
        stream waited for, its GPU checked)."""
        return []

    def take_member(self, other):
        """A grouped call's member adopted by ``other`` (a backend of this
        side): the streams its array came from are this call's too."""
        for p in other.producers:
            if not any(p is q for q in self.producers):
                self.producers.append(p)

    def is_writable(self, buf):
        return not _cuda.is_readonly(buf)

    def adopt_out(self, out, n, dtype):
        from ._dispatch import is_device_array
        if not is_device_array(out):
            raise InvalidBufferError(
                f"out: expected a CUDA device array like buf, got {_side(out)}: host and "
                "device arrays cannot be mixed in one call")
        d = _cuda.as_device(out, self.producers)
        if (np.dtype(d.dtype) != dtype or d.size != n or not _cuda.is_c_contiguous(d)
                or _cuda.is_readonly(out)):
            raise InvalidBufferError(f"out: expected a writable contiguous device array "
                                     f"of {n} {dtype} values")
        return d.reshape(d.size)

    # -- arrays ----------------------------------------------------------------
    def empty(self, n, dtype):
        return part(_cuda.empty(max(int(n), 1), dtype), 0, int(n))

    def zeros(self, n, dtype):
        return _cuda.zeros(n, dtype)

    def converted(self, a, dtype):
        out = self.empty(a.size, dtype)
        self.kernels.convert(a, out, **self.kw)
        return out

    def assign(self, dst, src):
        self.kernels.convert(src, dst, **self.kw)

    def divide(self, a, d):
        self.kernels.divide(a, d, **self.kw)

    def place_members(self, fused, members, place, to_fused):
        """A grouped call's ``members`` to (``to_fused``) or from their places
        in ``fused``, ``place`` a placement of :class:`mpigc._group._Layout`:
        one launch per member."""
        _, ats, nshards = place
        self.kernels.group_copy(fused, members, ats, nshards, to_fused, **self.kw)

    def fill_nan(self, a):
        if a.size:
            _cuda.copy(a, np.full(a.size, np.nan, a.dtype))

    def count_nonfinite(self, a):
        return self.kernels.count_nonfinite(a, **self.kw)

    def stats(self, x, e_in):
        """As :meth:`HostBackend.stats`, by one launch (the host reads the
        result: synchronised)."""
        return self.kernels.stats(x, e_in, **self.kw)

    # -- what MPI touches ------------------------------------------------------
    def sync(self):
        """The call's work is queued (its end): a wait for the engine's
        stream on the host, or, with a stream of mpigc's own
        (``MPIGC_CUDA_STREAM``), an event that the streams of the call's
        arrays wait for, without a host wait (:func:`mpigc._cuda.finish`)."""
        _cuda.finish(self.producers)

    def ready_for_mpi(self):
        """What MPI reads next (through :meth:`wire` and :meth:`stage`) is
        complete: with CUDA-aware MPI, which reads device memory outside any
        stream's order, a wait for the engine's stream; staged, nothing: the
        staging copy runs on the engine's stream after the kernels that
        wrote the data and waits for itself (a wait here would be a second
        one, ~70 us with two ranks on one H200)."""
        if self.aware.aware:
            _cuda.sync()

    def wire(self, a, send=None):
        """What MPI reads or writes for device array ``a``: the device buffer
        with CUDA-aware MPI, else a staging buffer of the same bytes into
        which ``a[lo:hi]`` is copied for ``send=(lo, hi)`` (``True``: all of
        it). Synchronise the device first."""
        if self.aware.aware:
            return _cuda.mpi_buffer(a)
        b = _cuda.staging_pool.take(a.nbytes)
        self.staged.append(b)
        w = b[:a.nbytes].view(a.dtype)
        if send is True:
            send = (0, a.size)
        if send is not None and send[1] > send[0]:
            self.stage(w, a, *send)
        return w

    def stage(self, wire, a, lo, hi):
        """``a[lo:hi]`` into its staging buffer ``wire`` (synchronous: MPI
        reads it next), without CUDA-aware MPI."""
        if not self.aware.aware and hi > lo:
            t0 = _timeline.ON and _timeline.now()
            _cuda.copy(part(wire, lo, hi), part(a, lo, hi))
            if t0:
                _timeline.span("staging to host", t0,
                               args={"bytes": (hi - lo) * a.dtype.itemsize})

    def unstage(self, dst, wire):
        """What MPI wrote into ``wire`` to device array ``dst``, without
        CUDA-aware MPI (queued on the engine's stream: the span is the
        queueing, not the copy)."""
        if not self.aware.aware and dst.size:
            t0 = _timeline.ON and _timeline.now()
            _cuda.copy(dst, wire)
            if t0:
                _timeline.span("staging to device", t0, args={"bytes": dst.nbytes})

    # -- a whole call on the host (hierarchical calls: the node's shared window) --
    def host_copy(self, a):
        """A copy of device array ``a`` in a pinned staging buffer (now, in the
        caller's thread: ``adopt`` waited for the stream that produced it),
        given back by :meth:`release`."""
        b = _cuda.staging_pool.take(max(a.nbytes, 1))
        self.staged.append(b)
        h = b[:a.nbytes].view(a.dtype)
        t0 = _timeline.ON and _timeline.now()
        _cuda.to_host(a, h)
        if t0:
            _timeline.span("staging to host", t0, args={"bytes": a.nbytes})
        return h

    def for_engine(self, h, fill=None):
        """Filled now and copied to the device (the engine's fill hook is for
        host buffers only)."""
        if fill is not None:
            fill(0, h.size)
        return _cuda.to_device(h), None

    def to_host(self, a, out=None):
        return _cuda.to_host(a, out)

    def to_side(self, h):
        return _cuda.to_device(h)

    def put(self, dst, h):
        if h.size:
            t0 = _timeline.ON and _timeline.now()
            _cuda.copy(dst, h)
            _cuda.sync()
            if t0:
                _timeline.span("staging to device", t0, args={"bytes": h.nbytes})

    def release(self):
        """The call is over (and synchronised: :meth:`sync`): its staging
        buffers go back to the pool."""
        for b in self.staged:
            _cuda.staging_pool.give(b)
        self.staged = []


def _is_device(a):
    from ._dispatch import is_device_array
    return is_device_array(a)


def _side(a):
    return "a CUDA device array" if _is_device(a) else type(a).__name__


# -- host arrays that are not numpy arrays ------------------------------------------

#: DLPack's device type of CPU memory (kDLCPU)
_DLPACK_CPU = 1


def host_view(obj, kind):
    """A numpy array over the memory of CPU array ``obj`` (no copy: writes
    to it land in ``obj``), found by protocol, never by importing the
    array's library: ``__array_interface__`` (the view checked to start at
    the interface's pointer), the buffer protocol (``memoryview``:
    ``array.array``, ``bytearray``, a ``ctypes`` array, ...), or DLPack
    (``__dlpack__`` with ``__dlpack_device__`` on the CPU: torch CPU
    tensors). The view is read-only where ``obj`` says its memory is
    (a read-only buffer or interface; a DLPack export flagged read-only,
    or one of the legacy protocol, which cannot say it is writable, as
    ``numpy.from_dlpack`` reads it). Raises DTypeError for an object that
    exposes no memory or one of a dtype numpy has not (a torch bfloat16
    tensor), InvalidBufferError where the export is refused (a torch tensor
    that requires grad: pass ``t.detach()``, which shares its memory)."""
    name = type(obj).__name__
    if isinstance(obj, np.generic):  # a numpy scalar: no memory of its own
        raise DTypeError(f"{kind}: expected an array, got the scalar {name}")
    iface = getattr(obj, "__array_interface__", None)
    if isinstance(iface, dict):
        a = np.asarray(obj)
        data = iface.get("data")
        if (isinstance(data, tuple) and a.size
                and a.__array_interface__["data"][0] != data[0]):
            raise InvalidBufferError(f"{kind}: numpy copied the {name} instead of viewing "
                                     "its memory (through __array_interface__): pass a "
                                     "numpy array")
        return a
    try:
        mem = memoryview(obj)
    except TypeError:
        mem = None
    if mem is not None:
        try:
            return np.asarray(mem)
        except (TypeError, ValueError, NotImplementedError) as exc:
            raise DTypeError(f"{kind}: expected float16, float32 or float64 (native byte "
                             f"order), got a {name} of format {mem.format!r} ({exc})") from exc
    if hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        return _dlpack_view(obj, kind, name)
    raise DTypeError(f"{kind}: expected a numpy array, a CPU array that exposes its memory "
                     "(the buffer protocol, __array_interface__ or DLPack: a torch CPU "
                     f"tensor) or a CUDA device array, got {name}")


def _dlpack_view(obj, kind, name):
    """``numpy.from_dlpack(obj)`` for :func:`host_view`, its failures as
    mpigc errors."""
    try:
        dev = obj.__dlpack_device__()
        dev_type = int(dev[0])
    except Exception as exc:  # noqa: BLE001 - the producer's own error, named below
        raise InvalidBufferError(f"{kind}: the {name}'s __dlpack_device__() failed: "
                                 f"{exc}") from exc
    if dev_type != _DLPACK_CPU:
        raise DTypeError(f"{kind}: expected a numpy array, a CPU array or a CUDA device "
                         f"array (with __cuda_array_interface__), got a {name} on DLPack "
                         f"device {tuple(int(d) for d in dev)}")
    from_dlpack = getattr(np, "from_dlpack", None) or np._from_dlpack  # numpy 1.22
    try:
        return from_dlpack(obj)
    except Exception as exc:  # noqa: BLE001 - BufferError, RuntimeError, ...: the producer's
        dtype = str(getattr(obj, "dtype", "")).rsplit(".", 1)[-1]
        if dtype and dtype not in ("float16", "float32", "float64"):
            raise DTypeError(f"{kind}: expected float16, float32 or float64 (native byte "
                             f"order), got {dtype}") from exc
        raise InvalidBufferError(f"{kind}: the {name}'s memory cannot be read through "
                                 f"DLPack: {exc}") from exc
