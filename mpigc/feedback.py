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
from typing import NamedTuple

import numpy as np

from . import _dispatch
from . import _timeline
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
    """A key's residuals (``worker``, ``owner``), call count and config.

    ``worker`` and ``owner`` are properties: while the key is one member of
    a grouped call's fused residuals (``fused``, a :class:`_Fused`), its
    residuals live in the group's fused buffers, and the first read or write
    of either (a single call on the key, a state, a checkpoint, a snapshot)
    first copies every member's back into arrays of their own (:meth:`_Fused.evict`)."""

    __slots__ = ("n", "dtype", "world_size", "rank", "_worker", "_owner", "config",
                 "calls", "on_device", "fused")

    def __init__(self, n, dtype, world_size, rank, config, on_device=None):
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

    def place(self, device):
        """Move not-yet-placed residuals to where a call needs them."""
        if self.on_device is None:  # loaded: never fused
            if device:
                from . import _cuda
                self._worker = None if self._worker is None else _cuda.to_device(self._worker)
                self._owner = None if self._owner is None else _cuda.to_device(self._owner)
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


class _Fused:
    """The residuals of a grouped call's members, kept fused between calls
    (issue 51 item 6): ``worker``, laid out as the group's fused buffer
    (placement ``place``), and ``owner``, as this rank's fused shard
    (``owner_place``); None where the members keep their own arrays. A
    grouped call with the same keys, entries and placement uses them as they
    are (no gather or scatter per call); anything else that reads or writes a
    member's residual first moves every member's back into arrays of their
    own (:meth:`evict`), which is the scatter a call used to make at its end."""

    __slots__ = ("members", "place", "owner_place", "dtype", "device", "worker", "owner",
                 "lock")

    def __init__(self, members, place, owner_place, dtype, device):
        self.members = list(members)
        self.place, self.owner_place = place, owner_place
        self.dtype, self.device = dtype, device
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

    def evict(self):
        """Every member's residuals back into arrays of their own (new ones:
        the store's lock may be held); the fused arrays are dropped. Under
        the group's own lock; does nothing once done."""
        with self.lock:
            members, dtype, device = self.members, self.dtype, self.device
            if self.worker is None and self.owner is None:
                return
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
                        dst = _empty(m, dtype, device)
                        setattr(e, attr, dst)
                    if not device:
                        dst[lo:hi] = arr[at:at + hi - lo]
                if device:  # one launch per member
                    _dispatch.kernels(arr).group_copy(
                        arr, [getattr(e, attr) for e in members], ats, nshards, False)
                if attr == "_owner":
                    # a member smaller than the ranks owns no element here: an
                    # empty owner residual, as its single call leaves
                    for e in members:
                        if e._owner is None:
                            e._owner = _empty(0, dtype, device)
            self.worker = self.owner = None
            for e in members:
                if e.fused is self:
                    e.fused = None
            if t0:
                _timeline.span("group: residuals out", t0)


