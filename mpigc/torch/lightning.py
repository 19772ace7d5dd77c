"""PyTorch Lightning: mpigc's DDP communication hook as a callback, its
residuals saved in Lightning's checkpoints.

``DDPStrategy(ddp_comm_hook=..., ddp_comm_state=...)`` registers the hook only
when the root device is CUDA (Lightning 2.x): on CPU it is silently skipped.
:class:`MpigcCommHook` registers :func:`mpigc.torch.comm_hook` itself, on
whatever device, and keeps the residuals in the ``.ckpt`` files that
Lightning writes (``ModelCheckpoint``, ``trainer.save_checkpoint``) and reads
(``trainer.fit(ckpt_path=...)``)::

    import lightning as L
    from mpigc.torch.lightning import MpigcCommHook

    trainer = L.Trainer(strategy="ddp", accelerator="cpu",
                        devices=ranks_per_node, num_nodes=nodes,
                        callbacks=[MpigcCommHook(op="2bit", rel_threshold=1.5)])
    trainer.fit(model, loader)             # mpirun -n 8 python train.py

For Lightning's FSDP2 strategy (``ModelParallelStrategy``),
:class:`MpigcFsdpHooks` registers :func:`mpigc.torch.register_fsdp_hooks`
after ``configure_model`` and keeps their residuals in its checkpoints.

Importing this module imports Lightning (``pip install 'mpigc[lightning]'``);
``import mpigc.torch`` does not. See ``docs/torch.md``, "PyTorch Lightning".
"""
import sys
import warnings


try:
    from lightning.pytorch import Callback
except ImportError as _exc:
    try:  # the standalone package of the same code
        from pytorch_lightning import Callback
    except ImportError:
        raise ImportError("mpigc.torch.lightning needs PyTorch Lightning: pip install "
                          f"'mpigc[lightning]' ({_exc})") from _exc

from .. import _comm as _engine_comm
from .._errors import ConfigError, DTypeError, MismatchError, MpigcError, StateError
from ..checkpoint import CheckpointError
from ..compressors import get_compressor
from ._common import resolve_comm
from ._fsdp import register_fsdp_hooks
from ._hook import CommHookState, comm_hook
from ._record import gather_record, state_for_rank

__all__ = ["MpigcCommHook", "MpigcFsdpHooks", "CHECKPOINT_KEY"]

#: The key of Lightning's checkpoint dict that holds the residuals.
CHECKPOINT_KEY = "mpigc"
_CLASSES = {c.__name__: c for c in (CheckpointError, ConfigError, DTypeError, MismatchError,
                                     MpigcError, StateError)}


def _ddp_strategy_types():
    """Lightning's DDPStrategy, from each of its two packages that is loaded
    (``lightning.pytorch`` and ``pytorch_lightning`` define distinct classes)."""
    out = []
    for pkg in ("lightning.pytorch", "pytorch_lightning"):
        if pkg in sys.modules:
            out.append(sys.modules[pkg].strategies.DDPStrategy)
    return tuple(out)


