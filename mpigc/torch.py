"""PyTorch integration: bucketed, overlapped, compressed gradient synchronisation.

One line makes an existing model's gradient exchange compressed::

    import mpigc.torch
    sync = mpigc.torch.GradientSync(model, op="2bit", rel_threshold=1.5)  # collective
    mpigc.torch.broadcast_parameters(model)               # every rank starts equal
    for x, y in loader:
        opt.zero_grad()
        loss_fn(model(x), y).backward()    # buckets start their allreduce as they fill
        sync.wait()                        # gradients are now averaged over the ranks
        opt.step()

or, Horovod style, ``opt = mpigc.torch.DistributedOptimizer(opt, model, op="2bit")``,
an optimizer of the wrapped class whose gradients are averaged by the end of
``backward()`` (as with DDP); or, keeping DDP, its communication hook:
``ddp.register_comm_hook(mpigc.torch.CommHookState(ddp, op="2bit"), mpigc.torch.comm_hook)``.

A thin layer by composition over :func:`mpigc.iallreduce` and
:class:`mpigc.ErrorFeedback`; see ``docs/torch.md`` for the design (bucket order, keys,
residual layout, unused and frozen parameters, CUDA staging, AMP and the
``nonfinite="skip"`` default, uneven inputs and ``join()``) and a migration guide
from DDP and Horovod. Importing this module imports torch; ``import mpigc`` does not.
"""
import contextlib
import hashlib
import json
import os
import time
import weakref
import zlib

import numpy as np
from mpi4py import MPI

try:
    import torch
except ImportError as _exc:  # pragma: no cover - depends on the environment
    raise ImportError("mpigc.torch needs PyTorch: pip install 'mpigc[torch]' "
                      f"({_exc})") from _exc

from . import _comm as _engine_comm
from . import _comm
from ._errors import (ConfigError, DTypeError, InvalidBufferError, MismatchError,
                      MpigcError, NonFiniteError, StateError)
from .allreduce import iallreduce
from .compressors import get_compressor
from . import _dispatch, _hierarchy
from ._collective import GATHER_MODES, NONFINITE_POLICIES
from .feedback import ErrorFeedback, _entry_state, shard_bounds
from ._adam import CompressedAdamW

__all__ = ["GradientSync", "DistributedOptimizer", "CommHookState", "comm_hook",
           "broadcast_parameters", "broadcast_optimizer_state", "Bucket", "CompressedAdamW",
           "init_process_group"]


def _hooked_by(p):
    """The GradientSync whose hooks are on parameter ``p``, or None."""
    ref = getattr(p, "_mpigc_sync", None)  # (copies of p carry it too)
    sync = None if ref is None else ref()
    return sync if sync is not None and id(p) in sync._hooked_ids else None


_BUCKET_DTYPES = {torch.float16: np.float32, torch.bfloat16: np.float32,
                  torch.float32: np.float32, torch.float64: np.float64}


# -- agreement helpers ---------------------------------------------------------
def _raise_everywhere(comm, exc, what):
    """Raise on every rank if ``exc`` is not None on some rank (collective)."""
    _comm.agree(comm, exc, what, default=StateError, classes={c.__name__: c for c in (
        ConfigError, DTypeError, InvalidBufferError, MismatchError, MpigcError, StateError,
        TypeError, ValueError)})


def agree_construction(comm, exc, settings, what):
    """The first collective of a constructor (collective over ``comm``).

    Raises on every rank when the arguments were refused on some rank
    (``exc``: a rank that raised alone before its first collective would
    leave the others waiting in it), then :class:`MismatchError` on every
    rank when ``settings`` (a dict of JSON values) differ between ranks,
    naming the settings and the ranks.
    """
    _raise_everywhere(comm, exc, what)
    rows = comm.allgather(json.dumps(settings, sort_keys=True, default=repr))
    if all(r == rows[0] for r in rows):
        return
    ref = json.loads(rows[0])
    differ = []
    for r, row in enumerate(rows[1:], 1):
        mine = json.loads(row)
        for k in sorted(set(ref) | set(mine)):
            if ref.get(k) != mine.get(k):
                differ.append(f"{k}={mine.get(k)!r} on rank {r} but {ref.get(k)!r} on rank 0")
    raise MismatchError(f"{what}: the ranks were given different settings: "
                        + "; ".join(differ[:5]) + (" ..." if len(differ) > 5 else "")
                        + " (every rank must pass the same arguments)")


def _check_same(comm, items, what):
    """Raise :class:`MismatchError` on every rank unless ``items`` (a list of
    ``(name, shape, dtype)``) is the same on every rank."""
    blob = json.dumps(items).encode()
    fps = comm.allgather(zlib.crc32(blob))
    if all(f == fps[0] for f in fps):
        return
    lists = comm.allgather(items)
    ref = {n: (s, d) for n, s, d in lists[0]}
    details = []
    for r in range(1, comm.size):
        if lists[r] == lists[0]:
            continue
        mine = {n: (s, d) for n, s, d in lists[r]}
        missing = [n for n in ref if n not in mine]
        extra = [n for n in mine if n not in ref]
        differ = [f"{n} {list(ref[n][0])} {ref[n][1]} vs {list(mine[n][0])} {mine[n][1]}"
                  for n in ref if n in mine and mine[n] != ref[n]]
        parts = []
        if missing:
            parts.append(f"lacks {missing[:5]}" + (" ..." if len(missing) > 5 else ""))
        if extra:
            parts.append(f"has extra {extra[:5]}" + (" ..." if len(extra) > 5 else ""))
        if differ:
            parts.append("differs in " + "; ".join(differ[:5]))
        if not parts:
            parts.append("has them in another order")
        details.append(f"rank {r} " + ", ".join(parts))
    raise MismatchError(f"{what}: ranks have different parameters (compared with rank 0: "
                        + "; ".join(details) + "); every rank must build the same model "
                        "and freeze the same parameters")


def _describe(named):
    return [(n, list(p.shape), str(p.dtype).replace("torch.", "")) for n, p in named]


def _resolve_comm(comm):
    if comm is None:
        comm = MPI.COMM_WORLD
    if not isinstance(comm, MPI.Intracomm):
        raise TypeError(f"comm: expected an mpi4py Intracomm, got {type(comm).__name__}")
    return comm


def _torch_nonfinite(nonfinite):
    """The torch layer's default policy for NaN/Inf gradients: ``"skip"``
    (``$MPIGC_NONFINITE`` overrides it), so that a loss scaler sees them."""
    policy = nonfinite if nonfinite is not None else os.environ.get("MPIGC_NONFINITE", "skip")
    if policy not in NONFINITE_POLICIES:
        raise ConfigError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {policy!r}"
                          + ("" if nonfinite is not None else " (from $MPIGC_NONFINITE)"))
    return policy


def _resolve_timeout(timeout):
    """Seconds a rank waits for the others to reach a step's synchronisation
    (``$MPIGC_TORCH_TIMEOUT``, default 1800 as torch.distributed's); None or
    0: forever."""
    if timeout is None:
        env = os.environ.get("MPIGC_TORCH_TIMEOUT", "1800")
        try:
            timeout = float(env)
        except ValueError:
            raise ConfigError(f"MPIGC_TORCH_TIMEOUT: expected seconds, got {env!r}") from None
    timeout = float(timeout)
    if timeout < 0:
        raise ConfigError(f"timeout: expected seconds >= 0, got {timeout!r}")
    return timeout or None


def _check_feedback(feedback):
    """``feedback`` as a store: a new one for None."""
    if feedback is None:
        return ErrorFeedback()
    if not isinstance(feedback, ErrorFeedback):
        raise ConfigError(f"feedback: expected an ErrorFeedback, got {type(feedback).__name__}")
    return feedback


def _positive(x):
    try:
        return float(x) > 0
    except (TypeError, ValueError):
        return False


def _check_gather(gather):
    if gather not in GATHER_MODES:
        raise ConfigError(f"gather must be one of {GATHER_MODES}, got {gather!r}")


