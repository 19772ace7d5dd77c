"""CompressedAdamW: AdamW whose compressed exchange comes after Adam's
preconditioning, with the variance frozen after an exact warm-up (the 1-bit
Adam recipe of Tang et al. 2021, with any mpigc compressor).

Exported as :class:`mpigc.torch.CompressedAdamW`; see ``docs/torch.md``.

Why it exists: compressing *gradients* under Adam (``GradientSync`` with
``2bit``, ``1bit`` or ``terngrad`` in front of ``torch.optim.AdamW``) feeds
Adam's second moment the compressed values. With error feedback a coordinate
often receives nothing for a few steps and then the delayed sum at once, so
``v`` grows with the square of those bursts while the first moment averages
them away: the step ``m / sqrt(v)`` shrinks as if the learning rate had been
cut. Here the ranks exchange exactly (``op="none"``) for ``freeze_steps``
steps of plain AdamW; then ``v`` is frozen and what is compressed, with error
feedback, is each rank's *momentum* ``beta1 * m + (1 - beta1) * g_local``.
The averaged momentum is the same on every rank and replaces ``m``.

From 0/1 Adam (Lu et al. 2022) it takes two optional ideas: the frozen
variance refreshed at growing intervals (``var_refresh``), and local steps
between exchanges (``sync_every``). The warm-up's exchange may be ``bf16``
(``warmup_op``) and its length chosen by the variance itself
(``freeze_steps="auto"``).
"""
import warnings

import torch

from .._errors import ConfigError, InvalidBufferError, MpigcError
from ..feedback import ErrorFeedback
from ._common import (Rendezvous, agreed_comm, check_same, resolve_timeout, resolve_warn_s,
                      torch_compressor)
from ._adam_steps import AdamSteps
from ._residuals import Residuals

__all__ = ["CompressedAdamW", "local_gradients_hook"]

_WARMUP_OPS = ("none", "bf16", "fp16")


def _check_arguments(comm, lr, betas, eps, weight_decay, freeze_steps, warmup_op,
                     freeze_threshold, freeze_window, sync_every, var_refresh, nonfinite):
    """CompressedAdamW's checks of its arguments, before its first collective
    (which agrees on them)."""
    from mpi4py import MPI

    if not isinstance(comm, MPI.Intracomm):
        raise ConfigError(f"comm: expected an mpi4py Intracomm, got "
                          f"{type(comm).__name__}")
    if (lr < 0 or eps < 0 or weight_decay < 0
            or not all(0 <= b < 1 for b in betas)):
        raise ConfigError(f"CompressedAdamW: invalid lr={lr}, betas={betas}, "
                          f"eps={eps} or weight_decay={weight_decay}")
    if freeze_steps != "auto" and (
            isinstance(freeze_steps, str) or int(freeze_steps) != freeze_steps
            or freeze_steps < 1):
        raise ConfigError("freeze_steps must be 'auto' or an integer >= 1 (the "
                          "variance to freeze comes from the exact warm-up), got "
                          f"{freeze_steps!r}")
    if warmup_op not in _WARMUP_OPS:
        raise ConfigError(f"warmup_op must be one of {', '.join(_WARMUP_OPS)} (an "
                          f"exchange without error feedback), got {warmup_op!r}")
    if not (isinstance(freeze_window, int) and freeze_window >= 1
            and 0 < freeze_threshold < 1):
        raise ConfigError("freeze_window must be an integer >= 1 and "
                          "freeze_threshold in (0, 1), got "
                          f"{freeze_window!r}, {freeze_threshold!r}")
    if not (isinstance(sync_every, int) and sync_every >= 1):
        raise ConfigError(f"sync_every must be an integer >= 1, got {sync_every!r}")
    if not (isinstance(var_refresh, int) and var_refresh >= 0):
        raise ConfigError("var_refresh must be an integer >= 0 (0: never), got "
                          f"{var_refresh!r}")
    if nonfinite not in ("skip", "raise"):
        raise ConfigError(f"nonfinite must be 'skip' or 'raise', got {nonfinite!r}")


