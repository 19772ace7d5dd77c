"""The residual store's entries (:mod:`mpigc.feedback`'s, private to it and
to :mod:`mpigc._residual_txn`): a key's residuals (:class:`Entry`), the fused
residuals of a grouped call's members (:class:`Fused`), and the copies of
residual arrays on either side (host or device) that the store makes."""
import contextlib
import threading

import numpy as np

from . import _dispatch
from . import _timeline
from ._errors import StateError


class Entry:
    """A key's residuals (``worker``, ``owner``), call count and config.

    ``worker`` and ``owner`` are properties: while the key is one member of
    a grouped call's fused residuals (``fused``, a :class:`Fused`), its
    residuals live in the group's fused buffers, and the first read or write
    of either (a single call on the key, a state, a checkpoint, a snapshot)
    first copies every member's back into arrays of their own (:meth:`Fused.evict`)."""

    __slots__ = ("n", "dtype", "world_size", "rank", "_worker", "_owner", "config",
                 "calls", "on_device", "gpu", "fused")

    def __init__(self, n, dtype, world_size, rank, config, on_device=None, gpu=None):
        self.n = n
        self.dtype = np.dtype(dtype)
        self.world_size = world_size
        self.rank = rank
        self._worker = None
        self._owner = None
        self.fused = None
        self.config = config
        self.calls = 0
        #: True: residuals in device memory; False: host; None: not placed yet
        #: (loaded from a state dict or a checkpoint; see the module docstring)
        self.on_device = on_device
        #: the GPU (its id) whose memory holds device residuals; None on the host
        self.gpu = gpu if on_device else None

    @property
    def worker(self):
        if self.fused is not None:
            self.fused.evict()
        return self._worker

    @worker.setter
    def worker(self, a):
        if self.fused is not None:
            self.fused.evict()
        self._worker = a

    @property
    def owner(self):
        if self.fused is not None:
            self.fused.evict()
        return self._owner

    @owner.setter
    def owner(self, a):
        if self.fused is not None:
            self.fused.evict()
        self._owner = a

    def holds(self):
        """Whether the key holds a residual (without moving fused ones)."""
        return self.fused is not None or self._worker is not None or self._owner is not None

    def place(self, device, gpu=None):
        """Move not-yet-placed residuals to where a call needs them: the host,
        or (``device``) GPU ``gpu``, the call's, current in the calling thread."""
        if self.on_device is None:  # loaded: never fused
            if device:
                from . import _cuda
                self._worker = None if self._worker is None else _cuda.to_device(self._worker)
                self._owner = None if self._owner is None else _cuda.to_device(self._owner)
            self.on_device = bool(device)
            self.gpu = gpu if device else None

    def fit(self, key, n, dtype, world_size, rank, device, gpu):
        """For :meth:`ErrorFeedback.acquire <mpigc.feedback.ErrorFeedback.acquire>`
        (under the store's lock): check that ``key``'s entry fits a call of
        ``n`` values of ``dtype`` on ``world_size`` ranks (rank ``rank``),
        with a device buffer on GPU ``gpu`` if ``device``, and place its
        residuals for it (:meth:`place`; an entry that holds no residual may
        change sides). Raises StateError, changing nothing, if it does not fit."""
        if (self.n, self.dtype, self.world_size, self.rank) != (
                n, np.dtype(dtype), world_size, rank):
            raise StateError(
                f"key {key!r} holds residuals of {self.describe()} (rank {self.rank}); "
                f"this call has {n} values of {np.dtype(dtype)} on {world_size} rank(s) "
                f"(rank {rank}): use another key, or reset({key!r})")
        if not self.holds():
            self.on_device = None  # nothing held: the key may change sides
        if self.on_device is not None and self.on_device != bool(device):
            held, given = (("device", "host") if self.on_device else ("host", "device"))
            raise StateError(
                f"key {key!r} holds residuals in {held} memory; this call has a "
                f"{given} buffer: use another key, reset({key!r}), or move them "
                "(load_state_dict(state_dict()) places them on the next call)")
        if self.on_device and self.gpu != gpu:
            # another GPU's memory: a kernel here would fault or read it
            # through the peer mapping
            raise StateError(
                f"key {key!r} holds residuals on GPU {self.gpu}; this call's buffer is "
                f"on GPU {gpu}: use a key per GPU, reset({key!r}), or move them "
                "(load_state_dict(state_dict()) places them on the next call's GPU)")
        self.place(device, gpu)

    def add_to_worker(self, lo, hi, add):
        """:meth:`ErrorFeedback.add_to_worker <mpigc.feedback.ErrorFeedback.add_to_worker>`:
        ``add(view)`` of ``[lo, hi)`` of the worker residual (a fused
        member's own again first), with its GPU current; False if it has none."""
        with on_gpu(self.gpu):
            w = self.worker
            if w is None:
                return False
            add(w[lo:hi])
        return True

    def ensure_worker(self):
        """:meth:`ErrorFeedback.ensure_worker <mpigc.feedback.ErrorFeedback.ensure_worker>`:
        zeros of its size and dtype, on its side (its GPU current), as the
        worker residual if it has none. Returns True."""
        with on_gpu(self.gpu):
            if self.worker is None:
                self.worker = zeros(self.n, self.dtype, bool(self.on_device))
        return True

    def host_copy(self):
        """An entry with host copies of the residuals (the same one if they
        are on the host already), copied on the entry's GPU."""
        if not self.on_device:
            return self
        e = Entry(self.n, self.dtype, self.world_size, self.rank, self.config, False)
        e.calls = self.calls
        with on_gpu(self.gpu):
            e.worker = host(self.worker)
            e.owner = host(self.owner)
        return e

    def describe(self):
        return (f"{self.n} values of {self.dtype} on {self.world_size} rank(s)")