_UNEVEN = ("the other ranks did not reach this step's gradient synchronisation within "
           "{timeout:g} s. A rank that ran out of batches (uneven inputs)? Wrap the training "
           "loop in `with sync.join():` (`opt.join()`, DistributedOptimizer) on every rank. "
           "The step stays pending (timeout=, $MPIGC_TORCH_TIMEOUT)")


def _wait_request(test, timeout, progress, what, why=_UNEVEN):
    """Poll ``test()`` (a request's) until it is true, calling ``progress()``
    meanwhile; :class:`StateError` (on this rank) after ``timeout`` seconds,
    its message ``what: why``."""
    deadline = None if timeout is None else time.monotonic() + timeout
    spins = 0
    while not test():
        progress()
        spins += 1
        if spins > 200:
            if deadline is not None and time.monotonic() > deadline:
                raise StateError(f"{what}: " + why.format(timeout=timeout))
            time.sleep(0.0002)


class _Rendezvous:
    """Every rank's arrival at a collective method of this layer (a state
    dict, a checkpoint), within a timeout. A checkpoint saved inside ``if
    rank == 0:`` then ends on that rank with an error that says what to do,
    instead of waiting forever in the method's first collective."""

    def __init__(self, comm):
        self.comm = comm
        self.req = None  # a barrier posted by a call that timed out

    def __call__(self, timeout, what):
        if self.req is None:
            self.req = self.comm.Ibarrier()
        _wait_request(self.req.Test, timeout, lambda: None, what,
                      "the other ranks did not call it within {timeout:g} s. It is "
                      "collective: call it on every rank, not only on the one that writes "
                      "the model's checkpoint (not inside `if rank == 0:` / `if "
                      "master_process:`). Its barrier stays posted: call it on every rank "
                      "before any other collective use of this object (timeout=, "
                      "$MPIGC_TORCH_TIMEOUT)")
        self.req = None


def _copy_of(a, into=None):
    """A copy of residual ``a`` on its own side (a device residual stays in
    device memory), written into ``into`` when that fits; None for None."""
    if a is None:
        return None
    if _dispatch.is_device_array(a):
        from . import _cuda
        if (into is None or not _dispatch.is_device_array(into) or into.size != a.size
                or np.dtype(into.dtype) != np.dtype(a.dtype)):
            into = _cuda.empty(a.size, a.dtype)
        if a.size:
            _cuda.copy(into, a)
        return into
    if (into is None or not isinstance(into, np.ndarray) or into.shape != a.shape
            or into.dtype != a.dtype):
        return np.array(a, copy=True)
    into[...] = a
    return into


def _snapshot(fb, key, reuse=None):
    """A copy of ``key``'s residuals (None if the key has none yet), on their
    side: device residuals are copied on the device, never to the host. The
    arrays of ``reuse`` (an older snapshot of the key, no longer needed) are
    written over when they fit, so a step allocates nothing."""
    e = fb._entries.get(key)
    if e is None:
        return None
    old_w, old_o = (reuse[0], reuse[1]) if reuse is not None else (None, None)
    return _copy_of(e.worker, old_w), _copy_of(e.owner, old_o), e.calls


def _restore(fb, key, snap):
    """Put back what :func:`_snapshot` took (copied: the snapshot's arrays
    stay the snapshot's)."""
    if snap is None:
        fb.reset(key)
        return
    e = fb._entries[key]
    worker, owner, calls = snap
    for name, old in (("worker", worker), ("owner", owner)):
        cur = getattr(e, name)
        if old is None or cur is None or cur.size != old.size:
            setattr(e, name, _copy_of(old))
        elif _dispatch.is_device_array(cur) or _dispatch.is_device_array(old):
            from . import _cuda
            if cur.size:
                _cuda.copy(cur, old)
        else:
            cur[...] = old
    e.calls = calls


def _snapshot_keys(fb, keys, reuse=None):
    """:func:`_snapshot` of each of ``keys`` (a bucket's residual keys):
    ``{key: snapshot}``; ``reuse``: an older such dict whose arrays are
    written over."""
    reuse = reuse or {}
    return {k: _snapshot(fb, k, reuse.get(k)) for k in keys}


def _restore_keys(fb, snaps):
    """Put back :func:`_snapshot_keys`'s ``snaps`` (keys without residuals
    then are forgotten)."""
    for k, snap in snaps.items():
        _restore(fb, k, snap)


class _Layout:
    """Where parameters sit in one flat buffer (a bucket of GradientSync or
    of DDP): ``index``, ``key``, ``names``, ``offsets``, ``numels``, ``n``,
    ``dtype`` (numpy)."""

    def __init__(self, index, names, numels, dtype):
        self.index = index
        self.names = list(names)
        self.numels = [int(m) for m in numels]
        self.offsets = np.concatenate([[0], np.cumsum(self.numels)])[:-1].astype(int).tolist()
        self.n = int(sum(self.numels))
        self.dtype = np.dtype(dtype)
        desc = json.dumps([[n, m] for n, m in zip(self.names, self.numels)]).encode()
        digest = hashlib.sha1(desc).hexdigest()[:12]
        self.key = f"torch/{self.names[0]}..{self.names[-1]}/{digest}"


def _uses_owner(gather, config):
    return gather == "compressed" and get_compressor(dict(config)).uses_feedback


def _state_from_layouts(layouts, fbs, comm, gather):
    """Per-parameter residual state (see :meth:`GradientSync.state_dict`)
    from the per-bucket ``fbs`` (an ``ErrorFeedback.state_dict()``) of
    ``layouts`` (collective: one alltoall moves owner shards)."""
    N, r = comm.size, comm.rank
    out, sends = {}, [[] for _ in range(N)]
    for b in layouts:
        s = fbs.get(b.key)
        if s is None:
            continue
        has_owner = _uses_owner(gather, s["config"])
        lo, hi = shard_bounds(b.n, N)[r]
        for name, off, m in zip(b.names, b.offsets, b.numels):
            qlo, qhi = shard_bounds(m, N)[r]
            out[name] = {
                "worker": None if s["worker"] is None else s["worker"][off:off + m].copy(),
                "owner": np.zeros(qhi - qlo, s["dtype"]) if has_owner else None,
                "config": dict(s["config"]), "calls": s["calls"], "world_size": N,
                "rank": r, "n": m, "dtype": s["dtype"]}
            if s["owner"] is None:
                continue
            plo, phi = max(lo - off, 0), min(hi - off, m)  # my owned elements of it
            for j, (jlo, jhi) in enumerate(shard_bounds(m, N)):
                a, z = max(plo, jlo), min(phi, jhi)
                if a < z:
                    sends[j].append((name, a - jlo, s["owner"][off + a - lo:off + z - lo]))
    for pieces in comm.alltoall(sends):
        for name, start, vals in pieces:
            out[name]["owner"][start:start + vals.size] = vals
    return out


def _check_state(state, numel_of, N, r):
    """Validate a per-parameter state against ``{name: numel}`` (local)."""
    for name, s in state.items():
        if name not in numel_of:
            continue
        m = numel_of[name]
        if (int(s["world_size"]), int(s["rank"])) != (N, r):
            raise StateError(
                f"{name!r}: residuals of rank {s['rank']} of {s['world_size']}, this "
                f"is rank {r} of {N}; reshard with mpigc.load_checkpoint first")
        if int(s["n"]) != m:
            raise StateError(f"{name!r}: residuals of {s['n']} values, the "
                             f"parameter has {m}")
        qlo, qhi = shard_bounds(m, N)[r]
        if s.get("owner") is not None and np.asarray(s["owner"]).size != qhi - qlo:
            raise StateError(f"{name!r}: owner residual of {np.asarray(s['owner']).size}"
                             f" values, expected {qhi - qlo}")