def _empty(n, dtype, device):
    if device:
        from . import _cuda
        return _cuda.empty(n, dtype)
    return np.empty(n, dtype)


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

    The user API is the mapping-like view (``keys()``, ``in``, ``len``),
    :meth:`state_dict`, :meth:`load_state_dict`, :meth:`reset` and
    ``skipped_steps``. The methods of the residual transaction API
    (:meth:`acquire` to :meth:`hold_name`; :func:`snapshot` and :func:`restore`) are for
    mpigc's own modules.

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
        self._fused = {}  # a grouped call's keys -> its members' fused residuals
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
        entries = {str(key): _entry_from_state(key, s) for key, s in state.items()}
        with self._lock:
            if self._busy:
                raise StateError("a collective is pending; wait for it before loading")
            self._entries = entries
            self._fused.clear()

    def reset(self, key=None):
        """Forget the residuals of ``key`` (or of every key)."""
        with self._lock:
            if self._busy and (key is None or str(key) in self._busy):
                raise StateError("a collective using this state is pending; wait for it "
                                 "before reset()")
            if key is None:
                self._entries.clear()
                self._spares.clear()
                self._fused.clear()
            else:
                self._entries.pop(str(key), None)

    # -- residual transaction API (mpigc's own modules) -----------------------
    # The collectives, hierarchical calls, checkpoints and the torch
    # integration reach the residuals through these methods only; the store's
    # bookkeeping (entries, keys in use, first calls, spares, the lock) stays
    # private to this module. They are not part of the user API: a user
    # reads and replaces state with state_dict(), load_state_dict(), reset().
    # What a method does "under the lock" it does in one hold of the store's
    # lock (never across an MPI call); no caller holds that lock itself.

    def acquire(self, key, n, dtype, world_size, rank, device=False):
        """For mpigc's own modules: mark ``key`` busy for a call and return
        its entry (or None if the key is new, which is then a pending first
        call: :meth:`state_dict` leaves it out). Raises StateError if it is
        in use already or does not fit the call (size, layout, or
        host/device memory: ``device`` is whether the call's buffer is a
        device array); then nothing changed. Under the lock: the checks, the
        placing of not-yet-placed residuals and the marking are one step.
        Pair with :meth:`release`."""
        with self._lock:
            if key in self._busy:
                raise StateError(f"key {key!r} is already used by a pending collective; "
                                 "wait for it, or use distinct keys")
            e = self._entries.get(key)
            if e is not None and (e.n, e.dtype, e.world_size, e.rank) != (
                    n, np.dtype(dtype), world_size, rank):
                raise StateError(
                    f"key {key!r} holds residuals of {e.describe()} (rank {e.rank}); this "
                    f"call has {n} values of {np.dtype(dtype)} on {world_size} rank(s) "
                    f"(rank {rank}): use another key, or reset({key!r})")
            if e is not None and not e.holds():
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

    def release(self, key):
        """For mpigc's own modules: ``key`` (marked by :meth:`acquire`) is no
        longer in use, nor a pending first call. Under the lock; never
        raises (releasing a key not in use does nothing)."""
        with self._lock:
            self._busy.discard(key)
            self._first.discard(key)

    def commit(self, key, entry, n, dtype, world_size, rank, config, device=False):
        """For mpigc's own modules: the call on ``key`` (which it holds, by
        :meth:`acquire`) goes ahead. Installs a new entry for ``key`` if
        ``entry`` is None (a first call; residuals on the device if
        ``device``), sets the entry's ``config``, and returns the entry.
        Under the lock (the key stays in use: the caller then writes the
        entry's residuals, then calls :meth:`release`)."""
        with self._lock:
            if entry is None:
                entry = _Entry(n, dtype, world_size, rank, config, bool(device))
                self._entries[key] = entry
            entry.config = config
            return entry

    def take_spare(self, n, dtype, device=False):
        """For mpigc's own modules: a scratch residual buffer of ``n``
        values (contents undefined), in device memory if ``device``: one
        given back by :meth:`give_spare` (taken out of the pool under the
        lock), or a new one (allocated outside the lock)."""
        with self._lock:
            pool = self._spares.get((n, np.dtype(dtype), bool(device)))
            if pool:
                return pool.pop()
        if device:
            from . import _cuda
            return _cuda.empty(n, dtype)
        return np.empty(n, dtype)

    def give_spare(self, arr):
        """For mpigc's own modules: give a residual buffer no entry uses any
        more back for :meth:`take_spare` (kept, under the lock, if the pool
        of its size, dtype and side is empty; else dropped)."""
        with self._lock:
            key = (arr.size, np.dtype(arr.dtype), _dispatch.is_device_array(arr))
            pool = self._spares.setdefault(key, [])
            if len(pool) < 1:
                pool.append(arr)

    def hold_entries(self):
        """For mpigc's own modules (checkpoints): mark every key busy and
        return ``{key: entry}`` (the live entries, no copies, except host
        copies of residuals kept on a GPU), so no collective changes them
        while a checkpoint reads them. Raises StateError if a key (or a
        hierarchical call's name) is in use; then nothing is marked. Under
        the lock. Pair with :meth:`release_entries`."""
        with self._lock:
            busy = sorted(self._busy)
            if busy:
                raise StateError(f"key(s) {busy} in use by a pending collective; wait "
                                 "for them before saving")
            self._busy.update(self._entries)
            return {k: e.host_copy() for k, e in self._entries.items()}

    def release_entries(self, entries):
        """For mpigc's own modules: the keys of ``entries`` (as
        :meth:`hold_entries` returned them) are no longer in use. Under the
        lock."""
        with self._lock:
            self._busy.difference_update(entries)

    def replace_entries(self, entries, skipped_steps=None):
        """For mpigc's own modules: install ``{key: entry}`` (not copied; made
        by :func:`new_entry`) in place of every entry, and the count of
        skipped steps if given (a checkpoint's). Raises StateError, and
        changes nothing, if a key (or a hierarchical call's name) is in
        use. Under the lock."""
        with self._lock:
            busy = sorted(self._busy)
            if busy:
                raise StateError(f"key(s) {busy} in use by a pending collective; wait "
                                 "for them before loading")
            self._entries = dict(entries)
            self._fused.clear()
            if skipped_steps is not None:
                self.skipped_steps = int(skipped_steps)

    def count_skipped_step(self):
        """For mpigc's own modules: one more call was skipped on every rank
        because of non-finite values (``skipped_steps``). Under the lock."""
        with self._lock:
            self.skipped_steps += 1

    def add_to_worker(self, key, lo, hi, add):
        """For mpigc's own modules (mpigc.torch's fold-back): add to the
        worker residual of ``key`` in ``[lo, hi)``: ``add(view)`` adds, in
        place, to ``view``, that range of the residual (a view on its side:
        a host or device array). Does nothing, and returns False, if the key
        has no worker residual; True otherwise. Only while no call uses the
        key."""
        e = self._entries.get(key)
        if e is None or e.worker is None or hi <= lo:
            return False
        add(e.worker[lo:hi])
        return True

    def update_entries(self, entries):
        """For mpigc's own modules: install ``{key: entry}`` (not copied),
        replacing the entries of those keys and keeping the others. Under
        the lock; no check that the keys are free (the caller knows no call
        uses them)."""
        with self._lock:
            self._entries.update(entries)

    def entry(self, key):
        """For mpigc's own modules: the live entry of ``key`` (not a copy),
        or None. One dictionary lookup, without the lock: read its fields,
        or change its residual arrays in place, only while holding the key
        (or knowing no call uses it)."""
        return self._entries.get(key)

    def entries(self):
        """For mpigc's own modules: ``{key: entry}``, a new dict of the live
        entries (not copies), taken under the lock (every key, pending first
        calls included)."""
        with self._lock:
            return dict(self._entries)

    # -- one call's transaction --------------------------------------------------------
    def begin(self, key, n, dtype, world_size, rank, device=False):
        """For mpigc's own modules: a :class:`Transaction` of one call on
        ``key``, which holds the key (:meth:`acquire`: raises StateError,
        and then nothing changed)."""
        return Transaction(self, key, n, dtype, world_size, rank, device)

    def begin_group(self, keys, sizes, place, owner_place, shard_n, dtype, world_size,
                    rank, device=False):
        """For mpigc's own modules (grouped calls, :mod:`mpigc._group`): a
        :class:`GroupTransaction` holding every key of ``keys`` (raises
        StateError, and then nothing changed)."""
        return GroupTransaction(self, keys, sizes, place, owner_place, shard_n, dtype,
                                world_size, rank, device)

    # -- a transaction of several calls, by reference --------------------------------
    def mark(self, key):
        """For mpigc's own modules (a hierarchical call): what ``key`` holds
        now, by reference (no copy), to :meth:`rollback` to if the caller's
        transaction fails or :meth:`settle` once it succeeded. The calls in
        between must leave the arrays they replace intact (the engine's
        ``keep_replaced``). Under the lock."""
        with self._lock:
            e = self._entries.get(key)
            if e is None:
                return _Mark(key, None, None, None, 0, None)
            return _Mark(key, e, e.worker, e.owner, e.calls, e.config)

    def rollback(self, mark):
        """Put back what :meth:`mark` saw: the key's entry then (with its
        arrays, call count and config), or no entry if it had none. Under the
        lock (no :meth:`state_dict` sees a half-restored entry)."""
        with self._lock:
            if mark.entry is None:
                self._entries.pop(mark.key, None)
            else:
                e = mark.entry
                e.worker, e.owner, e.calls, e.config = \
                    mark.worker, mark.owner, mark.calls, mark.config
                self._entries[mark.key] = e

    def settle(self, mark):
        """The transaction that :meth:`mark` began succeeded: the worker
        array the key held then, if it no longer does, becomes a spare."""
        if mark.worker is not None and mark.entry.worker is not mark.worker:
            self.give_spare(mark.worker)

    def hold_name(self, prefix, make_name):
        """For mpigc's own modules (hierarchical calls): mark a name of the
        caller's busy, so :meth:`state_dict`, :meth:`load_state_dict`,
        :meth:`reset` and checkpoints see a call in progress. Under the
        lock: if a busy name starts with ``prefix``, marks nothing (without
        calling ``make_name``) and returns None; else marks ``make_name()``
        (called once, under the lock) busy and returns it. Pair with
        :meth:`release` of that name."""
        with self._lock:
            if any(b.startswith(prefix) for b in self._busy):
                return None
            name = make_name()
            self._busy.add(name)
            return name


