"""The torch layer's one residual-state component: what GradientSync, the
DDP hook and CompressedAdamW do to their residuals, written once.

:class:`Residuals` holds an object's :class:`mpigc.ErrorFeedback` store and
does, through the store's API only (no entry field is written here):

- a step that changes the residuals of all its calls or of none: the
  store's transactions (:meth:`ErrorFeedback.transaction`) record a call's
  keys by copy before it starts (their arrays reused step after step), put
  back when another call of the step failed or was skipped;
- the fold-back of parameters that no rank used: what their elements
  delivered goes back into the worker residuals (hierarchical calls: each of
  a slice's handlers takes its share);
- the per-parameter state of bucket layouts (``state_dict`` and its load,
  in :meth:`GradientSync.state_dict`'s format, whatever the bucketing,
  hierarchy and world size), and the checkpoint glue around
  :func:`mpigc.save_checkpoint` and :func:`mpigc.load_checkpoint`;
- the residuals of keys of their own (the FSDP hooks': one flat call per
  key), read and installed by key.

The conversions themselves (per bucket <-> per parameter, flat <->
hierarchical slices) are :mod:`mpigc.torch._state`'s.
"""
import numpy as np

from .._errors import MpigcError
from ..feedback import ErrorFeedback, shard_bounds

from ._common import as_tensor, raise_everywhere
from ._record import gather_record
from ._state import (entries_for_layouts, flat_to_hier, hier_to_flat, incoming_state,
                     residual_keys, state_from_layouts, store_state)


