"""CompressedAdamW's arithmetic: the moments, the frozen variance (the
freeze, 0/1 Adam's refreshes), the update, and 0/1 Adam's local steps
(``sync_every``: a window of local updates, then one compressed exchange)."""
import torch

from .._errors import MismatchError, NonFiniteError
from ..allreduce import iallreduce
from ._common import STEP, settled, wait_request


class AdamSteps:
    """The step half of :class:`mpigc.torch.CompressedAdamW`, its base
    class: methods on the moments, the flat buffers and the window state that
    CompressedAdamW's constructor sets up."""

    def _wire(self, t):
        return t.numpy() if t.device.type == "cpu" else t

    def _exchange(self, buf, op, **kw):
        """Average ``buf`` over the ranks; True if the result is finite (the
        same answer on every rank: the result is the same). The wait watches
        the rendezvous: :class:`MismatchError` on every rank when some rank
        is in a collective method (``save_checkpoint``) instead of this step;
        that rank abandons the exchange as it raises (:meth:`_abandon`), so
        that it ends on every rank and the next step works everywhere."""
        req = iallreduce(self._wire(buf), op, comm=self.comm, average=True,
                         gather=self.gather, nonfinite=self.nonfinite, **kw)
        self._arrive.step_posted()
        doing = f"CompressedAdamW's exchange of step {self._arrive.posted}"
        label = f"CompressedAdamW.step (rank {self.comm.rank} of {self.comm.size})"
        found = None
        try:  # no timeout and no lines on stderr (as the blocking call before): the watch only
            wait_request(lambda: settled(req), label, STEP, timeout=None, warn_s=None,
                         watch=self._arrive.watch(doing, label))
        except MismatchError as e:  # the ranks in the method abandon it as they raise
            found = e
            wait_request(lambda: settled(req), label, STEP, timeout=self._timeout,
                         warn_s=self._arrive.warn_s)
        try:
            req.wait()
            if bool(torch.isfinite(buf).all()):
                return True  # (after `found`: the method timed out there, then stepped)
            error = None
        except NonFiniteError as e:
            error = e
        # not finite on every rank: a rank's NaN/Inf, or an exchange abandoned
        told = self._comm.allgather(None)
        gone = [(q, t) for q, t in enumerate(told) if t is not None]
        for q, (attempt, _) in gone:
            self._arrive.forget(q, attempt)
        if gone:
            q, (_, text) = gone[0]
            raise found or self._arrive.mismatch(q, text, doing, label)
        if error is not None:
            raise error
        return False

    def _abandon(self, what):
        """The Rendezvous's ``abandon`` on a rank in the collective method
        ``what`` while the others wait in the exchange this rank posts next:
        this rank's side of it, all NaN, so that it ends on every rank with
        no residual changed (``nonfinite``: a NaN result or NonFiniteError,
        on every rank), and the others told that it was abandoned (the
        gather of :meth:`_exchange`'s non-finite end), so they raise
        MismatchError instead of skipping the step. The exchange is the
        warm-up's before the freeze, else the compressed one (a window's
        or a refresh's come after a step's first exchange, which the others
        cannot have passed)."""
        buf = torch.full_like(self._flat_g, float("nan"))
        op, kw = ((self.compressor, dict(key=self.key, feedback=self.feedback))
                  if self.frozen else (self.warmup_op, {}))
        req = iallreduce(self._wire(buf), op, comm=self.comm, average=True,
                         gather=self.gather, nonfinite=self.nonfinite, **kw)
        self._arrive.step_posted()
        label = f"{what} (rank {self.comm.rank} of {self.comm.size})"
        wait_request(lambda: settled(req), label, STEP, timeout=None, warn_s=None)
        try:
            req.wait()
        except NonFiniteError:
            pass
        self._comm.allgather((self._arrive.attempt, what))

    @property
    def frozen(self):
        """True once the variance is frozen and the momentum is compressed."""
        return self.frozen_at is not None

    def _local_step(self, t, g, refresh, loss):
        """0/1 Adam's local steps: each rank updates its own parameters with
        its own momentum; every ``sync_every`` steps the ranks exchange the
        sum of their ``(lr / c1) * momentum`` (compressed, error feedback) and
        all restart from the same parameters."""
        if self._window == 0:
            self._flatten_params(self._x0)
            self._m_local.copy_(self._m)
        kept = None
        if self._window + 1 == self.sync_every:  # ends in an exchange: kept for an abandon
            params = torch.empty_like(self._x0)
            self._flatten_params(params)
            kept = (params, self._acc.clone(), self._m_local.clone(), list(self._lr_sum),
                    list(self._decay), self._steps, self._window)
        for i, (group, (lo, hi)) in enumerate(zip(self.param_groups, self._slices)):
            b1 = group["betas"][0]
            g[lo:hi].mul_(1 - b1).add_(self._m_local[lo:hi] * b1)
            scale = group["lr"] / (1 - b1 ** t)
            self._acc[lo:hi].add_(g[lo:hi] * scale)
            self._lr_sum[i] += scale
            self._decay[i] *= 1 - group["lr"] * group["weight_decay"]
        self._m_local.copy_(g)
        self._apply(t, self._m_local)
        self._steps = t
        self._window += 1
        if self._window == self.sync_every:
            try:
                self._end_window(loss)
            except MismatchError:  # abandoned: as before this step (its parameters too)
                params, acc, m_local, self._lr_sum, self._decay, self._steps, \
                    self._window = kept
                self._unflatten_params(params)
                self._acc.copy_(acc)
                self._m_local.copy_(m_local)
                raise
            if refresh and self._window == 0 and self._steps == t:
                self._refresh(t)
        return loss

    @torch.no_grad()
    def synchronize(self):
        """End the current window of local steps now (collective: call it
        on every rank, e.g. before an evaluation or a checkpoint). Nothing
        to do without ``sync_every`` or between windows."""
        if self._window:
            self._end_window(None)

    @property
    def in_sync(self):
        """True when every rank holds the same parameters (no local steps
        pending)."""
        return self._window == 0

    def _end_window(self, loss):
        acc = self._acc
        kept = acc.clone()  # the exchange writes into it: back if it is abandoned
        try:
            ok = self._exchange(acc, self.compressor, key=self.key, feedback=self.feedback)
        except MismatchError:
            acc.copy_(kept)
            raise
        if ok:
            for i, (group, (lo, hi)) in enumerate(zip(self.param_groups, self._slices)):
                c2 = 1 - group["betas"][1] ** self.variance_updates
                denom = self._v[lo:hi].div(c2).sqrt_().add_(group["eps"])
                if group["weight_decay"]:
                    self._x0[lo:hi].mul_(self._decay[i])
                self._x0[lo:hi].sub_(acc[lo:hi].div(denom))
                self._m[lo:hi].copy_(acc[lo:hi].div(self._lr_sum[i]))
        else:  # the window is dropped on every rank
            self._steps -= self._window
            self._skip(loss)
        self._m_local.copy_(self._m)
        self._unflatten_params(self._x0)
        acc.zero_()
        self._lr_sum = [0.0] * len(self.param_groups)
        self._decay = [1.0] * len(self.param_groups)
        self._window = 0

    def _flatten_params(self, out):
        off = 0
        for group in self.param_groups:
            for p in group["params"]:
                out[off:off + p.numel()].copy_(p.reshape(-1))
                off += p.numel()

    def _unflatten_params(self, src):
        off = 0
        for group in self.param_groups:
            for p in group["params"]:
                p.copy_(src[off:off + p.numel()].view_as(p))
                off += p.numel()

    def _update_moments(self, g, m=True):
        for group, (lo, hi) in zip(self.param_groups, self._slices):
            b1, b2 = group["betas"]
            # no fused multiply-adds (alpha=, addcmul): every element is rounded
            # as the documented formula says, on every device and in numpy
            if m:
                self._m[lo:hi].mul_(b1).add_(g[lo:hi] * (1 - b1))
            self._v[lo:hi].mul_(b2).add_(g[lo:hi] * g[lo:hi] * (1 - b2))
        self.variance_updates += 1

    def _refresh(self, t):
        """0/1 Adam's variance refresh: the local gradients of this step
        averaged with ``warmup_op`` update the frozen variance (after this
        step's update); the next refresh comes twice as many steps later."""
        if not self._exchange(self._flat_r, self.warmup_op):
            return  # tried again at the next step
        self._update_moments(self._flat_r, m=False)
        self.refreshes += 1
        self._next_refresh = t + self.var_refresh * 2 ** self.refreshes

    def _freeze_now(self):
        """Freeze after this warm-up step? A step count, or 'auto': the sum of
        the bias-corrected sqrt(v) moved by at most ``freeze_threshold``
        (relative) over the last ``freeze_window`` steps. Rank 0 decides and
        the others follow (their variances are equal; their float sums might
        not be)."""
        if self.freeze_steps != "auto":
            return self._steps >= self.freeze_steps
        total = 0.0
        for group, (lo, hi) in zip(self.param_groups, self._slices):
            c2 = 1 - group["betas"][1] ** self.variance_updates
            total += float(self._v[lo:hi].double().div(c2).sqrt().sum())
        self._spread.append(total)
        self._spread = self._spread[-(self.freeze_window + 1):]
        ok = (len(self._spread) > self.freeze_window
              and abs(total / self._spread[0] - 1) <= self.freeze_threshold)
        return bool(self._comm.bcast(ok, root=0))

    def _skip(self, loss):
        self.skipped_steps += 1
        return loss

    def _apply(self, t, m=None):
        m = self._m if m is None else m
        off = 0
        for group, (lo, hi) in zip(self.param_groups, self._slices):
            b1, b2 = group["betas"]
            c1, c2 = 1 - b1 ** t, 1 - b2 ** self.variance_updates
            lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
            denom = self._v[lo:hi].div(c2).sqrt_().add_(eps)
            upd = m[lo:hi].div(denom).mul_(lr / c1)
            for p in group["params"]:
                k = p.numel()
                if wd:
                    p.mul_(1 - lr * wd)
                p.sub_(upd[off - lo:off - lo + k].view_as(p))
                off += k