def _entries_for_layouts(layouts, state, comm):
    """The per-bucket ``ErrorFeedback`` state of ``layouts`` built from a
    per-parameter ``state`` (collective: one alltoall moves owner shards)."""
    N, r = comm.size, comm.rank
    new, sends = {}, [[] for _ in range(N)]
    by_index = {b.index: b for b in layouts}
    for b in layouts:
        saved = [(name, off, m, state[name]) for name, off, m
                 in zip(b.names, b.offsets, b.numels) if name in state]
        if not saved:
            continue
        dtype = b.dtype
        worker = None
        if any(s.get("worker") is not None for *_, s in saved):
            worker = np.zeros(b.n, dtype)
            for name, off, m, s in saved:
                if s.get("worker") is not None:
                    worker[off:off + m] = np.asarray(s["worker"]).reshape(-1)
        has_owner = any(s.get("owner") is not None for *_, s in saved)
        bounds = shard_bounds(b.n, N)
        lo, hi = bounds[r]
        new[b.key] = {"worker": worker,
                      "owner": np.zeros(hi - lo, dtype) if has_owner else None,
                      "config": dict(saved[0][3]["config"]),
                      "calls": max(int(s.get("calls", 0)) for *_, s in saved),
                      "world_size": N, "rank": r, "n": b.n, "dtype": dtype.name}
        for name, off, m, s in saved:
            if s.get("owner") is None:
                continue
            vals = np.asarray(s["owner"]).reshape(-1)
            qlo, qhi = shard_bounds(m, N)[r]  # bucket positions off+qlo .. off+qhi
            for j, (jlo, jhi) in enumerate(bounds):
                a, z = max(off + qlo, jlo), min(off + qhi, jhi)
                if a < z:
                    sends[j].append((b.index, a - jlo, vals[a - off - qlo:z - off - qlo]))
    for pieces in comm.alltoall(sends):
        for index, start, vals in pieces:
            owner = new[by_index[index].key]["owner"]
            owner[start:start + vals.size] = vals
    return new


# -- hierarchical buckets (hierarchy="node"/"auto") ------------------------------
def _agree_hierarchy(c, comm, hierarchy, who):
    """Check ``hierarchy`` and that every rank passed the same (collective
    over ``c``): ``(layout, hierarchical)``, the node layout of ``comm``
    (None for ``"flat"``) and whether the buckets' calls are hierarchical."""
    exc = None
    if hierarchy not in _hierarchy.HIERARCHY_MODES:
        exc = ConfigError(f"hierarchy must be one of {_hierarchy.HIERARCHY_MODES}, got "
                          f"{hierarchy!r}")
    _raise_everywhere(c, exc, who)
    modes = c.allgather(hierarchy)
    if any(m != modes[0] for m in modes):
        exc = MismatchError(f"{who}: ranks disagree on hierarchy (" + ", ".join(
            f"rank {r}: {m!r}" for r, m in enumerate(modes)) + ")")
    _raise_everywhere(c, exc, who)
    lay = None if hierarchy == "flat" else _hierarchy.layout(comm)
    return lay, lay is not None and lay.hierarchical(hierarchy)


def _residual_keys(lay, hier, key, n):
    """``[(slice, key)]``: the residual keys of a bucket's calls on this rank:
    its own (slice None), or, when the calls are hierarchical, those of the
    slices this rank handles (``mpigc._hierarchy``)."""
    if not hier:
        return [(None, key)]
    return [(sl, _hierarchy.slice_key(key, sl, lay.L, n)) for sl in lay.slices_of(lay.rank)]


def _hier_to_flat(c, lay, fbs, size, rank):
    """``fbs`` (an ``ErrorFeedback.state_dict()``) with each bucket's
    hierarchical residuals (slice keys) also in the flat layout under the
    bucket's key (collective), as :func:`mpigc.save_checkpoint` converts them."""
    from . import checkpoint
    tmp = ErrorFeedback()
    tmp.load_state_dict(fbs)
    hier = checkpoint._hier_groups(tmp._entries)
    rows = checkpoint._hier_rows(c, hier)
    out = dict(fbs)
    for k, e in checkpoint._hier_to_flat(c, lay, hier, rows, size, rank).items():
        out[k[:-len(checkpoint.HIER_SUFFIX)]] = {
            "worker": e.worker, "owner": e.owner, "config": e.config, "calls": e.calls,
            "world_size": size, "rank": rank, "n": e.n, "dtype": e.dtype.name}
    return out


def _flat_to_hier(c, comm, new, hierarchy, who):
    """The per-bucket flat-layout state ``new`` (of
    :func:`_entries_for_layouts`) as residual entries of hierarchical calls
    on ``comm`` (collective): each bucket's worker residuals summed per node
    to its slices' handlers, owner shards moved to the group owners, as
    ``load_checkpoint(..., hierarchy=)`` does. ``{key: entry}``."""
    from . import checkpoint
    exc, tmp = None, ErrorFeedback()
    try:
        tmp.load_state_dict(new)
    except MpigcError as e:
        exc = e
    _raise_everywhere(c, exc, who)
    keys = c.allgather(sorted(tmp._entries))
    if any(k != keys[0] for k in keys):
        exc = StateError(f"{who}: ranks' states cover different buckets (" + "; ".join(
            f"rank {r}: {len(k)} bucket(s)" for r, k in enumerate(keys)) + ")")
    _raise_everywhere(c, exc, who)
    return checkpoint._to_layout(c, comm, tmp._entries, hierarchy)


# -- broadcast helpers ---------------------------------------------------------
def init_process_group(backend=None, *, comm=None, master_addr=None, master_port=None,
                       **kwargs):
    """``torch.distributed.init_process_group`` over the ranks of an MPI job
    (``mpirun``, ``srun``: any launcher MPI runs under), as under ``torchrun``
    (collective over ``comm``).

    Sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
    ``MASTER_ADDR`` and ``MASTER_PORT`` from the MPI job
    (:func:`mpigc.launch.torchrun_env`: the address and a free port are agreed
    over MPI), then initialises the default process group from them. A script
    written for ``torchrun`` calls this instead of
    ``torch.distributed.init_process_group`` and reads the variables as
    before; or it stays unchanged under ``python -m mpigc.launch``.

    Parameters
    ----------
    backend : str, optional
        ``"nccl"`` when CUDA is available, else ``"gloo"`` (default).
    comm, master_addr, master_port
        As for :func:`mpigc.launch.torchrun_env`.
    **kwargs
        Passed on (``timeout=``, ``device_id=``, ...).

    Returns
    -------
    dict
        The variables set.

    Examples
    --------
    >>> env = mpigc.torch.init_process_group()               # doctest: +SKIP
    >>> model = DDP(model.to(device), device_ids=[int(env["LOCAL_RANK"])])  # doctest: +SKIP
    """
    from .launch import torchrun_env
    env = torchrun_env(comm, master_addr=master_addr, master_port=master_port)
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    torch.distributed.init_process_group(backend, init_method="env://",
                                         rank=int(env["RANK"]),
                                         world_size=int(env["WORLD_SIZE"]), **kwargs)
    return env


def _named_tensors(obj):
    if isinstance(obj, torch.nn.Module):
        return list(obj.named_parameters()) + list(obj.named_buffers())
    if isinstance(obj, dict):
        return [(k, v) for k, v in obj.items() if torch.is_tensor(v)]
    return list(obj)


def broadcast_parameters(module, root=0, *, comm=None):
    """Copy the parameters and buffers of ``module`` from ``root`` to every rank,
    in place (collective), so that every rank starts from the same model.

    Parameters
    ----------
    module : torch.nn.Module, dict of tensors, or iterable of ``(name, tensor)``
        CPU or CUDA tensors of any dtype.
    root : int
        The rank whose values win.
    comm : mpi4py.MPI.Intracomm, optional
        Default ``MPI.COMM_WORLD``; mpigc talks on a private duplicate.

    Raises
    ------
    MismatchError
        On every rank, when ranks hold different names, shapes or dtypes.
    """
    comm = _resolve_comm(comm)
    named = _named_tensors(module)
    c = comm.Dup()  # never on the user's communicator
    try:
        _check_same(c, _describe(named), "broadcast_parameters")
        with torch.no_grad():
            for _, t in named:
                if t.numel() == 0:
                    continue
                host = t.detach()
                staged = host.device.type != "cpu" or not host.is_contiguous()
                if staged:
                    host = host.to("cpu", copy=True).contiguous()
                c.Bcast([host.reshape(-1).view(torch.uint8).numpy(), MPI.BYTE], root=root)
                if staged:
                    t.copy_(host)
    finally:
        c.Free()


