"""DiLoCo: local steps of an inner optimizer, then an outer Nesterov step on
the pseudo-gradient averaged with a compressed allreduce (Douillard et al.
2023, "DiLoCo: Distributed Low-Communication Training of Language Models").

Exported as :class:`mpigc.torch.DiLoCo`; see ``docs/lowcomm.md``.

Every rank (a replica) steps its own inner optimizer on its own batches for
``sync_every`` steps. Then the ranks average the pseudo-gradient
``delta = anchor - params`` (the anchor is the parameters at the last
synchronisation) with :func:`mpigc.allreduce` (any op, with error feedback),
apply SGD with Nesterov momentum to the anchor and restart from it, the same
bits on every rank. The inner optimizer's state stays local and is never
exchanged.

With ``shards=S`` a replica is ``S`` consecutive ranks of ``comm`` that hold
one model between them (FSDP2's ``fully_shard`` on those ranks): each rank
exchanges its own shard's pseudo-gradient with the ranks that hold the same
shard in the other replicas, over a sub-communicator of ``comm``.
"""
import zlib

import numpy as np
import torch

from ..allreduce import allreduce, iallreduce
from .._errors import (ConfigError, InvalidBufferError, MismatchError, MpigcError,
                       NonFiniteError, StateError)
from ..feedback import ErrorFeedback
from ._common import (Rendezvous, agreed_comm, resolve_timeout, resolve_warn_s,
                      torch_compressor, warn_if_uncompressed)

__all__ = ["DiLoCo", "StreamingDiLoCo"]


def _inner_settings(opt):
    """The inner optimizer's class and hyperparameters per group (not its
    parameters or state): the same on every rank."""
    groups = getattr(opt, "param_groups", [])
    return [type(opt).__name__] + [
        {k: (list(v) if isinstance(v, tuple) else v) for k, v in sorted(g.items())
         if k != "params" and isinstance(v, (int, float, str, bool, tuple, type(None)))}
        for g in groups]


def _residuals_to_torch(state):
    """:meth:`mpigc.ErrorFeedback.state_dict` with its arrays as tensors."""
    return {k: {n: (torch.from_numpy(v) if isinstance(v, np.ndarray) else v)
                for n, v in e.items()} for k, e in state.items()}


def _residuals_from_torch(state):
    return {k: {n: (v.numpy() if isinstance(v, torch.Tensor) else v) for n, v in e.items()}
            for k, e in state.items()}


def _is_dtensor(p):
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:   # a torch without torch.distributed: no DTensor
        return False
    return isinstance(p, DTensor)


def _local(p):
    """A parameter's values on this rank: an FSDP2 parameter's local shard."""
    return p.to_local() if _is_dtensor(p) else p


def _check_mesh(named, shards, rank):
    """A DTensor parameter is sharded over the ``shards`` ranks of this
    rank's replica, this rank at coordinate ``rank % shards``."""
    for n, p in named:
        if not _is_dtensor(p):
            continue
        mesh = p.device_mesh
        if mesh.ndim != 1 or mesh.size() != shards or mesh.get_local_rank() != rank % shards:
            raise ConfigError(
                f"DiLoCo: parameter {n} is a DTensor over a mesh of shape "
                f"{tuple(mesh.shape)}, this rank at {mesh.get_coordinate()}; with "
                f"shards={shards} expected a 1-D mesh of {shards} ranks (the replica: "
                f"ranks {rank - rank % shards}..{rank - rank % shards + shards - 1} of "
                f"comm), this rank at [{rank % shards}]")