class MpigcCommHook(Callback):
    """A Lightning callback that trains a ``DDPStrategy`` model through
    :func:`mpigc.torch.comm_hook`, on CPU or GPU, and keeps the residuals in
    Lightning's checkpoints.

    At ``on_fit_start`` (every rank, after Lightning has wrapped the model in
    ``DistributedDataParallel``) it builds a :class:`CommHookState` for the
    wrapped model and registers the hook; so ``DDPStrategy`` must be given no
    ``ddp_comm_hook`` of its own. Each checkpoint Lightning writes holds every
    rank's residuals under ``checkpoint["mpigc"]`` (gathered to the rank that
    writes the file); ``trainer.fit(ckpt_path=...)`` gives each rank its own
    back, on the world size they were saved with (then the run continues bit
    for bit) or on any other (resharded as :func:`mpigc.load_checkpoint` does:
    worker residuals summed, owner shards re-split).

    Parameters
    ----------
    op : str or Compressor
        As for :class:`CommHookState` (``"2bit"``, ``"1bit"``, ``"none"``, ...).
    comm : mpi4py.MPI.Intracomm, optional
        The ranks of the DDP job, in the order of Lightning's global ranks
        (default ``MPI.COMM_WORLD``); the callback talks on a private
        duplicate.
    strict : bool
        Loading a checkpoint: residuals saved with another compressor config,
        or for parameter names the model does not have (or without those it
        has), raise on every rank (default). ``False``: those parameters start
        with no residuals, with a warning.
    **kwargs
        Passed to :class:`CommHookState`: ``average``, ``gather``,
        ``nonfinite``, ``feedback``, ``hierarchy``, ``timeout`` and the
        compressor's parameters (``rel_threshold=1.5``, ``threshold=0.5``).

    Attributes
    ----------
    state : CommHookState or None
        The hook's state in the current (or last) ``fit``.

    Raises
    ------
    mpigc.ConfigError
        From ``trainer.fit``, on every rank: the strategy is not a
        ``DDPStrategy``, it has a ``ddp_comm_hook`` of its own, or ``comm``
        does not hold the trainer's ranks.

    Notes
    -----
    A checkpoint grows by every rank's residuals: about ``world_size + 1``
    times the trainable parameters' size (float32), all of it gathered in the
    memory of the rank that writes the file. Lightning loads a checkpoint
    whole on every rank, so every rank reads all of them when it resumes.
    Resuming from a checkpoint without residuals (written without this
    callback, or by ``save_checkpoint(..., weights_only=True)``) warns, and
    the residuals start from zero.

    Examples
    --------
    >>> trainer = L.Trainer(strategy="ddp", accelerator="cpu", devices=4,
    ...                     callbacks=[MpigcCommHook(op="2bit", rel_threshold=1.5)],
    ...                     max_epochs=10)                      # doctest: +SKIP
    >>> trainer.fit(model, loader, ckpt_path="last")             # doctest: +SKIP
    """

    def __init__(self, op="2bit", *, comm=None, strict=True, **kwargs):
        self.op = op
        self.comm = resolve_comm(comm)
        self.strict = bool(strict)
        self.kwargs = dict(kwargs)
        self.state = None
        self._comm = None     # private duplicate of comm, made at the first fit
        self._root = None     # the rank of _comm that writes Lightning's checkpoints
        self._loaded = None   # checkpoint["mpigc"] read by on_load_checkpoint

    def __repr__(self):
        params = "".join(f", {k}={v!r}" for k, v in sorted(self.kwargs.items()))
        return f"MpigcCommHook(op={self.op!r}{params})"

    # -- Lightning hooks -----------------------------------------------------------
    def setup(self, trainer, pl_module, stage):
        self._loaded = None
        if stage != "fit":
            return
        strategy = trainer.strategy
        kinds = _ddp_strategy_types()
        if not isinstance(strategy, kinds):
            raise ConfigError(
                f"MpigcCommHook: expected a DDPStrategy (Trainer(strategy='ddp')), got "
                f"{type(strategy).__name__}; the hook replaces DDP's allreduce, so it needs "
                "DDP (also on one process: strategy='ddp', devices=1)")
        if getattr(strategy, "_ddp_comm_hook", None) is not None:
            raise ConfigError(
                "MpigcCommHook: the DDPStrategy has a ddp_comm_hook of its own; DDP takes "
                "one hook: give DDPStrategy no ddp_comm_hook/ddp_comm_state (Lightning "
                "registers those on CUDA only), MpigcCommHook registers mpigc's on any "
                "device")

    def on_load_checkpoint(self, trainer, pl_module, checkpoint):
        # before on_fit_start: kept until the hook's state exists
        self._loaded = checkpoint.get(CHECKPOINT_KEY)

    def on_fit_start(self, trainer, pl_module):
        from torch.nn.parallel import DistributedDataParallel
        ddp = trainer.strategy.model
        if not isinstance(ddp, DistributedDataParallel):
            raise ConfigError(f"MpigcCommHook: expected the model wrapped in "
                              f"DistributedDataParallel at on_fit_start, got "
                              f"{type(ddp).__name__}")
        if self.comm.size != trainer.world_size:
            raise ConfigError(
                f"MpigcCommHook: comm has {self.comm.size} rank(s), the trainer "
                f"{trainer.world_size}: run one process per rank of an MPI job (mpirun, "
                "srun; not strategy='ddp_spawn'), with comm holding all of them")
        if self._comm is None:
            self._comm = self.comm.Dup()
        roots = self._comm.allgather(bool(trainer.is_global_zero))
        if roots.count(True) != 1:
            raise ConfigError(f"MpigcCommHook: expected Lightning's global rank 0 once "
                              f"among the ranks of comm, found it {roots.count(True)} times")
        self._root = roots.index(True)
        previous, self.state = self.state, None
        state = CommHookState(ddp, op=self.op, comm=self.comm, **self.kwargs)
        ddp.register_comm_hook(state, comm_hook)
        self.state = state
        record, self._loaded = self._loaded, None
        if record is not None:
            self._load(record)
        elif trainer.ckpt_path:
            if self._comm.rank == self._root:
                warnings.warn(f"MpigcCommHook: the checkpoint {trainer.ckpt_path} holds no "
                              "mpigc residuals (written without MpigcCommHook, or with "
                              "weights_only=True): they start from zero", RuntimeWarning,
                              stacklevel=2)
        elif previous is not None:
            # a second fit with this callback goes on with the first one's residuals
            state.load_state_dict(previous.state_dict(), strict=self.strict)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        if self.state is None:  # no fit has started: no residuals yet
            return
        record = self.gather_residuals()
        if record is not None:
            checkpoint[CHECKPOINT_KEY] = record

    # -- the residuals in the checkpoint -------------------------------------------
    def gather_residuals(self):
        """Every rank's residuals, on the rank that writes Lightning's
        checkpoints (collective); ``None`` on the others.

        Returns
        -------
        dict or None
            A residual record (``mpigc/torch/_record.py``: every rank's
            :meth:`CommHookState.state_dict`, its arrays as CPU tensors, which
            Lightning's ``torch.load(weights_only=True)`` reads, and the
            world size).
        """
        return gather_record(self._comm, self.state.state_dict(), root=self._root)

    def _load(self, record):
        """This rank's residuals from ``record`` into :attr:`state` (collective)."""
        exc, state = None, {}
        try:
            state = state_for_rank(record, self._comm.size, self._comm.rank)
            want = self.state.compressor.get_config()
            bad = {}
            for name, s in state.items():
                saved = get_compressor(dict(s["config"])).get_config()
                if name in self.state.names and saved != want:
                    bad[name] = saved
            if bad and self.strict:
                name = sorted(bad)[0]
                raise MismatchError(
                    f"the checkpoint's residuals were made with another "
                    f"compressor config for {len(bad)} parameter(s): {name!r} saved "
                    f"{bad[name]}, in use {want} (strict=False starts those from zero)")
            for name in bad:
                del state[name]
            if bad and self._comm.rank == self._root:
                warnings.warn(f"MpigcCommHook: {len(bad)} parameter(s) start from zero "
                              "residuals: saved with another compressor config",
                              RuntimeWarning, stacklevel=3)
        except (MpigcError, KeyError, TypeError, ValueError) as e:
            exc = e if isinstance(e, MpigcError) else CheckpointError(
                f"checkpoint[{CHECKPOINT_KEY!r}] is not readable: "
                f"{type(e).__name__}: {e}")
        _engine_comm.agree(self._comm, exc, "MpigcCommHook (loading the residuals)",
                           classes=_CLASSES, default=StateError)
        self.state.load_state_dict(state, strict=self.strict)


