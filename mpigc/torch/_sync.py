"""GradientSync: bucketed, overlapped, compressed gradient averaging."""
import contextlib
import time
import weakref

import numpy as np
import torch
from mpi4py import MPI

from .. import _comm as _engine_comm
from .._errors import ConfigError, DTypeError, MpigcError, StateError
from ..allreduce import iallreduce

from ._common import (BUCKET_DTYPES, JOIN, STEP, Rendezvous, ThresholdWatch, agree_construction,
                      check_feedback, check_gather, check_same, describe,
                      engine_after_torch, engine_array, first_is_nan, positive, profiled,
                      raise_everywhere, resolve_comm, resolve_timeout, resolve_warn_s,
                      simulating, torch_after_engine, torch_compressor, torch_nonfinite,
                      wait_request, warn_if_uncompressed)
from ._launch import broadcast_parameters
from ._buckets import Layout, accumulating_dtype, plan_buckets
from ._residuals import Residuals
from ._state import agree_hierarchy


def _hooked_by(p):
    """The GradientSync whose hooks are on parameter ``p``, or None."""
    ref = getattr(p, "_mpigc_sync", None)  # (copies of p carry it too)
    sync = None if ref is None else ref()
    return sync if sync is not None and id(p) in sync._hooked_ids else None

# -- buckets -------------------------------------------------------------------
class Bucket(Layout):
    """One fused gradient buffer (read-only view for users and tests).

    Attributes
    ----------
    index : int
        Position in the launch order (the same on every rank).
    key : str
        The residual key in :attr:`GradientSync.feedback`, derived from the
        ordered parameter names and sizes (``"torch/<first>..<last>/<hash>"``).
    names : list of str
        The parameters, in bucket order.
    offsets, numels : list of int
        Where each parameter's gradient sits in the flat buffer.
    tensor : torch.Tensor
        The buffer: float32 (float64 for float64 parameters), 1-D; a CUDA
        tensor on the parameters' GPU for a device bucket, else in host
        memory (pinned when its parameters are on a GPU).
    on_device : bool
        A device bucket: every parameter of the bucket is on one GPU (and
        ``device_buckets`` was not turned off); the engine compresses and
        decodes it on that GPU.
    flat : numpy.ndarray or torch.Tensor
        What the engine reduces: the numpy view of :attr:`tensor` (host
        bucket), or :attr:`tensor` itself (device bucket).
    started_at : float or None
        ``time.perf_counter()`` when this step's allreduce started, or None.
    """

    def __init__(self, index, entries, np_dtype, device, pin):
        super().__init__(index, [n for n, _, _ in entries],
                         [p.numel() for _, _, p in entries], np_dtype)
        self.param_index = [i for _, i, _ in entries]
        tdtype = torch.float64 if self.dtype == np.float64 else torch.float32
        sim = device is None and simulating()
        self.on_device = device is not None or sim
        if device is not None:  # a device bucket in GPU memory
            self.tensor = torch.zeros(self.n, dtype=tdtype, device=device)
        else:
            self.tensor = torch.zeros(self.n, dtype=tdtype, pin_memory=pin)
        self.flat = engine_array(self.tensor, self.on_device)
        self.pending = len(self.names)
        self.request = None
        self.error = None
        self.started_at = None

    def __repr__(self):
        return (f"Bucket(index={self.index}, key={self.key!r}, params={len(self.names)}, "
                f"n={self.n}, on_device={self.on_device})")


def _accumulate_grad_hook(p, fn):
    """Call ``fn(p)`` once ``p.grad`` holds this backward's accumulated gradient."""
    if hasattr(p, "register_post_accumulate_grad_hook"):  # torch >= 2.1
        return p.register_post_accumulate_grad_hook(fn), None
    acc = p.expand_as(p).grad_fn.next_functions[0][0]  # torch 2.0: AccumulateGrad node
    return acc.register_hook(lambda *_: fn(p)), acc


