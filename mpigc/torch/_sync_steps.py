"""GradientSync's steps: each gradient copied into its bucket during
backward, the buckets' calls started in bucket order, the step's agreement
(one small allreduce of every rank, active or joined) and its completion:
the averaged gradients back into ``param.grad``, the residuals of a failed
or skipped step put back, those of unused parameters folded back."""
import time
import weakref

import numpy as np
import torch
from mpi4py import MPI

from .._auto import waiting_with
from .._errors import StateError
from ..allreduce import iallreduce

from ._common import (JOIN, STEP, engine_after_torch, first_is_nan, fold_back_needs_worker,
                      profiled, settled, torch_after_engine, wait_request)


def _accumulate_grad_hook(p, fn):
    """Call ``fn(p)`` once ``p.grad`` holds this backward's accumulated gradient."""
    if hasattr(p, "register_post_accumulate_grad_hook"):  # torch >= 2.1
        return p.register_post_accumulate_grad_hook(fn), None
    acc = p.expand_as(p).grad_fn.next_functions[0][0]  # torch 2.0: AccumulateGrad node
    return acc.register_hook(lambda *_: fn(p)), acc




class SyncSteps:
    """The step half of :class:`mpigc.torch.GradientSync`, its base class:
    the methods that run during ``backward()``, :meth:`GradientSync.wait`
    and :meth:`GradientSync.join`, on the state that GradientSync's
    constructor sets up (its buckets, parameters, per-step flags and its
    :class:`mpigc.torch._residuals.Residuals`)."""

    def _init_steps(self):
        """The step state, once the buckets are made."""
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
        self._handles = []  # a hook on every parameter, as its gradient is accumulated
        self._hooked_ids = {id(p) for p in self._params}
        for i, p in enumerate(self._params):
            self._handles.append(_accumulate_grad_hook(p, self._make_hook(i)))
            p._mpigc_sync = weakref.ref(self)  # see _sync._hooked_by

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

    def _make_hook(self, i):
        def hook(p):
            self._grad_ready(i, p)
        return hook

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
        # op="auto": the engine decides per call (the same on every rank) and
        # folds the residuals into a call it runs as "none"
        op, auto = self.compressor, {}
        if self.auto_pin is not None:
            op, auto = "auto", {"auto_op": self.compressor, "auto_pin": self.auto_pin}
        # (a model step of op="auto" completes in the call: waited for as the
        # step's agreement is, with its lines and timeout)
        with profiled(f"mpigc: start bucket {b.key}"), \
                waiting_with(self._wait_in_call if auto else None):
            b.request = iallreduce(b.flat, op=op, comm=self.comm, key=b.key,
                                   average=self.average, gather=self.gather,
                                   feedback=self.feedback, nonfinite=self.nonfinite,
                                   hierarchy=self.hierarchy, **auto)

    def _wait_in_call(self, req):
        """Wait for an engine request inside an ``op="auto"`` call
        (:func:`mpigc._auto.waiting_with`), as for the step's agreement."""
        self._wait(lambda: settled(req))

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

    def _complete_step(self):
        """:meth:`GradientSync.wait` of a step with gradients: start the
        buckets that some parameter did not fill, agree, complete."""
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
        self._arrive.step_posted()

    def _agreement(self, wait=STEP, what="GradientSync",
                   doing="the gradient synchronisation of step {step}"):
        """Wait for the step's agreement (:func:`wait_request`: a line on
        stderr when it lasts, :class:`StateError` after the timeout, the
        agreement still posted; :class:`MismatchError` on every rank when
        some rank is in a collective method instead)."""
        self._wait(self._agree_req.Test, wait, what, doing)
        self._agree_req = None
        return self._agree_buf

    def _wait(self, test, wait=STEP, what="GradientSync",
              doing="the gradient synchronisation of step {step}"):
        """Poll ``test()`` (:func:`wait_request`) as the step's waits do."""
        label = f"{what} (rank {self.rank} of {self.size})"
        wait_request(test, label, wait, timeout=self.timeout, warn_s=self._warn_s,
                     progress=self._poke, watch=self._arrive.watch(doing, label))

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
            b.decision = getattr(b.request, "decision", None)
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

    def _shadow_steps(self):
        """:meth:`GradientSync.join` on a rank that left its loop: shadow the
        others' steps (zero gradients) until every rank has left."""
        while True:
            if self._agree_req is None:  # else one that timed out here: taken up
                self._post_agreement(active=False, changed=0,
                                     used=[False] * len(self._params)
                                     if self.find_unused_parameters else None)
            buf = self._agreement(JOIN, "GradientSync.join",
                                  "join(), shadowing the others' step {step}")
            if buf[0] == 0:
                break
            for b in self.buckets:  # shadow: zeros, in bucket order
                b.tensor.zero_()
                b.pending = 0
            self._dirty = True
            self._launch_ready()
            self._finish(buf, write=False)

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
                if b.decision is not None and b.decision.op == "none":
                    # op="auto" ran it plain: its residuals went into the sum
                    fold_back_needs_worker(self.feedback, b.key, b.tensor, spans)
                self._residuals.fold_back(b, b.tensor, spans, self.average, self.size)
