"""GradientSync: bucketed, overlapped, compressed gradient averaging (its
construction, public API and state; the steps are :mod:`._sync_steps`'s, the
buckets :mod:`._buckets`', the residuals :mod:`._residuals`')."""
import contextlib

import numpy as np
import torch

from .. import _comm as _engine_comm
from .._errors import ConfigError, DTypeError, MpigcError, StateError

from ._buckets import Bucket, make_buckets  # noqa: F401 (Bucket: mpigc.torch.Bucket)
from ._common import (BUCKET_DTYPES, Rendezvous, ThresholdWatch, agreed_comm,
                      check_feedback, check_gather, check_same, describe, positive,
                      raise_everywhere, resolve_comm, resolve_timeout, resolve_warn_s,
                      check_auto_flat, simulating, torch_auto, torch_nonfinite,
                      warn_if_uncompressed)
from ._launch import broadcast_parameters
from ._residuals import Residuals
from ._sync_steps import SyncSteps
from ._state import agree_hierarchy


def _hooked_by(p):
    """The GradientSync whose hooks are on parameter ``p``, or None."""
    ref = getattr(p, "_mpigc_sync", None)  # (copies of p carry it too)
    sync = None if ref is None else ref()
    return sync if sync is not None and id(p) in sync._hooked_ids else None

class GradientSync(SyncSteps):
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
        ``"terngrad"``, ``"fp16"``, ``"bf16"``, ``"none"`` (exactly ``MPI_Allreduce``),
        or ``"auto"``: per bucket and step ``"none"`` or ``auto_op``, as the
        engine's ``op="auto"`` decides (the same on every rank; host buckets
        and ``hierarchy="flat"`` only; see docs/torch.md).
    auto_op : str, dict or Compressor, optional
        With ``op="auto"``: the compressor it may choose (default ``"2bit"``,
        the relative mode); ``**params`` are its parameters.
    auto_pin : {"model", "none", "compressed"}, optional
        With ``op="auto"``: pins the decision (the engine still measures);
        default ``$MPIGC_AUTO_PIN`` (read at construction) or ``"model"``.
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
        seconds (default 60; 0: never), and again every 5 times that. A
        collective method on some ranks while the others wait in a step (or
        another method) is a :class:`mpigc.MismatchError` on every rank at
        once instead (docs/torch.md, "Waits for the other ranks").
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
                 hierarchy="flat", auto_op=None, auto_pin=None, **params):
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
            named, settings = self._check_arguments(module, op, bucket_mb, gather, nonfinite,
                                                    timeout, feedback, hierarchy, params,
                                                    auto_op, auto_pin)
        except (MpigcError, TypeError, ValueError) as e:
            exc = e
        # this object's own small collectives, once the ranks agreed
        self._comm = agreed_comm(self.comm, exc, settings, "GradientSync")
        _engine_comm.resolve(self.comm)  # the engine's duplicate, now rather than in a hook
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
        self.buckets = make_buckets(named, float(bucket_mb), self.device_buckets)
        # all buckets under $MPIGC_MIN_COMPRESS_BYTES: nothing would be compressed
        # (op="auto" runs such calls as "none" by design)
        if self.auto_pin is None:
            warn_if_uncompressed("GradientSync", self.compressor,
                                 [b.tensor for b in self.buckets])
        self._init_steps()

    def _check_arguments(self, module, op, bucket_mb, gather, nonfinite, timeout, feedback,
                         hierarchy, params, auto_op=None, auto_pin=None):
        """The constructor's checks, before its first collective (which
        agrees on them): ``(named parameters, settings)``."""
        #: ``op="auto"``: the pin (``"model"``, ``"none"``, ``"compressed"``);
        #: else None. :attr:`compressor` is then ``auto_op``'s.
        self.auto_pin = None
        self.compressor, self.auto_pin = torch_auto(op, auto_op, auto_pin, params)
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
        if self.auto_pin is not None:
            check_auto_flat(hierarchy, self.device_buckets and (simulating() or any(
                p.is_cuda for _, p in named if p.requires_grad)) and
                "parameters on a GPU need device_buckets=False (host buckets)",
                "GradientSync")
        config = self.compressor.get_config()
        return named, {"op": "auto" if self.auto_pin else config,
                       "auto_op": config if self.auto_pin else None,
                       "auto_pin": self.auto_pin, "bucket_mb": float(bucket_mb),
                       "average": self.average, "gather": gather,
                       "nonfinite": self.nonfinite,
                       "find_unused_parameters": self.find_unused_parameters,
                       "hierarchy": str(hierarchy)}

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
        self._complete_step()
        self.steps += 1

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
        self._shadow_steps()
        counts = self._comm.allgather(self.steps - start)
        root = int(np.argmax(counts))
        if max(counts) > min(counts):
            broadcast_parameters(list(zip(self.names, self._params)), root=root,
                                 comm=self.comm)

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

    def load_checkpoint(self, path, strict=True, step=None):
        """Load residuals saved by :meth:`save_checkpoint` (collective), on any
        world size and bucketing; returns :func:`mpigc.load_checkpoint`'s info.
        ``step``: :class:`mpigc.MismatchError` on every rank, nothing loaded,
        unless the checkpoint was saved with this ``step``."""
        self._arrive(self.timeout, "GradientSync.load_checkpoint")
        return self._residuals.load_checkpoint(
            path, lambda state: self.load_state_dict(state, strict=strict), step=step)

    def __repr__(self):
        op = f"'auto', auto_op={self.compressor!r}" if self.auto_pin else repr(self.compressor)
        return (f"GradientSync(op={op}, params={len(self.names)}, "
                f"buckets={len(self.buckets)}, ranks={self.size})")