#: :func:`mpigc.torch._record.state_for_rank`, under the name the tests and
#: earlier docs use
residuals_for_rank = state_for_rank


def _model_parallel_types():
    """Lightning's ModelParallelStrategy (FSDP2), from each loaded package."""
    out = []
    for pkg in ("lightning.pytorch", "pytorch_lightning"):
        mod = sys.modules.get(pkg)
        if mod is not None and hasattr(mod.strategies, "ModelParallelStrategy"):
            out.append(mod.strategies.ModelParallelStrategy)
    return tuple(out)


class MpigcFsdpHooks(Callback):
    """A Lightning callback for ``ModelParallelStrategy`` (FSDP2): at
    ``on_fit_start`` (after ``configure_model`` has called ``fully_shard``)
    it runs :func:`mpigc.torch.register_fsdp_hooks` on the LightningModule,
    so every FSDP module's gradient reduce-scatter is mpigc's compressed one
    over MPI; the residuals travel in Lightning's checkpoints.

    Lightning's FSDP2 strategy saves the model and optimizer with
    ``torch.distributed.checkpoint`` but the rest of the checkpoint dict (the
    callbacks' part) as one file written by global rank 0: so each rank's
    residual rows are gathered there, ``checkpoint["mpigc"]`` (the
    :meth:`FsdpHookState.state_dict` record and the rows, ``world_size x
    row`` CPU tensors), and on ``fit(ckpt_path=...)`` each rank takes back its
    own (the same world size: bit for bit) or, on another, the rows
    ``torch.distributed.checkpoint`` would give it (resharded as
    :meth:`FsdpHookState.load_state_dict` does).

    Parameters
    ----------
    op, **kwargs
        As for :func:`mpigc.torch.register_fsdp_hooks` (``threshold=``,
        ``rel_threshold=``, ``nonfinite=``, ``timeout=``, ...).
    comm : mpi4py.MPI.Intracomm, optional
        The trainer's ranks in Lightning's order (default ``MPI.COMM_WORLD``).

    Attributes
    ----------
    state : FsdpHookState or None
        The hooks of the current (or last) ``fit``.
    """

    def __init__(self, op="2bit", *, comm=None, **kwargs):
        self.op, self.comm, self.kwargs = op, resolve_comm(comm), dict(kwargs)
        self.state = None
        self._comm = self._root = self._loaded = None
        self._fitting = False

    def __repr__(self):
        params = "".join(f", {k}={v!r}" for k, v in sorted(self.kwargs.items()))
        return f"MpigcFsdpHooks(op={self.op!r}{params})"

    def setup(self, trainer, pl_module, stage):
        self._loaded = None
        if stage == "fit" and not isinstance(trainer.strategy, _model_parallel_types()):
            raise ConfigError(
                f"MpigcFsdpHooks: expected Lightning's FSDP2 strategy "
                f"(ModelParallelStrategy(data_parallel_size=..., tensor_parallel_size=1)), "
                f"got {type(trainer.strategy).__name__}; for DDP use MpigcCommHook")

    def on_load_checkpoint(self, trainer, pl_module, checkpoint):
        # ModelParallelStrategy restores after on_fit_start (its
        # restore_checkpoint_after_setup): the hooks exist already
        record = checkpoint.get(CHECKPOINT_KEY)
        if self.state is not None and self._fitting:
            if record is not None:
                self._load(record)
        else:
            self._loaded = record

    def on_fit_end(self, trainer, pl_module):
        self._fitting = False

    def on_fit_start(self, trainer, pl_module):
        self._fitting = True
        if self.comm.size != trainer.world_size:
            raise ConfigError(f"MpigcFsdpHooks: comm has {self.comm.size} rank(s), the "
                              f"trainer {trainer.world_size}: one process per MPI rank")
        if self._comm is None:
            self._comm = self.comm.Dup()
        self._root = self._comm.allgather(bool(trainer.is_global_zero)).index(True)
        self.state = register_fsdp_hooks(pl_module, self.op, comm=self.comm, **self.kwargs)
        record, self._loaded = self._loaded, None
        if record is not None:
            self._load(record)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        import torch
        if self.state is None:
            return
        sd = self.state.state_dict()
        rows = {k: v.to_local().detach().reshape(-1).clone() for k, v in sd["rows"].items()}
        every = self._comm.gather(rows, root=self._root)
        if every is not None:
            checkpoint[CHECKPOINT_KEY] = {
                "format": "mpigc.torch.lightning.fsdp", "version": 1, "record": sd["meta"],
                "rows": {k: torch.stack([r[k] for r in every]) for k in rows}}

    def _load(self, record):
        """This rank's rows of ``record`` into :attr:`state` (collective)."""
        exc, mine = None, {}
        try:
            for key, rows in record["rows"].items():
                n_old, j, m = rows.shape[0], self._comm.rank, self._comm.size
                c = -(-n_old // m)  # as DCP's Shard(0) of n_old rows over m ranks
                lo = min(j * c, n_old)
                mine[key] = rows[lo:min(lo + c, n_old)]
            state = {"meta": record["record"], "rows": mine}
        except (KeyError, TypeError, AttributeError, IndexError) as e:
            exc = CheckpointError(f"checkpoint[{CHECKPOINT_KEY!r}] is not readable: "
                                  f"{type(e).__name__}: {e}")
            state = None
        _engine_comm.agree(self._comm, exc, "MpigcFsdpHooks (loading the residuals)",
                           classes=_CLASSES, default=StateError)
        self.state.load_state_dict(state)