def new_entry(n, dtype, world_size, rank, config, calls=0, worker=None, owner=None):
    """For mpigc's own modules (checkpoints, mpigc.torch's state): an entry
    to install with :meth:`ErrorFeedback.replace_entries` or
    :meth:`ErrorFeedback.update_entries`, holding ``worker`` and ``owner``
    (host arrays or None, not copied) and the call count ``calls``; placed
    on the device, if its buffers are there, by its key's next call."""
    e = _Entry(n, dtype, world_size, rank, config)
    e.calls, e.worker, e.owner = int(calls), worker, owner
    return e


# -- a step that may be rolled back, by copy (mpigc.torch's nonfinite="skip") ---------
def _entry_from_state(key, s):
    """A key's entry from its state (as :func:`_entry_state` gives it),
    checked; the residuals copied to the host."""
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
    return e


def snapshot(fb, key, reuse=None):
    """For mpigc's own modules (a step that may be rolled back, e.g.
    mpigc.torch's ``nonfinite="skip"``): a copy of the residuals of ``key``
    in the store ``fb`` (an :class:`ErrorFeedback`),
    ``(worker, owner, calls)``, or None if the key has none yet. Copies
    stay on their side: device residuals are copied on the device, never
    to the host. The arrays of ``reuse`` (an older snapshot of the key, no
    longer needed) are written over when they fit, so a step allocates
    nothing. Read while the caller knows no call uses the key."""
    e = fb.entry(key)
    if e is None:
        return None
    old_w, old_o = (reuse[0], reuse[1]) if reuse is not None else (None, None)
    return _copy_of(e.worker, old_w), _copy_of(e.owner, old_o), e.calls


