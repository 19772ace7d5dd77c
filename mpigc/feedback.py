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
too), of the GPU the key's calls ran on. A key used with a host buffer
cannot then be used with a device buffer (or the other way round), nor a key
whose residuals are on one GPU by a call on another GPU of the process: that
is a :class:`StateError`. Residuals put in by
:meth:`ErrorFeedback.load_state_dict` or ``mpigc.load_checkpoint`` are host
arrays and have no place yet: the key's next call moves them to the device
(its GPU) if its buffer is a device array. :meth:`ErrorFeedback.state_dict` and
checkpoints always get host copies. Every copy or move of a key's device
residuals outside a call (a state, a checkpoint's save, a record by copy and
its restore, a grouped call's fused residuals given back to their members)
runs on the key's GPU, made current for it (:func:`mpigc._cuda.on_gpu`)
whatever GPU the calling thread has current.
"""
import threading

import numpy as np

from . import _dispatch
from ._errors import StateError
from ._residual_entry import Entry, Spares, host, on_gpu
from ._residual_txn import GroupTransaction, Saved, Transaction, Txn
from .compressors import get_compressor

__all__ = ["ErrorFeedback", "get_default_feedback", "shard_bounds", "hold_for_plain",
           "plain_done"]


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


def _refuse(busy, tail):
    """StateError if any key of ``busy`` is used by a pending call."""
    if busy:
        raise StateError(f"key(s) {sorted(busy)} in use by a pending collective; wait "
                         + tail)


def _refuse_in_use(key, busy):
    if key in busy:
        raise StateError(f"key {key!r} is already used by a pending collective; "
                         "wait for it, or use distinct keys")


def _call_gpu(device, device_id):
    """The id of a call's GPU: ``device_id``, or for a device call without
    one the GPU current now (asked once); None for a host call."""
    if device and device_id is None:
        from . import _cuda
        device_id = _cuda.current_device_id()
    return device_id if device else None


def _entry_state(e):
    """One entry as :meth:`ErrorFeedback.state_dict` gives it (host copies,
    made on the entry's GPU)."""
    with on_gpu(e.gpu):
        worker, owner = host(e.worker), host(e.owner)
    return {"worker": worker, "owner": owner, "config": dict(e.config),
            "calls": e.calls, "world_size": e.world_size, "rank": e.rank, "n": e.n,
            "dtype": e.dtype.name}


class ErrorFeedback:
    """The residual store: residuals per key, kept between calls.

    Module-level collectives use one process-wide store
    (:func:`get_default_feedback`); pass ``feedback=ErrorFeedback()`` to keep
    several independent ones (e.g. per model).

    The user API is the mapping-like view (``keys()``, ``in``, ``len``),
    :meth:`state_dict`, :meth:`load_state_dict`, :meth:`reset` and
    ``skipped_steps``. The methods of the residual transaction API
    (:meth:`acquire` to :meth:`hold_name`) are for mpigc's own modules; every
    rollback is a :meth:`transaction` (:mod:`mpigc._residual_txn`).

    Examples
    --------
    >>> fb = mpigc.ErrorFeedback()
    >>> mpigc.allreduce(grad, op="2bit", key="w", feedback=fb)   # doctest: +SKIP
    >>> state = fb.state_dict()      # {'w': {'worker': ..., 'owner': ..., ...}}
    """

    def __init__(self):
        self._entries = {}
        #: for mpigc's own modules: the transactions' scratch residual buffers
        self.spares = Spares()
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
            _refuse(self._busy - self._first, "for it before taking the state")
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
                self.spares.clear()
                self._fused.clear()
            else:
                self._entries.pop(str(key), None)

    # -- residual transaction API (mpigc's own modules only; "under the lock":
    # in one hold of the store's lock, never across an MPI call) --------------

    def acquire(self, key, n, dtype, world_size, rank, device=False, device_id=None):
        """For mpigc's own modules: mark ``key`` busy for a call; returns its
        entry (None: a new key, then a pending first call, which
        :meth:`state_dict` leaves out) and the call's GPU (:func:`_call_gpu`).
        StateError, nothing changed, if it is in use or does not fit the call
        (size, layout, side, GPU). Under the lock: checks, placing, marking."""
        gpu = _call_gpu(device, device_id)
        with self._lock:
            _refuse_in_use(key, self._busy)
            e = self._entries.get(key)
            if e is None:
                self._first.add(key)
            else:  # StateError if it does not fit the call; else placed for it
                e.fit(key, n, dtype, world_size, rank, device, gpu)
            self._busy.add(key)
            return e, gpu

    def acquire_group(self, keys, sizes, dtype, world_size, rank, device, device_id, place,
                      owner_place):
        """For :class:`GroupTransaction`: :meth:`acquire` of each of ``keys`` (of
        ``sizes``) in one hold of the lock: ``(entries, gpu, fused)``, ``fused``
        their fused residuals if they serve the call (fit where the first fits)."""
        gpu, keys, held = _call_gpu(device, device_id), tuple(keys), 0
        with self._lock:
            entries = [self._entries.get(k) for k in keys]
            fused = self._fused.get(keys)
            if fused is not None and fused.serves(entries, place, owner_place) \
                    and self._busy.isdisjoint(keys):  # no key is new, none in use
                entries[0].fit(keys[0], sizes[0], dtype, world_size, rank, device, gpu)
                self._busy.update(keys)
                return entries, gpu, fused
            try:  # one by one: StateError, nothing held, as the first acquire() failing
                for k, m, e in zip(keys, sizes, entries):
                    _refuse_in_use(k, self._busy)
                    if e is None:
                        self._first.add(k)
                    else:
                        e.fit(k, m, dtype, world_size, rank, device, gpu)
                    self._busy.add(k)
                    held += 1
            except BaseException:
                self._busy.difference_update(keys[:held])
                self._first.difference_update(keys[:held])
                raise
            return entries, gpu, None

    def release(self, *keys):
        """For mpigc's own modules: ``keys`` (marked by :meth:`acquire`) are no
        longer in use, nor pending first calls. Under the lock; never raises."""
        with self._lock:
            self._busy.difference_update(keys)
            self._first.difference_update(keys)

    def commit(self, key, entry, n, dtype, world_size, rank, config, device=False,
               gpu=None):
        """For mpigc's own modules: the call on ``key`` (held) goes ahead: a new
        entry if ``entry`` is None (a first call; on GPU ``gpu`` if ``device``),
        given ``config``; returns it. Under the lock (the key stays held)."""
        with self._lock:
            if entry is None:
                entry = Entry(n, dtype, world_size, rank, config, bool(device), gpu)
                self._entries[key] = entry
            entry.config = config
            return entry

    def hold_entries(self):
        """For :meth:`Txn.hold_all`: mark every key busy and return
        ``{key: entry}`` (host copies of residuals kept on a GPU). StateError,
        nothing marked, if a key (or a hierarchical call's name) is in use;
        nothing either where a copy fails: they are made first. Under the lock."""
        with self._lock:
            _refuse(self._busy, "for them before saving")
            held = {k: e.host_copy() for k, e in self._entries.items()}
            self._busy.update(held)
            return held

    def replace_entries(self, entries, skipped_steps=None, hold=False):
        """For mpigc's own modules: ``{key: entry}`` (not copied; made by
        :func:`new_entry`) in place of every entry, and the count of skipped
        steps if given; ``hold``: the old and new keys marked busy (for
        :meth:`Txn.install`). StateError, nothing changed, if a key is in
        use. Returns ``(entries, skipped_steps)`` replaced and the keys marked."""
        with self._lock:
            _refuse(self._busy, "for them before loading")
            old = (self._entries, self.skipped_steps)
            self._entries = dict(entries)
            self._fused.clear()
            if skipped_steps is not None:
                self.skipped_steps = int(skipped_steps)
            keys = sorted(set(old[0]) | set(entries)) if hold else []
            self._busy.update(keys)
            return old, keys

    def count_skipped_step(self):
        """For mpigc's own modules: one more call skipped on every rank for
        non-finite values (``skipped_steps``). Under the lock."""
        with self._lock:
            self.skipped_steps += 1

    def add_to_worker(self, key, lo, hi, add):
        """For mpigc's own modules (mpigc.torch's fold-back): ``add(view)``
        adds in place to ``key``'s worker residual in ``[lo, hi)`` (a view on
        its side, called with a device residual's GPU current). Returns False,
        doing nothing, if the key has no worker residual. Only while no call uses it."""
        e = self._entries.get(key)
        return e is not None and hi > lo and e.add_to_worker(lo, hi, add)

    def ensure_worker(self, key):
        """For mpigc's own modules (mpigc.torch's fold-back after a plain sum
        of ``op="auto"`` cleared the residuals, :func:`plain_done`): zeros on
        the entry's side as ``key``'s worker residual if it has none. Returns
        whether it has one now (False: no entry). Under the lock; only while
        no call uses it."""
        with self._lock:
            e = self._entries.get(key)
            return e is not None and e.ensure_worker()

    def update_entries(self, entries):
        """For mpigc's own modules: ``{key: entry}`` (not copied) in place of
        those keys', others kept. Under the lock; only while no call uses them."""
        with self._lock:
            self._entries.update(entries)

    def entry(self, key):
        """For mpigc's own modules: the live entry of ``key`` or None, without
        the lock: use it only while holding the key (or no call uses it)."""
        return self._entries.get(key)

    def entries(self):
        """For mpigc's own modules: a new dict of the live entries (pending first calls too)."""
        with self._lock:
            return dict(self._entries)

    # -- one call's transaction --------------------------------------------------------
    def begin(self, key, n, dtype, world_size, rank, device=False, device_id=None):
        """For mpigc's own modules: a :class:`Transaction` of one call, holding
        ``key`` (:meth:`acquire`: StateError, and then nothing changed);
        ``device_id``: a device call's GPU, as its backend took it when it
        adopted the buffer (None: asked once here)."""
        return Transaction(self, key, n, dtype, world_size, rank, device, device_id)

    def begin_group(self, keys, sizes, place, owner_place, shard_n, dtype, world_size,
                    rank, device=False, device_id=None):
        """For mpigc's own modules (grouped calls, :mod:`mpigc._group`): a
        :class:`GroupTransaction` holding every key of ``keys`` (or StateError)."""
        return GroupTransaction(self, keys, sizes, place, owner_place, shard_n, dtype,
                                world_size, rank, device, device_id)

    def keep_fused(self, keys, fused):
        """``fused`` holds the residuals of a grouped call's ``keys`` now."""
        self._fused[tuple(keys)] = fused

    # -- every rollback: a transaction (mpigc._residual_txn) -------------------------
    def transaction(self, saved=None):
        """For mpigc's own modules: a :class:`Txn` on this store, holding
        nothing yet; ``saved``: another's records, to restore."""
        return Txn(self, saved)

    def record(self, key):
        """For :meth:`Txn.keep`: what ``key`` holds now, by reference (a
        :class:`Saved`), or None if it has no entry. Under the lock."""
        with self._lock:
            e = self._entries.get(key)
            return None if e is None else Saved(e.worker, e.owner, e.calls, e.config, e,
                                                False)

    def put_back(self, saved, whole=None, held=()):
        """For :meth:`Txn.restore`: ``whole`` (entries, skipped steps) if given
        in place of the store's, then each record of ``saved`` (None: forget
        the key) put back: entry, calls, config, arrays (copies copied into
        the entry's own). In one hold of the lock: no state sees half of it.
        Raises StateError, putting nothing back, if a key it would change is
        used by a call (``held``: the restoring transaction's own keys), as
        :meth:`reset` does: the call's residuals are not overwritten under it."""
        with self._lock:
            busy = self._busy.difference(held)
            _refuse(busy if whole is not None else busy.intersection(saved),
                    "for it before putting their residuals back")
            if whole is not None:
                self._entries, self.skipped_steps = dict(whole[0]), whole[1]
                self._fused.clear()
            for key, s in saved.items():
                if s is None:
                    self._entries.pop(key, None)
                else:
                    self._entries[key] = s.put_back()

    def hold_name(self, prefix, make_name):
        """For mpigc's own modules (hierarchical calls): mark a name busy, so
        states, loads, resets and checkpoints see a call in progress. Under
        the lock: None if a busy name starts with ``prefix``; else marks
        ``make_name()`` (called once) busy and returns it (:meth:`release` it)."""
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
    e = Entry(n, dtype, world_size, rank, config)
    e.calls, e.worker, e.owner = int(calls), worker, owner
    return e


def _entry_from_state(key, s):
    """A key's entry from its state (as :func:`_entry_state` gives it),
    checked; the residuals copied to the host."""
    get_compressor(dict(s["config"]))  # validates the config
    n = int(s["n"]) if "n" in s else int(np.asarray(s["worker"]).size)
    dtype = np.dtype(s.get("dtype") or np.asarray(s["worker"]).dtype)
    e = Entry(n, dtype, int(s["world_size"]), int(s["rank"]), dict(s["config"]))
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


def _host_array(a):
    """A host copy of a loaded residual on a device: a Numba array, or any
    ``__cuda_array_interface__`` object (CuPy, a CUDA torch tensor), made on
    its GPU."""
    if not _dispatch.is_device_array(a):
        return a
    from . import _cuda
    return _cuda.host_copy(a)


def hold_for_plain(fb, key, n, dtype, world_size, rank):
    """For ``op="auto"`` (:mod:`mpigc._auto`) when it runs a call as a plain
    sum: hold ``key`` for the call, as a call's transaction does (StateError,
    holding nothing, if it is in use or does not fit a host call of ``n``
    values of ``dtype`` on ``world_size`` ranks), and return its entry, or
    None if it has none. The caller adds the entry's residuals (``worker``,
    and ``owner`` on this rank's shard) into the values the plain sum takes,
    then ends the hold with :func:`plain_done`."""
    entry, _ = fb.acquire(key, n, dtype, world_size, rank)
    return entry


def plain_done(fb, key, entry, delivered):
    """End a hold of :func:`hold_for_plain`: with ``delivered`` (the plain
    sum went ahead on every rank with the residuals added), ``entry``'s
    residuals are delivered, so they are cleared (None: the next compressed
    call starts from zero; the worker array becomes a spare); otherwise
    (the call failed or was skipped) they stay as they were. Releases the
    key; never raises."""
    try:
        if delivered and entry is not None:
            with fb._lock:
                old, entry.worker, entry.owner = entry.worker, None, None
            if old is not None:
                fb.spares.give(old, entry.gpu)
    finally:
        fb.release(key)


_default = ErrorFeedback()


def get_default_feedback():
    """The process-wide store used when a collective gets ``feedback=None``."""
    return _default