class DiLoCo:
    """The outer optimizer of DiLoCo over an inner optimizer (collective).

    >>> inner = torch.optim.AdamW(model.parameters(), lr=1e-3)      # doctest: +SKIP
    >>> opt = mpigc.torch.DiLoCo(model, inner, sync_every=50, op="2bit")  # doctest: +SKIP
    >>> inner.zero_grad(); loss.backward(); opt.step()  # doctest: +SKIP

    Parameters
    ----------
    model : torch.nn.Module or iterable of (name, parameter)
        The replica. Its parameters that require gradients, all float32 or
        all float64 on one device, the same names, shapes and order on every
        rank. Rank 0's values are broadcast at construction (every replica
        starts from the same anchor).
    inner_optimizer : torch.optim.Optimizer
        Steps the parameters locally (its state is this rank's own; no
        gradient synchronisation besides this object's).
    sync_every : int
        H, the inner steps between outer synchronisations (default 100).
    outer_lr, outer_momentum, nesterov : float, float, bool
        The outer SGD (defaults as the paper: 0.7, 0.9, Nesterov):
        ``m = mu * m + g``; ``anchor -= lr * (g + mu * m)`` (``lr * m``
        without Nesterov), ``g`` the averaged pseudo-gradient.
    op : str or Compressor
        The exchange of the pseudo-gradient (default ``"none"``: exact);
        ``"bf16"``, ``"fp16"``, ``"2bit"``, ``"1bit"``... with error feedback
        in :attr:`feedback` under ``key``. Its parameters as keywords.
    comm : mpi4py communicator (default ``MPI.COMM_WORLD``): the replicas.
    shards : int
        The ranks per replica (default 1: every rank a replica). Ranks
        ``[r * shards, (r + 1) * shards)`` of ``comm`` are replica ``r``, and
        each holds shard ``comm.rank % shards`` of it: the local shards of
        FSDP2 parameters (DTensors over a 1-D mesh of those ``shards``
        ranks, coordinate ``comm.rank % shards``: :func:`fully_shard` with
        the ``"shard"`` dimension of an ``(R, shards)`` device mesh), or
        plain tensors that are this rank's shard. The exchange runs over
        :attr:`replica_comm` (the ranks holding this shard, one per replica):
        shard ``s`` is averaged over the replicas' shard ``s``, the outer step
        applied to it, as the unsharded step would on those values. Every
        check and every failure is agreed over all of ``comm``.
    gather : ``"compressed"`` (default) or ``"exact"``, as :func:`mpigc.allreduce`.
    nonfinite : ``"raise"`` (default) or ``"skip"``
        A synchronisation whose pseudo-gradient is not finite on some rank
        is dropped on every rank (parameters back at the anchor; anchor,
        momentum and residuals unchanged): :class:`mpigc.NonFiniteError` on
        every rank, or without error (``skipped_syncs`` counts it).
    timeout : float, optional
        Seconds a synchronisation waits for every rank to reach it
        (``$MPIGC_TORCH_TIMEOUT``, default 1800): a rank that reached it
        alone gets :class:`mpigc.StateError` instead of waiting forever.
    """

    def __init__(self, model, inner_optimizer, *, sync_every=100, outer_lr=0.7,
                 outer_momentum=0.9, nesterov=True, op="none", comm=None, key="diloco",
                 gather="compressed", nonfinite="raise", timeout=None, shards=1,
                 **op_params):
        from mpi4py import MPI

        self.comm = MPI.COMM_WORLD if comm is None else comm
        exc, settings, named = None, None, []
        try:  # every check before the first collective, agreed on there
            if not isinstance(self.comm, MPI.Intracomm):
                raise ConfigError(f"comm: expected an mpi4py Intracomm, got "
                                  f"{type(self.comm).__name__}")
            if not (isinstance(shards, int) and shards >= 1
                    and self.comm.size % shards == 0):
                raise ConfigError(f"DiLoCo: shards (ranks per replica) must be an integer "
                                  f">= 1 that divides the {self.comm.size} ranks of comm, "
                                  f"got {shards!r}")
            if not (isinstance(sync_every, int) and sync_every >= 1):
                raise ConfigError(f"sync_every must be an integer >= 1, got {sync_every!r}")
            if not (float(outer_lr) > 0 and 0 <= float(outer_momentum) < 1):
                raise ConfigError(f"DiLoCo: expected outer_lr > 0 and 0 <= outer_momentum "
                                  f"< 1, got {outer_lr!r}, {outer_momentum!r}")
            if nonfinite not in ("raise", "skip"):
                raise ConfigError(f"nonfinite must be 'raise' or 'skip', got {nonfinite!r}")
            if gather not in ("compressed", "exact"):
                raise ConfigError(f"gather must be 'compressed' or 'exact', got {gather!r}")
            if not callable(getattr(inner_optimizer, "step", None)):
                raise ConfigError("DiLoCo: inner_optimizer must be an optimizer (with "
                                  f"step()), got {type(inner_optimizer).__name__}")
            self.timeout = resolve_timeout(timeout)
            self.compressor = torch_compressor(op, op_params)
            pairs = model.named_parameters() if isinstance(model, torch.nn.Module) else model
            named = [(str(n), p) for n, p in pairs if p.requires_grad]
            if not named:
                raise ConfigError("DiLoCo: no parameters that require gradients")
            dtypes = {p.dtype for _, p in named}
            devices = {p.device for _, p in named}
            if len(dtypes) > 1 or len(devices) > 1 or next(iter(dtypes)) not in (
                    torch.float32, torch.float64):
                raise InvalidBufferError(
                    "DiLoCo: parameters must all be float32 or all float64, on one "
                    f"device; got {sorted(map(str, dtypes))} on {sorted(map(str, devices))}")
            local_shapes = [list(_local(p).shape) for _, p in named]
            _check_mesh(named, shards, self.comm.rank)
            settings = {"sync_every": sync_every, "outer_lr": float(outer_lr),
                        "outer_momentum": float(outer_momentum), "nesterov": bool(nesterov),
                        "op": self.compressor.get_config(), "key": str(key),
                        "gather": gather, "nonfinite": nonfinite,
                        "inner": _inner_settings(inner_optimizer),
                        "shards": shards,
                        # global shapes (a DTensor's); a plain tensor's when unsharded
                        # (sharded, its shape is its shard's: checked per shard below)
                        "parameters": [[n, list(p.shape) if shards == 1 or _is_dtensor(p)
                                        else None, str(p.dtype)] for n, p in named]}
            settings.update(self._more_settings(named))
        except (MpigcError, TypeError, ValueError) as e:
            exc = e
        # this object's own small collectives, once the ranks agreed
        self._comm = agreed_comm(self.comm, exc, settings, "DiLoCo")
        self.shards = shards
        #: the ranks that hold this rank's shard, one per replica (``comm`` itself
        #: when ``shards=1``): the outer exchange runs over it
        self.replica_comm = self.comm
        if shards > 1:
            try:
                self._check_shards(local_shapes)
            except BaseException:
                self._comm.Free()
                raise
            self.replica_comm = self._comm.Split(self.comm.rank % shards,
                                                 self.comm.rank // shards)
        self.inner = inner_optimizer
        self.sync_every = sync_every
        self.outer_lr = float(outer_lr)
        self.outer_momentum = float(outer_momentum)
        self.nesterov = bool(nesterov)
        self.key = str(key)
        self.gather = gather
        self.nonfinite = nonfinite
        self.feedback = ErrorFeedback()
        self._rendezvous = Rendezvous(self._comm, resolve_warn_s())
        self._named = named
        self._shapes = settings["parameters"]   # agreed by every rank: no shard's own
        n = sum(p.numel() for p in self._params)
        dev, dt = self._params[0].device, self._params[0].dtype
        self._anchor = torch.zeros(n, dtype=dt, device=dev)
        self._delta = torch.zeros(n, dtype=dt, device=dev)   # exchanged in place
        self._m = torch.zeros(n, dtype=dt, device=dev)       # outer momentum
        warn_if_uncompressed("DiLoCo", self.compressor, [self._delta])
        with torch.no_grad():
            self._flatten(self._anchor)
            host = self._anchor.cpu()
            # every replica starts from replica 0's (rank 0's when unsharded)
            (self._comm if shards == 1 else self.replica_comm).Bcast(host.numpy(), root=0)
            self._anchor.copy_(host)
            self._unflatten(self._anchor)
        #: inner steps in the open window (0: every rank holds the anchor)
        self.window = 0
        #: outer synchronisations done, and those dropped (non-finite, mismatch)
        self.syncs = 0
        self.skipped_syncs = 0

    def _more_settings(self, named):
        """A subclass's own settings, checked inside the constructor's
        agreement (raise :class:`ConfigError` to refuse them)."""
        return {}

    def _check_shards(self, local_shapes):
        """Every replica's shard ``s`` has the same shapes (collective over
        all of ``comm``: :class:`MismatchError` on every rank)."""
        rows = self._comm.allgather(local_shapes)
        self._shard_shapes = rows[:self.shards]   # replica 0's: every replica's
        bad = [i for i, r in enumerate(rows) if r != rows[i % self.shards]]
        if bad:
            i = bad[0]
            raise MismatchError(
                f"DiLoCo: the replicas' shards differ in shape: shard {i % self.shards} "
                f"is {rows[i % self.shards]} on rank {i % self.shards} (replica 0) and "
                f"{rows[i]} on rank {i} (replica {i // self.shards}); every replica must "
                f"shard the same model the same way over {self.shards} ranks")

    @property
    def _params(self):
        """This rank's tensors: a parameter, or an FSDP2 parameter's local shard
        (taken at each use: FSDP may swap it)."""
        return [_local(p) for _, p in self._named]

    # -- helpers ----------------------------------------------------------------
    @staticmethod
    def _wire(t):
        return t.numpy() if t.device.type == "cpu" else t

    def _flatten(self, out):
        off = 0
        for p in self._params:
            out[off:off + p.numel()].copy_(p.detach().reshape(-1))
            off += p.numel()

    def _unflatten(self, src):
        off = 0
        for p in self._params:
            p.detach().copy_(src[off:off + p.numel()].view_as(p))
            off += p.numel()

    def _settings_crc(self):
        row = (self.sync_every, self.outer_lr, self.outer_momentum, self.nesterov,
               repr(sorted(self.compressor.get_config().items())), self.key, self.gather,
               self.nonfinite, repr(self._shapes), repr(_inner_settings(self.inner)))
        return zlib.crc32(repr(row).encode())

    @property
    def in_sync(self):
        """True when the parameters are the anchor on every rank (no inner
        step since the last synchronisation)."""
        return self.window == 0

    @property
    def anchor(self):
        """The parameters of the last synchronisation, flat (a copy)."""
        return self._anchor.clone()

    @property
    def outer_gradient(self):
        """The averaged pseudo-gradient that the last synchronisation applied
        (flat; its values after the exchange, a copy)."""
        return self._delta.clone()

    # -- steps ------------------------------------------------------------------
    def zero_grad(self, set_to_none=True):
        self.inner.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        """One inner step; every ``sync_every``-th one ends with the outer
        synchronisation (collective then). Returns the inner step's loss."""
        loss = self.inner.step() if closure is None else self.inner.step(closure)
        self.window += 1
        if self.window >= self.sync_every:
            self.synchronize()
        return loss

    @torch.no_grad()
    def synchronize(self):
        """End the open window now: the outer step (collective: on every rank,
        e.g. before an evaluation or a checkpoint). Nothing to do in sync.

        On failure (a rank alone past ``timeout``, a pseudo-gradient not
        finite on some rank, settings or window lengths that differ between
        ranks, an error of the exchange) the window is dropped on every rank
        that took part: the parameters are set back to the anchor, and the
        anchor, the outer momentum and the residuals are unchanged. A rank
        that timed out alone keeps its window instead (the others never
        came): its next call takes up the barrier it posted.
        """
        if self.window == 0:
            return
        self._rendezvous(self.timeout, f"DiLoCo.synchronize after {self.window} inner steps",
                         "DiLoCo.synchronize")
        delta = self._delta
        self._flatten(delta)
        torch.sub(self._anchor, delta, out=delta)
        row = (self.syncs, self.window, self._settings_crc(),
               zlib.crc32(self._wire(self._anchor).tobytes()) if self._anchor.device.type
               == "cpu" else 0)
        finite = bool(torch.isfinite(delta).all())
        rows = self._comm.allgather((row, finite))
        exc = None
        if any(r[:3] != rows[0][0][:3] or r[3] != rows[i % self.shards][0][3]
               for i, (r, _) in enumerate(rows)):
            exc = MismatchError(
                "DiLoCo.synchronize: the ranks differ in (syncs done, inner steps in the "
                "window, settings, anchor): " + ", ".join(
                    f"rank {i}: {r[0]}, {r[1]}, {r[2]:08x}, {r[3]:08x}"
                    for i, (r, _) in enumerate(rows)) + " (every rank must run the same "
                "number of inner steps with the same settings and load the same state; "
                "the anchor is compared between the replicas of a shard)")
        elif not all(f for _, f in rows):
            bad = [i for i, (_, f) in enumerate(rows) if not f]
            exc = NonFiniteError(f"DiLoCo.synchronize: the pseudo-gradient is not finite "
                                 f"on rank(s) {bad}; the window of {self.window} inner "
                                 "steps is dropped on every rank (parameters back at the "
                                 "anchor)")
        if exc is None:
            # sharded: the residuals as they are, by copy, put back if another
            # shard's exchange fails (this shard's then delivered nothing)
            txn = None
            if self.shards > 1:
                txn = self.feedback.transaction()
                txn.copy(self.key)
            try:
                allreduce(self._wire(delta), self.compressor, comm=self.replica_comm,
                          key=self.key, average=True, gather=self.gather,
                          feedback=self.feedback, nonfinite="raise")
            except MpigcError as e:  # raised on every rank of replica_comm by the engine
                exc = e              # (residuals unchanged by a call that fails)
            if self.shards > 1:  # and on every rank when one shard's exchange failed
                failed = [i for i, ok in enumerate(self._comm.allgather(exc is None))
                          if not ok]
                if failed and exc is None:
                    txn.restore()
                    exc = StateError(f"DiLoCo.synchronize: the exchange failed on rank(s) "
                                     f"{failed} (another shard); the window is dropped on "
                                     "every rank, its residuals as before it")
        if exc is not None:
            self._drop()
            if isinstance(exc, NonFiniteError) and self.nonfinite == "skip":
                return
            raise exc
        self._outer_step(delta)
        self._unflatten(self._anchor)
        self.syncs += 1
        self.window = 0

    def _outer_step(self, g):
        """SGD with (Nesterov) momentum on the anchor; no fused multiply-adds,
        so that every element is rounded as the formula says."""
        mu, lr = self.outer_momentum, self.outer_lr
        self._m.mul_(mu).add_(g)
        upd = g + self._m * mu if self.nesterov else self._m
        self._anchor.sub_(upd * lr)

    def _drop(self):
        self._unflatten(self._anchor)
        self._delta.zero_()
        self.window = 0
        self.skipped_syncs += 1

    # -- state ------------------------------------------------------------------
    def state_dict(self):
        """The outer state (not collective): anchor, outer momentum, counters,
        this rank's residuals (as CPU tensors, so that ``torch.load`` with
        ``weights_only=True`` reads it). The inner optimizer's state and the model's
        parameters are saved by their own ``state_dict()``."""
        return {"anchor": self._anchor.clone(), "momentum": self._m.clone(),
                "window": self.window, "syncs": self.syncs,
                "skipped_syncs": self.skipped_syncs, "world_size": self.comm.size,
                "rank": self.comm.rank, "sync_every": self.sync_every,
                "shards": self.shards,
                "residuals": _residuals_to_torch(self.feedback.state_dict())}

    def load_state_dict(self, state):
        """Restore :meth:`state_dict` (not collective). At the world size it was
        saved at, every rank loads its own: the run continues bit for bit. At
        another world size the anchor, momentum and counters load (they are the
        same on every rank) and the residuals are not (use
        :meth:`load_checkpoint`, which re-shards them); a window open at the
        save is then refused (save in sync)."""
        if state["anchor"].numel() != self._anchor.numel():
            raise InvalidBufferError(f"DiLoCo.load_state_dict: the state holds "
                                     f"{state['anchor'].numel()} values, the parameters "
                                     f"{self._anchor.numel()}")
        if int(state.get("shards", 1)) != self.shards:
            raise ConfigError(f"DiLoCo.load_state_dict: the state was saved with "
                              f"shards={state.get('shards', 1)}, this object has "
                              f"shards={self.shards}")
        same = int(state["world_size"]) == self.comm.size
        window = int(state["window"])
        if window and (not same or window >= self.sync_every):
            raise ConfigError(f"DiLoCo.load_state_dict: the state was saved {window} inner "
                              "steps into a window; resume it at the same world size and "
                              "sync_every, or save after synchronize()")
        self._anchor.copy_(state["anchor"])
        self._m.copy_(state["momentum"])
        self.window = window
        self.syncs = int(state["syncs"])
        self.skipped_syncs = int(state["skipped_syncs"])
        if same:
            self.feedback.load_state_dict(_residuals_from_torch(state["residuals"]))
        else:
            self.feedback.reset()

    def save_checkpoint(self, path, step=None):
        """The residuals with :func:`mpigc.save_checkpoint` (collective; loadable
        on any number of ranks)."""
        import mpigc
        self._unsharded("save_checkpoint")
        self._rendezvous(self.timeout, "DiLoCo.save_checkpoint")
        return mpigc.save_checkpoint(path, self.feedback, comm=self.comm, step=step)

    def load_checkpoint(self, path, step=None):
        """The residuals saved by :meth:`save_checkpoint` (collective);
        ``step`` as in :func:`mpigc.load_checkpoint`."""
        import mpigc
        self._unsharded("load_checkpoint")
        self._rendezvous(self.timeout, "DiLoCo.load_checkpoint")
        return mpigc.load_checkpoint(path, self.feedback, comm=self.comm, step=step)

    def _unsharded(self, what):
        if self.shards > 1:  # the same on every rank: raised on every rank
            raise ConfigError(f"DiLoCo.{what}: not with shards > 1 (each shard's residuals "
                              "are its replicas' own); save state_dict() per rank")

    def __repr__(self):
        return (f"DiLoCo(sync_every={self.sync_every}, outer_lr={self.outer_lr}, "
                f"outer_momentum={self.outer_momentum}, op={self.compressor!r}, "
                f"values={self._anchor.numel()}, ranks={self.comm.size}"
                + (f", shards={self.shards})" if self.shards > 1 else ")"))


class StreamingDiLoCo(DiLoCo):
    """Streaming DiLoCo (Douillard et al. 2025): the parameters in
    ``fragments`` parts, each synchronised once every ``sync_every`` inner
    steps on a staggered schedule, its exchange nonblocking
    (:func:`mpigc.iallreduce`) and overlapped with the next ``overlap``
    inner steps (collective).

    Fragment ``p`` (contiguous whole parameters, about ``1/fragments`` of
    the values each, in the model's order) starts its exchange after inner
    step ``t`` when ``t % sync_every == ((p + 1) * sync_every // fragments)
    % sync_every``: its pseudo-gradient ``anchor_p - params_p`` is averaged
    while the ranks take ``overlap`` more inner steps; then the outer step
    (as :class:`DiLoCo`'s, on that fragment) is applied to ``anchor_p``, late
    by ``overlap`` steps, and the fragment's parameters become
    ``mix * params_p + (1 - mix) * anchor_p`` (``mix=0``: the anchor, the
    same bits on every rank; the paper's merge keeps part of the local steps
    taken meanwhile). ``fragments=1, overlap=0, mix=0`` is :class:`DiLoCo`
    bit for bit. Other parameters as :class:`DiLoCo`.

    With ``shards=S`` the fragments are cut at whole parameters by their
    sizes summed over the shards (the same parameters in every shard's
    fragment ``p``), and each fragment's exchange runs over
    :attr:`replica_comm`; whether every shard's exchange started and ended
    is agreed over all of ``comm``, and when one failed the others drop the
    fragment too, their residuals of it put back as before the exchange.

    :attr:`fragment_syncs` counts each fragment's completed exchanges.
    :meth:`synchronize` completes the exchanges in flight and then
    synchronises every fragment at once (blocking): every rank holds the
    anchor. :meth:`state_dict` needs no exchange in flight (after
    :meth:`synchronize`, or at a step where none is).
    """

    def __init__(self, model, inner_optimizer, *, fragments=2, overlap=0, mix=0.0, **kw):
        self.fragments, self.overlap, self.mix = fragments, overlap, mix
        self._h = kw.get("sync_every", 100)
        self._shards = kw.get("shards", 1)
        super().__init__(model, inner_optimizer, **kw)
        sizes = [p.numel() for p in self._params]
        whole = sizes if self.shards == 1 else [   # the parameters' sizes, all shards
            sum(int(np.prod(shapes[i])) for shapes in self._shard_shapes)
            for i in range(len(sizes))]
        total, cuts, off, k = sum(whole), [0], 0, 1
        for i, s in enumerate(whole):  # cut at whole parameters, near k * total / P
            off += s
            if k < fragments and off * fragments >= k * total and off < total:
                cuts.append(i + 1)
                k += 1
        cuts.append(len(whole))
        starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).tolist()
        # this rank's values of fragment p (empty where its shard holds none)
        self._bounds = [(starts[a], starts[b]) for a, b in zip(cuts[:-1], cuts[1:])]
        # fragment -> (request or None, inner step at which it applies, transaction)
        self._pending = {}
        self._t = 0            # inner steps taken
        self.fragment_syncs = [0] * len(self._bounds)

    def _more_settings(self, named):
        n_params = len(named)
        if not (isinstance(self.fragments, int) and 1 <= self.fragments <= n_params):
            raise ConfigError(f"fragments must be an integer from 1 to the number of "
                              f"parameters ({n_params}), got {self.fragments!r}")
        if not (isinstance(self.overlap, int) and 0 <= self.overlap < self._h):
            raise ConfigError(f"overlap must be an integer from 0 to sync_every - 1 (an "
                              f"exchange ends before its fragment's next turn), got "
                              f"{self.overlap!r}")
        if not 0 <= float(self.mix) < 1:
            raise ConfigError(f"mix must be in [0, 1), got {self.mix!r}")
        return {"fragments": self.fragments, "overlap": self.overlap, "mix": float(self.mix)}

    def _settings_crc(self):
        return zlib.crc32(repr((super()._settings_crc(), self.fragments, self.overlap,
                                float(self.mix))).encode())

    def _start_of(self, p):
        return ((p + 1) * self.sync_every // len(self._bounds)) % self.sync_every

    @torch.no_grad()
    def step(self, closure=None):
        """One inner step; then the fragments whose exchange ends here are
        applied and those whose turn it is start theirs (collective then)."""
        loss = self.inner.step() if closure is None else self.inner.step(closure)
        self._t += 1
        self.window += 1     # inner steps since the last synchronize() of every fragment
        for p in sorted(p for p, v in self._pending.items() if v[1] <= self._t):
            self._finish(p)
        for p in range(len(self._bounds)):
            if self._t % self.sync_every == self._start_of(p):
                self._begin(p)
                if self.overlap == 0 and p in self._pending:
                    self._finish(p)
        return loss

    def _begin(self, p):
        lo, hi = self._bounds[p]
        self._rendezvous(self.timeout, f"StreamingDiLoCo fragment {p} at inner step {self._t}",
                         "StreamingDiLoCo fragment")
        d, a = self._delta[lo:hi], self._anchor[lo:hi]
        self._flatten_range(d, lo, hi)   # other fragments' slices may be in flight
        torch.sub(a, d, out=d)
        row = (self._t, p, self.fragment_syncs[p], self._settings_crc(),
               zlib.crc32(self._wire(a).tobytes()) if a.device.type == "cpu" else 0)
        rows = self._comm.allgather((row, bool(torch.isfinite(d).all())))
        exc, req, txn = None, None, None
        # the anchor's CRC is compared between the replicas of a shard
        if any(r[:4] != rows[0][0][:4] or r[4] != rows[i % self.shards][0][4]
               for i, (r, _) in enumerate(rows)):
            exc = MismatchError(f"StreamingDiLoCo fragment {p}: the ranks differ in (inner "
                                "step, fragment, its syncs, settings, anchor): "
                                + ", ".join(str(r) for r, _ in rows))
        elif not all(f for _, f in rows):
            exc = NonFiniteError(f"StreamingDiLoCo fragment {p}: the pseudo-gradient is not "
                                 f"finite on rank(s) {[i for i, (_, f) in enumerate(rows) if not f]}"
                                 "; the fragment's window is dropped on every rank")
        if exc is None:
            if self.shards > 1:   # put back if another shard's exchange fails
                txn = self.feedback.transaction()
                txn.copy(f"{self.key}/{p}")
            try:
                if hi > lo:   # sharded: a shard may hold none of this fragment
                    req = iallreduce(self._wire(d), self.compressor, comm=self.replica_comm,
                                     key=f"{self.key}/{p}", average=True, gather=self.gather,
                                     feedback=self.feedback, nonfinite="raise")
            except MpigcError as e:
                exc = e
            exc = self._shards_agree(exc, req, txn, p, "start")
        if exc is not None:
            self._drop_fragment(p)
            if isinstance(exc, NonFiniteError) and self.nonfinite == "skip":
                return
            raise exc
        self._pending[p] = (req, self._t + self.overlap, txn)

    def _shards_agree(self, exc, req, txn, p, what):
        """Sharded: whether every shard's exchange of fragment ``p`` could
        ``what`` (collective over ``comm``). Where it did but another shard's
        did not, its request is completed (its replicas all posted it) and its
        residuals put back: :class:`StateError`, the fragment dropped."""
        if self.shards == 1:
            return exc
        failed = [i for i, ok in enumerate(self._comm.allgather(exc is None)) if not ok]
        if failed and exc is None:
            try:
                if req is not None:
                    req.wait()
            except MpigcError:
                pass            # a failed call leaves the residuals; put back anyway
            txn.restore()
            exc = StateError(f"StreamingDiLoCo fragment {p}: the exchange failed to {what} "
                             f"on rank(s) {failed} (another shard); the fragment is dropped "
                             "on every rank, its residuals as before the exchange")
        return exc

    def _finish(self, p):
        req, _, txn = self._pending.pop(p)
        lo, hi = self._bounds[p]
        exc = None
        try:
            if req is not None:
                req.wait()
        except MpigcError as e:
            exc = e
        exc = self._shards_agree(exc, None, txn, p, "complete")
        if exc is not None:
            self._drop_fragment(p)
            raise exc
        g, mu, lr = self._delta[lo:hi], self.outer_momentum, self.outer_lr
        m, a = self._m[lo:hi], self._anchor[lo:hi]
        m.mul_(mu).add_(g)
        a.sub_((g + m * mu if self.nesterov else m) * lr)
        if self.mix:
            local = torch.zeros_like(a)
            self._flatten_range(local, lo, hi)
            a_new = local * float(self.mix) + a * (1 - float(self.mix))
            self._unflatten_range(a_new, lo, hi)
        else:
            self._unflatten_range(a, lo, hi)
        self.fragment_syncs[p] += 1
        self.syncs += 1

    def _drop_fragment(self, p):
        lo, hi = self._bounds[p]
        self._unflatten_range(self._anchor[lo:hi], lo, hi)
        self.skipped_syncs += 1

    def _ranged(self, lo, hi):
        off = 0
        for q in self._params:
            k = q.numel()
            if lo <= off and off + k <= hi:
                yield q, off - lo, k
            off += k

    def _flatten_range(self, out, lo, hi):
        for q, o, k in self._ranged(lo, hi):
            out[o:o + k].copy_(q.detach().reshape(-1))

    def _unflatten_range(self, src, lo, hi):
        for q, o, k in self._ranged(lo, hi):
            q.detach().copy_(src[o:o + k].view_as(q))

    @torch.no_grad()
    def synchronize(self):
        """Complete the exchanges in flight, then synchronise every fragment
        at once (the :class:`DiLoCo` step, blocking; collective)."""
        for p in sorted(self._pending):
            self._finish(p)
        super().synchronize()

    def state_dict(self):
        if self._pending:
            raise StateError(f"StreamingDiLoCo.state_dict: fragment(s) {sorted(self._pending)} "
                             "are being exchanged; call synchronize() first")
        # each fragment has its own window: the steps since the last synchronize()
        # go under their own name, and no single window is open
        return dict(super().state_dict(), window=0, since_sync=self.window,
                    inner_steps=self._t, fragment_syncs=list(self.fragment_syncs))

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.window = int(state["since_sync"])
        self._t = int(state["inner_steps"])
        self.fragment_syncs = [int(x) for x in state["fragment_syncs"]]