def restore(fb, key, snap):
    """For mpigc's own modules: put back into ``fb`` what :func:`snapshot` took
    (copied: the snapshot's arrays stay the snapshot's); a snapshot of
    None forgets the key (:meth:`ErrorFeedback.reset`). KeyError if the key has no entry
    to restore into."""
    if snap is None:
        fb.reset(key)
        return
    e = fb.entry(key)
    if e is None:
        raise KeyError(key)
    worker, owner, calls = snap
    for name, old in (("worker", worker), ("owner", owner)):
        cur = getattr(e, name)
        if old is None or cur is None or cur.size != old.size:
            setattr(e, name, _copy_of(old))
        elif _dispatch.is_device_array(cur) or _dispatch.is_device_array(old):
            from . import _cuda
            if cur.size:
                _cuda.copy(cur, old)
        else:
            cur[...] = old
    e.calls = calls


class Transaction:
    """One call's use of a key (:meth:`ErrorFeedback.begin`). The key is held
    from the start to :meth:`end`. The new worker residual is written to a
    scratch array (:meth:`take_scratch`) and installed by :meth:`commit`, so
    a call that does not go ahead leaves the old one; ``entry`` is the key's
    entry (None before a first call's commit)."""

    __slots__ = ("fb", "key", "entry", "scratch", "held", "deferred", "_shape", "keep")

    def __init__(self, fb, key, n, dtype, world_size, rank, device):
        self.entry = fb.acquire(key, n, dtype, world_size, rank, device)
        self.fb, self.key = fb, key
        self._shape = (n, dtype, world_size, rank, bool(device))
        self.scratch = None
        self.held = True
        self.deferred = False
        self.keep = False  # the caller keeps the arrays the call replaces (commit)

    def worker(self):
        """The worker residual before the call (None: none yet)."""
        return None if self.entry is None else self.entry.worker

    def take_scratch(self):
        """The array the call writes its new worker residual to."""
        n, dtype, _, _, device = self._shape
        self.scratch = self.fb.take_spare(n, dtype, device)
        return self.scratch

    def commit(self, config, keep_replaced=False):
        """The call goes ahead: the key's entry (made for a first call) takes
        ``config`` and the scratch array as its worker residual; the array it
        replaces becomes a spare, unless ``keep_replaced`` (the caller may put
        it back: :meth:`ErrorFeedback.rollback`). Returns the entry."""
        n, dtype, size, rank, device = self._shape
        e = self.entry = self.fb.commit(self.key, self.entry, n, dtype, size, rank, config,
                                        device)
        self.keep = keep_replaced
        if self.scratch is not None:
            old, e.worker = e.worker, self.scratch
            self.scratch = None
            if old is not None and not keep_replaced:
                self.fb.give_spare(old)
        return e

    def skipped(self):
        """The call was skipped on every rank (``nonfinite="skip"``)."""
        self.fb.count_skipped_step()

    def calls(self):
        """How many calls used the key before this one (None: no entry yet;
        a grouped call's: the most of its members')."""
        return None if self.entry is None else self.entry.calls

    def count_call(self):
        """The call is over: one more call used the key (nothing for a key
        that has no entry)."""
        if self.entry is not None:
            self.entry.calls += 1

    def ensure_worker(self, make):
        """The array the committed call writes its new worker residual to
        (terngrad, whose residual is written once the scale is agreed, after
        the commit): the entry's, updated in place, or ``make()``, an array
        of the entry's size whose values the call writes whole, installed
        first when the entry has none or when the call keeps the arrays it
        replaces (``keep_replaced``: a hierarchical call may put the old one
        back, :meth:`ErrorFeedback.rollback`, so it must not be written)."""
        e = self.entry
        if e.worker is None or self.keep:
            e.worker = make()
        return e.worker

    def owner(self):
        """The owner residual of the committed call's entry (None: none)."""
        return self.entry.owner

    def ensure_owner(self, make):
        """The owner residual of the committed call's entry: ``make()``
        (zeros of this rank's shard) installed first when it has none."""
        e = self.entry
        if e.owner is None:
            e.owner = make()
        return e.owner

    def take_owner_scratch(self, n, dtype):
        """The array the committed call writes its new owner residual to
        (``n`` values of this rank's shard, contents undefined): a spare, so
        that the owner residual is double-buffered like the worker's (the old
        one becomes the spare at :meth:`set_owner`), or a new one."""
        return self.fb.take_spare(n, dtype, self._shape[4])

    def set_owner(self, arr):
        """The committed call's new owner residual ``arr`` replaces the old
        (which the call no longer reads): the old becomes a spare, unless
        the call keeps the arrays it replaces (``keep_replaced``)."""
        old, self.entry.owner = self.entry.owner, arr
        if old is not None and old is not arr and not self.keep:
            self.fb.give_spare(old)

    def end(self, defer=False):
        """The call is over, or will not go ahead: an unused scratch array
        becomes a spare and the key is released; with ``defer``, only at
        :meth:`settle` (a call the progress thread completed keeps its key
        until its caller sees it done)."""
        if self.scratch is not None:
            self.fb.give_spare(self.scratch)
            self.scratch = None
        if self.held:
            if defer:
                self.deferred = True
                return
            self.fb.release(self.key)
            self.held = False

    def settle(self):
        """The caller saw the call done: release a key :meth:`end` deferred."""
        if self.deferred:
            self.deferred = self.held = False
            self.fb.release(self.key)


