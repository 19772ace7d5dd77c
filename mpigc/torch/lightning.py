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

With :class:`mpigc.torch.CompressedAdamW` returned by ``configure_optimizers``,
:class:`MpigcCompressedAdamW` registers :func:`mpigc.torch.local_gradients_hook`
(DDP leaves the gradients local; the optimizer's exchange is the only one) and
keeps every rank's residuals and window of local steps in the checkpoints.

Importing this module imports Lightning (``pip install 'mpigc[lightning]'``);
``import mpigc.torch`` does not. See ``docs/torch.md``, "PyTorch Lightning".
"""
import sys
import warnings

from mpi4py.util import pkl5


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

__all__ = ["MpigcCommHook", "MpigcFsdpHooks", "MpigcCompressedAdamW", "CHECKPOINT_KEY",
           "ADAMW_CHECKPOINT_KEY"]

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


def _wrapped_ddp(trainer, what, comm):
    """The DDP-wrapped model of a fit that is starting, and a check that the
    job runs one process per rank of ``comm`` (the same outcome on every
    rank: both facts are the job's)."""
    from torch.nn.parallel import DistributedDataParallel
    ddp = trainer.strategy.model
    if not isinstance(ddp, DistributedDataParallel):
        raise ConfigError(f"{what}: expected the model wrapped in DistributedDataParallel "
                          f"at on_fit_start, got {type(ddp).__name__}")
    if comm.size != trainer.world_size:
        raise ConfigError(
            f"{what}: comm has {comm.size} rank(s), the trainer {trainer.world_size}: run "
            "one process per rank of an MPI job (mpirun, srun; not "
            "strategy='ddp_spawn'), with comm holding all of them")
    return ddp


def _writing_rank(comm, trainer, what):
    """The rank of ``comm`` that writes Lightning's checkpoints (collective)."""
    roots = comm.allgather(bool(trainer.is_global_zero))
    if roots.count(True) != 1:
        raise ConfigError(f"{what}: expected Lightning's global rank 0 once among the "
                          f"ranks of comm, found it {roots.count(True)} times")
    return roots.index(True)


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
        ddp = _wrapped_ddp(trainer, "MpigcCommHook", self.comm)
        if self._comm is None:
            self._comm = self.comm.Dup()
        self._root = _writing_rank(self._comm, trainer, "MpigcCommHook")
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


#: The key of Lightning's checkpoint dict that holds :class:`MpigcCompressedAdamW`'s part.
ADAMW_CHECKPOINT_KEY = "mpigc_adamw"
_ADAMW_FORMAT = "mpigc.torch.lightning.adamw"


class MpigcCompressedAdamW(Callback):
    """A Lightning callback for :class:`mpigc.torch.CompressedAdamW` under a
    ``DDPStrategy``: DDP leaves the gradients local, so the optimizer's
    exchange of the momentum is the only one, on CPU or GPU; every rank's
    residuals (and, inside a window of local steps, ``sync_every > 1``, its
    window and parameters) travel in Lightning's checkpoints.

    ``configure_optimizers`` returns the :class:`CompressedAdamW` (with any
    scheduler); the callback, on every rank:

    - at ``on_fit_start`` (the model wrapped in ``DistributedDataParallel``)
      registers :func:`mpigc.torch.local_gradients_hook` on it, as the plain
      DDP recipe does by hand (``DDPStrategy`` registers a ``ddp_comm_hook``
      on CUDA only, and without a hook DDP would average every gradient
      exactly before the optimizer exchanges its momentum: the full traffic
      on top of the compressed one);
    - at each checkpoint Lightning writes, gathers every rank's residuals
      (``opt.feedback``) and window to the rank that writes the file, under
      ``checkpoint["mpigc_adamw"]`` (Lightning itself saves rank 0's
      ``optimizer.state_dict()`` only, which holds no residuals);
    - at ``on_train_start`` of ``fit(ckpt_path=...)``, after Lightning has
      loaded rank 0's optimizer state on every rank, gives each rank its own
      back: on the same world size bit for bit; on another the residuals
      resharded as :func:`mpigc.load_checkpoint` does (a window of local
      steps cannot be: :class:`mpigc.checkpoint.CheckpointError` on every rank).

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm, optional
        The trainer's ranks in Lightning's order (default ``MPI.COMM_WORLD``);
        the callback talks on a private duplicate.

    Raises
    ------
    mpigc.ConfigError
        From ``trainer.fit``, on every rank: the strategy is not a
        ``DDPStrategy`` or has a ``ddp_comm_hook`` of its own, an
        ``MpigcCommHook`` is among the callbacks, the precision plugin has a
        ``GradScaler`` (``precision="16-mixed"``: use ``"bf16-mixed"`` or
        ``"32-true"``), no optimizer or not every one is a
        :class:`CompressedAdamW`, or ``comm`` (or an optimizer's ``comm``)
        does not hold the trainer's ranks.
    mpigc.MismatchError, mpigc.checkpoint.CheckpointError
        From ``fit(ckpt_path=...)``, on every rank: residuals saved with
        another compressor config or for another number of values, a record
        that is not readable, or a window of local steps saved on another
        world size.

    Examples
    --------
    >>> class Model(L.LightningModule):                          # doctest: +SKIP
    ...     def configure_optimizers(self):
    ...         return mpigc.torch.CompressedAdamW(self.parameters(), lr=3e-3,
    ...                                            op="1bit", freeze_steps=100)
    >>> trainer = L.Trainer(strategy="ddp", accelerator="cpu", devices=4,
    ...                     callbacks=[MpigcCompressedAdamW()])  # doctest: +SKIP
    """

    def __init__(self, *, comm=None):
        self.comm = resolve_comm(comm)
        self.optimizers = []  # [(index in trainer.optimizers, CompressedAdamW)] of this fit
        self._comm = None     # private duplicate of comm, made at the first fit
        self._root = None     # the rank of _comm that writes Lightning's checkpoints
        self._loaded = None   # checkpoint["mpigc_adamw"] read by on_load_checkpoint
        self._ckpt_path = None

    def __repr__(self):
        return "MpigcCompressedAdamW()"

    # -- Lightning hooks -----------------------------------------------------------
    def setup(self, trainer, pl_module, stage):
        self._loaded = None
        if stage != "fit":
            return
        what = "MpigcCompressedAdamW"
        strategy = trainer.strategy
        if not isinstance(strategy, _ddp_strategy_types()):
            raise ConfigError(
                f"{what}: expected a DDPStrategy (Trainer(strategy='ddp')), got "
                f"{type(strategy).__name__}; the callback makes DDP leave the gradients "
                "local, so it needs DDP (also on one process: strategy='ddp', devices=1)")
        if getattr(strategy, "_ddp_comm_hook", None) is not None:
            raise ConfigError(
                f"{what}: the DDPStrategy has a ddp_comm_hook of its own; DDP takes one "
                "hook, and CompressedAdamW needs local_gradients_hook, which this "
                "callback registers: give DDPStrategy no ddp_comm_hook")
        if any(isinstance(c, MpigcCommHook) for c in trainer.callbacks):
            raise ConfigError(
                f"{what}: MpigcCommHook is among the callbacks; DDP takes one hook: "
                "compress the gradients (MpigcCommHook, any optimizer) or the AdamW "
                "momentum (CompressedAdamW with MpigcCompressedAdamW), not both")
        if getattr(trainer.precision_plugin, "scaler", None) is not None:
            raise ConfigError(
                f"{what}: the precision plugin ({type(trainer.precision_plugin).__name__}) "
                "has a GradScaler (precision='16-mixed'), which CompressedAdamW refuses "
                "(a per-rank skip decision would let the ranks diverge): use "
                "precision='bf16-mixed' or '32-true'")

    def on_load_checkpoint(self, trainer, pl_module, checkpoint):
        # before on_fit_start; the optimizers' states are loaded after it
        self._loaded = checkpoint.get(ADAMW_CHECKPOINT_KEY)

    def on_fit_start(self, trainer, pl_module):
        from ._adam import CompressedAdamW, local_gradients_hook
        what = "MpigcCompressedAdamW"
        ddp = _wrapped_ddp(trainer, what, self.comm)
        opts = list(trainer.optimizers)
        if not opts or not all(isinstance(o, CompressedAdamW) for o in opts):
            kinds = ", ".join(type(o).__name__ for o in opts) or "none"
            raise ConfigError(
                f"{what}: expected configure_optimizers to return CompressedAdamW "
                f"optimizer(s) only, got {kinds}; the gradients stay local, so any other "
                "optimizer would step on this rank's gradient alone")
        for i, o in enumerate(opts):
            if o.comm.size != trainer.world_size:
                raise ConfigError(f"{what}: optimizer {i}'s comm has {o.comm.size} "
                                  f"rank(s), the trainer {trainer.world_size}")
        if self._comm is None:
            self._comm = self.comm.Dup()
        self._root = _writing_rank(self._comm, trainer, what)
        ddp.register_comm_hook(None, local_gradients_hook)
        self.optimizers = list(enumerate(opts))
        self._ckpt_path = trainer.ckpt_path

    def on_train_start(self, trainer, pl_module):
        # after Lightning's restore_training_state: rank 0's optimizer state is
        # on every rank; each rank's own residuals and window go in place of it
        record, self._loaded = self._loaded, None
        path, self._ckpt_path = self._ckpt_path, None
        if record is not None:
            self._load(record, pl_module)
        elif path and self._comm.rank == self._root:
            warnings.warn(f"MpigcCompressedAdamW: the checkpoint {path} holds no "
                          "CompressedAdamW residuals (written without "
                          "MpigcCompressedAdamW, or with weights_only=True): they start "
                          "from zero", RuntimeWarning, stacklevel=2)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        if not self.optimizers:  # no fit has started
            return
        record = self.gather_state()
        if record is not None:
            checkpoint[ADAMW_CHECKPOINT_KEY] = record

    # -- every rank's state in the checkpoint ----------------------------------------
    def gather_state(self):
        """Every rank's residuals and window of each CompressedAdamW, on the rank
        that writes Lightning's checkpoints (collective); ``None`` on the others.

        Returns
        -------
        dict or None
            ``{"format": "mpigc.torch.lightning.adamw", "version": 1,
            "world_size": N, "optimizers": {index: {"key", "residuals",
            "windows", "params"}}}``: ``residuals`` a residual record
            (``mpigc/torch/_record.py``) of the optimizer's store; ``windows``
            and ``params`` every rank's open window
            (``state_dict()["mpigc"]["window"]``) and flat parameters, or
            ``None`` between windows. CPU tensors only (Lightning's
            ``torch.load(weights_only=True)`` reads them).
        """
        import torch
        out = {}
        for i, opt in self.optimizers:
            residuals = gather_record(self._comm, opt.feedback.state_dict(), root=self._root)
            window = opt.state_dict()["mpigc"]["window"]
            mine = (None, None)
            if window is not None:
                flat = torch.cat([p.detach().reshape(-1) for g in opt.param_groups
                                  for p in g["params"]]).cpu()
                mine = ({k: (v.detach().cpu().clone() if torch.is_tensor(v) else v)
                         for k, v in window.items()}, flat)
            every = pkl5.Intracomm(self._comm).gather(mine, root=self._root)
            if every is not None:
                out[i] = {"key": opt.key, "residuals": residuals,
                          "windows": [w for w, _ in every], "params": [p for _, p in every]}
        if self._comm.rank != self._root:
            return None
        return {"format": _ADAMW_FORMAT, "version": 1, "world_size": self._comm.size,
                "optimizers": out}

    def _load(self, record, pl_module):
        """This rank's residuals and window from ``record`` (collective)."""
        import torch
        exc, plans = None, []
        size, rank = self._comm.size, self._comm.rank
        try:
            if not isinstance(record, dict) or record.get("format") != _ADAMW_FORMAT:
                raise CheckpointError(f"checkpoint[{ADAMW_CHECKPOINT_KEY!r}]: expected "
                                      f"format {_ADAMW_FORMAT!r}, got {_describe(record)}")
            if record.get("version") != 1:
                raise CheckpointError(f"checkpoint[{ADAMW_CHECKPOINT_KEY!r}]: expected "
                                      f"version 1, got {record.get('version')!r}")
            saved = record["optimizers"]
            if sorted(saved) != [i for i, _ in self.optimizers]:
                raise CheckpointError(
                    f"the checkpoint holds CompressedAdamW state for optimizer(s) "
                    f"{sorted(saved)}, the trainer has {[i for i, _ in self.optimizers]}")
            for i, opt in self.optimizers:
                part = saved[i]
                state = state_for_rank(part["residuals"], size, rank)
                n = sum(p.numel() for g in opt.param_groups for p in g["params"])
                want = opt.compressor.get_config()
                for key, s in state.items():
                    if key != opt.key or int(s["n"]) != n:
                        raise CheckpointError(
                            f"optimizer {i}: the checkpoint's residuals are for key "
                            f"{key!r} of {s['n']} values, the CompressedAdamW has key "
                            f"{opt.key!r} and {n} values")
                    got = get_compressor(dict(s["config"])).get_config()
                    if got != want:
                        raise MismatchError(
                            f"optimizer {i}: the checkpoint's residuals were made with "
                            f"another compressor config: saved {got}, in use {want}")
                windows, params = part["windows"], part["params"]
                window = flat = None
                if any(w is not None for w in windows):
                    if len(windows) != size:
                        raise CheckpointError(
                            f"optimizer {i}: saved inside a window of local steps "
                            f"(sync_every) on {len(windows)} rank(s), which this run of "
                            f"{size} cannot continue (each rank's parameters differ in "
                            "a window): resume on the same world size, or from a "
                            "checkpoint saved between windows")
                    window, flat = windows[rank], params[rank]
                    if flat.numel() != n:
                        raise CheckpointError(f"optimizer {i}: the window holds "
                                              f"{flat.numel()} parameters, expected {n}")
                plans.append((opt, state, window, flat))
        except (MpigcError, KeyError, TypeError, ValueError, AttributeError) as e:
            exc = e if isinstance(e, MpigcError) else CheckpointError(
                f"checkpoint[{ADAMW_CHECKPOINT_KEY!r}] is not readable: "
                f"{type(e).__name__}: {e}")
        _engine_comm.agree(self._comm, exc, "MpigcCompressedAdamW (loading the state)",
                           classes=_CLASSES, default=StateError)
        for opt, state, window, flat in plans:
            opt.feedback.load_state_dict(state)
            if window is None:
                continue
            sd = opt.state_dict()
            sd["mpigc"]["window"] = window
            opt.load_state_dict(sd)
            with torch.no_grad():
                off = 0
                for g in opt.param_groups:
                    for p in g["params"]:
                        k = p.numel()
                        p.copy_(flat[off:off + k].reshape(p.shape).to(p.device, p.dtype))
                        off += k


def _describe(record):
    if isinstance(record, dict):
        return f"a dict with format {record.get('format')!r}"
    return type(record).__name__
