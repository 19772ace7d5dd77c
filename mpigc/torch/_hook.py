"""mpigc's compressed allreduce as a DDP communication hook."""
import time
import warnings
import weakref

import numpy as np
import torch
from mpi4py import MPI

from .. import _comm as _engine_comm
from .._errors import ConfigError, DTypeError, MpigcError, StateError
from ..allreduce import iallreduce

from ._common import (HOOK_STALE, HOOK_STEP, NP_OF_TORCH, Rendezvous, ThresholdWatch,
                      agree_construction, check_feedback, check_gather, check_same,
                      describe, engine_after_torch, engine_array, first_is_nan, positive,
                      profiled, resolve_comm, resolve_timeout, resolve_warn_s, simulating,
                      torch_after_engine, torch_compressor, torch_nonfinite, wait_request,
                      warn_if_uncompressed)
from ._buckets import Layout, own_dtype, plan_buckets
from ._residuals import Residuals
from ._state import agree_hierarchy


def layout_independent(compressor):
    """Whether each element's result of ``compressor`` depends only on that
    element on every rank (and its residuals), not on where it sits in the
    buffer or what shares the buffer: ``none``, ``fp16``, ``bf16`` and
    ``2bit`` with an absolute threshold. Not so: the blocks of ``1bit`` and
    of relative ``2bit`` (their reconstruction values and thresholds are per
    block of the shard), ``terngrad`` (one scale per call, random streams by
    position) and compressors mpigc does not know."""
    config = compressor.get_config()
    return (config["id"] in ("none", "fp16", "bf16")
            or (config["id"] == "2bit" and config.get("rel_threshold") is None))


def _mark_used(ref, i):
    """A gradient hook of parameter ``i``: backward computed its gradient on
    this rank (it runs before the gradient is accumulated, so before DDP marks
    the parameter ready and hands its bucket to the hook)."""
    def hook(grad):
        state = ref()
        if state is not None:
            state._used[i] = 1
    return hook


def _count_backward(ref):
    """A gradient hook of the first parameter: one more backward pass since
    DDP last called the hook (see :attr:`CommHookState.UNCALLED`)."""
    def hook(grad):
        state = ref()
        if state is not None:
            state._note_backward()
    return hook


def _settled(req):
    """Whether engine request ``req`` is done or failed (its error stays
    with it, for its ``wait()``)."""
    try:
        return req.test()
    except Exception:  # noqa: BLE001 - raised again by its wait()
        return True


def _raise_after_backward(error):
    """Have the backward pass that runs the hook raise ``error`` once it has
    ended, after DDP's own end-of-backward callback; False when no backward
    pass runs the hook (DDP's ``Join`` shadows a step outside one).

    DDP's reducer reads a hook's future in C++, as a tensor: a future given
    an exception with ``set_exception`` reaches ``backward()`` as
    ``RuntimeError: Unable to cast <the message> to Tensor``, and one failed
    by a ``then()`` callback as a RuntimeError whose message wraps the
    original's with a traceback. An exception raised by the hook itself keeps
    its class and message, but leaves DDP's step unfinished (its next forward
    raises "Expected to have finished reduction in the prior iteration").
    So the hook completes its futures (DDP finishes the step) and raises
    from an autograd engine callback queued by a callback: the engine runs
    callbacks in the order they were queued, so the second one runs after
    every callback queued during backward, DDP's included, and
    ``backward()`` raises ``error`` itself."""
    engine = torch.autograd.Variable._execution_engine

    def last():
        raise error

    try:
        engine.queue_callback(lambda: engine.queue_callback(last))
    except RuntimeError:  # "Final callbacks can only be installed during backward pass"
        return False
    return True


# -- DDP communication hook ----------------------------------------------------