class Fused:
    """The residuals of a grouped call's members, kept fused between calls
    (issue 51 item 6): ``worker``, laid out as the group's fused buffer
    (placement ``place``), and ``owner``, as this rank's fused shard
    (``owner_place``); None where the members keep their own arrays. A
    grouped call with the same keys, entries and placement uses them as they
    are (no gather or scatter per call); anything else that reads or writes a
    member's residual first moves every member's back into arrays of their
    own (:meth:`evict`), which is the scatter a call used to make at its end.
    ``gpu``: the id of the GPU whose memory holds device residuals (the
    grouped call's and every member's), where :meth:`evict` allocates and
    copies whatever GPU is current; None on the host."""

    __slots__ = ("members", "place", "owner_place", "dtype", "device", "gpu", "worker",
                 "owner", "lock")

    def __init__(self, members, place, owner_place, dtype, device, gpu=None):
        self.members = list(members)
        self.place, self.owner_place = place, owner_place
        self.dtype, self.device = dtype, device
        self.gpu = gpu if device else None
        self.worker = self.owner = None
        self.lock = threading.Lock()

    def serves(self, entries, place, owner_place):
        """Whether a grouped call of ``entries`` (its members' entries, in
        order) and this placement finds its residuals here."""
        if (self.worker is None and self.owner is None) or len(entries) != len(self.members):
            return False
        if not (self.place is place or self.place == place) or not (
                self.owner_place is owner_place or self.owner_place == owner_place):
            return False
        for e, m in zip(entries, self.members):
            if e is not m or e.fused is not self:
                return False
        return True

    def adopt(self, worker, owner, calls):
        """A committed grouped call's fused residuals ``worker`` and ``owner``
        (None: the members keep their own) become the members' (their own
        arrays of them are stale: dropped), and ``calls`` their call count.
        Returns whether the members are now fused (hold any of them)."""
        for e in self.members:
            if worker is not None:
                e._worker = None
            if owner is not None:
                e._owner = None
            e.calls = calls
        self.worker, self.owner = worker, owner
        if worker is None and owner is None:
            return False
        for e in self.members:
            e.fused = self
        return True

    def evict(self, current=None):
        """Every member's residuals back into arrays of their own (new ones:
        the store's lock may be held), allocated and copied on the group's
        GPU (``gpu``, made current for it: :func:`mpigc._cuda.on_gpu`;
        ``current``: the GPU the caller knows is current, a call's, which
        saves the driver ask); the fused arrays are dropped. Under the
        group's own lock; does nothing once done."""
        with self.lock:
            if self.worker is None and self.owner is None:
                return
            with on_gpu(self.gpu, current):
                self._evict()

    def _evict(self):
        """:meth:`evict`'s copies, with the group's GPU current."""
        members, dtype, device = self.members, self.dtype, self.device
        t0 = _timeline.ON and _timeline.now()
        for arr, place, attr in ((self.worker, self.place, "_worker"),
                                 (self.owner, self.owner_place, "_owner")):
            if arr is None or place is None:
                continue
            pieces, ats, nshards = place
            for i, lo, hi, at in pieces:
                e = members[i]
                dst = getattr(e, attr)
                m = e.n if attr == "_worker" else hi - lo
                if dst is None or dst.size != m:
                    dst = empty(m, dtype, device)
                    setattr(e, attr, dst)
                if not device:
                    dst[lo:hi] = arr[at:at + hi - lo]
            if device:  # one launch per member, on the engine's stream
                from . import _cuda
                _dispatch.kernels(arr).group_copy(
                    arr, [getattr(e, attr) for e in members], ats, nshards, False,
                    **_cuda.stream_kw())
            if attr == "_owner":
                # a member smaller than the ranks owns no element here: an
                # empty owner residual, as its single call leaves
                for e in members:
                    if e._owner is None:
                        e._owner = empty(0, dtype, device)
        self.worker = self.owner = None
        for e in members:
            if e.fused is self:
                e.fused = None
        if t0:
            _timeline.span("group: residuals out", t0)