def broadcast_optimizer_state(optimizer, root=0, *, comm=None):
    """Give every rank ``root``'s optimizer state (``optimizer.load_state_dict``);
    collective. Needed after a resume where only ``root`` read the checkpoint."""
    comm = _resolve_comm(comm)
    state = optimizer.state_dict() if comm.rank == root else None
    state = comm.bcast(state, root=root)
    if comm.rank != root:
        optimizer.load_state_dict(state)


# -- device buckets ------------------------------------------------------------
#: Test seam (private). Under Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``)
#: only: buckets of CPU parameters become device buckets whose engine array is a
#: simulated device array over the bucket tensor's memory, so the device bucket
#: code (allocation, gradient copy, the engine's device path, copy-back,
#: snapshots and rollback, residual state) runs without a GPU. Read when a
#: GradientSync or a hook call is made; see tests/mpi/test_torch_gpu_sim_mpi.py.
_sim_device_buckets = False


def _simulating():
    if not _sim_device_buckets:
        return False
    from . import _cuda
    if not _cuda.simulator():
        raise ConfigError("mpigc.torch._sim_device_buckets is a test seam of Numba's CUDA "
                          "simulator: set NUMBA_ENABLE_CUDASIM=1")
    return True


def _sim_device_array(t):
    """The seam: a simulated device array over CPU tensor ``t``'s memory."""
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
    return FakeCUDAArray(t.detach().numpy())


def _engine_array(t, device):
    """What the engine reduces for a contiguous 1-D bucket tensor ``t``: a CUDA
    tensor itself (through ``__cuda_array_interface__``: the engine's device
    path), under the test seam a simulated device array over it, else its
    numpy view (the host path)."""
    if t.is_cuda:
        return t
    if device:
        return _sim_device_array(t)
    return t.detach().numpy()


def _as_tensor(a, like):
    """A torch view (no copy) of residual array ``a`` (numpy, Numba device or
    simulated device array) for arithmetic next to tensor ``like``."""
    if isinstance(a, np.ndarray):
        return torch.from_numpy(a)
    if like.is_cuda:
        return torch.as_tensor(a, device=like.device)  # __cuda_array_interface__
    return torch.from_numpy(a._ary)  # the simulator's array wraps a numpy array


def _engine_after_torch(device):
    """Order the engine's kernels after what torch queued so far on its
    current stream of ``device``. The engine launches on the default stream
    (the legacy one, which is torch's default stream too): when torch's
    current stream is another one, the default stream waits for an event
    recorded on it (no host wait, no device-wide synchronisation)."""
    cur = torch.cuda.current_stream(device)
    engine = torch.cuda.default_stream(device)
    if cur != engine:
        engine.wait_stream(cur)


def _torch_after_engine(device):
    """Order what torch queues next on its current stream after the engine's
    kernels (the engine waits for them on the host before a call completes;
    this event keeps the order should it ever return earlier)."""
    cur = torch.cuda.current_stream(device)
    engine = torch.cuda.default_stream(device)
    if cur != engine:
        cur.wait_stream(engine)


def _first_is_nan(tensors):
    """``[isnan(t[0])]`` of 1-D tensors (False for empty ones) with one read
    back per device, not one per tensor (a read waits for the stream)."""
    out = [False] * len(tensors)
    by_device = {}
    for i, t in enumerate(tensors):
        if t.numel():
            by_device.setdefault(t.device, []).append(i)
    for idx in by_device.values():
        flags = torch.stack([torch.isnan(tensors[i][0]) for i in idx]).tolist()
        for i, f in zip(idx, flags):
            out[i] = bool(f)
    return out


# -- buckets -------------------------------------------------------------------
class Bucket(_Layout):
    """One fused gradient buffer (read-only view for users and tests).

    Attributes
    ----------
    index : int
        Position in the launch order (the same on every rank).
    key : str
        The residual key in :attr:`GradientSync.feedback`, derived from the
        ordered parameter names and sizes (``"torch/<first>..<last>/<hash>"``).
    names : list of str
        The parameters, in bucket order.
    offsets, numels : list of int
        Where each parameter's gradient sits in the flat buffer.
    tensor : torch.Tensor
        The buffer: float32 (float64 for float64 parameters), 1-D; a CUDA
        tensor on the parameters' GPU for a device bucket, else in host
        memory (pinned when its parameters are on a GPU).
    on_device : bool
        A device bucket: every parameter of the bucket is on one GPU (and
        ``device_buckets`` was not turned off); the engine compresses and
        decodes it on that GPU.
    flat : numpy.ndarray or torch.Tensor
        What the engine reduces: the numpy view of :attr:`tensor` (host
        bucket), or :attr:`tensor` itself (device bucket).
    started_at : float or None
        ``time.perf_counter()`` when this step's allreduce started, or None.
    """

    def __init__(self, index, entries, np_dtype, device, pin):
        super().__init__(index, [n for n, _, _ in entries],
                         [p.numel() for _, _, p in entries], np_dtype)
        self.param_index = [i for _, i, _ in entries]
        tdtype = torch.float64 if self.dtype == np.float64 else torch.float32
        sim = device is None and _simulating()
        self.on_device = device is not None or sim
        if device is not None:  # a device bucket in GPU memory
            self.tensor = torch.zeros(self.n, dtype=tdtype, device=device)
        else:
            self.tensor = torch.zeros(self.n, dtype=tdtype, pin_memory=pin)
        self.flat = _engine_array(self.tensor, self.on_device)
        self.pending = len(self.names)
        self.request = None
        self.error = None
        self.started_at = None

    def __repr__(self):
        return (f"Bucket(index={self.index}, key={self.key!r}, params={len(self.names)}, "
                f"n={self.n}, on_device={self.on_device})")


def _accumulate_grad_hook(p, fn):
    """Call ``fn(p)`` once ``p.grad`` holds this backward's accumulated gradient."""
    if hasattr(p, "register_post_accumulate_grad_hook"):  # torch >= 2.1
        return p.register_post_accumulate_grad_hook(fn), None
    acc = p.expand_as(p).grad_fn.next_functions[0][0]  # torch 2.0: AccumulateGrad node
    return acc.register_hook(lambda *_: fn(p)), acc


