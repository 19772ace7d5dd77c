"""The residual store's one transaction mechanism (:mod:`mpigc.feedback`'s,
private to it): every change to a store's residuals that may have to be
undone goes through a :class:`Txn`.

A transaction holds its keys (busy in the store: no other call, state,
reset or checkpoint touches them) from its start to :meth:`Txn.end`,
records what it will replace, and ends in one of two ways: :meth:`Txn.accept`
(what it replaced is no longer needed: replaced worker arrays become the
store's spares) or :meth:`Txn.restore` (put back, in one hold of the store's
lock). What it records (``txn.saved``: key -> :class:`Saved`, or None where
the key had no entry; ``txn.whole``: the whole set of entries) is data: a
caller may keep it and restore it later (:meth:`ErrorFeedback.transaction`
with ``saved``). The record is taken

- by reference (:meth:`Txn.keep`) where the calls in between write new
  arrays and leave the ones they replace intact (a hierarchical call's
  inter-node calls, started with ``keep_replaced``);
- by copy (:meth:`Txn.copy`), on the residuals' own side, only where they
  may change in place (a torch step's calls: their replaced arrays become
  spares that the next call writes);
- of the whole store (:meth:`Txn.install`) for an install in place of every
  entry (a checkpoint's load, undone if another rank fails).

The engine's per-call :class:`Transaction` (and :class:`GroupTransaction`)
is one: it holds its key(s), and writes nothing the store holds before its
``commit`` (the new worker residual goes to a scratch array), so a call that
does not go ahead has nothing to put back; at the commit what it replaces
is accepted at once (a spare), unless ``keep_replaced``: a transaction
around it holds a record of the key by reference and decides.
"""
from typing import NamedTuple

import numpy as np

from . import _dispatch
from . import _timeline
from ._residual_entry import Entry, Fused, copy_of, on_gpu, zero

__all__ = ["Saved", "Txn", "Transaction", "GroupTransaction"]


class Saved(NamedTuple):
    """What a transaction recorded of a key that had an entry: its residuals
    (the arrays themselves, or copies where ``copied``), call count and
    config, and the entry itself, to put back."""
    worker: object
    owner: object
    calls: int
    config: object
    entry: object
    copied: bool

    def put_back(self):
        """Its entry with what it recorded put back (for
        :meth:`ErrorFeedback.put_back`, under the store's lock): the arrays
        themselves, or copies written into the entry's arrays where they fit,
        made on its GPU; the call count and config."""
        e = self.entry
        if not self.copied:
            e.worker, e.owner = self.worker, self.owner
        else:
            with on_gpu(e.gpu):
                e.worker, e.owner = copy_of(self.worker, e.worker), copy_of(self.owner, e.owner)
        e.calls, e.config = self.calls, self.config
        return e


class Txn:
    """A transaction on the residuals of the store ``fb`` (see the module
    docstring); ``saved``: records to restore (another transaction's)."""

    __slots__ = ("fb", "keys", "held", "deferred", "saved", "whole")

    def __init__(self, fb, saved=None):
        self.fb = fb
        self.keys = []  # the keys it holds until end()
        self.held = self.deferred = False
        self.saved = {} if saved is None else saved  # key -> Saved | None
        self.whole = None  # what install() replaced: (entries, skipped_steps)

    # -- the keys it holds ----------------------------------------------------------
    def hold_all(self):
        """Hold every key of the store (a checkpoint's save reads them) and
        return ``{key: entry}`` (host copies of residuals kept on a GPU).
        Raises StateError, and holds nothing, if a key is in use."""
        entries = self.fb.hold_entries()
        self.keys, self.held = list(entries), True
        return entries

    def end(self, defer=False):
        """The transaction is over: its keys are released; with ``defer``,
        only at :meth:`settle` (a call the progress thread completed keeps
        its key until its caller sees it done)."""
        if self.held:
            if defer:
                self.deferred = True
                return
            self._release()

    def _release(self):
        self.held = False
        self.fb.release(*self.keys)

    def settle(self):
        """The caller saw the call done: release the keys :meth:`end` deferred."""
        if self.deferred:
            self.deferred = False
            self._release()

    # -- what it replaces -----------------------------------------------------------
    def keep(self, key):
        """Record what ``key`` holds now by reference (no copy). The calls
        until :meth:`restore` or :meth:`accept` must leave the arrays they
        replace intact (the engine's ``keep_replaced``)."""
        self.saved[key] = self.fb.record(key)

    def copy(self, key, reuse=None):
        """Record copies of what ``key`` holds now, on the residuals' side
        (device residuals are copied on the device), written into the arrays
        of ``reuse`` (an older record of the key, no longer needed) where
        they fit, so that a step allocates nothing; device copies are made
        on the key's GPU, whichever is current. Only while no call uses the
        key."""
        e = self.fb.entry(key)
        if e is None:
            self.saved[key] = None
            return
        w, o = (None, None) if reuse is None else (reuse.worker, reuse.owner)
        with on_gpu(e.gpu):
            self.saved[key] = Saved(copy_of(e.worker, w), copy_of(e.owner, o), e.calls,
                                    e.config, e, True)

    def install(self, entries, skipped_steps=None):
        """Install ``{key: entry}`` in place of every entry (and the count of
        skipped steps if given), recording the entries it replaces, and hold
        the keys of both until :meth:`end`. Raises StateError, and changes
        nothing, if a key is in use."""
        self.whole, self.keys = self.fb.replace_entries(entries, skipped_steps, hold=True)
        self.held = True

    def restore(self):
        """Put back what it recorded (the keys that had no entry then are
        forgotten), in one hold of the store's lock. Raises StateError, and
        puts nothing back, if a call other than its own holds a key it
        would change."""
        self.fb.put_back(self.saved, self.whole, self.keys if self.held else ())

    def accept(self):
        """What it recorded is not put back: a worker array recorded by
        reference that its key no longer holds becomes a spare (of its
        entry's side)."""
        for s in self.saved.values():
            if (s is not None and not s.copied and s.worker is not None
                    and s.entry.worker is not s.worker):
                self.fb.spares.give(s.worker, s.entry.gpu)


