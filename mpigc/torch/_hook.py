"""mpigc's compressed allreduce as a DDP communication hook (its
construction, DDP's buckets and their residuals, state; the steps are
:mod:`._hook_steps`')."""
import warnings
import weakref

import numpy as np
import torch

from .. import _comm as _engine_comm
from .._errors import ConfigError, DTypeError, MpigcError, StateError

from ._buckets import Layout, own_dtype, plan_buckets
from ._common import (NP_OF_TORCH, Rendezvous, ThresholdWatch, agreed_comm,
                      check_auto_flat, check_feedback, check_gather, check_same, describe,
                      positive, resolve_comm, resolve_timeout, resolve_warn_s, simulating,
                      torch_auto, torch_nonfinite)
from ._hook_steps import HookSteps
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


# -- DDP communication hook ----------------------------------------------------

class CommHookState(HookSteps):
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
    op, comm, average, gather, feedback, hierarchy, auto_op, auto_pin, **params
        As for :class:`GradientSync`. ``op="auto"``: per call ``"none"`` or
        ``auto_op`` (CPU parameters and ``hierarchy="flat"`` only); its
        calls are DDP's buckets in place or the fixed groups as ``auto_op``'s
        would be. With ``hierarchy="node"`` (or ``"auto"``
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
        completes them first (their results are dropped). A collective method
        on some ranks while the others wait in a step is a
        :class:`mpigc.MismatchError` on every rank at once instead (from
        ``backward()`` in the step).

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
    decisions : dict
        With ``op="auto"``: ``{key: Decision}`` of the last completed step's
        calls (what each ran and why, :attr:`mpigc.AutoRequest.decision`);
        else empty.
    """

    def __init__(self, module, op="2bit", *, comm=None, average=True, gather="compressed",
                 nonfinite=None, feedback=None, hierarchy="flat", timeout=None,
                 bucket_mb=None, find_unused_parameters=None, auto_op=None, auto_pin=None,
                 **params):
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
        self.auto_pin = None  # op="auto": its pin; self.compressor is auto_op's
        try:  # agreed on at the first collective, as GradientSync's
            self.compressor, self.auto_pin = torch_auto(op, auto_op, auto_pin, params)
            self.nonfinite = torch_nonfinite(nonfinite)
            self.timeout = resolve_timeout(timeout)
            self._warn_s = resolve_warn_s()
            self.feedback = check_feedback(feedback)
            check_gather(gather)
            if not positive(bucket_mb):
                raise ConfigError(f"bucket_mb: expected a positive number, got {bucket_mb!r}")
            named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
            if self.auto_pin is not None:
                check_auto_flat(hierarchy, (simulating() or any(p.is_cuda for _, p in named))
                                and "its parameters must be on the CPU", "CommHookState")
            config = self.compressor.get_config()
            settings = {"op": "auto" if self.auto_pin else config,
                        "auto_op": config if self.auto_pin else None,
                        "auto_pin": self.auto_pin, "average": self.average,
                        "gather": gather, "nonfinite": self.nonfinite,
                        "hierarchy": str(hierarchy), "bucket_mb": float(bucket_mb),
                        "find_unused_parameters": self.find_unused_parameters}
        except (MpigcError, TypeError, ValueError) as e:
            exc = e
        self._comm = agreed_comm(self.comm, exc, settings, "CommHookState")
        _engine_comm.resolve(self.comm)
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
        #: op="auto": {key: Decision} of the last completed step's calls
        self.decisions = {}
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
        self._size_checked = self.compressor.codec_id == "none" or self.auto_pin is not None
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

    def load_checkpoint(self, path, strict=True, step=None):
        """Load a checkpoint of :meth:`save_checkpoint` or
        :meth:`GradientSync.save_checkpoint`, of any world size (collective).
        ``step``: :class:`mpigc.MismatchError` on every rank, nothing loaded,
        unless the checkpoint was saved with this ``step``."""
        self._arrive(self.timeout, "CommHookState.load_checkpoint")
        return self._residuals.load_checkpoint(
            path, lambda state: self.load_state_dict(state, strict=strict), step=step)

    def __repr__(self):
        op = f"'auto', auto_op={self.compressor!r}" if self.auto_pin else repr(self.compressor)
        return (f"CommHookState(op={op}, params={len(self.names)}, "
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
