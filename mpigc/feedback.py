"""Error-feedback state: the residuals of every key, what checkpoints save.

Each key (a parameter name, a bucket name) holds, on each rank:

``worker``
    The part of this rank's gradient that its payloads have not delivered
    yet (``x - D(Q(x))``), one value per element, dtype ``work_dtype``.
``owner``
    For ``gather="compressed"``: the part of the reduced shard this rank owns
    that its second-stage payload has not delivered yet. Shards are contiguous
    in rank order, as ``numpy.array_split(range(n), world_size)``.
``calls``
    How many collectives used the key (terngrad's random streams depend on it).

A residual that was never needed (error feedback off) is ``None``.

Where residuals live
--------------------
A key's residuals live where its buffers live: in host memory for numpy
buffers, in device memory for CUDA device arrays (the double-buffer spare
too). A key used with a host buffer cannot then be used with a device buffer
(or the other way round): that is a :class:`StateError`. Residuals put in by
:meth:`ErrorFeedback.load_state_dict` or ``mpigc.load_checkpoint`` are host
arrays and have no place yet: the key's next call moves them to the device
if its buffer is a device array. :meth:`ErrorFeedback.state_dict` and
checkpoints always get host copies.
"""
import threading

import numpy as np

from . import _dispatch
from ._errors import StateError
from .compressors import get_compressor

__all__ = ["ErrorFeedback", "get_default_feedback", "shard_bounds"]