class GradientSync:
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
        ``"terngrad"``, ``"fp16"``, ``"bf16"``, ``"none"`` (exactly ``MPI_Allreduce``).
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
        forever.
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
                 hierarchy="flat", **params):
        self.comm = _resolve_comm(comm)
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
            self.compressor = get_compressor(op, **params)
            self.nonfinite = _torch_nonfinite(nonfinite)
            self.timeout = _resolve_timeout(timeout)
            self.feedback = _check_feedback(feedback)
            if not _positive(bucket_mb):
                raise ConfigError(f"bucket_mb: expected a positive number, got {bucket_mb!r}")
            _check_gather(gather)
            named = (list(module.named_parameters()) if isinstance(module, torch.nn.Module)
                     else list(module))
            for n, p in named:
                if p.requires_grad and p.dtype not in _BUCKET_DTYPES:
                    raise DTypeError(f"parameter {n!r}: expected a float16, bfloat16, "
                                     f"float32 or float64 parameter, got {p.dtype}")
            settings = {"op": self.compressor.get_config(), "bucket_mb": float(bucket_mb),
                        "average": self.average, "gather": gather,
                        "nonfinite": self.nonfinite,
                        "find_unused_parameters": bool(find_unused_parameters),
                        "hierarchy": str(hierarchy)}
        except (MpigcError, TypeError, ValueError) as e:
            exc = e
        self._comm = self.comm.Dup()  # this object's own small collectives
        _engine_comm.resolve(self.comm)  # the engine's duplicate, now rather than in a hook
        agree_construction(self._comm, exc, settings, "GradientSync")
        self._arrive = _Rendezvous(self._comm)
        self.hierarchy = hierarchy
        # the node layout (collective): whether the buckets' calls are hierarchical
        self._lay, self._hier = _agree_hierarchy(self._comm, self.comm, hierarchy,
                                                 "GradientSync")
        named = [(n, p) for n, p in named if p.requires_grad]
        _check_same(self._comm, _describe(named), "GradientSync")
        taken = [n for n, p in named if _hooked_by(p) is not None]
        _raise_everywhere(self._comm, None if not taken else StateError(
            f"parameters {taken[:5]} are synchronised by another GradientSync (or "
            "DistributedOptimizer) already: call remove_hooks() on it (opt.sync."
            "remove_hooks()) before wrapping the model again, e.g. after unfreezing "
            "layers"), "GradientSync")
        self.names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self.size, self.rank = self._comm.size, self._comm.rank
        self.buckets = self._make_buckets(named, float(bucket_mb))
        self._where = {}  # param index -> (bucket, offset, numel)
        self._views = {}  # param index -> its slice of the bucket (as_bucket_view)
        for b in self.buckets:
            for i, off, m in zip(b.param_index, b.offsets, b.numels):
                self._where[i] = (b, off, m)
                p = self._params[i]
                if (self.gradient_as_bucket_view and p.device == b.tensor.device
                        and p.dtype == b.tensor.dtype):
                    self._views[i] = b.tensor[off:off + m].view(p.shape)
        self._ready = [False] * len(self._params)
        self._next = 0
        self._dirty = False
        self._no_sync = 0
        self._versions = {}  # param index -> (grad, its _version) when its bucket started
        # several buckets: residuals before the step, put back when another
        # bucket of the step was skipped (nonfinite="skip") or failed (an
        # error, e.g. NaN/Inf with nonfinite="raise"), so a step changes the
        # residuals of all its buckets or of none
        self._keep_snapshots = len(self.buckets) > 1
        self._snapshots = {}
        self._spare_snapshots = {}  # key -> an old snapshot whose arrays are reused
        self._agree_req = None
        self._agree_buf = None
        self._changed = []
        self._callback_queued = False
        self._handles = []
        self._hooked_ids = {id(p) for p in self._params}
        for i, p in enumerate(self._params):
            self._handles.append(_accumulate_grad_hook(p, self._make_hook(i)))
            p._mpigc_sync = weakref.ref(self)  # see _hooked_by

    # -- construction ----------------------------------------------------------
    def _make_buckets(self, named, bucket_mb):
        # reverse registration order: roughly the order in which backward
        # produces the gradients (DDP does the same); one dtype per bucket
        cap = bucket_mb * (1 << 20)
        open_, nbytes, done = {}, {}, []
        for i in reversed(range(len(named))):
            name, p = named[i]
            dt = _BUCKET_DTYPES[p.dtype]
            cur = open_.setdefault(dt, [])
            cur.append((name, i, p))
            nbytes[dt] = nbytes.get(dt, 0) + p.numel() * np.dtype(dt).itemsize
            if nbytes[dt] >= cap:
                done.append((cur[0][1], dt, cur))
                open_[dt], nbytes[dt] = [], 0
        done += [(cur[0][1], dt, cur) for dt, cur in open_.items() if cur]
        done.sort(key=lambda t: -t[0])  # by first parameter, in backward order
        # where each bucket lives is this rank's choice (the layout above is
        # the same on every rank whatever the devices): on the GPU that holds
        # all its parameters, else in host memory
        buckets = []
        for k, (_, dt, entries) in enumerate(done):
            devices = {p.device for _, _, p in entries}
            dev = next(iter(devices)) if len(devices) == 1 else None
            on_gpu = dev is not None and dev.type == "cuda" and self.device_buckets
            pin = (not on_gpu and torch.cuda.is_available()
                   and any(p.is_cuda for _, _, p in entries))
            buckets.append(Bucket(k, entries, dt, dev if on_gpu else None, pin))
        return buckets

    def _make_hook(self, i):
        def hook(p):
            self._grad_ready(i, p)
        return hook

    def remove_hooks(self):
        """Detach from the model: its gradients are no longer synchronised.

        Call it before building a new ``GradientSync`` (or
        ``DistributedOptimizer``) for the same parameters, e.g. after
        unfreezing layers: otherwise both objects' hooks fire and the old
        one, which does not know the new parameters, raises at the next
        step. Not collective; the residuals stay in :attr:`feedback`.
        """
        for h, _ in self._handles:
            h.remove()
        self._handles = []
        self._hooked_ids = set()

    # -- during backward ---------------------------------------------------------
    def _grad_ready(self, i, p):
        if self._no_sync or p.grad is None:
            return
        b, off, m = self._where[i]
        if self._ready[i]:
            raise StateError(
                f"parameter {self.names[i]!r} got a second gradient before sync.wait(); "
                "accumulate gradients inside `with sync.no_sync():` instead. Or is another "
                "GradientSync hooked to the same parameters? Call remove_hooks() on the "
                "old one before wrapping the model again")
        if self.sync_on_backward and not self._callback_queued:
            # as DDP: finish the step when the autograd engine finishes backward
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._callback_queued = True
        view = self._views.get(i)
        if view is None or not self._is_view(p.grad, view):
            with torch.no_grad():
                # on the GPU for a device bucket (on torch's current stream)
                b.tensor[off:off + m].copy_(p.grad.detach().reshape(-1))
            if view is not None:
                p.grad = view  # backward accumulates into the bucket from now on
        if b.tensor.is_cuda:
            _engine_after_torch(b.tensor.device)
        self._ready[i] = True
        self._dirty = True
        b.pending -= 1
        if b.pending == 0:
            self._launch_ready()
        self._poke()

    @staticmethod
    def _is_view(grad, view):
        return (grad is not None and grad.data_ptr() == view.data_ptr()
                and grad.shape == view.shape and grad.dtype == view.dtype
                and grad.stride() == view.stride())

    def _end_of_backward(self):
        self._callback_queued = False
        self.wait()

    def _launch(self, b):
        # the gradients as sent: a change before wait() would be lost (see wait)
        for i in b.param_index:
            g = self._params[i].grad
            if self._ready[i] and g is not None:
                self._versions[i] = (g, g._version)
        if b.tensor.is_cuda:
            _engine_after_torch(b.tensor.device)  # zeros and fold-backs of wait()
        if self._keep_snapshots:
            self._snapshots[b.key] = _snapshot_keys(
                self.feedback, [k for _, k in self._residual_keys(b)],
                self._spare_snapshots.pop(b.key, None))
        b.started_at = time.perf_counter()
        b.request = iallreduce(b.flat, op=self.compressor, comm=self.comm, key=b.key,
                               average=self.average, gather=self.gather,
                               feedback=self.feedback, nonfinite=self.nonfinite,
                               hierarchy=self.hierarchy)

    def _launch_ready(self):
        # buckets start in index order on every rank, whatever order their
        # gradients arrive in (the engine needs the same order everywhere)
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            self._launch(self.buckets[self._next])
            self._next += 1

    def _poke(self):
        """Let the started allreduces progress (MPI progresses inside test())."""
        for b in self.buckets[:self._next]:
            if b.request is not None and b.error is None and not b.request.done:
                try:
                    b.request.test()
                except Exception as e:  # noqa: BLE001 - raised by wait()
                    b.error = e

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
        if self._agree_req is None:
            for b in self.buckets[self._next:]:  # buckets that some parameter did not fill
                for i, off, m in zip(b.param_index, b.offsets, b.numels):
                    if not self._ready[i]:
                        b.tensor[off:off + m].zero_()
                b.pending = 0
            self._launch_ready()
            changed = [self.names[i] for i, (g, v) in self._versions.items()
                       if self._params[i].grad is not g or g._version != v]
            self._post_agreement(active=True, changed=bool(changed),
                                 used=self._ready if self.find_unused_parameters else None)
            self._changed = changed
        buf = self._agreement()
        self._finish(buf, write=True)
        self.steps += 1

    def _post_agreement(self, active, changed, used=None):
        """Every step starts with one small allreduce on every rank, active
        or joined: [ranks with gradients, ranks whose gradients changed
        after they were sent, per parameter: ranks that used it]."""
        buf = np.zeros(2 + (len(self._params) if self.find_unused_parameters else 0),
                       np.int64)
        buf[0], buf[1] = int(active), int(changed)
        if used is not None:
            buf[2:] = np.asarray(used, np.int64)
        self._agree_buf = buf
        self._agree_req = self._comm.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM)

    def _agreement(self):
        _wait_request(self._agree_req.Test, self.timeout, self._poke,
                      f"GradientSync (rank {self.rank} of {self.size})")
        self._agree_req = None
        return self._agree_buf

    def _finish(self, buf, write):
        """Complete the step's allreduces (every rank, active or joined)."""
        unused = (buf[2:] == 0) if self.find_unused_parameters else None
        errors = []
        for b in self.buckets:
            try:
                if b.error is None:
                    b.request.wait()
            except Exception as e:  # noqa: BLE001
                b.error = e
            if b.error is not None:
                errors.append(b.error)
        snapshots, self._snapshots = self._snapshots, {}
        changed, self._changed = self._changed, []
        failed = {b.key for b in self.buckets if b.error is not None}
        self._reset_step()
        if errors:
            # a failed call changed no residual; those of this step's other
            # buckets go back to what they were before it
            for key, snaps in snapshots.items():
                if key not in failed:
                    _restore_keys(self.feedback, snaps)
            self._spare_snapshots.update(snapshots)
            raise errors[0]
        if buf[1]:
            raise StateError(
                f"param.grad was changed in place or replaced after backward() had sent it, "
                f"on {int(buf[1])} rank(s) (here: {changed[:5]}); the averaged gradients "
                "would overwrite that change. Call sync.wait() (opt.synchronize()) before "
                "clipping, GradScaler.unscale_() or any other change of the gradients")
        for dev in {b.tensor.device for b in self.buckets if b.tensor.is_cuda}:
            _torch_after_engine(dev)
        nan = _first_is_nan([b.tensor for b in self.buckets])  # a skipped bucket: all NaN
        skipped = self.nonfinite == "skip" and any(nan)
        self.last_step_finite = not skipped
        if skipped:  # a step that a loss scaler will skip: no residual changes
            self.nonfinite_steps += 1
            for b, bad in zip(self.buckets, nan):
                if b.key in snapshots and not bad:
                    _restore_keys(self.feedback, snapshots[b.key])
        # the snapshots' arrays serve the next step's snapshots
        self._spare_snapshots.update(snapshots)
        with torch.no_grad():
            for i, p in enumerate(self._params):
                b, off, m = self._where[i]
                if unused is not None and unused[i]:
                    if not skipped:
                        self._fold_back(b, off, m)
                    if i in self._views:
                        b.tensor[off:off + m].zero_()  # a .grad that is the view reads 0
                    continue
                if not write:
                    continue
                if i in self._views:
                    p.grad = self._views[i]  # the result is in place already
                    continue
                src = b.tensor[off:off + m].view(p.shape)
                if p.grad is None:
                    p.grad = torch.empty_like(p, memory_format=torch.contiguous_format)
                p.grad.copy_(src)

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
        while True:
            self._post_agreement(active=False, changed=0,
                                 used=[False] * len(self._params)
                                 if self.find_unused_parameters else None)
            buf = self._agreement()
            if buf[0] == 0:
                break
            for b in self.buckets:  # shadow: zeros, in bucket order
                b.tensor.zero_()
                b.pending = 0
            self._dirty = True
            self._launch_ready()
            self._finish(buf, write=False)
        counts = self._comm.allgather(self.steps - start)
        root = int(np.argmax(counts))
        if max(counts) > min(counts):
            broadcast_parameters(list(zip(self.names, self._params)), root=root,
                                 comm=self.comm)

    def _reset_step(self):
        self._ready = [False] * len(self._params)
        self._next = 0
        self._dirty = False
        self._versions = {}
        for b in self.buckets:
            b.pending = len(b.names)
            b.request = None
            b.error = None

    def _fold_back(self, b, off, m):
        """A parameter no rank used: give what its elements delivered back to
        the worker residuals (so nothing is lost), leave its grad alone."""
        if self._hier:
            self._fold_back_hier(b, off, m)
            return
        entry = self.feedback._entries.get(b.key)
        if entry is None or entry.worker is None:
            return
        delivered = b.tensor[off:off + m]
        worker = _as_tensor(entry.worker, b.tensor)[off:off + m]  # a view, either side
        worker += delivered if self.average else delivered / self.size

    def _residual_keys(self, b):
        return _residual_keys(self._lay, self._hier, b.key, b.n)

    def _fold_back_hier(self, b, off, m):
        """:meth:`_fold_back` for hierarchical buckets: a slice's worker
        residuals are held by its M handlers (one per node), so each takes
        1/M of the total that the parameter's elements delivered."""
        lay = self._lay
        total = self.size if self.average else 1  # delivered = total sum / this
        sb = shard_bounds(b.n, lay.L)
        for sl, key in self._residual_keys(b):
            e = self.feedback._entries.get(key)
            slo, shi = sb[sl]
            lo, hi = max(off, slo), min(off + m, shi)
            if e is None or e.worker is None or hi <= lo:
                continue
            worker = _as_tensor(e.worker, b.tensor)[lo - slo:hi - slo]
            worker += b.tensor[lo:hi] * (total / lay.M)

    # -- state -------------------------------------------------------------------
    def _idle(self, what):
        if self._dirty:
            raise StateError(f"{what}: a gradient synchronisation is in progress; call "
                             "wait() first")

    def state_dict(self):
        """The residuals keyed by parameter name (collective).

        The format is :meth:`mpigc.ErrorFeedback.state_dict`'s, one key per
        trainable parameter, so it loads into an :class:`ErrorFeedback` that
        :func:`mpigc.save_checkpoint` can save (and reshard). ``worker`` is the
        parameter's slice of its bucket's worker residual; ``owner`` is this
        rank's shard (``numpy.array_split`` of the parameter's elements) of the
        owner residuals, gathered from the ranks that own those elements in
        the current bucketing. So the state does not depend on the buckets.
        """
        self._arrive(self.timeout, "GradientSync.state_dict")
        exc = None
        try:
            self._idle("state_dict")
            fbs = self.feedback.state_dict()
        except MpigcError as e:
            exc, fbs = e, {}
        _raise_everywhere(self._comm, exc, "GradientSync.state_dict")
        if self._hier:
            fbs = _hier_to_flat(self._comm, self._lay, fbs, self.size, self.rank)
        return _state_from_layouts(self.buckets, fbs, self._comm, self.gather)

    def load_state_dict(self, state, strict=True):
        """Load residuals from :meth:`state_dict` (collective), whatever the
        bucketing was when they were saved.

        ``state`` must come from a job with this world size (load a checkpoint
        saved at another size with :func:`mpigc.load_checkpoint`, which
        reshards it, then pass ``store.state_dict()``). With ``strict`` (the
        default) names that are not trainable parameters here, or trainable
        parameters missing from a non-empty state, raise
        :class:`mpigc.StateError` on every rank; otherwise they are ignored
        and the missing residuals start at zero.
        """
        self._arrive(self.timeout, "GradientSync.load_state_dict")
        exc = None
        try:
            self._idle("load_state_dict")
            state = dict(state)
            known = set(self.names)
            extra = sorted(set(state) - known)
            missing = [n for n in self.names if n not in state] if state else []
            if strict and (extra or missing):
                raise StateError(f"state names do not match the parameters: unexpected "
                                 f"{extra[:5]}, missing {missing[:5]} (strict=False "
                                 "ignores them)")
            _check_state(state, {n: p.numel() for n, p in zip(self.names, self._params)},
                         self.size, self.rank)
        except MpigcError as e:
            exc = e
        _raise_everywhere(self._comm, exc, "GradientSync.load_state_dict")
        new = _entries_for_layouts(self.buckets, state, self._comm)
        if not self._hier:
            self.feedback.load_state_dict(new)
            return
        # hierarchical buckets: each bucket's flat-layout residuals to its slice
        # keys on this layout
        entries = _flat_to_hier(self._comm, self.comm, new, self.hierarchy,
                                "GradientSync.load_state_dict")
        self.feedback._replace_entries(entries)

    def save_checkpoint(self, path, step=None):
        """Save the residuals with :func:`mpigc.save_checkpoint` (collective),
        keyed by parameter name (see :meth:`state_dict`)."""
        import mpigc
        fb = ErrorFeedback()
        fb.load_state_dict(self.state_dict())
        return mpigc.save_checkpoint(path, fb, comm=self.comm, step=step)

    def load_checkpoint(self, path, strict=True):
        """Load residuals saved by :meth:`save_checkpoint` (collective), on any
        world size and bucketing; returns :func:`mpigc.load_checkpoint`'s info."""
        import mpigc
        self._arrive(self.timeout, "GradientSync.load_checkpoint")
        fb = ErrorFeedback()
        info = mpigc.load_checkpoint(path, fb, comm=self.comm)
        self.load_state_dict(fb.state_dict(), strict=strict)
        return info

    def __repr__(self):
        return (f"GradientSync(op={self.compressor!r}, params={len(self.names)}, "
                f"buckets={len(self.buckets)}, ranks={self.size})")


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
    Horovod's ``synchronize()`` and ``skip_synchronize()`` are supported.
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
        if (module is None) == (sync is None):
            raise ConfigError("DistributedOptimizer: pass either a module or sync=")
        if sync is None:
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