class CommHookState:
    """The state of :func:`comm_hook`: mpigc's compressed allreduce as a DDP
    communication hook, with residuals keyed by parameter name.

    ``ddp.register_comm_hook(CommHookState(ddp, op="2bit"), mpigc.torch.comm_hook)``:
    DDP keeps its process group (gloo, NCCL) for everything else (broadcasts,
    ``Join``); the buckets' gradients travel over MPI, compressed. Build it on
    every rank (collective over ``comm``).

    What one compressed call reduces depends on the compressor.
    Element-wise ones (``none``, ``fp16``, ``bf16``, ``2bit`` with an
    absolute threshold) reduce DDP's bucket in place. DDP builds its buckets
    anew after the first iteration (and whenever it rebuilds them); each
    bucket's residuals are kept per parameter, so a new bucketing takes over
    the residuals of the old one (one ``alltoall`` when it first appears).
    For the others (``1bit`` and relative ``2bit``, whose reconstruction
    values and thresholds are per block of ``block_size`` values of a
    shard, and ``terngrad``), where a parameter sits in the call changes its
    result, so they compress fixed groups of parameters instead:
    :class:`GradientSync`'s buckets of ``bucket_mb`` (DDP's
    ``bucket_cap_mb`` by default). DDP's buckets are copied into them and
    the results back, and a group starts when DDP has handed over all its
    parameters. So the result does not depend on DDP's bucketing, which
    differs between a job's first step and the later ones, and a resumed
    run continues bit for bit; with the same bucket size it is
    :class:`GradientSync`'s bit for bit for float32 and float64 parameters
    (float16 ones are grouped apart, in their own dtype as DDP's buckets,
    where GradientSync reduces them in float32 buckets with the others).

    :meth:`state_dict` is per parameter name, in
    :meth:`GradientSync.state_dict`'s format: a checkpoint of either loads
    into the other. Under ``ddp.no_sync()`` DDP calls no hook.

    Parameters
    ----------
    module : torch.nn.Module or DistributedDataParallel
        The model (a DDP wrapper is unwrapped: names as ``ddp.module``'s).
    op, comm, average, gather, feedback, hierarchy, **params
        As for :class:`GradientSync`. With ``hierarchy="node"`` (or ``"auto"``
        on several nodes) each bucket is summed exactly inside the node and
        compressed only between nodes; the residuals of its slices are
        kept per parameter across DDP's rebucketing as for flat buckets.
    bucket_mb : float, optional
        The size of the fixed groups of the compressors that are not
        element-wise (see above), in MiB of the parameters' dtype. Default:
        DDP's ``bucket_cap_mb`` when ``module`` is the DDP wrapper, else 25.
    find_unused_parameters : bool, optional
        As DDP's; default True when ``module`` is a DDP wrapper built with
        ``find_unused_parameters=True`` or a static graph (the modes in which
        DDP leaves the ``.grad`` of a parameter that no rank used alone),
        else False. True: what the elements of a parameter that no rank used
        in a step delivered goes back into its residuals, as
        :class:`GradientSync` does, so nothing is lost; its result in DDP's
        bucket is zero, as with DDP's own allreduce. It costs a gradient hook
        per parameter (which tells that backward computed its gradient on
        this rank) and one small allreduce over MPI per step.
    nonfinite : str, optional
        As for :class:`GradientSync`: default ``"skip"``, so NaN/Inf reach DDP's
        gradients (and ``GradScaler``) as with DDP's own allreduce, and no
        residual changes in that step. ``"raise"``: the step's futures fail
        with :class:`mpigc.NonFiniteError` on every rank, and no residual
        changes either.
    timeout : float, optional
        As for :class:`GradientSync`: the seconds a rank waits for the others
        in a step and in :meth:`state_dict`, :meth:`save_checkpoint` and the
        loads before it raises :class:`mpigc.StateError` on that rank (a
        step's from ``backward()``). Such a wait says so on stderr after
        ``$MPIGC_TORCH_WARN_S`` seconds (60), and again every 5 times that.
        A step that timed out leaves its calls posted; this rank's next step
        completes them first (their results are dropped).

    An error in the hook (a timeout, ``nonfinite="raise"``, a bucket it
    cannot reduce) is raised by ``backward()`` itself, its class and message
    unchanged, once DDP has finished the step (DDP's next step works); the
    step's ``param.grad`` are then not the average. Under DDP's ``Join``,
    where DDP runs the hook outside ``backward()``, the hook raises it.

    The arguments are checked on every rank before the first collective and
    must be the same on every rank (:class:`mpigc.ConfigError` or
    :class:`mpigc.MismatchError` on every rank otherwise).

    Attributes
    ----------
    groups : list of Layout or None
        The fixed groups the calls reduce (``names``, ``offsets``,
        ``numels``, ``key``: their residual keys in :attr:`feedback`), or
        None for an element-wise compressor (DDP's buckets in place).
    feedback : ErrorFeedback
        The residuals, keyed as the calls are.
    nonfinite_steps : int
        Steps skipped for NaN/Inf gradients (``nonfinite="skip"``).
    """

    def __init__(self, module, op="2bit", *, comm=None, average=True, gather="compressed",
                 nonfinite=None, feedback=None, hierarchy="flat", timeout=None,
                 bucket_mb=None, find_unused_parameters=None, **params):
        ddp = None
        if isinstance(module, torch.nn.parallel.DistributedDataParallel):
            ddp, module = module, module.module
        if bucket_mb is None:
            bucket_mb = (getattr(ddp, "bucket_bytes_cap", 25 << 20) / (1 << 20)
                         if ddp is not None else 25.0)
        if find_unused_parameters is None:  # DDP leaves unused .grad alone in both modes
            find_unused_parameters = ddp is not None and bool(
                ddp.find_unused_parameters or getattr(ddp, "static_graph", False))
        self.comm = resolve_comm(comm)
        self.average = bool(average)
        self.gather = gather
        self.find_unused_parameters = bool(find_unused_parameters)
        exc, settings, named = None, None, []
        try:  # agreed on at the first collective, as GradientSync's
            self.compressor = torch_compressor(op, params)
            self.nonfinite = torch_nonfinite(nonfinite)
            self.timeout = resolve_timeout(timeout)
            self._warn_s = resolve_warn_s()
            self.feedback = check_feedback(feedback)
            check_gather(gather)
            if not positive(bucket_mb):
                raise ConfigError(f"bucket_mb: expected a positive number, got {bucket_mb!r}")
            named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
            settings = {"op": self.compressor.get_config(), "average": self.average,
                        "gather": gather, "nonfinite": self.nonfinite,
                        "hierarchy": str(hierarchy), "bucket_mb": float(bucket_mb),
                        "find_unused_parameters": self.find_unused_parameters}
        except (MpigcError, TypeError, ValueError) as e:
            exc = e
        self._comm = self.comm.Dup()
        _engine_comm.resolve(self.comm)
        agree_construction(self._comm, exc, settings, "CommHookState")
        self._arrive = Rendezvous(self._comm, self._warn_s)
        check_same(self._comm, describe(named), "CommHookState")
        self.hierarchy = hierarchy
        lay, hier = agree_hierarchy(self._comm, self.comm, hierarchy, "CommHookState")
        self._residuals = Residuals(self.feedback, self.comm, self._comm, gather, lay, hier,
                                    hierarchy)
        self.names = [n for n, _ in named]
        self._numel = {n: p.numel() for n, p in named}
        self._name_of = {id(p): n for n, p in named}
        self._params = [p for _, p in named]  # keeps the ids valid
        self.bucket_mb = float(bucket_mb)
        #: the fixed groups that the calls reduce (None: DDP's buckets in place)
        self.groups, self._group_dtypes = ((None, None)
                                           if layout_independent(self.compressor)
                                           else self._make_groups(named, self.bucket_mb))
        self._place_of = {}  # name -> (group, offset in it)
        for g in self.groups or ():
            for n, off in zip(g.names, g.offsets):
                self._place_of[n] = (g, off)
        self._group_buffers = {}  # group index -> its tensor
        self._layouts = {}   # index -> Layout in use (DDP's buckets, or the groups)
        self._pending = {}   # per-parameter state waiting for its bucket
        self._reset_step()
        #: steps whose gradients were non-finite on some rank (``nonfinite="skip"``)
        self.nonfinite_steps = 0
        self.size, self.rank = self._comm.size, self._comm.rank
        self._used = np.zeros(len(named), np.int64)  # since the last step, this rank
        self._unfinished = []  # agreements of failed steps, posted, not waited for
        self._stale = []  # (request, buffer): calls of a step that timed out, posted
        ref = weakref.ref(self)
        if self.find_unused_parameters:
            self._used_handles = [p.register_hook(_mark_used(ref, i))
                                  for i, p in enumerate(self._params)]
        # a hook that DDP never calls (not registered, or a framework that
        # registers it only on CUDA, as Lightning's DDPStrategy): warn
        self._backwards = 0
        self._watch = ThresholdWatch(self.compressor, "CommHookState")
        # whether a step's calls are all under $MPIGC_MIN_COMPRESS_BYTES is
        # known at the first step (DDP's buckets): checked until it is decided
        self._size_checked = self.compressor.codec_id == "none"
        self._count_handle = (self._params[0].register_hook(_count_backward(ref))
                              if self._params else None)

    #: Backward passes without a hook call after which :class:`CommHookState`
    #: warns that DDP does not call it (more than any gradient accumulation
    #: under ``no_sync`` runs without a synchronising pass).
    UNCALLED = 64

    def _note_backward(self):
        self._backwards += 1
        if self._backwards == self.UNCALLED:
            warnings.warn(
                f"CommHookState: {self.UNCALLED} backward passes and DDP has not called "
                "mpigc.torch.comm_hook: is it registered (ddp.register_comm_hook(state, "
                "mpigc.torch.comm_hook))? Lightning's DDPStrategy registers ddp_comm_hook "
                "only on CUDA: use mpigc.torch.lightning.MpigcCommHook. Until it is "
                "called, the gradients are DDP's own allreduce, uncompressed",
                RuntimeWarning, stacklevel=2)

    @staticmethod
    def _make_groups(named, bucket_mb):
        """The one bucketing (:mod:`mpigc.torch._buckets`) of ``bucket_mb``
        MiB, each group in the dtype of its parameters (as DDP's buckets):
        ``(layouts, torch dtypes)``."""
        groups, dtypes = [], []
        for k, (members, dt) in enumerate(plan_buckets(named, bucket_mb, own_dtype)):
            dtypes.append(dt)
            groups.append(Layout(k, [named[i][0] for i in members],
                                 [named[i][1].numel() for i in members],
                                 NP_OF_TORCH.get(dt, np.float32)))
        return groups, dtypes

    def _reset_step(self):
        self._calls = []     # (layout, request, buffer, snapshot): this step's calls
        self._futures = []   # (future, DDP's bucket tensor, its layout)
        self._error = None   # what failed in this step's hooks so far
        self._result_at = {}  # name -> (buffer, offset) of its result (groups)
        self._waiting = ([len(g.names) for g in self.groups]
                         if self.groups is not None else [])
        self._next_group = 0

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
            self._pending.update(self._residuals.state_of(stale))
            self._residuals.drop(stale)
            for lay in stale:
                del self._layouts[lay.index]
        if any(n in self._pending for n in layout.names):
            self._residuals.install([layout], self._pending, "comm_hook", replace=False)
            for n in layout.names:
                self._pending.pop(n, None)
        self._layouts[layout.index] = layout

    def _start(self, layout, buffer, several):
        """Start the compressed allreduce of ``buffer`` (a 1-D tensor in
        ``layout``: a DDP bucket or a group)."""
        known = self._layouts.get(layout.index)
        if known is None or known.key != layout.key:
            self._place(layout)
        # several calls: a step changes the residuals of all or of none (see
        # _complete)
        snap = self._residuals.snapshot(layout) if several else None
        # reduced in place: a CUDA tensor as it is (the engine reduces device
        # arrays on the GPU, after what torch queued on its current stream), a
        # CPU one as numpy
        flat = buffer.detach()
        if flat.is_cuda:
            engine_after_torch(flat.device)
        with profiled(f"mpigc: start bucket {layout.key}"):
            req = iallreduce(engine_array(flat, simulating()), op=self.compressor,
                             comm=self.comm,
                             key=layout.key, average=self.average, gather=self.gather,
                             feedback=self.feedback, nonfinite=self.nonfinite,
                             hierarchy=self.hierarchy)
        for _, r, _, _ in self._calls:
            try:
                r.test()  # progress; errors come from wait()
            except Exception:  # noqa: BLE001
                pass
        self._calls.append((layout, req, buffer, snap))

    def _group_buffer(self, g, like):
        """Group ``g``'s tensor, on the device of ``like`` (allocated once)."""
        buf = self._group_buffers.get(g.index)
        if buf is None or buf.device != like.device:
            buf = torch.zeros(g.n, dtype=self._group_dtypes[g.index], device=like.device)
            self._group_buffers[g.index] = buf
        return buf

    def _start_groups(self, like, force=False):
        """Start the groups whose parameters DDP handed over, in group order
        (the same on every rank); ``force``: all the others too, the
        parameters that DDP did not hand over as zeros (buffers on the
        device of tensor ``like``)."""
        several = len(self.groups) > 1
        while self._next_group < len(self.groups):
            g = self.groups[self._next_group]
            if self._waiting[self._next_group] and not force:
                return
            buf = self._group_buffer(g, like)
            for n, off, m in zip(g.names, g.offsets, g.numels):
                if n not in self._result_at:
                    buf[off:off + m].zero_()
                self._result_at[n] = (buf, off)
            self._start(g, buf, several)
            self._next_group += 1

    def _hook(self, bucket):
        self._backwards = 0
        if self._count_handle is not None:  # DDP calls the hook: no more counting
            self._count_handle.remove()
            self._count_handle = None
        tensor = bucket.buffer()
        layout = None
        if self._error is None:  # after an error the step's other buckets wait for it
            try:
                if self._stale:
                    self._finish_stale()
                layout = self._layout_of(bucket, tensor)
                self._take(bucket, tensor, layout)
            except Exception as e:  # noqa: BLE001 - raised at the end of the step
                self._error = e
        fut = torch.futures.Future()
        self._futures.append((fut, tensor, layout))
        if bucket.is_last():
            self._complete()
        return fut

    def _take(self, bucket, tensor, layout):
        """Start what DDP's ``bucket`` (its flat ``tensor``) completes."""
        if self.groups is None:  # DDP's bucket in place
            self._start(layout, tensor, not (bucket.is_last() and bucket.index() == 0))
            return
        # copied into the groups
        for n, off, m in zip(layout.names, layout.offsets, layout.numels):
            g, goff = self._place_of[n]
            if n in self._result_at:
                raise StateError(f"comm_hook: DDP handed over parameter {n!r} twice "
                                 "in one step")
            buf = self._group_buffer(g, tensor)
            with torch.no_grad():
                buf[goff:goff + m].copy_(tensor[off:off + m])
            self._result_at[n] = (buf, goff)
            self._waiting[g.index] -= 1
        self._start_groups(tensor, force=bucket.is_last())

    def _finish_stale(self):
        """Complete the calls of a step that timed out on this rank before
        this step's start (the engine takes a key for one call at a time).
        Their results are dropped (DDP had that step's error): the buffers
        they reduce in place (DDP's buckets, which DDP reuses, may hold this
        step's gradients already, or the groups) get back what they held."""
        t0 = time.monotonic()
        while self._stale:
            req, buf = self._stale[0]
            held = buf.detach().clone()
            if buf.is_cuda:
                engine_after_torch(buf.device)
            self._wait(lambda: _settled(req), HOOK_STALE, t0)  # a timeout keeps the rest
            self._stale.pop(0)
            try:
                req.wait()
            except Exception:  # noqa: BLE001 - that step failed already
                pass
            if buf.is_cuda:
                torch_after_engine(buf.device)
            with torch.no_grad():
                buf.copy_(held)

    def _agree_used(self):
        """Post the step's sum over the ranks of the parameters each used."""
        used, self._used = self._used, np.zeros(len(self.names), np.int64)
        return used, self._comm.Iallreduce(MPI.IN_PLACE, used, op=MPI.SUM)

    def _wait(self, test, wait, since):
        """Wait for the other ranks (:func:`wait_request`: a line on stderr
        when it lasts, :class:`StateError` after the timeout)."""
        wait_request(test, f"comm_hook (rank {self.rank} of {self.size})", wait,
                     timeout=self.timeout, warn_s=self._warn_s, since=since)

    def _settle(self, calls):
        """Wait for the step's ``calls``, under one timeout for the step:
        ``(the first error, [whether each failed], when the wait began)``.
        Calls still in flight after a timeout stay posted (``_stale``) and
        fail with it."""
        t0 = time.monotonic()
        error, failed, late = None, [], None
        for layout, req, buf, _ in calls:
            with profiled(f"mpigc: wait bucket {layout.key}"):
                if late is None:
                    try:
                        self._wait(lambda: _settled(req), HOOK_STEP, t0)
                    except StateError as e:
                        late = e
                if late is not None and not _settled(req):
                    self._stale.append((req, buf))
                    error = error or late
                    failed.append(True)
                    continue
                try:
                    req.wait()
                    failed.append(False)
                except Exception as e:  # noqa: BLE001
                    error = error or e
                    failed.append(True)
        return error, failed, t0

    def _complete(self):
        """The last bucket of the step: complete every call and every DDP
        bucket's future (DDP waits for them when backward ends); an error of
        the step is raised by ``backward()`` (:func:`_raise_after_backward`)."""
        calls, futures, result_at = self._calls, self._futures, self._result_at
        error = self._error
        self._reset_step()
        if not self._size_checked and calls and error is None:  # the same on every rank
            self._size_checked = True
            warn_if_uncompressed("CommHookState", self.compressor,
                                 [b for _, _, b, _ in calls])
        used, used_req = self._agree_used() if self.find_unused_parameters else (None, None)
        late, failed, t0 = self._settle(calls)
        error = error or late
        if used_req is not None and error is None:
            try:
                self._wait(used_req.Test, HOOK_STEP, t0)
            except MpigcError as e:
                error = e
        if used_req is not None and error is not None:
            # kept alive: it completes when the others post theirs
            self._unfinished = [r for r in self._unfinished if not r.Test()] + [used_req]
        for dev in {b.device for _, _, b, _ in calls if b.is_cuda}:
            torch_after_engine(dev)
        skipped = False
        if error is not None:
            # a failed call changed no residual: put back those of the step's
            # other calls, so the failed step changes none
            for (_, _, _, snap), bad in zip(calls, failed):
                if snap is not None and not bad:
                    self._residuals.restore(snap)
        elif self.nonfinite == "skip":
            bad = first_is_nan([b for _, _, b, _ in calls])
            if any(bad):  # a step GradScaler skips: put the other residuals back
                skipped = True
                self.nonfinite_steps += 1
                for (_, _, _, snap), b in zip(calls, bad):
                    if not b and len(calls) > 1:
                        self._residuals.restore(snap)
        for layout, _, _, snap in calls:  # their arrays serve the next snapshots
            if snap is not None:
                self._residuals.recycle(layout.key, snap)
        if error is None:
            unused = (set() if used is None else
                      {n for n, u in zip(self.names, used) if u == 0})
            with torch.no_grad():
                if unused and not skipped:
                    for layout, _, buf, _ in calls:
                        self._fold_back(layout, buf, unused)
                for _, tensor, layout in futures:
                    self._deliver(tensor, layout, result_at, unused)
            if not skipped:
                self._watch.observe([t for _, t, _ in futures])
        if error is None:
            for fut, tensor, _ in futures:
                fut.set_result(tensor)
        elif _raise_after_backward(error):
            for fut, tensor, _ in futures:  # DDP finishes its step; backward() raises
                fut.set_result(tensor)
        else:  # outside backward (DDP's Join shadowing a step): raised here
            for fut, _, _ in futures:
                fut.set_exception(error)
            raise error

    def _deliver(self, tensor, layout, result_at, unused):
        """The results of DDP's bucket ``tensor`` into it (from the groups),
        zero for the parameters no rank used (as DDP's own allreduce: a
        ``.grad`` that is a view of the bucket reads zeros)."""
        for n, off, m in zip(layout.names, layout.offsets, layout.numels):
            if n in unused:
                tensor[off:off + m].zero_()
            elif n in result_at:
                buf, goff = result_at[n]
                tensor[off:off + m].copy_(buf[goff:goff + m])

    def _fold_back(self, layout, buf, unused):
        """What the elements of parameters that no rank used delivered goes
        back into the worker residuals of ``layout``'s call, as
        :class:`GradientSync` does (:meth:`Residuals.fold_back`)."""
        spans = [(off, m) for n, off, m in zip(layout.names, layout.offsets, layout.numels)
                 if n in unused]
        if spans:
            self._residuals.fold_back(layout, buf, spans, self.average, self.size)

    # -- state -------------------------------------------------------------------
    def _idle(self, what):
        if self._calls or self._futures:
            raise StateError(f"CommHookState.{what}: a step is in progress")

    def state_dict(self, gather=False):
        """Residuals per parameter name (collective), as
        :meth:`GradientSync.state_dict`; ``gather=True``: every rank's as one
        record on rank 0 (``None`` on the others) for the checkpoint rank 0
        writes, which :meth:`load_state_dict` takes on every rank, on any
        world size."""
        self._arrive(self.timeout, "CommHookState.state_dict")
        return self._residuals.state(self._layouts.values(), lambda: self._idle("state_dict"),
                                     "CommHookState.state_dict", self._pending, gather)

    def load_state_dict(self, state, strict=True):
        """Load :meth:`state_dict` (or :meth:`GradientSync.state_dict`) output
        of this world size, or the record of ``state_dict(gather=True)`` of
        any world size (collective); each bucket takes its parameters'
        residuals at its next step. ``strict`` as for GradientSync."""
        self._arrive(self.timeout, "CommHookState.load_state_dict")
        state = self._residuals.incoming(state, self._numel, strict,
                                         lambda: self._idle("load_state_dict"),
                                         "CommHookState.load_state_dict")
        self.feedback.reset()
        self._layouts = {}
        self._pending = {n: s for n, s in state.items() if n in self._numel}

    def save_checkpoint(self, path, step=None):
        """:func:`mpigc.save_checkpoint` of :meth:`state_dict` (collective)."""
        self._arrive(self.timeout, "CommHookState.save_checkpoint")
        return self._residuals.save_checkpoint(path, step, self.state_dict())

    def load_checkpoint(self, path, strict=True):
        """Load a checkpoint of :meth:`save_checkpoint` or
        :meth:`GradientSync.save_checkpoint`, of any world size (collective)."""
        self._arrive(self.timeout, "CommHookState.load_checkpoint")
        return self._residuals.load_checkpoint(
            path, lambda state: self.load_state_dict(state, strict=strict))

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