def shard_bounds(n, size):
    """``(lo, hi)`` of every rank's shard of ``n`` elements, as
    ``numpy.array_split`` cuts them (the first ``n % size`` get one more)."""
    q, r = divmod(int(n), int(size))
    bounds = []
    lo = 0
    for j in range(size):
        hi = lo + q + (1 if j < r else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds


class _Entry:
    __slots__ = ("n", "dtype", "world_size", "rank", "worker", "owner", "config",
                 "calls", "on_device")

    def __init__(self, n, dtype, world_size, rank, config, on_device=None):
        self.n = n
        self.dtype = np.dtype(dtype)
        self.world_size = world_size
        self.rank = rank
        self.worker = None
        self.owner = None
        self.config = config
        self.calls = 0
        #: True: residuals in device memory; False: host; None: not placed yet
        #: (loaded from a state dict or a checkpoint; see the module docstring)
        self.on_device = on_device

    def place(self, device):
        """Move not-yet-placed residuals to where a call needs them."""
        if self.on_device is None:
            if device:
                from . import _cuda
                self.worker = None if self.worker is None else _cuda.to_device(self.worker)
                self.owner = None if self.owner is None else _cuda.to_device(self.owner)
            self.on_device = bool(device)

    def host_copy(self):
        """An entry with host copies of the residuals (the same one if they
        are on the host already)."""
        if not self.on_device:
            return self
        e = _Entry(self.n, self.dtype, self.world_size, self.rank, self.config, False)
        e.calls = self.calls
        e.worker = _host(self.worker)
        e.owner = _host(self.owner)
        return e

    def describe(self):
        return (f"{self.n} values of {self.dtype} on {self.world_size} rank(s)")


def _entry_state(e):
    """One entry as :meth:`ErrorFeedback.state_dict` gives it (host copies)."""
    return {"worker": _host(e.worker), "owner": _host(e.owner), "config": dict(e.config),
            "calls": e.calls, "world_size": e.world_size, "rank": e.rank, "n": e.n,
            "dtype": e.dtype.name}


def _host(a):
    """A host copy of residual ``a`` (host or device), or None."""
    if a is None:
        return None
    if _dispatch.is_device_array(a):
        return a.copy_to_host()
    return a.copy()


class ErrorFeedback:
    """The residual store: residuals per key, kept between calls.

    Module-level collectives use one process-wide store
    (:func:`get_default_feedback`); pass ``feedback=ErrorFeedback()`` to keep
    several independent ones (e.g. per model).

    Examples
    --------
    >>> fb = mpigc.ErrorFeedback()
    >>> mpigc.allreduce(grad, op="2bit", key="w", feedback=fb)   # doctest: +SKIP
    >>> state = fb.state_dict()      # {'w': {'worker': ..., 'owner': ..., ...}}
    """

    def __init__(self):
        self._entries = {}
        self._spares = {}
        self._busy = set()  # keys used by a call in progress
        self._first = set()  # those of them whose call is their first (new keys)
        self._lock = threading.Lock()
        #: how many calls were skipped because of non-finite gradients
        self.skipped_steps = 0

    # -- mapping-like view ---------------------------------------------------
    def keys(self):
        return list(self._entries)

    def __contains__(self, key):
        return str(key) in self._entries

    def __len__(self):
        return len(self._entries)

    def __repr__(self):
        return f"ErrorFeedback(keys={self.keys()!r})"

    # -- public state --------------------------------------------------------
    def state_dict(self):
        """A copy of the state (host arrays, also for residuals kept on a
        GPU), per key::

            {"worker": ndarray | None, "owner": ndarray | None,
             "config": dict, "calls": int, "world_size": int, "rank": int,
             "n": int, "dtype": str}

        A key whose first call is pending is not in the state yet.

        Raises
        ------
        StateError
            While a call on a key of the state is pending (its residuals are
            being replaced: the state never holds a half-updated one), or a
            hierarchical call of this store is.
        """
        out = {}
        with self._lock:
            busy = sorted(self._busy - self._first)
            if busy:
                raise StateError(f"key(s) {busy} in use by a pending collective; wait "
                                 "for it before taking the state")
            for key, e in self._entries.items():
                if key not in self._first:
                    out[key] = _entry_state(e)
        return out

    def load_state_dict(self, state):
        """Replace the state by ``state`` (as :meth:`state_dict` returns it).

        The residuals are copied (as host arrays; device arrays are copied
        to the host). Sizes are checked: a worker residual must have ``n``
        values and an owner residual the size of the rank's shard. A key's
        next collective moves its residuals to the GPU if its buffer is a
        device array.
        """
        entries = {}
        for key, s in state.items():
            get_compressor(dict(s["config"]))  # validates the config
            n = int(s["n"]) if "n" in s else int(np.asarray(s["worker"]).size)
            dtype = np.dtype(s.get("dtype") or np.asarray(s["worker"]).dtype)
            e = _Entry(n, dtype, int(s["world_size"]), int(s["rank"]), dict(s["config"]))
            e.calls = int(s.get("calls", 0))
            if s.get("worker") is not None:
                w = np.array(_host_array(s["worker"]), dtype=dtype).reshape(-1)
                if w.size != n:
                    raise StateError(f"key {key!r}: worker residual has {w.size} values, "
                                     f"expected {n}")
                e.worker = w
            if s.get("owner") is not None:
                lo, hi = shard_bounds(n, e.world_size)[e.rank]
                o = np.array(_host_array(s["owner"]), dtype=dtype).reshape(-1)
                if o.size != hi - lo:
                    raise StateError(f"key {key!r}: owner residual has {o.size} values, "
                                     f"expected {hi - lo} (shard of rank {e.rank})")
                e.owner = o
            entries[str(key)] = e
        with self._lock:
            if self._busy:
                raise StateError("a collective is pending; wait for it before loading")
            self._entries = entries

    def reset(self, key=None):
        """Forget the residuals of ``key`` (or of every key)."""
        with self._lock:
            if self._busy and (key is None or str(key) in self._busy):
                raise StateError("a collective using this state is pending; wait for it "
                                 "before reset()")
            if key is None:
                self._entries.clear()
                self._spares.clear()
            else:
                self._entries.pop(str(key), None)

    # -- used by checkpoints (mpigc.checkpoint) -------------------------------
    def _hold_entries(self):
        """Mark every key busy and return ``{key: entry}`` (the live entries,
        no copies, except host copies of residuals kept on a GPU), so no
        collective changes them while a checkpoint reads them. Raises
        StateError if a key is in use. Pair with :meth:`_release_entries`."""
        with self._lock:
            busy = sorted(self._busy)
            if busy:
                raise StateError(f"key(s) {busy} in use by a pending collective; wait "
                                 "for them before saving")
            self._busy.update(self._entries)
            return {k: e.host_copy() for k, e in self._entries.items()}

    def _release_entries(self, entries):
        with self._lock:
            self._busy.difference_update(entries)

    def _replace_entries(self, entries):
        """Install ``{key: _Entry}`` (not copied) in place of every entry."""
        with self._lock:
            busy = sorted(self._busy)
            if busy:
                raise StateError(f"key(s) {busy} in use by a pending collective; wait "
                                 "for them before loading")
            self._entries = dict(entries)

    # -- used by the collectives ---------------------------------------------
    def _acquire(self, key, n, dtype, world_size, rank, device=False):
        """Mark ``key`` busy for a call and return its entry (or None if the
        key is new). Raises StateError if it does not fit the call (size,
        layout, or host/device memory: ``device`` is whether the call's
        buffer is a device array)."""
        with self._lock:
            if key in self._busy:
                raise StateError(f"key {key!r} is already used by a pending collective; "
                                 "wait for it, or use distinct keys")
            e = self._entries.get(key)
            if e is not None and (e.n, e.dtype, e.world_size, e.rank) != (n, np.dtype(dtype), world_size, rank):
                raise StateError(
                    f"key {key!r} holds residuals of {e.describe()} (rank {e.rank}); this "
                    f"call has {n} values of {np.dtype(dtype)} on {world_size} rank(s) "
                    f"(rank {rank}): use another key, or reset({key!r})")
            if e is not None and e.worker is None and e.owner is None:
                e.on_device = None  # nothing held: the key may change sides
            if e is not None and e.on_device is not None and e.on_device != bool(device):
                held, given = (("device", "host") if e.on_device else ("host", "device"))
                raise StateError(
                    f"key {key!r} holds residuals in {held} memory; this call has a "
                    f"{given} buffer: use another key, reset({key!r}), or move them "
                    "(load_state_dict(state_dict()) places them on the next call)")
            if e is not None:
                e.place(device)
            else:
                self._first.add(key)
            self._busy.add(key)
            return e

    def _release(self, key):
        with self._lock:
            self._busy.discard(key)
            self._first.discard(key)

    def _commit(self, key, entry, n, dtype, world_size, rank, config, device=False):
        """Install a new entry for ``key`` (first call) or update ``config``;
        returns the entry."""
        with self._lock:
            if entry is None:
                entry = _Entry(n, dtype, world_size, rank, config, bool(device))
                self._entries[key] = entry
            entry.config = config
            return entry

    def _take_spare(self, n, dtype, device=False):
        """A scratch residual buffer of ``n`` values (contents undefined), in
        device memory if ``device``."""
        with self._lock:
            pool = self._spares.get((n, np.dtype(dtype), bool(device)))
            if pool:
                return pool.pop()
        if device:
            from . import _cuda
            return _cuda.empty(n, dtype)
        return np.empty(n, dtype)

    def _give_spare(self, arr):
        with self._lock:
            key = (arr.size, np.dtype(arr.dtype), _dispatch.is_device_array(arr))
            pool = self._spares.setdefault(key, [])
            if len(pool) < 1:
                pool.append(arr)


def _host_array(a):
    return a.copy_to_host() if _dispatch.is_device_array(a) else a


_default = ErrorFeedback()


def get_default_feedback():
    """The process-wide store used when a collective gets ``feedback=None``."""
    return _default