# -- DDP communication hook ----------------------------------------------------
_NP_OF_TORCH = {torch.float16: np.float16, torch.float32: np.float32,
                torch.float64: np.float64}


class CommHookState:
    """The state of :func:`comm_hook`: mpigc's compressed allreduce as a DDP
    communication hook, with residuals keyed by parameter name.

    ``ddp.register_comm_hook(CommHookState(ddp, op="2bit"), mpigc.torch.comm_hook)``:
    DDP keeps its process group (gloo, NCCL) for everything else (broadcasts,
    ``Join``); the buckets' gradients travel over MPI, compressed. Build it on
    every rank (collective over ``comm``).

    DDP builds its buckets anew after the first iteration (and whenever it
    rebuilds them); each bucket's residuals are kept per parameter, so a new
    bucketing takes over the residuals of the old one (one ``alltoall`` when
    it first appears). :meth:`state_dict` is per parameter name, in
    :meth:`GradientSync.state_dict`'s format: a checkpoint of either loads
    into the other. Under ``ddp.no_sync()`` DDP calls no hook.

    Parameters
    ----------
    module : torch.nn.Module or DistributedDataParallel
        The model (a DDP wrapper is unwrapped: names as ``ddp.module``'s).
    op, comm, average, gather, feedback, hierarchy, **params
        As for :class:`GradientSync`. With ``hierarchy="node"`` (or ``"auto"``
        on several nodes) each DDP bucket is summed exactly inside the node
        and compressed only between nodes; the residuals of its slices are
        kept per parameter across DDP's rebucketing as for flat buckets.
    nonfinite : str, optional
        As for :class:`GradientSync`: default ``"skip"``, so NaN/Inf reach DDP's
        gradients (and ``GradScaler``) as with DDP's own allreduce, and no
        residual changes in that step. ``"raise"``: the step's futures fail
        with :class:`mpigc.NonFiniteError` on every rank, and no residual
        changes either.
    timeout : float, optional
        As for :class:`GradientSync`: the seconds a rank waits for the others
        in a step and in :meth:`state_dict`, :meth:`save_checkpoint` and the
        loads before it raises :class:`mpigc.StateError` on that rank.

    The arguments are checked on every rank before the first collective and
    must be the same on every rank (:class:`mpigc.ConfigError` or
    :class:`mpigc.MismatchError` on every rank otherwise).
    """

    def __init__(self, module, op="2bit", *, comm=None, average=True, gather="compressed",
                 nonfinite=None, feedback=None, hierarchy="flat", timeout=None, **params):
        if isinstance(module, torch.nn.parallel.DistributedDataParallel):
            module = module.module
        self.comm = _resolve_comm(comm)
        self.average = bool(average)
        self.gather = gather
        exc, settings, named = None, None, []
        try:  # agreed on at the first collective, as GradientSync's
            self.compressor = get_compressor(op, **params)
            self.nonfinite = _torch_nonfinite(nonfinite)
            self.timeout = _resolve_timeout(timeout)
            self.feedback = _check_feedback(feedback)
            _check_gather(gather)
            named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
            settings = {"op": self.compressor.get_config(), "average": self.average,
                        "gather": gather, "nonfinite": self.nonfinite,
                        "hierarchy": str(hierarchy)}
        except (MpigcError, TypeError, ValueError) as e:
            exc = e
        self._comm = self.comm.Dup()
        _engine_comm.resolve(self.comm)
        agree_construction(self._comm, exc, settings, "CommHookState")
        self._arrive = _Rendezvous(self._comm)
        _check_same(self._comm, _describe(named), "CommHookState")
        self.hierarchy = hierarchy
        self._lay, self._hier = _agree_hierarchy(self._comm, self.comm, hierarchy,
                                                 "CommHookState")
        self.names = [n for n, _ in named]
        self._numel = {n: p.numel() for n, p in named}
        self._name_of = {id(p): n for n, p in named}
        self._params = [p for _, p in named]  # keeps the ids valid
        self._layouts = {}   # bucket index -> _Layout in use
        self._pending = {}   # per-parameter state waiting for its bucket
        self._inflight = []  # (layout, future, request, tensor, snapshot)
        self._spare_snapshots = {}  # key -> an old snapshot whose arrays are reused
        #: steps whose gradients were non-finite on some rank (``nonfinite="skip"``)
        self.nonfinite_steps = 0
        self.size, self.rank = self._comm.size, self._comm.rank

    # -- in the hook -------------------------------------------------------------
    def _layout_of(self, bucket, tensor):
        try:
            names = [self._name_of[id(p)] for p in bucket.parameters()]
        except KeyError:
            raise StateError("comm_hook: DDP's bucket holds a parameter that "
                             "CommHookState does not know (build it for the module "
                             "that DDP wraps)") from None
        if tensor.dtype not in _NP_OF_TORCH:
            raise DTypeError(f"comm_hook: expected float16, float32 or float64 "
                             f"gradients, got {tensor.dtype}")
        return _Layout(bucket.index(), names, [self._numel[n] for n in names],
                       _NP_OF_TORCH[tensor.dtype])

    def _keys(self, layout):
        """The residual keys of ``layout``'s calls on this rank."""
        return [k for _, k in _residual_keys(self._lay, self._hier, layout.key, layout.n)]

    def _place(self, layout):
        """A bucket layout new at its index takes over the residuals of its
        parameters (collective; every rank has the same buckets). A layout
        that only moved to another index keeps its residuals; the layouts it
        replaces (those that held its parameters, and the one it displaces
        at its index, whose parameters go to other buckets) hand theirs over
        by parameter name."""
        for i in [i for i, lay in self._layouts.items()
                  if lay.key == layout.key and i != layout.index]:
            del self._layouts[i]  # moved: its old index is free
        mine = set(layout.names)
        displaced = self._layouts.get(layout.index)
        stale = [lay for lay in self._layouts.values()
                 if lay.key != layout.key and (mine & set(lay.names) or lay is displaced)]
        if stale:
            # not feedback.state_dict(): buckets of this step before this one are
            # in flight (their keys busy); the stale ones are not (their
            # parameters are this bucket's, or, for the displaced one, of buckets
            # to come: a bucket of this step at another index that had its key
            # would have freed this index already)
            fbs = {}
            for lay in stale:
                for k in self._keys(lay):
                    e = self.feedback._entries.get(k)
                    if e is not None:
                        fbs[k] = _entry_state(e)
            if self._hier:  # the slices' residuals in the flat layout of each bucket
                fbs = _hier_to_flat(self._comm, self._lay, fbs, self.size, self.rank)
            self._pending.update(_state_from_layouts(stale, fbs, self._comm, self.gather))
            for lay in stale:
                for k in self._keys(lay):
                    self.feedback.reset(k)
                self._spare_snapshots.pop(lay.key, None)
                del self._layouts[lay.index]
        if any(n in self._pending for n in layout.names):
            new = _entries_for_layouts([layout], self._pending, self._comm)
            if self._hier:
                entries = _flat_to_hier(self._comm, self.comm, new, self.hierarchy,
                                        "comm_hook")
            else:
                tmp = ErrorFeedback()
                tmp.load_state_dict(new)
                entries = tmp._entries
            with self.feedback._lock:
                self.feedback._entries.update(entries)
            for n in layout.names:
                self._pending.pop(n, None)
        self._layouts[layout.index] = layout

    def _hook(self, bucket):
        tensor = bucket.buffer()
        layout = self._layout_of(bucket, tensor)
        known = self._layouts.get(layout.index)
        if known is None or known.key != layout.key:
            self._place(layout)
        # several buckets: a step changes the residuals of all or of none (see
        # _complete)
        several = not (bucket.is_last() and bucket.index() == 0)
        snap = (_snapshot_keys(self.feedback, self._keys(layout),
                               self._spare_snapshots.pop(layout.key, None))
                if several else None)
        # DDP's flat bucket is reduced in place: a CUDA tensor as it is (the
        # engine reduces device arrays on the GPU, after what torch queued on
        # its current stream), a CPU one as numpy
        flat = tensor.detach()
        if flat.is_cuda:
            _engine_after_torch(flat.device)
        req = iallreduce(_engine_array(flat, _simulating()), op=self.compressor,
                         comm=self.comm,
                         key=layout.key, average=self.average, gather=self.gather,
                         feedback=self.feedback, nonfinite=self.nonfinite,
                         hierarchy=self.hierarchy)
        fut = torch.futures.Future()
        self._inflight.append((layout, fut, req, tensor, snap))
        for _, _, r, _, _ in self._inflight[:-1]:
            try:
                r.test()  # progress; errors come from wait()
            except Exception:  # noqa: BLE001
                pass
        if bucket.is_last():
            self._complete()
        return fut

    def _complete(self):
        """The last bucket of the step: complete every bucket's allreduce and
        its future (DDP waits for them when backward ends)."""
        items, self._inflight = self._inflight, []
        error, failed = None, []
        for _, _, req, _, _ in items:
            try:
                _wait_request(req.test, self.timeout, lambda: None,
                              f"comm_hook (rank {self.rank} of {self.size})",
                              "the other ranks did not reach this step's gradient "
                              "synchronisation within {timeout:g} s (uneven inputs? DDP's "
                              "`join()` context manager on every rank; timeout=, "
                              "$MPIGC_TORCH_TIMEOUT)")
                req.wait()
                failed.append(False)
            except Exception as e:  # noqa: BLE001
                error = error or e
                failed.append(True)
        for dev in {t.device for _, _, _, t, _ in items if t.is_cuda}:
            _torch_after_engine(dev)
        if error is not None:
            # a failed call changed no residual: put back those of the step's
            # other buckets, so the failed step changes none
            for (_, _, _, _, snap), bad in zip(items, failed):
                if snap is not None and not bad:
                    _restore_keys(self.feedback, snap)
        elif self.nonfinite == "skip":
            bad = _first_is_nan([t for _, _, _, t, _ in items])
            if any(bad):  # a step GradScaler skips: put the other residuals back
                self.nonfinite_steps += 1
                for (layout, _, _, _, snap), b in zip(items, bad):
                    if not b and len(items) > 1:
                        _restore_keys(self.feedback, snap)
        for layout, _, _, _, snap in items:  # their arrays serve the next snapshots
            if snap is not None:
                self._spare_snapshots[layout.key] = snap
        for _, fut, _, tensor, _ in items:
            if error is None:
                fut.set_result(tensor)
            else:
                fut.set_exception(error)

    # -- state -------------------------------------------------------------------
    def state_dict(self):
        """Residuals per parameter name (collective), as
        :meth:`GradientSync.state_dict`."""
        self._arrive(self.timeout, "CommHookState.state_dict")
        exc = None
        try:
            if self._inflight:
                raise StateError("CommHookState.state_dict: a step is in progress")
            fbs = self.feedback.state_dict()
        except MpigcError as e:
            exc, fbs = e, {}
        _raise_everywhere(self._comm, exc, "CommHookState.state_dict")
        if self._hier:
            fbs = _hier_to_flat(self._comm, self._lay, fbs, self.size, self.rank)
        out = {n: dict(s) for n, s in self._pending.items()}
        out.update(_state_from_layouts(list(self._layouts.values()), fbs, self._comm,
                                       self.gather))
        return out

    def load_state_dict(self, state, strict=True):
        """Load :meth:`state_dict` (or :meth:`GradientSync.state_dict`) output
        of this world size (collective); each bucket takes its parameters'
        residuals at its next step. ``strict`` as for GradientSync."""
        self._arrive(self.timeout, "CommHookState.load_state_dict")
        exc = None
        try:
            if self._inflight:
                raise StateError("CommHookState.load_state_dict: a step is in progress")
            state = dict(state)
            extra = sorted(set(state) - set(self.names))
            missing = [n for n in self.names if n not in state] if state else []
            if strict and (extra or missing):
                raise StateError(f"state names do not match the parameters: unexpected "
                                 f"{extra[:5]}, missing {missing[:5]} (strict=False "
                                 "ignores them)")
            _check_state(state, self._numel, self.size, self.rank)
        except MpigcError as e:
            exc = e
        _raise_everywhere(self._comm, exc, "CommHookState.load_state_dict")
        self.feedback.reset()
        self._layouts = {}
        self._pending = {n: s for n, s in state.items() if n in self._numel}

    def save_checkpoint(self, path, step=None):
        """:func:`mpigc.save_checkpoint` of :meth:`state_dict` (collective)."""
        import mpigc
        fb = ErrorFeedback()
        fb.load_state_dict(self.state_dict())
        return mpigc.save_checkpoint(path, fb, comm=self.comm, step=step)

    def load_checkpoint(self, path, strict=True):
        """Load a checkpoint of :meth:`save_checkpoint` or
        :meth:`GradientSync.save_checkpoint`, of any world size (collective)."""
        import mpigc
        self._arrive(self.timeout, "CommHookState.load_checkpoint")
        fb = ErrorFeedback()
        info = mpigc.load_checkpoint(path, fb, comm=self.comm)
        self.load_state_dict(fb.state_dict(), strict=strict)
        return info

    def __repr__(self):
        return (f"CommHookState(op={self.compressor!r}, params={len(self.names)}, "
                f"buckets={len(self._layouts)}, ranks={self.size})")


def comm_hook(state, bucket):
    """DDP communication hook: mpigc's compressed allreduce of the bucket,
    over MPI, with error feedback keyed by parameter name.

    >>> ddp.register_comm_hook(mpigc.torch.CommHookState(ddp, op="2bit",
    ...                                                   rel_threshold=1.5),
    ...                        mpigc.torch.comm_hook)        # doctest: +SKIP

    Returns a ``torch.futures.Future`` of the averaged bucket; the futures of a
    step complete when DDP hands over its last bucket.
    """
    return state._hook(bucket)
