"""The residuals of every rank as one record, for a checkpoint that one rank
writes (``torch.save`` inside ``if rank == 0:``, Lightning's ``.ckpt``), and
each rank's part of such a record, on any world size.

A record is a plain dict of CPU tensors, ints and strings (``torch.load`` with
``weights_only=True`` reads it)::

    {"format": "mpigc.torch.residuals", "version": 1, "world_size": N,
     "mpigc_version": str,
     "residuals": [state of rank 0, ..., state of rank N-1]}

each state per parameter name as :meth:`GradientSync.state_dict` gives it
(``worker``, ``owner``, ``config``, ``calls``, ``n``, ``dtype``), without
``world_size`` and ``rank``. Rank 0 holds ``N + 1`` times the float32 bytes of
the trainable parameters while it gathers (``N`` worker residuals and the
owner shards); large models save with ``save_checkpoint`` instead (every rank
writes its own part).
"""
import numpy as np
import torch
from mpi4py.util import pkl5

from .._errors import StateError
from .._version import __version__
from ..checkpoint import CheckpointError, owner_sources, worker_sources
from ..feedback import shard_bounds

FORMAT = "mpigc.torch.residuals"
VERSION = 1


def is_record(obj):
    """Whether ``obj`` is a record (or claims to be one) rather than a
    per-rank state dict."""
    return isinstance(obj, dict) and "format" in obj and "residuals" in obj


def gather_record(comm, state, root=0):
    """Every rank's per-parameter ``state`` as one record on rank ``root`` of
    ``comm`` (collective); ``None`` on the other ranks."""
    mine = {}
    for name, s in state.items():
        mine[name] = {"worker": _tensor(s.get("worker")), "owner": _tensor(s.get("owner")),
                      "config": dict(s["config"]), "calls": int(s.get("calls", 0)),
                      "n": int(s["n"]), "dtype": np.dtype(s["dtype"]).name}
    every = pkl5.Intracomm(comm).gather(mine, root=root)
    if comm.Get_rank() != root:
        return None
    return {"format": FORMAT, "version": VERSION, "world_size": comm.Get_size(),
            "mpigc_version": __version__, "residuals": every}


def _tensor(a):
    return None if a is None else torch.from_numpy(np.array(a, copy=True).reshape(-1))


def _array(t, dtype):
    if t is None:
        return None
    return (t.numpy() if torch.is_tensor(t) else np.asarray(t)).astype(dtype, copy=False)


def _describe(record):
    if isinstance(record, dict):
        return f"a dict with format {record.get('format')!r}"
    return type(record).__name__


def state_for_rank(record, size, rank):
    """Rank ``rank`` of ``size``'s per-parameter state (the format of
    :meth:`GradientSync.state_dict`) from ``record``, made on any world size.

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
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise CheckpointError(f"expected a residual record of format {FORMAT!r}, got "
                              f"{_describe(record)}")
    if record.get("version") != VERSION:
        raise CheckpointError(f"expected a residual record of version {VERSION}, got "
                              f"{record.get('version')!r} (written by mpigc "
                              f"{record.get('mpigc_version')}, this is {__version__})")
    old = int(record["world_size"])
    ranks = record["residuals"]
    if len(ranks) != old:
        raise CheckpointError(f"the residual record holds {len(ranks)} ranks' residuals, "
                              f"expected its world size {old}")
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
