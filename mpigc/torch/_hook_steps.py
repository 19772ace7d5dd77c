"""The DDP hook's steps: each DDP bucket handed to :func:`comm_hook` is
reduced in place or copied into the fixed groups, the calls start in order,
and DDP's last bucket completes the step (the calls waited for under one
timeout, the residuals of a failed or skipped step put back, unused
parameters folded back, the results into DDP's buckets, their futures
completed; an error raised by ``backward()`` itself)."""
import time

import numpy as np
import torch
from mpi4py import MPI

from .._auto import waiting_with
from .._errors import MismatchError, MpigcError, StateError
from ..allreduce import iallreduce

from ._common import (HOOK_STALE, HOOK_STEP, engine_after_torch, engine_array, first_is_nan,
                      fold_back_needs_worker, profiled, settled, simulating,
                      torch_after_engine, wait_request, warn_if_uncompressed)


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


class HookSteps:
    """The step half of :class:`mpigc.torch.CommHookState`, its base class:
    what :func:`comm_hook` does with each of DDP's buckets, on the state
    that CommHookState's constructor sets up (its groups, layouts and
    :class:`mpigc.torch._residuals.Residuals`)."""

    def _reset_step(self):
        self._calls = []     # (layout, request, buffer, snapshot): this step's calls
        self._futures = []   # (future, DDP's bucket tensor, its layout)
        self._error = None   # what failed in this step's hooks so far
        self._result_at = {}  # name -> (buffer, offset) of its result (groups)
        self._waiting = ([len(g.names) for g in self.groups]
                         if self.groups is not None else [])
        self._next_group = 0

    # -- in the hook -------------------------------------------------------------
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
        # op="auto": the engine decides per call (the same on every rank) and
        # folds the residuals into a call it runs as "none"
        op, auto = self.compressor, {}
        if self.auto_pin is not None:
            op, auto = "auto", {"auto_op": self.compressor, "auto_pin": self.auto_pin}
        # (a model step of op="auto" completes in the call: waited for as the
        # step's calls are, with their lines and timeout)
        with profiled(f"mpigc: start bucket {layout.key}"), waiting_with(
                (lambda r: self._wait(lambda: settled(r), HOOK_STEP, time.monotonic()))
                if auto else None):
            req = iallreduce(engine_array(flat, simulating()), op=op, comm=self.comm,
                             key=layout.key, average=self.average, gather=self.gather,
                             feedback=self.feedback, nonfinite=self.nonfinite,
                             hierarchy=self.hierarchy, **auto)
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
        if not self._futures:  # DDP's first bucket of a step
            self._arrive.step_posted()
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
            # a timeout keeps the rest (unwatched: an older step than the one posted)
            self._wait(lambda: settled(req), HOOK_STALE, t0, watched=False)
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

    def _wait(self, test, wait, since, watched=True):
        """Wait for the other ranks (:func:`wait_request`: a line on stderr
        when it lasts, :class:`StateError` after the timeout;
        ``watched``: :class:`MismatchError` on every rank when some rank is
        in a collective method of this object instead)."""
        label = f"comm_hook (rank {self.rank} of {self.size})"
        wait_request(test, label, wait, timeout=self.timeout, warn_s=self._warn_s,
                     since=since, watch=self._arrive.watch(
                         "the gradient synchronisation of step {step} (comm_hook)", label)
                     if watched else None)

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
                        self._wait(lambda: settled(req), HOOK_STEP, t0)
                    except (StateError, MismatchError) as e:
                        late = e
                if late is not None and not settled(req):
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
        decisions = {layout.key: req.decision for layout, req, _, _ in calls
                     if getattr(req, "decision", None) is not None}
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
            self.decisions = decisions
            unused = (set() if used is None else
                      {n for n, u in zip(self.names, used) if u == 0})
            with torch.no_grad():
                if unused and not skipped:
                    for layout, _, buf, _ in calls:
                        self._fold_back(layout, buf, unused, decisions.get(layout.key))
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

    def _fold_back(self, layout, buf, unused, decision=None):
        """What the elements of parameters that no rank used delivered goes
        back into the worker residuals of ``layout``'s call, as
        :class:`GradientSync` does (:meth:`Residuals.fold_back`);
        ``decision``: the call's, with ``op="auto"``."""
        spans = [(off, m) for n, off, m in zip(layout.names, layout.offsets, layout.numels)
                 if n in unused]
        if spans:
            if decision is not None and decision.op == "none":
                # op="auto" ran it plain: its residuals went into the sum
                fold_back_needs_worker(self.feedback, layout.key, buf, spans)
            self._residuals.fold_back(layout, buf, spans, self.average, self.size)