class Spares:
    """A store's scratch residual buffers (double-buffering): at most one
    per size, dtype and side (the host, or a GPU), under a lock of its own.
    A device spare serves calls on its own GPU only (one process may drive
    several): the caller says which, ``gpu``, the id its call's backend
    took when it adopted the buffer (:class:`mpigc._backend.DeviceBackend`),
    so that no take or give asks the driver; None is the host."""

    def __init__(self):
        self._pools = {}
        self._lock = threading.Lock()

    def take(self, n, dtype, gpu=None):
        """A buffer of ``n`` values (contents undefined), on the host (``gpu``
        None) or in the memory of GPU ``gpu``, current in the calling thread
        (the call's): one given back by :meth:`give` (taken out under the
        lock), or a new one (allocated outside the lock)."""
        key = (n, np.dtype(dtype), gpu)
        with self._lock:
            pool = self._pools.get(key)
            if pool:
                return pool.pop()
        return empty(n, dtype, gpu is not None)

    def give(self, arr, gpu=None):
        """Give back a residual buffer that no entry uses any more, on the
        host (``gpu`` None) or on GPU ``gpu``; kept if the pool of its size,
        dtype and side is empty, else dropped."""
        key = (arr.size, np.dtype(arr.dtype), gpu)
        with self._lock:
            pool = self._pools.setdefault(key, [])
            if len(pool) < 1:
                pool.append(arr)

    def clear(self):
        with self._lock:
            self._pools.clear()


def on_gpu(gpu, current=None):
    """:func:`mpigc._cuda.on_gpu`: GPU ``gpu`` current for a block (nothing
    for None, a host residual's, without importing the CUDA side)."""
    if gpu is None:
        return _HOST
    from . import _cuda
    return _cuda.on_gpu(gpu, current)


_HOST = contextlib.nullcontext()


def empty(n, dtype, device):
    if device:
        from . import _cuda
        return _cuda.empty(n, dtype)
    return np.empty(n, dtype)


def zeros(n, dtype, device):
    """``n`` zeros of ``dtype``, in device memory if ``device`` (of the GPU
    current now)."""
    if device:
        from . import _cuda
        return _cuda.zeros(n, dtype)
    return np.zeros(n, dtype)



def host(a):
    """A host copy of residual ``a`` (host or device), or None."""
    if a is None:
        return None
    if _dispatch.is_device_array(a):
        from . import _cuda
        return _cuda.to_host(a)
    return a.copy()



def zero(dst):
    """``dst[:] = 0`` in device memory."""
    from . import _cuda
    _cuda.copy(dst, np.zeros(dst.size, dst.dtype))



def copy_of(a, into=None):
    """A copy of residual ``a`` on its own side (a device residual stays in
    device memory), written into ``into`` when that fits; None for None."""
    if a is None:
        return None
    if _dispatch.is_device_array(a):
        from . import _cuda
        if (into is None or not _dispatch.is_device_array(into) or into.size != a.size
                or np.dtype(into.dtype) != np.dtype(a.dtype)):
            into = _cuda.empty(a.size, a.dtype)
        if a.size:
            _cuda.copy(into, a)
        return into
    if (into is None or not isinstance(into, np.ndarray) or into.shape != a.shape
            or into.dtype != a.dtype):
        return np.array(a, copy=True)
    into[...] = a
    return into

