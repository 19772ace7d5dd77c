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

Importing this module imports Lightning (``pip install 'mpigc[lightning]'``);
``import mpigc.torch`` does not. See ``docs/torch.md``, "PyTorch Lightning".
"""
import sys
import warnings

import numpy as np
import torch
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
from .._version import __version__
from ..checkpoint import CheckpointError, owner_sources, worker_sources
from ..compressors import get_compressor
from ..feedback import shard_bounds
from ._common import resolve_comm
from ._hook import CommHookState, comm_hook

__all__ = ["MpigcCommHook", "CHECKPOINT_KEY"]

#: The key of Lightning's checkpoint dict that holds the residuals.
CHECKPOINT_KEY = "mpigc"
_FORMAT = "mpigc.torch.lightning"
_VERSION = 1
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
            ``{"format": "mpigc.torch.lightning", "version": 1,
            "world_size": N, "mpigc_version": str, "residuals": [state of
            rank 0, ..., state of rank N-1]}``, each state as
            :meth:`CommHookState.state_dict`'s per parameter name, its arrays
            as CPU tensors (Lightning loads checkpoints with
            ``torch.load(weights_only=True)``) and without ``world_size`` and
            ``rank``.
        """
        mine = {}
        for name, s in self.state.state_dict().items():
            mine[name] = {"worker": _tensor(s.get("worker")), "owner": _tensor(s.get("owner")),
                          "config": dict(s["config"]), "calls": int(s.get("calls", 0)),
                          "n": int(s["n"]), "dtype": np.dtype(s["dtype"]).name}
        every = pkl5.Intracomm(self._comm).gather(mine, root=self._root)
        if self._comm.rank != self._root:
            return None
        return {"format": _FORMAT, "version": _VERSION, "world_size": self._comm.size,
                "mpigc_version": __version__, "residuals": every}

    def _load(self, record):
        """This rank's residuals from ``record`` into :attr:`state` (collective)."""
        exc, state = None, {}
        try:
            state = residuals_for_rank(record, self._comm.size, self._comm.rank)
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


def _tensor(a):
    return None if a is None else torch.from_numpy(np.ascontiguousarray(a))


def _array(t, dtype):
    if t is None:
        return None
    return (t.numpy() if torch.is_tensor(t) else np.asarray(t)).astype(dtype, copy=False)


def residuals_for_rank(record, size, rank):
    """Rank ``rank`` of ``size``'s per-parameter state (the format of
    :meth:`CommHookState.state_dict`) from the checkpoint record ``record``
    (``checkpoint["mpigc"]``), made on any world size.

    On the world size of the record it is that rank's state, exactly. On
    another one, as :func:`mpigc.load_checkpoint` reshards: new rank ``j``
    gets the sum of the worker residuals of the old ranks ``i`` with
    ``i % size == j`` (the total over the ranks is kept) and its shard of the
    owner residuals (``numpy.array_split`` of each parameter's elements over
    the new ranks).

    Raises
    ------
    mpigc.CheckpointError
        A record of another format or version, or one that does not hold the
        residuals of its world size.
    """
    if not isinstance(record, dict) or record.get("format") != _FORMAT:
        raise CheckpointError(f"checkpoint[{CHECKPOINT_KEY!r}]: expected a record of "
                              f"format {_FORMAT!r}, got {_describe(record)}")
    if record.get("version") != _VERSION:
        raise CheckpointError(f"checkpoint[{CHECKPOINT_KEY!r}]: expected version "
                              f"{_VERSION}, got {record.get('version')!r} (written by mpigc "
                              f"{record.get('mpigc_version')}, this is {__version__})")
    old = int(record["world_size"])
    ranks = record["residuals"]
    if len(ranks) != old:
        raise CheckpointError(f"checkpoint[{CHECKPOINT_KEY!r}]: expected the residuals of "
                              f"{old} ranks, got {len(ranks)}")
    if not 0 <= rank < size:
        raise StateError(f"rank {rank} of {size}: expected 0 <= rank < size")
    out = {}
    for name, first in ranks[0].items():
        n, dtype = int(first["n"]), np.dtype(first["dtype"])
        worker = None
        for i in worker_sources(old, size, rank):
            w = _array(ranks[i][name]["worker"], dtype)
            if w is not None:
                worker = w.copy() if worker is None else worker + w  # as load_checkpoint
        owner = None
        if any(r[name]["owner"] is not None for r in ranks):
            nlo, nhi = shard_bounds(n, size)[rank]
            owner = np.zeros(nhi - nlo, dtype)
            for i, a, z in owner_sources(n, old, size, rank):
                o = _array(ranks[i][name]["owner"], dtype)
                if o is not None:
                    olo = shard_bounds(n, old)[i][0]
                    owner[a - nlo:z - nlo] = o[a - olo:z - olo]
        out[name] = {"worker": worker, "owner": owner, "config": dict(first["config"]),
                     "calls": max(int(r[name]["calls"]) for r in ranks),
                     "world_size": size, "rank": rank, "n": n, "dtype": dtype.name}
    return out


def _describe(record):
    if isinstance(record, dict):
        return f"a dict with format {record.get('format')!r}"
    return type(record).__name__