class Residuals:
    """The residuals of one object of the torch layer.

    Parameters
    ----------
    feedback : ErrorFeedback
        The store (the object's public ``feedback``).
    comm : mpi4py.MPI.Intracomm
        The communicator of the object's calls (checkpoints go over it).
    own : mpi4py.MPI.Intracomm
        The object's duplicate for its own small collectives.
    gather : str
        The calls' ``gather`` (whether buckets keep owner residuals).
    lay, hier, hierarchy
        The node layout (None for ``"flat"``), whether the calls are
        hierarchical, and the ``hierarchy`` argument they are made with.
    """

    def __init__(self, feedback, comm, own, gather="compressed", lay=None, hier=False,
                 hierarchy="flat"):
        self.feedback = feedback
        self.comm, self.own = comm, own
        self.gather = gather
        self.lay, self.hier, self.hierarchy = lay, hier, hierarchy
        self._spares = {}  # layout key -> an old snapshot whose arrays are reused

    def keys(self, layout):
        """``[(slice, key)]``: the residual keys of ``layout``'s calls on this
        rank (slice None for a flat call)."""
        return residual_keys(self.lay, self.hier, layout.key, layout.n)

    # -- a step that changes the residuals of all its calls or of none -----------
    def snapshot(self, layout):
        """The residuals of ``layout``'s keys now, recorded by copy by a
        transaction of the store (its records, ``{key: Saved | None}``, in
        arrays of an older snapshot of it when there is one; by copy: the
        step's calls may reuse the arrays they replace), for :meth:`restore`;
        hand it back with :meth:`recycle`. Only while no call uses the keys."""
        reuse = self._spares.pop(layout.key, None) or {}
        txn = self.feedback.transaction()
        for _, k in self.keys(layout):
            txn.copy(k, reuse.get(k))
        return txn.saved

    def restore(self, snaps):
        """Put back :meth:`snapshot`'s ``snaps`` (keys that had no residuals
        then are forgotten): the transaction that took them, restored."""
        self.feedback.transaction(snaps).restore()

    def recycle(self, layout_key, snaps):
        """``snaps`` (of the layout with key ``layout_key``) is no longer
        needed: its arrays serve that layout's next snapshot."""
        self._spares[layout_key] = snaps

    def forget(self, layout_key):
        """A layout no longer used: drop its spare snapshot."""
        self._spares.pop(layout_key, None)

    # -- parameters that no rank used ----------------------------------------------
    def fold_back(self, layout, buf, spans, average, size):
        """What the elements ``spans`` (``[(offset, numel)]`` in ``layout``)
        of ``buf`` (the 1-D tensor that ``layout``'s call reduced, holding
        its result) delivered goes back into the call's worker residuals, so
        nothing is lost. A hierarchical call's slice is held by its ``M``
        handlers (one per node): each takes ``1/M`` of the total."""
        for sl, key in self.keys(layout):
            if sl is None:
                for off, m in spans:
                    def add(view, off=off, m=m):  # a view of the residual, either side
                        delivered = buf[off:off + m]
                        as_tensor(view, buf).add_(delivered if average else delivered / size)
                    self.feedback.add_to_worker(key, off, off + m, add)
                continue
            total = size if average else 1  # delivered = total sum / this
            share = total / self.lay.M
            slo, shi = shard_bounds(layout.n, self.lay.L)[sl]
            for off, m in spans:
                lo, hi = max(off, slo), min(off + m, shi)

                def add(view, lo=lo, hi=hi):  # a view of the residual, either side
                    as_tensor(view, buf).add_(buf[lo:hi] * share)
                self.feedback.add_to_worker(key, lo - slo, hi - slo, add)

    # -- per-parameter state -----------------------------------------------------------
    def state(self, layouts, idle, what, pending=None, gather=False):
        """The per-parameter state of ``layouts`` (collective; see
        :meth:`GradientSync.state_dict`), after ``pending`` (per-parameter
        states that no layout has taken yet); ``gather``: every rank's as one
        record on rank 0 (None elsewhere). ``idle()`` raises when a step is
        in progress (then on every rank)."""
        fbs = store_state(self.own, self.feedback, idle, what, self.lay, self.hier)
        out = {n: dict(s) for n, s in (pending or {}).items()}
        out.update(state_from_layouts(list(layouts), fbs, self.own, self.gather))
        return gather_record(self.own, out) if gather else out

    def state_of(self, layouts):
        """:meth:`state` of ``layouts`` whose keys no call uses, while calls
        on other keys may be in flight (collective: the ranks move owner
        shards), without the store's check for pending calls."""
        fbs = {}
        for layout in layouts:
            for _, k in self.keys(layout):
                e = self.feedback.entry(k)
                if e is not None:
                    fbs[k] = _entry_state(e)
        if self.hier:  # the slices' residuals in the flat layout of each bucket
            fbs = hier_to_flat(self.own, self.lay, fbs, self.own.size, self.own.rank)
        return state_from_layouts(list(layouts), fbs, self.own, self.gather)

    def incoming(self, state, numel_of, strict, idle, what):
        """This rank's per-parameter state from what a load got (collective;
        :func:`mpigc.torch._state.incoming_state`)."""
        return incoming_state(self.own, state, numel_of, strict, idle, what)

    def install(self, layouts, state, what, replace=True):
        """Residual entries of ``layouts`` from the per-parameter ``state``
        (collective), in place of every entry (``replace``) or of those of
        ``layouts`` only."""
        new = entries_for_layouts(list(layouts), state, self.own)
        if self.hier:  # each bucket's flat-layout residuals to its slice keys
            entries = flat_to_hier(self.own, self.comm, new, self.hierarchy, what)
        elif replace:
            self.feedback.load_state_dict(new)
            return
        else:
            tmp = ErrorFeedback()
            tmp.load_state_dict(new)
            entries = tmp.entries()
        if replace:
            self.feedback.replace_entries(entries)
        else:
            self.feedback.update_entries(entries)

    def drop(self, layouts):
        """Forget the residuals of ``layouts`` (no call uses their keys)."""
        for layout in layouts:
            for _, k in self.keys(layout):
                self.feedback.reset(k)
            self.forget(layout.key)

    # -- keys of their own (FSDP's groups: one flat call per key) -----------------------
    def states(self, keys):
        """``{key: state}`` (as :meth:`ErrorFeedback.state_dict` gives it:
        host copies) of those of ``keys`` that have residuals; not
        collective. Raises :class:`mpigc.StateError` while a call of the
        store is pending."""
        keys = set(keys)
        return {k: s for k, s in self.feedback.state_dict().items() if k in keys}

    def put(self, keys, entries):
        """``entries`` (``{key: entry}``, :func:`mpigc.feedback.new_entry`'s)
        in place of those of ``keys``; the keys of ``keys`` without one are
        forgotten, other keys kept. No call may use ``keys``."""
        for key in keys:
            if key not in entries:
                self.feedback.reset(key)
        self.feedback.update_entries(entries)

    def load_keys(self, keys, build, what):
        """A load of ``keys`` that changes all of them or none (collective):
        ``build()`` makes the entries (``{key: entry}``, nothing installed);
        an error in it on any rank raises on every rank, the store
        unchanged; else :meth:`put` installs them. Returns the entries."""
        exc, entries = None, {}
        try:
            entries = build()
        except (MpigcError, TypeError, ValueError, KeyError, AttributeError) as e:
            exc = e
        raise_everywhere(self.own, exc, what)
        self.put(keys, entries)
        return entries

    # -- checkpoints -------------------------------------------------------------------
    def save_checkpoint(self, path, step=None, state=None):
        """:func:`mpigc.save_checkpoint` (collective) of the store, or of the
        per-parameter ``state`` when given."""
        import mpigc
        fb = self.feedback
        if state is not None:
            fb = ErrorFeedback()
            fb.load_state_dict(state)
        return mpigc.save_checkpoint(path, fb, comm=self.comm, step=step)

    def load_checkpoint(self, path, load=None, step=None):
        """:func:`mpigc.load_checkpoint` (collective) into the store, or,
        with ``load``, into a new store whose state ``load(state)`` takes;
        returns its info. ``step`` as there (checked before ``load``)."""
        import mpigc
        if load is None:
            return mpigc.load_checkpoint(path, self.feedback, comm=self.comm, step=step)
        fb = ErrorFeedback()
        info = mpigc.load_checkpoint(path, fb, comm=self.comm, step=step)
        load(fb.state_dict())
        return info


def _entry_state(e):
    """One entry as :meth:`ErrorFeedback.state_dict` gives it (host copies),
    read through the entry's fields."""
    h = e.host_copy()
    return {"worker": _copy(h.worker), "owner": _copy(h.owner), "config": dict(h.config),
            "calls": h.calls, "world_size": h.world_size, "rank": h.rank, "n": h.n,
            "dtype": h.dtype.name}


def _copy(a):
    return None if a is None else np.array(a, copy=True)
