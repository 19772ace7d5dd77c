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
"""
import warnings
import zlib

import torch

from ..allreduce import allreduce
from .._errors import ConfigError, InvalidBufferError, MismatchError, MpigcError
from ..feedback import ErrorFeedback
from ._common import agree_construction, torch_compressor

__all__ = ["CompressedAdamW", "local_gradients_hook"]


class CompressedAdamW(torch.optim.Optimizer):
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
                 nonfinite="skip", **op_params):
        from mpi4py import MPI

        self.comm = MPI.COMM_WORLD if comm is None else comm
        # every argument is checked before the first collective, and the
        # checks are agreed on there (a rank that raised alone would leave the
        # others waiting in it)
        exc, settings, ps = None, None, []
        try:
            if not isinstance(self.comm, MPI.Intracomm):
                raise ConfigError(f"comm: expected an mpi4py Intracomm, got "
                                  f"{type(self.comm).__name__}")
            if (lr < 0 or eps < 0 or weight_decay < 0
                    or not all(0 <= b < 1 for b in betas)):
                raise ConfigError(f"CompressedAdamW: invalid lr={lr}, betas={betas}, "
                                  f"eps={eps} or weight_decay={weight_decay}")
            if int(freeze_steps) != freeze_steps or freeze_steps < 1:
                raise ConfigError("freeze_steps must be an integer >= 1 (the variance to "
                                  "freeze comes from the exact warm-up), got "
                                  f"{freeze_steps!r}")
            if nonfinite not in ("skip", "raise"):
                raise ConfigError(f"nonfinite must be 'skip' or 'raise', got {nonfinite!r}")
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
            settings = {"op": self.compressor.get_config(), "freeze_steps": int(freeze_steps),
                        "key": str(key), "gather": gather, "nonfinite": nonfinite,
                        "groups": [{k: (list(v) if isinstance(v, tuple) else v)
                                    for k, v in g.items() if k != "params"}
                                   for g in self.param_groups]}
        except (MpigcError, TypeError, ValueError) as e:
            exc = e
        if not isinstance(self.comm, MPI.Intracomm):
            raise exc  # no communicator to tell the others on
        self._comm = self.comm.Dup()  # this optimizer's own small collectives
        agree_construction(self._comm, exc, settings, "CompressedAdamW")
        self.freeze_steps = int(freeze_steps)
        self.key = str(key)
        self.gather = gather
        self.nonfinite = nonfinite
        self.feedback = ErrorFeedback()
        #: steps skipped because exchanged values were not finite
        self.skipped_steps = 0
        self._steps = 0
        self._check_same([(tuple(p.shape), str(p.dtype)) for p in ps], "the parameters")
        n = sum(p.numel() for p in ps)
        dev, dt = ps[0].device, ps[0].dtype
        self._flat_g = torch.zeros(n, dtype=dt, device=dev)   # exchanged buffer
        self._m = torch.zeros(n, dtype=dt, device=dev)
        self._v = torch.zeros(n, dtype=dt, device=dev)
        self._slices, off = [], 0
        for g in self.param_groups:
            lo = off
            for p in g["params"]:
                off += p.numel()
            self._slices.append((lo, off))

    # -- helpers -----------------------------------------------------------------
    def _check_same(self, items, what):
        mine = zlib.crc32(repr(items).encode())
        if len(set(self._comm.allgather(mine))) > 1:
            raise MismatchError(f"CompressedAdamW: the ranks disagree on {what}")

    def _wire(self, t):
        return t.numpy() if t.device.type == "cpu" else t

    def _exchange(self, op, **kw):
        """Average the exchanged buffer over the ranks; True if the result is
        finite (the same answer on every rank: the result is the same)."""
        allreduce(self._wire(self._flat_g), op, comm=self.comm, average=True,
                  gather=self.gather, nonfinite=self.nonfinite, **kw)
        return bool(torch.isfinite(self._flat_g).all())

    @property
    def frozen(self):
        """True once the variance is frozen and the momentum is compressed."""
        return self._steps >= self.freeze_steps

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
            # exact warm-up: plain AdamW on the averaged gradient
            if not self._exchange("none"):
                return self._skip(loss)
            for group, (lo, hi) in zip(self.param_groups, self._slices):
                b1, b2 = group["betas"]
                # no fused multiply-adds (alpha=, addcmul): every element is rounded
                # as the documented formula says, on every device and in numpy
                self._m[lo:hi].mul_(b1).add_(g[lo:hi] * (1 - b1))
                self._v[lo:hi].mul_(b2).add_(g[lo:hi] * g[lo:hi] * (1 - b2))
            self._apply(lambda b1, b2: (1 - b1 ** t, 1 - b2 ** t))
        else:
            # compressed momentum, frozen variance
            for group, (lo, hi) in zip(self.param_groups, self._slices):
                b1 = group["betas"][0]
                g[lo:hi].mul_(1 - b1).add_(self._m[lo:hi] * b1)
            if not self._exchange(self.compressor, key=self.key, feedback=self.feedback):
                return self._skip(loss)
            self._m.copy_(g)
            tf = self.freeze_steps
            self._apply(lambda b1, b2: (1 - b1 ** t, 1 - b2 ** tf))
        self._steps = t
        return loss

    def _skip(self, loss):
        self.skipped_steps += 1
        return loss

    def _apply(self, corrections):
        off = 0
        for group, (lo, hi) in zip(self.param_groups, self._slices):
            b1, b2 = group["betas"]
            c1, c2 = corrections(b1, b2)
            lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
            denom = self._v[lo:hi].div(c2).sqrt_().add_(eps)
            upd = self._m[lo:hi].div(denom).mul_(lr / c1)
            for p in group["params"]:
                k = p.numel()
                if wd:
                    p.mul_(1 - lr * wd)
                p.sub_(upd[off - lo:off - lo + k].view_as(p))
                off += k

    # -- state ----------------------------------------------------------------
    def state_dict(self):
        sd = super().state_dict()
        sd["mpigc"] = {"steps": self._steps, "freeze_steps": self.freeze_steps,
                       "skipped_steps": self.skipped_steps,
                       "exp_avg": self._m.clone(), "exp_avg_sq": self._v.clone()}
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
        saved_freeze = int(own["freeze_steps"])
        if int(own["steps"]) >= saved_freeze and saved_freeze != self.freeze_steps:
            # the variance was frozen at that step: no other value is right now
            warnings.warn(f"CompressedAdamW: the state was frozen after {saved_freeze} "
                          f"steps; keeping that instead of freeze_steps={self.freeze_steps}",
                          stacklevel=2)
            self.freeze_steps = saved_freeze
        self._steps = int(own["steps"])
        self.skipped_steps = int(own["skipped_steps"])
        self._m.copy_(own["exp_avg"])
        self._v.copy_(own["exp_avg_sq"])

    def save_checkpoint(self, path, step=None):
        """The residuals of the compressed exchange, with
        :func:`mpigc.save_checkpoint` (collective; any world size on load)."""
        import mpigc
        return mpigc.save_checkpoint(path, self.feedback, comm=self.comm, step=step)

    def load_checkpoint(self, path):
        import mpigc
        return mpigc.load_checkpoint(path, self.feedback, comm=self.comm)

    def __repr__(self):
        return (f"CompressedAdamW(op={self.compressor!r}, freeze_steps={self.freeze_steps}, "
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