class Transaction(Txn):
    """One call's use of a key (:meth:`ErrorFeedback.begin`), a :class:`Txn`
    holding the key from the start to :meth:`end`. The new worker residual is
    written to a scratch array (:meth:`take_scratch`) and installed by
    :meth:`commit`, so a call that does not go ahead leaves the old one;
    ``entry`` is the key's entry (None before a first call's commit);
    ``gpu`` the id of the call's GPU (None: a host call)."""

    __slots__ = ("key", "entry", "scratch", "_shape", "keep_replaced", "gpu")

    def __init__(self, fb, key, n, dtype, world_size, rank, device, device_id=None):
        entry, self.gpu = fb.acquire(key, n, dtype, world_size, rank, device, device_id)
        if entry is not None and entry.fused is not None:
            # its own arrays again, on its GPU: the call's, current (no ask)
            entry.fused.evict(self.gpu)
        Txn.__init__(self, fb)
        self.entry, self.key, self.keys = entry, key, [key]
        self._shape = (n, dtype, world_size, rank, bool(device))
        self.scratch = None
        self.held = True
        # a transaction around the call keeps the arrays it replaces (commit)
        self.keep_replaced = False

    def worker(self):
        """The worker residual before the call (None: none yet)."""
        return None if self.entry is None else self.entry.worker

    def take_scratch(self):
        """The array the call writes its new worker residual to."""
        n, dtype = self._shape[:2]
        self.scratch = self.fb.spares.take(n, dtype, self.gpu)
        return self.scratch

    def commit(self, config, keep_replaced=False):
        """The call goes ahead: the key's entry (made for a first call) takes
        ``config`` and the scratch array as its worker residual; the array it
        replaces becomes a spare, unless ``keep_replaced`` (a transaction
        around the call holds it by reference, :meth:`Txn.keep`, and may put
        it back). Returns the entry."""
        n, dtype, size, rank, device = self._shape
        e = self.entry = self.fb.commit(self.key, self.entry, n, dtype, size, rank, config,
                                        device, self.gpu)
        self.keep_replaced = keep_replaced
        if self.scratch is not None:
            old, e.worker = e.worker, self.scratch
            self.scratch = None
            if old is not None and not keep_replaced:
                self.fb.spares.give(old, self.gpu)
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
        back, :meth:`Txn.restore`, so it must not be written)."""
        e = self.entry
        if e.worker is None or self.keep_replaced:
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
        return self.fb.spares.take(n, dtype, self.gpu)

    def set_owner(self, arr):
        """The committed call's new owner residual ``arr`` replaces the old
        (which the call no longer reads): the old becomes a spare, unless
        the call keeps the arrays it replaces (``keep_replaced``)."""
        old, self.entry.owner = self.entry.owner, arr
        if old is not None and old is not arr and not self.keep_replaced:
            self.fb.spares.give(old, self.gpu)

    def end(self, defer=False):
        """The call is over, or will not go ahead: an unused scratch array
        becomes a spare and the key is released (with ``defer``, at
        :meth:`settle`: :meth:`Txn.end`)."""
        if self.scratch is not None:
            self.fb.spares.give(self.scratch, self.gpu)
            self.scratch = None
        Txn.end(self, defer)

    # settle() is the Txn's: the caller saw the call done


class GroupTransaction(Transaction):
    """One grouped call's use of its members' keys
    (:meth:`ErrorFeedback.begin_group`), with the interface of a
    :class:`Transaction`: the call reads and writes ``entry``, a fused entry
    of the whole fused buffer, as a single call does its key's. The members'
    residuals stay fused between calls (:class:`mpigc._residual_entry.Fused`, one per group of
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

    __slots__ = ("sizes", "entries", "committed", "place", "owner_place", "fused")

    def __init__(self, fb, keys, sizes, place, owner_place, shard_n, dtype, world_size,
                 rank, device, device_id=None):
        entries, self.gpu, fused = fb.acquire_group(keys, sizes, dtype, world_size, rank,
                                                    device, device_id, place, owner_place)
        Txn.__init__(self, fb)
        self.keys, self.sizes, self.entries = list(keys), sizes, entries
        self.key = None  # its keys are self.keys
        self.place, self.owner_place = place, owner_place
        n = sum(sizes)
        self._shape = (n, np.dtype(dtype), world_size, rank, bool(device))
        self.scratch = None
        self.keep_replaced = False
        self.held, self.committed = True, False
        self.entry = None
        self.fused = fused
        if fused is not None:
            f = self.entry = Entry(n, dtype, world_size, rank, None, bool(device), self.gpu)
            f.calls = entries[0].calls  # the members' (Fused.adopt), as long as fused
            f.worker, f.owner = fused.worker, fused.owner  # resident: no copies
            return
        for e in entries:  # members' own arrays again, on the call's GPU (no ask)
            if e is not None and e.fused is not None:
                e.fused.evict(self.gpu)
        if any(e is not None for e in entries):
            t0 = _timeline.ON and _timeline.now()
            f = self.entry = Entry(n, dtype, world_size, rank, None, bool(device), self.gpu)
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
        out = self.fb.spares.take(n, dtype, self.gpu)
        pieces, ats, nshards = place
        if device:
            if any(a is None for a in arrays):
                zero(out)  # the members without residuals yet
            from . import _cuda  # (the engine's stream: MPIGC_CUDA_STREAM)
            _dispatch.kernels(out).group_copy(out, arrays, ats, nshards, True,
                                              **_cuda.stream_kw())
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
        entries = self.entries
        for i, e in enumerate(entries):
            if e is None:  # a first call: the store makes its entry
                entries[i] = self.fb.commit(self.keys[i], None, self.sizes[i], dtype, size,
                                            rank, config, device, self.gpu)
            else:  # a key this transaction holds: no other reader
                e.config = config
        f = self.entry
        if f is None:
            f = self.entry = Entry(n, dtype, size, rank, config, device, self.gpu)
        f.config = config
        if self.scratch is not None:
            old, f.worker = f.worker, self.scratch
            self.scratch = None
            if old is not None:
                self.fb.spares.give(old, self.gpu)  # the members' get the new one at end()
        self.committed = True
        return f

    def _install(self):
        """The fused entry's residuals become the members' (kept fused) and
        its call count theirs."""
        f, (_, dtype, _, _, device) = self.entry, self._shape
        fused = self.fused
        if fused is None:
            fused = Fused(self.entries, self.place, self.owner_place, dtype, device, self.gpu)
        worker = f.worker if self.place is not None else None
        owner = f.owner if self.owner_place is not None else None
        if fused.adopt(worker, owner, f.calls):
            self.fb.keep_fused(self.keys, fused)
        f.worker = f.owner = None

    def end(self, defer=False):
        """The call is over, or will not go ahead: a committed call's
        residuals become the members' (fused); the fused arrays of a call
        that did not commit become spares, unless they are the members'
        already; the keys are released (with ``defer``, at :meth:`settle`, as
        :meth:`Transaction.end`)."""
        if self.scratch is not None:
            self.fb.spares.give(self.scratch, self.gpu)
            self.scratch = None
        f = self.entry
        if f is not None:
            if self.committed:
                self._install()
            elif self.fused is None:
                for a in (f.worker, f.owner):
                    if a is not None:
                        self.fb.spares.give(a, self.gpu)
            f.worker = f.owner = None
            self.committed = False
        Txn.end(self, defer)