class GroupTransaction(Transaction):
    """One grouped call's use of its members' keys
    (:meth:`ErrorFeedback.begin_group`), with the interface of a
    :class:`Transaction`: the call reads and writes ``entry``, a fused entry
    of the whole fused buffer, as a single call does its key's. The members'
    residuals stay fused between calls (:class:`_Fused`, one per group of
    keys in the store): a call whose keys, entries and placement are those
    of the last grouped call on them takes the fused arrays as they are;
    any other gathers the members' residuals into new fused arrays at the
    start. Once the call committed, :meth:`end` makes its fused arrays the
    members' (no scatter: a member's own arrays are made again only when
    something else reads it); a call that does not go ahead changes no
    member. Where: ``place``, a placement ``(pieces, ats, nshards)`` of the
    fused buffer (``pieces``: member ``i``'s elements ``[lo, hi)`` at fused
    offset ``at``; ``ats``: the same per member shard, for one device launch
    per member; see :class:`mpigc._group._Layout`); ``owner_place``: the
    same for this rank's fused shard of ``shard_n`` values. Every key is
    held from the start to :meth:`end`."""

    __slots__ = ("keys", "sizes", "entries", "committed", "place", "owner_place", "fused")

    def __init__(self, fb, keys, sizes, place, owner_place, shard_n, dtype, world_size,
                 rank, device):
        entries = []
        try:
            for k, m in zip(keys, sizes):
                entries.append(fb.acquire(k, m, dtype, world_size, rank, device))
        except BaseException:
            for k in keys[:len(entries)]:
                fb.release(k)
            raise
        self.fb, self.keys, self.sizes, self.entries = fb, keys, sizes, entries
        self.key = None  # its keys are self.keys
        self.place, self.owner_place = place, owner_place
        n = sum(sizes)
        self._shape = (n, np.dtype(dtype), world_size, rank, bool(device))
        self.scratch = None
        self.keep = False
        self.held, self.deferred, self.committed = True, False, False
        self.entry = None
        fused = self.fused = fb._fused.get(tuple(keys))
        if fused is not None and fused.serves(entries, place, owner_place):
            f = self.entry = _Entry(n, dtype, world_size, rank, None, bool(device))
            f.calls = max(e.calls for e in entries)
            f._worker, f._owner = fused.worker, fused.owner  # resident: no copies
            return
        self.fused = None
        if any(e is not None for e in entries):
            t0 = _timeline.ON and _timeline.now()
            f = self.entry = _Entry(n, dtype, world_size, rank, None, bool(device))
            f.calls = max(e.calls for e in entries if e is not None)
            try:
                f.worker = self._gather([None if e is None else e.worker for e in entries],
                                        place, n)
                if owner_place is not None:
                    f.owner = self._gather([None if e is None else e.owner
                                            for e in entries], owner_place, shard_n)
            except BaseException:  # no memory for the fused residuals: nothing held
                self.end()
                raise
            if t0:
                _timeline.span("group: residuals in", t0)

    def _gather(self, arrays, place, n):
        """The members' ``arrays`` laid out by placement ``place`` in a new
        array of ``n`` values (zeros for a member without one); None if none
        has one."""
        if all(a is None for a in arrays):
            return None
        _, dtype, _, _, device = self._shape
        out = self.fb.take_spare(n, dtype, device)
        pieces, ats, nshards = place
        if device:
            if any(a is None for a in arrays):
                _zero(out)  # the members without residuals yet
            _dispatch.kernels(out).group_copy(out, arrays, ats, nshards, True)
            return out
        for i, lo, hi, at in pieces:
            a = arrays[i]
            out[at:at + hi - lo] = 0 if a is None else a[lo:hi]
        return out

    # worker(), take_scratch(), skipped() and the rest are the Transaction's,
    # on the fused entry and the fused buffer's size

    def commit(self, config, keep_replaced=False):
        """The call goes ahead: every member's key gets an entry (made for a
        first call) with ``config``; the fused entry takes the scratch array
        as its worker residual (the members get theirs at :meth:`end`).
        Returns the fused entry."""
        n, dtype, size, rank, device = self._shape
        for i, (k, m) in enumerate(zip(self.keys, self.sizes)):
            self.entries[i] = self.fb.commit(k, self.entries[i], m, dtype, size, rank, config,
                                             device)
        f = self.entry
        if f is None:
            f = self.entry = _Entry(n, dtype, size, rank, config, device)
        f.config = config
        if self.scratch is not None:
            old, f.worker = f.worker, self.scratch
            self.scratch = None
            if old is not None:
                self.fb.give_spare(old)  # the members' get the new one at end()
        self.committed = True
        return f

    def _install(self):
        """The fused entry's residuals become the members' (kept fused) and
        its call count theirs."""
        f, (_, dtype, _, _, device) = self.entry, self._shape
        fused = self.fused
        if fused is None:
            fused = _Fused(self.entries, self.place, self.owner_place, dtype, device)
        worker = f._worker if self.place is not None else None
        owner = f._owner if self.owner_place is not None else None
        for e in self.entries:
            # their own arrays (gathered) are stale: the fused ones hold them
            if worker is not None:
                e._worker = None
            if owner is not None:
                e._owner = None
            e.calls = f.calls
        fused.worker, fused.owner = worker, owner
        if worker is not None or owner is not None:
            for e in self.entries:
                e.fused = fused
            self.fb._fused[tuple(self.keys)] = fused
        f._worker = f._owner = None

    def end(self, defer=False):
        """The call is over, or will not go ahead: a committed call's
        residuals become the members' (fused); the fused arrays of a call
        that did not commit become spares, unless they are the members'
        already; the keys are released (with ``defer``, at :meth:`settle`, as
        :meth:`Transaction.end`)."""
        if self.scratch is not None:
            self.fb.give_spare(self.scratch)
            self.scratch = None
        f = self.entry
        if f is not None:
            if self.committed:
                self._install()
            elif self.fused is None:
                for a in (f._worker, f._owner):
                    if a is not None:
                        self.fb.give_spare(a)
            f._worker = f._owner = None
            self.committed = False
        if self.held:
            if defer:
                self.deferred = True
                return
            self._release()

    def _release(self):
        self.held = False
        for k in self.keys:
            self.fb.release(k)

    def settle(self):
        """The caller saw the call done: release the keys :meth:`end` deferred."""
        if self.deferred:
            self.deferred = False
            self._release()


def _zero(dst):
    """``dst[:] = 0`` in device memory."""
    from . import _cuda
    _cuda.copy(dst, np.zeros(dst.size, dst.dtype))


class _Mark(NamedTuple):
    """What :meth:`ErrorFeedback.mark` saw of a key."""
    key: str
    entry: object
    worker: object
    owner: object
    calls: int
    config: object


def _copy_of(a, into=None):
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


def _host_array(a):
    return a.copy_to_host() if _dispatch.is_device_array(a) else a


_default = ErrorFeedback()


def get_default_feedback():
    """The process-wide store used when a collective gets ``feedback=None``."""
    return _default