class GradientSync:
    """Compressed, bucketed, overlapped gradient averaging for a torch model.

    Registers a hook on every trainable parameter. During ``backward()`` each
    gradient is copied into its bucket as soon as it is accumulated; a full
    bucket starts a nonblocking compressed allreduce (:func:`mpigc.iallreduce`)
    while the rest of the backward pass runs. :meth:`wait` completes them and
    writes the averaged gradients back into ``param.grad``. Construction is
    collective over ``comm``: the arguments are checked on every rank before
    the first collective and must be the same on every rank
    (:class:`mpigc.ConfigError` or :class:`mpigc.MismatchError` on every rank
    otherwise).

    Parameters
    ----------
    module : torch.nn.Module or iterable of (name, Parameter)
        Parameters with ``requires_grad=False`` at construction (frozen layers)
        are left out, as DDP does.
    op : str, dict or Compressor
        As for :func:`mpigc.allreduce`: ``"2bit"`` (default), ``"1bit"``,
        ``"terngrad"``, ``"fp16"``, ``"bf16"``, ``"none"`` (exactly ``MPI_Allreduce``).
    bucket_mb : float
        Bucket capacity in MiB of the bucket dtype (float32, or float64 for
        float64 parameters); DDP's default is 25. A larger parameter gets a
        bucket of its own.
    comm : mpi4py.MPI.Intracomm, optional
        Default ``MPI.COMM_WORLD``.
    average : bool
        Average (default) or sum over ranks.
    gather : str, optional
        As for :func:`mpigc.allreduce`.
    nonfinite : {"skip", "raise", "ignore"}, optional
        NaN/Inf in any rank's gradient. Default ``"skip"`` (or
        ``$MPIGC_NONFINITE``), as DDP passes them on: the gradients of the
        affected buckets become NaN on every rank (so ``GradScaler`` sees them,
        skips the step and lowers its scale) and no residual changes (with
        several buckets, those of the finite buckets are put back as they were
        before the step). ``"raise"``: :class:`mpigc.NonFiniteError` on every
        rank. See :attr:`nonfinite_steps`.
    timeout : float, optional
        Seconds a rank waits for the others in a step's synchronisation
        (uneven inputs without :meth:`join`) and in the collective methods
        (:meth:`state_dict`, :meth:`save_checkpoint` and the loads: called on
        one rank only, e.g. inside ``if rank == 0:``) before it raises
        :class:`mpigc.StateError` on that rank; default
        ``$MPIGC_TORCH_TIMEOUT`` or 1800 (as torch.distributed); 0 waits
        forever. Such a wait (and :meth:`join`'s) says on stderr what it
        waits for and the likely causes after ``$MPIGC_TORCH_WARN_S``
        seconds (default 60; 0: never), and again every 5 times that.
    sync_on_backward : bool
        Complete the synchronisation at the end of every ``backward()``, as
        DDP does, so ``param.grad`` holds the averages when ``backward()``
        returns (clipping, ``GradScaler`` and anything else that reads the
        gradients then need no :meth:`wait`). Default False: :meth:`wait`
        completes it. :class:`DistributedOptimizer` turns it on.
    hierarchy : {"flat", "auto", "node"}
        As for :func:`mpigc.allreduce` (default ``"flat"``): ``"node"`` sums
        each bucket exactly inside the node and compresses only between
        nodes; ``"auto"`` does so when ``comm`` spans several nodes with
        several ranks on a node. Must be the same on every rank.
        :meth:`state_dict` and checkpoints are per parameter either way, so
        they load whatever the hierarchy and node layout of the loading job.
    feedback : ErrorFeedback, optional
        The residual store of the buckets; default a new one, :attr:`feedback`.
    gradient_as_bucket_view : bool
        As in DDP: ``param.grad`` of float32 and float64 parameters on the
        device of their bucket (CPU parameters in host buckets, CUDA ones in
        device buckets) becomes a view of its bucket after the first
        synchronisation, so
        backward accumulates straight into the bucket and :meth:`wait`
        copies nothing back (saves two copies of every gradient per step
        and the memory of one). Call ``optimizer.zero_grad(set_to_none=False)``
        to keep the views: a gradient set to None is copied into the bucket
        once more and the view put back. Do not keep ``.grad`` tensors across
        steps: the next synchronisation overwrites them. Default False.
    find_unused_parameters : bool
        As in DDP: one more small allreduce per step tells which parameters got
        no gradient on any rank; their ``.grad`` is left untouched (None) and
        what their residuals delivered goes back into the residuals. Without
        it (default) a parameter without a gradient counts as a zero gradient
        on that rank and gets the average like the others.
    device_buckets : bool
        Default True: a bucket whose parameters are all on one GPU lives in
        that GPU's memory, and the engine compresses, decodes and keeps its
        residuals there (only packed bytes cross to the host, or none with
        CUDA-aware MPI), in order with torch's current stream; see
        ``docs/torch.md``. False: every bucket is in (pinned) host memory and
        the CPU compresses (two PCIe copies of every gradient per step).
        Buckets of CPU parameters, or of parameters on several devices, are
        host buckets either way.
    **params
        Compressor parameters, e.g. ``threshold=0.5``.

    Examples
    --------
    >>> sync = mpigc.torch.GradientSync(model, op="2bit", bucket_mb=25)  # doctest: +SKIP
    >>> loss.backward(); sync.wait(); optimizer.step()                  # doctest: +SKIP
    """

    def __init__(self, module, op="2bit", *, bucket_mb=25.0, comm=None, average=True,
                 gather="compressed", nonfinite=None, feedback=None,
                 find_unused_parameters=False, gradient_as_bucket_view=False,
                 timeout=None, sync_on_backward=False, device_buckets=True,
                 hierarchy="flat", **params):
        self.comm = resolve_comm(comm)
        self.device_buckets = bool(device_buckets)
        self.average = bool(average)
        self.gather = gather
        self.sync_on_backward = bool(sync_on_backward)
        #: steps whose gradients were non-finite on some rank (``nonfinite="skip"``)
        self.nonfinite_steps = 0
        #: False when the last synchronised step was skipped for NaN/Inf
        self.last_step_finite = True
        #: steps this object synchronised with gradients of this rank
        self.steps = 0
        self.find_unused_parameters = bool(find_unused_parameters)
        self.gradient_as_bucket_view = bool(gradient_as_bucket_view)
        # every argument is checked before the first collective, and the
        # checks are agreed on there: a rank that raised alone would leave the
        # others waiting in it
        exc, settings, named = None, None, []
        try:
            self.compressor = torch_compressor(op, params)
            self.nonfinite = torch_nonfinite(nonfinite)
            self.timeout = resolve_timeout(timeout)
            self._warn_s = resolve_warn_s()
            self.feedback = check_feedback(feedback)
            if not positive(bucket_mb):
                raise ConfigError(f"bucket_mb: expected a positive number, got {bucket_mb!r}")
            check_gather(gather)
            if module is None:
                raise ConfigError("module: expected a torch.nn.Module or (name, parameter) "
                                  "pairs, got None (DistributedOptimizer: pass the model, "
                                  "DistributedOptimizer(opt, model, ...), or sync=)")
            named = (list(module.named_parameters()) if isinstance(module, torch.nn.Module)
                     else list(module))
            for n, p in named:
                if p.requires_grad and p.dtype not in BUCKET_DTYPES:
                    raise DTypeError(f"parameter {n!r}: expected a float16, bfloat16, "
                                     f"float32 or float64 parameter, got {p.dtype}")
            settings = {"op": self.compressor.get_config(), "bucket_mb": float(bucket_mb),
                        "average": self.average, "gather": gather,
                        "nonfinite": self.nonfinite,
                        "find_unused_parameters": bool(find_unused_parameters),
                        "hierarchy": str(hierarchy)}
        except (MpigcError, TypeError, ValueError) as e:
            exc = e
        self._comm = self.comm.Dup()  # this object's own small collectives
        _engine_comm.resolve(self.comm)  # the engine's duplicate, now rather than in a hook
        agree_construction(self._comm, exc, settings, "GradientSync")
        self._watch = ThresholdWatch(self.compressor, "GradientSync")
        self._arrive = Rendezvous(self._comm, self._warn_s)
        self.hierarchy = hierarchy
        # the node layout (collective): whether the buckets' calls are hierarchical
        lay, hier = agree_hierarchy(self._comm, self.comm, hierarchy, "GradientSync")
        self._residuals = Residuals(self.feedback, self.comm, self._comm, gather, lay, hier,
                                    hierarchy)
        named = [(n, p) for n, p in named if p.requires_grad]
        check_same(self._comm, describe(named), "GradientSync")
        taken = [n for n, p in named if _hooked_by(p) is not None]
        raise_everywhere(self._comm, None if not taken else StateError(
            f"parameters {taken[:5]} are synchronised by another GradientSync (or "
            "DistributedOptimizer) already: call remove_hooks() on it (opt.sync."
            "remove_hooks()) before wrapping the model again, e.g. after unfreezing "
            "layers"), "GradientSync")
        self.names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self.size, self.rank = self._comm.size, self._comm.rank
        self.buckets = self._make_buckets(named, float(bucket_mb))
        # all buckets under $MPIGC_MIN_COMPRESS_BYTES: nothing would be compressed
        warn_if_uncompressed("GradientSync", self.compressor,
                             [b.tensor for b in self.buckets])
        self._where = {}  # param index -> (bucket, offset, numel)
        self._views = {}  # param index -> its slice of the bucket (as_bucket_view)
        for b in self.buckets:
            for i, off, m in zip(b.param_index, b.offsets, b.numels):
                self._where[i] = (b, off, m)
                p = self._params[i]
                if (self.gradient_as_bucket_view and p.device == b.tensor.device
                        and p.dtype == b.tensor.dtype):
                    self._views[i] = b.tensor[off:off + m].view(p.shape)
        self._ready = [False] * len(self._params)
        self._next = 0
        self._dirty = False
        self._no_sync = 0
        self._versions = {}  # param index -> (grad, its _version) when its bucket started
        # several buckets: residuals before the step, put back when another
        # bucket of the step was skipped (nonfinite="skip") or failed (an
        # error, e.g. NaN/Inf with nonfinite="raise"), so a step changes the
        # residuals of all its buckets or of none
        self._keep_snapshots = len(self.buckets) > 1
        self._snapshots = {}
        self._agree_req = None
        self._agree_buf = None
        self._changed = []
        self._callback_queued = False
        self._handles = []
        self._hooked_ids = {id(p) for p in self._params}
        for i, p in enumerate(self._params):
            self._handles.append(_accumulate_grad_hook(p, self._make_hook(i)))
            p._mpigc_sync = weakref.ref(self)  # see _hooked_by

    # -- construction ----------------------------------------------------------
    def _make_buckets(self, named, bucket_mb):
        # the one bucketing (float16/bfloat16 gradients in float32 buckets);
        # where each bucket lives is this rank's choice (the layout is the
        # same on every rank whatever the devices): on the GPU that holds all
        # its parameters, else in host memory
        buckets = []
        for k, (members, dt) in enumerate(plan_buckets(named, bucket_mb, accumulating_dtype)):
            entries = [(named[i][0], i, named[i][1]) for i in members]
            devices = {p.device for _, _, p in entries}
            dev = next(iter(devices)) if len(devices) == 1 else None
            on_gpu = dev is not None and dev.type == "cuda" and self.device_buckets
            pin = (not on_gpu and torch.cuda.is_available()
                   and any(p.is_cuda for _, _, p in entries))
            buckets.append(Bucket(k, entries, np.float64 if dt == torch.float64 else np.float32,
                                  dev if on_gpu else None, pin))
        return buckets

    def _make_hook(self, i):
        def hook(p):
            self._grad_ready(i, p)
        return hook

    def remove_hooks(self):
        """Detach from the model: its gradients are no longer synchronised.

        Call it before building a new ``GradientSync`` (or
        ``DistributedOptimizer``) for the same parameters, e.g. after
        unfreezing layers: otherwise both objects' hooks fire and the old
        one, which does not know the new parameters, raises at the next
        step. Not collective; the residuals stay in :attr:`feedback`.
        """
        for h, _ in self._handles:
            h.remove()
        self._handles = []
        self._hooked_ids = set()

    # -- during backward ---------------------------------------------------------
    def _grad_ready(self, i, p):
        if self._no_sync or p.grad is None:
            return
        b, off, m = self._where[i]
        if self._ready[i]:
            raise StateError(
                f"parameter {self.names[i]!r} got a second gradient before sync.wait(); "
                "accumulate gradients inside `with sync.no_sync():` instead. Or is another "
                "GradientSync hooked to the same parameters? Call remove_hooks() on the "
                "old one before wrapping the model again")
        if self.sync_on_backward and not self._callback_queued:
            # as DDP: finish the step when the autograd engine finishes backward
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._callback_queued = True
        view = self._views.get(i)
        if view is None or not self._is_view(p.grad, view):
            with torch.no_grad():
                # on the GPU for a device bucket (on torch's current stream)
                b.tensor[off:off + m].copy_(p.grad.detach().reshape(-1))
            if view is not None:
                p.grad = view  # backward accumulates into the bucket from now on
        if b.tensor.is_cuda:
            engine_after_torch(b.tensor.device)
        self._ready[i] = True
        self._dirty = True
        b.pending -= 1
        if b.pending == 0:
            self._launch_ready()
        self._poke()

    @staticmethod
    def _is_view(grad, view):
        return (grad is not None and grad.data_ptr() == view.data_ptr()
                and grad.shape == view.shape and grad.dtype == view.dtype
                and grad.stride() == view.stride())

    def _end_of_backward(self):
        self._callback_queued = False
        self.wait()

    def _launch(self, b):
        # the gradients as sent: a change before wait() would be lost (see wait)
        for i in b.param_index:
            g = self._params[i].grad
            if self._ready[i] and g is not None:
                self._versions[i] = (g, g._version)
        if b.tensor.is_cuda:
            engine_after_torch(b.tensor.device)  # zeros and fold-backs of wait()
        if self._keep_snapshots:
            self._snapshots[b.key] = self._residuals.snapshot(b)
        b.started_at = time.perf_counter()
        with profiled(f"mpigc: start bucket {b.key}"):
            b.request = iallreduce(b.flat, op=self.compressor, comm=self.comm, key=b.key,
                                   average=self.average, gather=self.gather,
                                   feedback=self.feedback, nonfinite=self.nonfinite,
                                   hierarchy=self.hierarchy)

    def _launch_ready(self):
        # buckets start in index order on every rank, whatever order their
        # gradients arrive in (the engine needs the same order everywhere)
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            self._launch(self.buckets[self._next])
            self._next += 1

    def _poke(self):
        """Let the started allreduces progress (MPI progresses inside test())."""
        for b in self.buckets[:self._next]:
            if b.request is not None and b.error is None and not b.request.done:
                try:
                    b.request.test()
                except Exception as e:  # noqa: BLE001 - raised by wait()
                    b.error = e

    # -- public API --------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation: backward passes inside the block only
        accumulate into ``param.grad`` locally; the first backward after it
        synchronises the accumulated gradients (as DDP's ``no_sync``)."""
        self._no_sync += 1
        try:
            yield
        finally:
            self._no_sync -= 1

    def wait(self):
        """Complete this step's allreduces and write the averaged gradients
        into ``param.grad`` (collective; call it after ``backward()`` and
        before ``optimizer.step()``). A no-op when no gradient arrived since
        the last call (e.g. after ``sync_on_backward`` finished the step).

        Raises
        ------
        MpigcError
            On every rank, when a bucket's allreduce failed (e.g.
            :class:`mpigc.NonFiniteError` for NaN/Inf gradients with
            ``nonfinite="raise"``); ``param.grad`` and the residuals are then
            unchanged.
        StateError
            On every rank, when some rank changed a ``param.grad`` in place or
            replaced it after its bucket started (clipping or
            ``GradScaler.unscale_`` before ``wait()``): that change would be
            silently lost. Call ``wait()`` (``opt.synchronize()``) first.
            On this rank only, when the other ranks did not reach the step
            within ``timeout`` seconds (see :meth:`join`).
        """
        if not self._dirty:
            return
        if self._agree_req is None:
            for b in self.buckets[self._next:]:  # buckets that some parameter did not fill
                for i, off, m in zip(b.param_index, b.offsets, b.numels):
                    if not self._ready[i]:
                        b.tensor[off:off + m].zero_()
                b.pending = 0
            self._launch_ready()
            changed = [self.names[i] for i, (g, v) in self._versions.items()
                       if self._params[i].grad is not g or g._version != v]
            self._post_agreement(active=True, changed=bool(changed),
                                 used=self._ready if self.find_unused_parameters else None)
            self._changed = changed
        buf = self._agreement()
        self._finish(buf, write=True)
        self.steps += 1

    def _post_agreement(self, active, changed, used=None):
        """Every step starts with one small allreduce on every rank, active
        or joined: [ranks with gradients, ranks whose gradients changed
        after they were sent, per parameter: ranks that used it]."""
        buf = np.zeros(2 + (len(self._params) if self.find_unused_parameters else 0),
                       np.int64)
        buf[0], buf[1] = int(active), int(changed)
        if used is not None:
            buf[2:] = np.asarray(used, np.int64)
        self._agree_buf = buf
        self._agree_req = self._comm.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM)

    def _agreement(self, wait=STEP, what="GradientSync"):
        """Wait for the step's agreement (:func:`wait_request`: a line on
        stderr when it lasts, :class:`StateError` after the timeout, the
        agreement still posted)."""
        wait_request(self._agree_req.Test, f"{what} (rank {self.rank} of {self.size})", wait,
                     timeout=self.timeout, warn_s=self._warn_s, progress=self._poke)
        self._agree_req = None
        return self._agree_buf

    def _finish(self, buf, write):
        """Complete the step's allreduces (every rank, active or joined)."""
        unused = (buf[2:] == 0) if self.find_unused_parameters else None
        errors = []
        for b in self.buckets:
            try:
                if b.error is None:
                    with profiled(f"mpigc: wait bucket {b.key}"):
                        b.request.wait()
            except Exception as e:  # noqa: BLE001
                b.error = e
            if b.error is not None:
                errors.append(b.error)
        snapshots, self._snapshots = self._snapshots, {}
        changed, self._changed = self._changed, []
        failed = {b.key for b in self.buckets if b.error is not None}
        self._reset_step()
        if errors:
            # a failed call changed no residual; those of this step's other
            # buckets go back to what they were before it
            for key, snaps in snapshots.items():
                if key not in failed:
                    self._residuals.restore(snaps)
            self._recycle(snapshots)
            raise errors[0]
        if buf[1]:
            raise StateError(
                f"param.grad was changed in place or replaced after backward() had sent it, "
                f"on {int(buf[1])} rank(s) (here: {changed[:5]}); the averaged gradients "
                "would overwrite that change. Call sync.wait() (opt.synchronize()) before "
                "clipping, GradScaler.unscale_() or any other change of the gradients")
        for dev in {b.tensor.device for b in self.buckets if b.tensor.is_cuda}:
            torch_after_engine(dev)
        nan = first_is_nan([b.tensor for b in self.buckets])  # a skipped bucket: all NaN
        skipped = self.nonfinite == "skip" and any(nan)
        self.last_step_finite = not skipped
        if skipped:  # a step that a loss scaler will skip: no residual changes
            self.nonfinite_steps += 1
            for b, bad in zip(self.buckets, nan):
                if b.key in snapshots and not bad:
                    self._residuals.restore(snapshots[b.key])
        self._recycle(snapshots)
        with torch.no_grad():
            if unused is not None and not skipped:
                self._fold_back(unused)
            for i, p in enumerate(self._params):
                b, off, m = self._where[i]
                if unused is not None and unused[i]:
                    if i in self._views:
                        b.tensor[off:off + m].zero_()  # a .grad that is the view reads 0
                    continue
                if not write:
                    continue
                if i in self._views:
                    p.grad = self._views[i]  # the result is in place already
                    continue
                src = b.tensor[off:off + m].view(p.shape)
                if p.grad is None:
                    p.grad = torch.empty_like(p, memory_format=torch.contiguous_format)
                p.grad.copy_(src)
        if write and not skipped:
            self._watch.observe([b.tensor for b in self.buckets])

    @contextlib.contextmanager
    def join(self):
        """Uneven inputs, as DDP's ``Join`` and Horovod's ``hvd.join()``:
        wrap the training loop in it on every rank; a rank that leaves the
        block while others still train shadows their steps (it contributes
        zero gradients, and the average stays over all ranks, as DDP's
        ``divide_by_initial_world_size=True``) until every rank has left.
        Then the trainable parameters of the rank that synchronised the most
        steps are broadcast to all (as DDP's Join; optimizer states of ranks
        that left early are their own). Collective when leaving the block.

        Examples
        --------
        >>> with sync.join():                             # doctest: +SKIP
        ...     for x, y in my_shard_of_uneven_length:
        ...         opt.zero_grad(); loss_fn(model(x), y).backward(); sync.wait(); opt.step()
        """
        start = self.steps
        yield self
        if self._dirty:  # a step the body left unfinished (e.g. after a timeout)
            self.wait()
        while True:
            if self._agree_req is None:  # else one that timed out here: taken up
                self._post_agreement(active=False, changed=0,
                                     used=[False] * len(self._params)
                                     if self.find_unused_parameters else None)
            buf = self._agreement(JOIN, "GradientSync.join")
            if buf[0] == 0:
                break
            for b in self.buckets:  # shadow: zeros, in bucket order
                b.tensor.zero_()
                b.pending = 0
            self._dirty = True
            self._launch_ready()
            self._finish(buf, write=False)
        counts = self._comm.allgather(self.steps - start)
        root = int(np.argmax(counts))
        if max(counts) > min(counts):
            broadcast_parameters(list(zip(self.names, self._params)), root=root,
                                 comm=self.comm)

    def _reset_step(self):
        self._ready = [False] * len(self._params)
        self._next = 0
        self._dirty = False
        self._versions = {}
        for b in self.buckets:
            b.pending = len(b.names)
            b.request = None
            b.error = None

    def _recycle(self, snapshots):
        """The step's snapshots' arrays serve the next step's snapshots."""
        for key, snaps in snapshots.items():
            self._residuals.recycle(key, snaps)

    def _fold_back(self, unused):
        """Parameters no rank used (``unused[i]``): what their elements
        delivered goes back to the worker residuals (so nothing is lost);
        their grads are left alone."""
        for b in self.buckets:
            spans = [(off, m) for i, off, m in zip(b.param_index, b.offsets, b.numels)
                     if unused[i]]
            if spans:
                self._residuals.fold_back(b, b.tensor, spans, self.average, self.size)

    # -- state -------------------------------------------------------------------
    def _idle(self, what):
        if self._dirty:
            raise StateError(f"{what}: a gradient synchronisation is in progress; call "
                             "wait() first")

    def state_dict(self, gather=False):
        """The residuals keyed by parameter name (collective).

        The format is :meth:`mpigc.ErrorFeedback.state_dict`'s, one key per
        trainable parameter, so it loads into an :class:`ErrorFeedback` that
        :func:`mpigc.save_checkpoint` can save (and reshard). ``worker`` is the
        parameter's slice of its bucket's worker residual; ``owner`` is this
        rank's shard (``numpy.array_split`` of the parameter's elements) of the
        owner residuals, gathered from the ranks that own those elements in
        the current bucketing. So the state does not depend on the buckets.

        Parameters
        ----------
        gather : bool
            True: every rank's state as one record on rank 0 (``None`` on the
            others), for the checkpoint rank 0 writes with ``torch.save``:
            call it on every rank, then save it inside ``if rank == 0:``.
            :meth:`load_state_dict` takes the record on every rank, on any
            world size. Rank 0 holds ``N + 1`` times the parameters' float32
            bytes meanwhile (``N`` ranks); large models use
            :meth:`save_checkpoint`.
        """
        self._arrive(self.timeout, "GradientSync.state_dict")
        return self._residuals.state(self.buckets, lambda: self._idle("state_dict"),
                                     "GradientSync.state_dict", gather=gather)

    def load_state_dict(self, state, strict=True):
        """Load residuals from :meth:`state_dict` (collective), whatever the
        bucketing was when they were saved.

        ``state`` is a per-rank state from a job with this world size (load a
        checkpoint saved at another size with :func:`mpigc.load_checkpoint`,
        which reshards it, then pass ``store.state_dict()``), or the record of
        ``state_dict(gather=True)`` from any world size, passed on every rank
        (resharded as :func:`mpigc.load_checkpoint` does). With ``strict`` (the
        default) names that are not trainable parameters here, or trainable
        parameters missing from a non-empty state, raise
        :class:`mpigc.StateError` on every rank; otherwise they are ignored
        and the missing residuals start at zero.
        """
        self._arrive(self.timeout, "GradientSync.load_state_dict")
        state = self._residuals.incoming(
            state, {n: p.numel() for n, p in zip(self.names, self._params)}, strict,
            lambda: self._idle("load_state_dict"), "GradientSync.load_state_dict")
        self._residuals.install(self.buckets, state, "GradientSync.load_state_dict")

    def save_checkpoint(self, path, step=None):
        """Save the residuals with :func:`mpigc.save_checkpoint` (collective),
        keyed by parameter name (see :meth:`state_dict`)."""
        self._arrive(self.timeout, "GradientSync.save_checkpoint")
        return self._residuals.save_checkpoint(path, step, self.state_dict())

    def load_checkpoint(self, path, strict=True):
        """Load residuals saved by :meth:`save_checkpoint` (collective), on any
        world size and bucketing; returns :func:`mpigc.load_checkpoint`'s info."""
        self._arrive(self.timeout, "GradientSync.load_checkpoint")
        return self._residuals.load_checkpoint(
            path, lambda state: self.load_state_dict(state, strict=strict))

    def __repr__(self):
        return (f"GradientSync(op={self.compressor!r}, params={len(self.names)}, "
                f"buckets={len(self.buckets)}, ranks={self.size})")
