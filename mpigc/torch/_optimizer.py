"""DistributedOptimizer: an optimizer whose gradients GradientSync averages."""
import contextlib

import torch

from .._errors import ConfigError, NonFiniteError, StateError

from ._sync import GradientSync


class DistributedOptimizer:
    """The wrapped optimizer, whose ``step()`` applies gradients averaged over
    the ranks (Horovod's ``hvd.DistributedOptimizer``).

    ``DistributedOptimizer(opt, model, op="2bit")`` returns an instance of a
    subclass of ``type(opt)`` (and of this class) created for it, so it is a
    ``torch.optim.Optimizer`` to learning-rate schedulers, ``GradScaler`` and
    ``isinstance``. It holds no optimizer state of its own: ``param_groups``,
    ``state``, ``defaults``, hooks and every other attribute are read from and
    written to the wrapped ``opt`` (:attr:`optimizer`), whose ``step()`` does
    the update. Its :class:`GradientSync` (:attr:`sync`) completes the
    synchronisation at the end of every ``backward()``, as DDP does
    (``sync_on_backward=True``), so clipping, ``GradScaler`` (unscale, step,
    update) and anything else that reads ``param.grad`` after ``backward()``
    see the averaged gradients.

    Parameters
    ----------
    optimizer : torch.optim.Optimizer
    module : torch.nn.Module, optional
        The model; a :class:`GradientSync` is built for it with ``**kwargs``
        (``op``, ``bucket_mb``, ``nonfinite``, ...).
    sync : GradientSync, optional
        Use an existing one instead (its ``sync_on_backward`` is turned on).

    Notes
    -----
    ``step()`` raises :class:`mpigc.NonFiniteError` on every rank when the
    step's gradients were non-finite on some rank (``nonfinite="skip"``, the
    default): without a loss scaler the update would write NaN into the
    parameters. ``GradScaler.step`` does not call ``step()`` for such steps.
    Horovod's ``synchronize()`` and ``skip_synchronize()`` are supported;
    Horovod's keywords (``named_parameters=``, ``compression=``,
    ``backward_passes_per_step=``, ``op=hvd.Average``, ...) are a
    :class:`mpigc.ConfigError` on every rank that names the mpigc way.
    """

    _subclasses = {}

    def __new__(cls, optimizer, module=None, *, sync=None, **kwargs):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer: expected a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
        if isinstance(optimizer, DistributedOptimizer):
            raise ConfigError("optimizer: already a DistributedOptimizer")
        base = type(optimizer)
        sub = DistributedOptimizer._subclasses.get(base)
        if sub is None:
            sub = type(f"Distributed{base.__name__}", (DistributedOptimizer, base),
                       {"__module__": __name__, "__doc__": DistributedOptimizer.__doc__})
            DistributedOptimizer._subclasses[base] = sub
        return object.__new__(sub)

    def __init__(self, optimizer, module=None, *, sync=None, **kwargs):
        if module is not None and sync is not None:
            raise ConfigError("DistributedOptimizer: pass either a module or sync=, not both")
        if sync is None:
            # GradientSync checks the arguments, a missing module and Horovod's
            # keywords (named_parameters=, compression=, ...) included, and
            # agrees on them before anything can block: raised on every rank
            kwargs.setdefault("sync_on_backward", True)
            sync = GradientSync(module, **kwargs)
        elif kwargs:
            raise ConfigError(f"DistributedOptimizer: with sync=, no other options "
                              f"(got {sorted(kwargs)})")
        else:
            sync.sync_on_backward = True
        object.__setattr__(self, "_mpigc_optimizer", optimizer)
        object.__setattr__(self, "_mpigc_sync", sync)
        object.__setattr__(self, "_mpigc_skip", 0)

    # -- the wrapped optimizer's attributes are this object's --------------------
    _OWN = ("step",)  # set here by LR schedulers (they wrap this object's step)

    def __getattr__(self, name):
        if name.startswith("_mpigc_"):
            raise AttributeError(name)
        return getattr(object.__getattribute__(self, "_mpigc_optimizer"), name)

    def __setattr__(self, name, value):
        if name.startswith("_mpigc_") or name in DistributedOptimizer._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self._mpigc_optimizer, name, value)

    def __delattr__(self, name):
        if name.startswith("_mpigc_") or name in DistributedOptimizer._OWN:
            object.__delattr__(self, name)
        else:
            delattr(self._mpigc_optimizer, name)

    @property
    def optimizer(self):
        """The wrapped optimizer (it holds the state and does the update)."""
        return self._mpigc_optimizer

    @property
    def sync(self):
        """The :class:`GradientSync` of the model."""
        return self._mpigc_sync

    def state_dict(self):
        return self._mpigc_optimizer.state_dict()

    def load_state_dict(self, state_dict):
        return self._mpigc_optimizer.load_state_dict(state_dict)

    def __getstate__(self):
        raise TypeError("a DistributedOptimizer is not picklable: save "
                        "opt.state_dict() and sync.state_dict() instead")

    # -- Horovod's API ---------------------------------------------------------
    def synchronize(self):
        """Complete the pending synchronisation now (collective): the averaged
        gradients are in ``param.grad`` (a no-op when ``backward()`` completed
        it already)."""
        self._mpigc_sync.wait()

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Horovod's recipe for changing the averaged gradients before the
        step: ``opt.synchronize()``, clip or unscale, then ``step()`` inside
        this block, which then applies ``param.grad`` as it is. A step
        inside it while a synchronisation is pending completes it and raises
        :class:`mpigc.StateError` (on every rank): call ``synchronize()``
        first."""
        self._mpigc_skip += 1
        try:
            yield
        finally:
            self._mpigc_skip -= 1

    def join(self):
        """:meth:`GradientSync.join` of :attr:`sync` (uneven inputs)."""
        return self._mpigc_sync.join()

    def step(self, closure=None):
        sync = self._mpigc_sync
        if self._mpigc_skip and sync._dirty:
            sync.wait()  # the peers are in it too: complete it, then say why not
            raise StateError("step() inside skip_synchronize() while this step's "
                             "gradients were not synchronised: call opt.synchronize() "
                             "before changing the gradients and stepping")
        sync.wait()
        if not sync.last_step_finite:
            raise NonFiniteError(
                "the gradients of this step are NaN/Inf (non-finite on some rank; the "
                "residuals are unchanged). With a torch.amp.GradScaler, call "
                "scaler.step(opt), which skips such steps; nonfinite='raise' raises "
                "in backward() instead")
        opt = self._mpigc_optimizer
        return opt.step() if closure is None else opt.step(closure)

    def __repr__(self):
        return f"DistributedOptimizer({self._mpigc_optimizer!r}, {self._mpigc_sync!r})"
