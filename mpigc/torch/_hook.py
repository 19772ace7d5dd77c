"""mpigc's compressed allreduce as a DDP communication hook."""
import torch

from .. import _comm as _engine_comm
from .._errors import DTypeError, MpigcError, StateError
from ..allreduce import iallreduce
from ..compressors import get_compressor
from ..feedback import ErrorFeedback, _entry_state

from ._common import (NP_OF_TORCH, Rendezvous, agree_construction, check_feedback,
                      check_gather, check_same, describe, engine_after_torch, engine_array,
                      first_is_nan, raise_everywhere, resolve_comm, resolve_timeout,
                      simulating, torch_after_engine, torch_nonfinite, wait_request)
from ._state import (Layout, agree_hierarchy, check_state, entries_for_layouts, flat_to_hier,
                     hier_to_flat, residual_keys, restore_keys, snapshot_keys,
                     state_from_layouts)


# -- DDP communication hook ----------------------------------------------------

class CommHookState:
    """The state of :func:`comm_hook`: mpigc's compressed allreduce as a DDP
    communication hook, with residuals keyed by parameter name.

    ``ddp.register_comm_hook(CommHookState(ddp, op="2bit"), mpigc.torch.comm_hook)``:
    DDP keeps its process group (gloo, NCCL) for everything else (broadcasts,
    ``Join``); the buckets' gradients travel over MPI, compressed. Build it on
    every rank (collective over ``comm``).

    DDP builds its buckets anew after the first iteration (and whenever it
    rebuilds them); each bucket's residuals are kept per parameter, so a new
    bucketing takes over the residuals of the old one (one ``alltoall`` when
    it first appears). :meth:`state_dict` is per parameter name, in
    :meth:`GradientSync.state_dict`'s format: a checkpoint of either loads
    into the other. Under ``ddp.no_sync()`` DDP calls no hook.

    Parameters
    ----------
    module : torch.nn.Module or DistributedDataParallel
        The model (a DDP wrapper is unwrapped: names as ``ddp.module``'s).
    op, comm, average, gather, feedback, hierarchy, **params
        As for :class:`GradientSync`. With ``hierarchy="node"`` (or ``"auto"``
        on several nodes) each DDP bucket is summed exactly inside the node
        and compressed only between nodes; the residuals of its slices are
        kept per parameter across DDP's rebucketing as for flat buckets.
    nonfinite : str, optional
        As for :class:`GradientSync`: default ``"skip"``, so NaN/Inf reach DDP's
        gradients (and ``GradScaler``) as with DDP's own allreduce, and no
        residual changes in that step. ``"raise"``: the step's futures fail
        with :class:`mpigc.NonFiniteError` on every rank, and no residual
        changes either.
    timeout : float, optional
        As for :class:`GradientSync`: the seconds a rank waits for the others
        in a step and in :meth:`state_dict`, :meth:`save_checkpoint` and the
        loads before it raises :class:`mpigc.StateError` on that rank.

    The arguments are checked on every rank before the first collective and
    must be the same on every rank (:class:`mpigc.ConfigError` or
    :class:`mpigc.MismatchError` on every rank otherwise).
    """

    def __init__(self, module, op="2bit", *, comm=None, average=True, gather="compressed",
                 nonfinite=None, feedback=None, hierarchy="flat", timeout=None, **params):
        if isinstance(module, torch.nn.parallel.DistributedDataParallel):
            module = module.module
        self.comm = resolve_comm(comm)
        self.average = bool(average)
        self.gather = gather
        exc, settings, named = None, None, []
        try:  # agreed on at the first collective, as GradientSync's
            self.compressor = get_compressor(op, **params)
            self.nonfinite = torch_nonfinite(nonfinite)
            self.timeout = resolve_timeout(timeout)
            self.feedback = check_feedback(feedback)
            check_gather(gather)
            named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
            settings = {"op": self.compressor.get_config(), "average": self.average,
                        "gather": gather, "nonfinite": self.nonfinite,
                        "hierarchy": str(hierarchy)}
        except (MpigcError, TypeError, ValueError) as e:
            exc = e
        self._comm = self.comm.Dup()
        _engine_comm.resolve(self.comm)
        agree_construction(self._comm, exc, settings, "CommHookState")
        self._arrive = Rendezvous(self._comm)
        check_same(self._comm, describe(named), "CommHookState")
        self.hierarchy = hierarchy
        self._lay, self._hier = agree_hierarchy(self._comm, self.comm, hierarchy,
                                                 "CommHookState")
        self.names = [n for n, _ in named]
        self._numel = {n: p.numel() for n, p in named}
        self._name_of = {id(p): n for n, p in named}
        self._params = [p for _, p in named]  # keeps the ids valid
        self._layouts = {}   # bucket index -> Layout in use
        self._pending = {}   # per-parameter state waiting for its bucket
        self._inflight = []  # (layout, future, request, tensor, snapshot)
        self._spare_snapshots = {}  # key -> an old snapshot whose arrays are reused
        #: steps whose gradients were non-finite on some rank (``nonfinite="skip"``)
        self.nonfinite_steps = 0
        self.size, self.rank = self._comm.size, self._comm.rank

    # -- in the hook -------------------------------------------------------------
    def _layout_of(self, bucket, tensor):
        try:
            names = [self._name_of[id(p)] for p in bucket.parameters()]
        except KeyError:
            raise StateError("comm_hook: DDP's bucket holds a parameter that "
                             "CommHookState does not know (build it for the module "
                             "that DDP wraps)") from None
        if tensor.dtype not in NP_OF_TORCH:
            raise DTypeError(f"comm_hook: expected float16, float32 or float64 "
                             f"gradients, got {tensor.dtype}")
        return Layout(bucket.index(), names, [self._numel[n] for n in names],
                       NP_OF_TORCH[tensor.dtype])

    def _keys(self, layout):
        """The residual keys of ``layout``'s calls on this rank."""
        return [k for _, k in residual_keys(self._lay, self._hier, layout.key, layout.n)]

    def _place(self, layout):
        """A bucket layout new at its index takes over the residuals of its
        parameters (collective; every rank has the same buckets). A layout
        that only moved to another index keeps its residuals; the layouts it
        replaces (those that held its parameters, and the one it displaces
        at its index, whose parameters go to other buckets) hand theirs over
        by parameter name."""
        for i in [i for i, lay in self._layouts.items()
                  if lay.key == layout.key and i != layout.index]:
            del self._layouts[i]  # moved: its old index is free
        mine = set(layout.names)
        displaced = self._layouts.get(layout.index)
        stale = [lay for lay in self._layouts.values()
                 if lay.key != layout.key and (mine & set(lay.names) or lay is displaced)]
        if stale:
            # not feedback.state_dict(): buckets of this step before this one are
            # in flight (their keys busy); the stale ones are not (their
            # parameters are this bucket's, or, for the displaced one, of buckets
            # to come: a bucket of this step at another index that had its key
            # would have freed this index already)
            fbs = {}
            for lay in stale:
                for k in self._keys(lay):
                    e = self.feedback._entries.get(k)
                    if e is not None:
                        fbs[k] = _entry_state(e)
            if self._hier:  # the slices' residuals in the flat layout of each bucket
                fbs = hier_to_flat(self._comm, self._lay, fbs, self.size, self.rank)
            self._pending.update(state_from_layouts(stale, fbs, self._comm, self.gather))
            for lay in stale:
                for k in self._keys(lay):
                    self.feedback.reset(k)
                self._spare_snapshots.pop(lay.key, None)
                del self._layouts[lay.index]
        if any(n in self._pending for n in layout.names):
            new = entries_for_layouts([layout], self._pending, self._comm)
            if self._hier:
                entries = flat_to_hier(self._comm, self.comm, new, self.hierarchy,
                                        "comm_hook")
            else:
                tmp = ErrorFeedback()
                tmp.load_state_dict(new)
                entries = tmp._entries
            with self.feedback._lock:
                self.feedback._entries.update(entries)
            for n in layout.names:
                self._pending.pop(n, None)
        self._layouts[layout.index] = layout

    def _hook(self, bucket):
        tensor = bucket.buffer()
        layout = self._layout_of(bucket, tensor)
        known = self._layouts.get(layout.index)
        if known is None or known.key != layout.key:
            self._place(layout)
        # several buckets: a step changes the residuals of all or of none (see
        # _complete)
        several = not (bucket.is_last() and bucket.index() == 0)
        snap = (snapshot_keys(self.feedback, self._keys(layout),
                               self._spare_snapshots.pop(layout.key, None))
                if several else None)
        # DDP's flat bucket is reduced in place: a CUDA tensor as it is (the
        # engine reduces device arrays on the GPU, after what torch queued on
        # its current stream), a CPU one as numpy
        flat = tensor.detach()
        if flat.is_cuda:
            engine_after_torch(flat.device)
        req = iallreduce(engine_array(flat, simulating()), op=self.compressor,
                         comm=self.comm,
                         key=layout.key, average=self.average, gather=self.gather,
                         feedback=self.feedback, nonfinite=self.nonfinite,
                         hierarchy=self.hierarchy)
        fut = torch.futures.Future()
        self._inflight.append((layout, fut, req, tensor, snap))
        for _, _, r, _, _ in self._inflight[:-1]:
            try:
                r.test()  # progress; errors come from wait()
            except Exception:  # noqa: BLE001
                pass
        if bucket.is_last():
            self._complete()
        return fut

    def _complete(self):
        """The last bucket of the step: complete every bucket's allreduce and
        its future (DDP waits for them when backward ends)."""
        items, self._inflight = self._inflight, []
        error, failed = None, []
        for _, _, req, _, _ in items:
            try:
                wait_request(req.test, self.timeout, lambda: None,
                              f"comm_hook (rank {self.rank} of {self.size})",
                              "the other ranks did not reach this step's gradient "
                              "synchronisation within {timeout:g} s (uneven inputs? DDP's "
                              "`join()` context manager on every rank; timeout=, "
                              "$MPIGC_TORCH_TIMEOUT)")
                req.wait()
                failed.append(False)
            except Exception as e:  # noqa: BLE001
                error = error or e
                failed.append(True)
        for dev in {t.device for _, _, _, t, _ in items if t.is_cuda}:
            torch_after_engine(dev)
        if error is not None:
            # a failed call changed no residual: put back those of the step's
            # other buckets, so the failed step changes none
            for (_, _, _, _, snap), bad in zip(items, failed):
                if snap is not None and not bad:
                    restore_keys(self.feedback, snap)
        elif self.nonfinite == "skip":
            bad = first_is_nan([t for _, _, _, t, _ in items])
            if any(bad):  # a step GradScaler skips: put the other residuals back
                self.nonfinite_steps += 1
                for (layout, _, _, _, snap), b in zip(items, bad):
                    if not b and len(items) > 1:
                        restore_keys(self.feedback, snap)
        for layout, _, _, _, snap in items:  # their arrays serve the next snapshots
            if snap is not None:
                self._spare_snapshots[layout.key] = snap
        for _, fut, _, tensor, _ in items:
            if error is None:
                fut.set_result(tensor)
            else:
                fut.set_exception(error)

    # -- state -------------------------------------------------------------------
    def state_dict(self):
        """Residuals per parameter name (collective), as
        :meth:`GradientSync.state_dict`."""
        self._arrive(self.timeout, "CommHookState.state_dict")
        exc = None
        try:
            if self._inflight:
                raise StateError("CommHookState.state_dict: a step is in progress")
            fbs = self.feedback.state_dict()
        except MpigcError as e:
            exc, fbs = e, {}
        raise_everywhere(self._comm, exc, "CommHookState.state_dict")
        if self._hier:
            fbs = hier_to_flat(self._comm, self._lay, fbs, self.size, self.rank)
        out = {n: dict(s) for n, s in self._pending.items()}
        out.update(state_from_layouts(list(self._layouts.values()), fbs, self._comm,
                                       self.gather))
        return out

    def load_state_dict(self, state, strict=True):
        """Load :meth:`state_dict` (or :meth:`GradientSync.state_dict`) output
        of this world size (collective); each bucket takes its parameters'
        residuals at its next step. ``strict`` as for GradientSync."""
        self._arrive(self.timeout, "CommHookState.load_state_dict")
        exc = None
        try:
            if self._inflight:
                raise StateError("CommHookState.load_state_dict: a step is in progress")
            state = dict(state)
            extra = sorted(set(state) - set(self.names))
            missing = [n for n in self.names if n not in state] if state else []
            if strict and (extra or missing):
                raise StateError(f"state names do not match the parameters: unexpected "
                                 f"{extra[:5]}, missing {missing[:5]} (strict=False "
                                 "ignores them)")
            check_state(state, self._numel, self.size, self.rank)
        except MpigcError as e:
            exc = e
        raise_everywhere(self._comm, exc, "CommHookState.load_state_dict")
        self.feedback.reset()
        self._layouts = {}
        self._pending = {n: s for n, s in state.items() if n in self._numel}

    def save_checkpoint(self, path, step=None):
        """:func:`mpigc.save_checkpoint` of :meth:`state_dict` (collective)."""
        import mpigc
        fb = ErrorFeedback()
        fb.load_state_dict(self.state_dict())
        return mpigc.save_checkpoint(path, fb, comm=self.comm, step=step)

    def load_checkpoint(self, path, strict=True):
        """Load a checkpoint of :meth:`save_checkpoint` or
        :meth:`GradientSync.save_checkpoint`, of any world size (collective)."""
        import mpigc
        self._arrive(self.timeout, "CommHookState.load_checkpoint")
        fb = ErrorFeedback()
        info = mpigc.load_checkpoint(path, fb, comm=self.comm)
        self.load_state_dict(fb.state_dict(), strict=strict)
        return info

    def __repr__(self):
        return (f"CommHookState(op={self.compressor!r}, params={len(self.names)}, "
                f"buckets={len(self._layouts)}, ranks={self.size})")


def comm_hook(state, bucket):
    """DDP communication hook: mpigc's compressed allreduce of the bucket,
    over MPI, with error feedback keyed by parameter name.

    >>> ddp.register_comm_hook(mpigc.torch.CommHookState(ddp, op="2bit",
    ...                                                   rel_threshold=1.5),
    ...                        mpigc.torch.comm_hook)        # doctest: +SKIP

    Returns a ``torch.futures.Future`` of the averaged bucket; the futures of a
    step complete when DDP hands over its last bucket.
    """
    return state._hook(bucket)