class CompressedAdamW(AdamSteps, torch.optim.Optimizer):
    """AdamW for data-parallel training that synchronises itself: do not wrap
    the model in ``GradientSync``/``DistributedOptimizer`` or DDP as well.

    >>> opt = mpigc.torch.CompressedAdamW(model.parameters(), lr=1e-3,
    ...                                   op="1bit", freeze_steps=100)  # doctest: +SKIP
    >>> loss.backward(); opt.step()      # exchanges and updates  # doctest: +SKIP

    Parameters
    ----------
    params : iterable of parameters or of param-group dicts (``lr``,
        ``weight_decay``, ``betas`` and ``eps`` per group, as AdamW).
        Every rank must pass the same parameters in the same order: float32
        or float64, all of one dtype and one device (CPU, or CUDA through the
        engine's device path).
    lr, betas, eps, weight_decay : as :class:`torch.optim.AdamW`.
    op : str or Compressor
        Compressor of the momentum after the warm-up (default ``"1bit"``).
        Its parameters (``block_size``, ``rel_threshold``, ...) as keywords.
    freeze_steps : int
        Steps of exact AdamW (gradients averaged with ``op="none"``) before
        the variance is frozen and the compressed exchange starts. DeepSpeed
        advises 15-25% of the training for 1-bit Adam; ``docs/torch.md``
        gives what was measured here.
        ``"auto"`` freezes when the variance has settled: after the first
        warm-up step at which the sum over the parameters of the
        bias-corrected ``sqrt(v)`` is within ``freeze_threshold`` (relative)
        of its value ``freeze_window`` steps before.
    warmup_op : ``"none"`` (default), ``"bf16"`` or ``"fp16"``
        The exchange of the warm-up's gradients (and of the refreshes):
        ``bf16`` halves the warm-up's bytes.
    freeze_threshold, freeze_window : float, int
        The criterion of ``freeze_steps="auto"`` (defaults 0.02 and 10).
    var_refresh : int
        0/1 Adam's variance refresh (default 0: never): after the freeze the
        variance takes the ``warmup_op``-averaged gradient of the step
        ``var_refresh`` steps later, then ``2 * var_refresh`` steps after
        that, and so on (one more exchange of the gradient at those steps).
    sync_every : int
        0/1 Adam's local steps (default 1: none): after the freeze each rank
        updates its parameters with its own momentum, and every
        ``sync_every`` steps the ranks exchange (compressed, with error
        feedback) the sum of their ``(lr / c1) * momentum`` over those steps
        and restart from the same parameters: the exchange's bytes divided
        by ``sync_every``. Between exchanges the ranks' parameters differ;
        :meth:`synchronize` ends a window early (before an evaluation or a
        checkpoint), :attr:`in_sync` says whether one is open.
    comm : mpi4py communicator (default ``MPI.COMM_WORLD``).
    gather : ``"compressed"`` (default) or ``"exact"``, as :func:`mpigc.allreduce`.
    key : str
        Residual key in the optimizer's own :class:`mpigc.ErrorFeedback`
        (:attr:`feedback`), saved by :meth:`save_checkpoint`.
    nonfinite : ``"skip"`` (default) or ``"raise"``
        A step whose exchanged values are not finite on some rank is skipped on
        every rank (no change to parameters, moments or residuals;
        :attr:`skipped_steps` counts them), or raises on every rank.

    Gradients must be the local ones (no other synchronisation). The rank's
    own gradient clipping, if any, acts on its local gradient. ``GradScaler``
    is not supported (use float32 or bfloat16 autocast): its per-rank skip
    decision would let ranks diverge, so it is refused on every rank.

    Under DDP (to keep its buffer broadcast, ``no_sync`` and ``join``),
    register :func:`local_gradients_hook` so that DDP leaves the gradients
    local and this optimizer's exchange is the only one::

        ddp.register_comm_hook(None, mpigc.torch.local_gradients_hook)
        opt = mpigc.torch.CompressedAdamW(ddp.parameters(), op="1bit")
    """

    _step_supports_amp_scaling = True  # so GradScaler calls step() on every rank

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, *,
                 op="1bit", freeze_steps=100, comm=None, key="adamw", gather="compressed",
                 nonfinite="skip", warmup_op="none", freeze_threshold=0.02, freeze_window=10,
                 var_refresh=0, sync_every=1, **op_params):
        from mpi4py import MPI

        self.comm = MPI.COMM_WORLD if comm is None else comm
        # every argument is checked before the first collective, and the
        # checks are agreed on there (a rank that raised alone would leave the
        # others waiting in it)
        exc, settings, ps = None, None, []
        try:
            _check_arguments(self.comm, lr, betas, eps, weight_decay, freeze_steps,
                             warmup_op, freeze_threshold, freeze_window, sync_every,
                             var_refresh, nonfinite)
            super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                          weight_decay=weight_decay))
            self.compressor = torch_compressor(op, op_params)
            ps = [p for g in self.param_groups for p in g["params"]]
            if not ps:
                raise ConfigError("CompressedAdamW: no parameters")
            dtypes = {p.dtype for p in ps}
            devices = {p.device for p in ps}
            if len(dtypes) > 1 or len(devices) > 1 or next(iter(dtypes)) not in (
                    torch.float32, torch.float64):
                raise InvalidBufferError(
                    "CompressedAdamW: parameters must all be float32 or all float64, on "
                    f"one device; got dtypes {sorted(map(str, dtypes))} on "
                    f"{sorted(map(str, devices))}")
            settings = {"op": self.compressor.get_config(),
                        "freeze_steps": freeze_steps if freeze_steps == "auto"
                        else int(freeze_steps), "warmup_op": warmup_op,
                        "freeze_threshold": float(freeze_threshold),
                        "freeze_window": freeze_window, "var_refresh": var_refresh,
                        "sync_every": sync_every,
                        "key": str(key), "gather": gather, "nonfinite": nonfinite,
                        "groups": [{k: (list(v) if isinstance(v, tuple) else v)
                                    for k, v in g.items() if k != "params"}
                                   for g in self.param_groups]}
        except (MpigcError, TypeError, ValueError) as e:
            exc = e
        # this optimizer's own small collectives, once the ranks agreed
        self._comm = agreed_comm(self.comm, exc, settings, "CompressedAdamW")
        # every rank's arrival at a collective method (save_checkpoint,
        # load_checkpoint), within $MPIGC_TORCH_TIMEOUT; the step's exchanges
        # watch it (a method called inside `if rank == 0:` raises on every rank)
        self._timeout = resolve_timeout(None)
        self._arrive = Rendezvous(self._comm, resolve_warn_s(), abandon=self._abandon)
        self.freeze_steps = freeze_steps if freeze_steps == "auto" else int(freeze_steps)
        self.warmup_op = warmup_op
        self.freeze_threshold = float(freeze_threshold)
        self.freeze_window = freeze_window
        self.var_refresh = var_refresh
        self.sync_every = sync_every
        #: the step after which the variance was frozen (None during the warm-up)
        self.frozen_at = None
        #: updates of the variance so far (warm-up steps and refreshes)
        self.variance_updates = 0
        #: refreshes of the frozen variance so far
        self.refreshes = 0
        self._next_refresh = None   # step of the next refresh once frozen
        self._spread = []           # auto freeze: sum of sqrt(v_hat) over the window
        self.key = str(key)
        self.gather = gather
        self.nonfinite = nonfinite
        self.feedback = ErrorFeedback()
        self._residuals = Residuals(self.feedback, self.comm, self._comm, gather)
        #: steps skipped because exchanged values were not finite
        self.skipped_steps = 0
        self._steps = 0
        check_same(self._comm, [(f"param_groups[{g}][{i}]", list(p.shape),
                                 str(p.dtype).replace("torch.", ""))
                                for g, group in enumerate(self.param_groups)
                                for i, p in enumerate(group["params"])], "CompressedAdamW")
        n = sum(p.numel() for p in ps)
        dev, dt = ps[0].device, ps[0].dtype
        self._flat_g = torch.zeros(n, dtype=dt, device=dev)   # exchanged buffer
        self._m = torch.zeros(n, dtype=dt, device=dev)
        self._v = torch.zeros(n, dtype=dt, device=dev)
        # the local gradient kept for a refresh of the variance
        self._flat_r = torch.zeros(n, dtype=dt, device=dev) if var_refresh else None
        # local steps (sync_every > 1): the parameters at the window's start,
        # this rank's momentum, the sum of its (lr / c1) * momentum, and per
        # group the sum of lr / c1 and the product of the weight decays
        self._window = 0
        if sync_every > 1:
            self._x0 = torch.zeros(n, dtype=dt, device=dev)
            self._m_local = torch.zeros(n, dtype=dt, device=dev)
            self._acc = torch.zeros(n, dtype=dt, device=dev)
        self._lr_sum = [0.0] * len(self.param_groups)
        self._decay = [1.0] * len(self.param_groups)
        self._slices, off = [], 0
        for g in self.param_groups:
            lo = off
            for p in g["params"]:
                off += p.numel()
            self._slices.append((lo, off))

    # -- the step -------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        if grad_scaler is not None:
            raise ConfigError("CompressedAdamW does not support GradScaler: use float32 or bfloat16 "
                      "autocast (a per-rank skip decision would let the ranks diverge)")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        g = self._flat_g
        off = 0
        for group in self.param_groups:
            for p in group["params"]:
                k = p.numel()
                if p.grad is None:
                    g[off:off + k].zero_()
                else:
                    g[off:off + k].copy_(p.grad.reshape(-1))
                off += k
        t = self._steps + 1
        if not self.frozen:
            # the warm-up: plain AdamW on the averaged gradient
            if not self._exchange(g, self.warmup_op):
                return self._skip(loss)
            self._update_moments(g)
            self._apply(t)
            self._steps = t
            if self._freeze_now():
                self.frozen_at = t
                self._next_refresh = t + self.var_refresh if self.var_refresh else None
            return loss
        end = self._window + 1 == self.sync_every   # the window's last step
        refresh = end and self._next_refresh is not None and t >= self._next_refresh
        if refresh:
            self._flat_r.copy_(g)
        if self.sync_every > 1:
            return self._local_step(t, g, refresh, loss)
        # compressed momentum, frozen variance
        for group, (lo, hi) in zip(self.param_groups, self._slices):
            b1 = group["betas"][0]
            g[lo:hi].mul_(1 - b1).add_(self._m[lo:hi] * b1)
        if not self._exchange(g, self.compressor, key=self.key, feedback=self.feedback):
            return self._skip(loss)
        self._m.copy_(g)
        self._apply(t)
        self._steps = t
        if refresh:
            self._refresh(t)
        return loss

    # -- state ----------------------------------------------------------------
    def state_dict(self):
        sd = super().state_dict()
        sd["mpigc"] = {"steps": self._steps, "freeze_steps": self.freeze_steps,
                       "frozen_at": self.frozen_at, "variance_updates": self.variance_updates,
                       "refreshes": self.refreshes, "next_refresh": self._next_refresh,
                       "spread": list(self._spread), "skipped_steps": self.skipped_steps,
                       "exp_avg": self._m.clone(), "exp_avg_sq": self._v.clone(),
                       "window": None}
        if self._window:  # this rank's local steps since the last exchange
            sd["mpigc"]["window"] = {
                "steps": self._window, "params": self._x0.clone(),
                "momentum": self._m_local.clone(), "sum": self._acc.clone(),
                "lr_sum": list(self._lr_sum), "decay": list(self._decay)}
        return sd

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        own = state_dict.pop("mpigc", None)
        if own is None:
            raise ConfigError("CompressedAdamW.load_state_dict: not a CompressedAdamW state "
                              "(no 'mpigc' entry)")
        if own["exp_avg"].numel() != self._m.numel():
            raise InvalidBufferError(
                f"CompressedAdamW.load_state_dict: the state holds {own['exp_avg'].numel()} "
                f"values, the parameters {self._m.numel()}")
        super().load_state_dict(state_dict)
        steps = int(own["steps"])
        if "frozen_at" in own:
            frozen_at, updates = own["frozen_at"], int(own["variance_updates"])
        else:  # saved before 'auto' and the refreshes: frozen after freeze_steps
            saved = int(own["freeze_steps"])
            frozen_at = saved if steps >= saved else None
            updates = min(steps, saved)
        if frozen_at is not None and own["freeze_steps"] != self.freeze_steps:
            # the variance was frozen at that step: no other value is right now
            warnings.warn(f"CompressedAdamW: the state was frozen after {frozen_at} "
                          f"steps; keeping that instead of freeze_steps={self.freeze_steps}",
                          stacklevel=2)
            self.freeze_steps = own["freeze_steps"]
        self._steps = steps
        self.frozen_at = None if frozen_at is None else int(frozen_at)
        self.variance_updates = updates
        self.refreshes = int(own.get("refreshes", 0))
        self._next_refresh = own.get("next_refresh")
        if self.frozen_at is not None and self.var_refresh and self._next_refresh is None:
            # refreshes switched on at resume: the first one var_refresh steps on
            self._next_refresh = steps + self.var_refresh
        elif not self.var_refresh:
            self._next_refresh = None
        self._spread = [float(x) for x in own.get("spread", [])]
        self.skipped_steps = int(own["skipped_steps"])
        self._m.copy_(own["exp_avg"])
        self._v.copy_(own["exp_avg_sq"])
        win = own.get("window")
        if self.sync_every > 1:
            self._window = 0
            self._m_local.copy_(self._m)
            self._acc.zero_()
            self._lr_sum = [0.0] * len(self.param_groups)
            self._decay = [1.0] * len(self.param_groups)
        if win:
            if self.sync_every <= int(win["steps"]):
                raise ConfigError(
                    f"CompressedAdamW.load_state_dict: the state was saved after "
                    f"{win['steps']} local steps; resume with the same sync_every (now "
                    f"{self.sync_every}), or save after synchronize()")
            self._window = int(win["steps"])
            self._x0.copy_(win["params"])
            self._m_local.copy_(win["momentum"])
            self._acc.copy_(win["sum"])
            self._lr_sum = [float(x) for x in win["lr_sum"]]
            self._decay = [float(x) for x in win["decay"]]

    def save_checkpoint(self, path, step=None):
        """The residuals of the compressed exchange, with
        :func:`mpigc.save_checkpoint` (collective: call it on every rank, not
        inside ``if rank == 0:``; any world size on load)."""
        self._arrive(self._timeout, "CompressedAdamW.save_checkpoint")
        return self._residuals.save_checkpoint(path, step)

    def load_checkpoint(self, path, step=None):
        """The residuals saved by :meth:`save_checkpoint` (collective);
        ``step`` as in :func:`mpigc.load_checkpoint`."""
        self._arrive(self._timeout, "CompressedAdamW.load_checkpoint")
        return self._residuals.load_checkpoint(path, step=step)

    def __repr__(self):
        return (f"CompressedAdamW(op={self.compressor!r}, freeze_steps={self.freeze_steps!r}, "
                f"values={self._m.numel()}, ranks={self.comm.size})")



def local_gradients_hook(state, bucket):
    """A DDP communication hook that leaves the gradients local (no
    communication): for :class:`CompressedAdamW` under DDP, whose own
    exchange of the momentum then is the only one.

    ``ddp.register_comm_hook(None, mpigc.torch.local_gradients_hook)``. DDP
    keeps the rest of what it does (broadcasting buffers at each forward,
    ``no_sync`` accumulation, ``join``); ``param.grad`` after ``backward()``
    is this rank's own gradient, so ``clip_grad_norm_`` clips each rank's
    local gradient by its own norm (as for :class:`CompressedAdamW` without
    DDP). ``state`` is unused.
    """
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut
