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
whose ``step()`` waits first.

A thin layer by composition over :func:`mpigc.iallreduce` and
:class:`mpigc.ErrorFeedback`; see ``docs/torch.md`` for the design (bucket order, keys,
residual layout, unused and frozen parameters, CUDA staging) and a migration guide
from DDP and Horovod. Importing this module imports torch; ``import mpigc`` does not.
"""
import contextlib
import hashlib
import json
import time
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
from ._errors import ConfigError, DTypeError, MismatchError, MpigcError, StateError
from .allreduce import iallreduce
from .compressors import get_compressor
from .feedback import ErrorFeedback, shard_bounds

__all__ = ["GradientSync", "DistributedOptimizer", "broadcast_parameters",
           "broadcast_optimizer_state", "Bucket"]

_BUCKET_DTYPES = {torch.float16: np.float32, torch.bfloat16: np.float32,
                  torch.float32: np.float32, torch.float64: np.float64}


# -- agreement helpers ---------------------------------------------------------
def _raise_everywhere(comm, exc, what):
    """Raise on every rank if ``exc`` is not None on some rank (collective)."""
    _comm.agree(comm, exc, what, default=StateError, classes={c.__name__: c for c in (
        ConfigError, DTypeError, MismatchError, MpigcError, StateError)})


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


# -- broadcast helpers ---------------------------------------------------------
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


# -- buckets -------------------------------------------------------------------
class Bucket:
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
    flat : numpy.ndarray
        The buffer (float32, or float64 for float64 parameters).
    started_at : float or None
        ``time.perf_counter()`` when this step's allreduce started, or None.
    """

    def __init__(self, index, entries, np_dtype, pin):
        self.index = index
        self.names = [n for n, _, _ in entries]
        self.param_index = [i for _, i, _ in entries]
        self.numels = [p.numel() for _, _, p in entries]
        self.offsets = np.concatenate([[0], np.cumsum(self.numels)])[:-1].astype(int).tolist()
        self.n = int(sum(self.numels))
        desc = json.dumps([[n, m] for n, m in zip(self.names, self.numels)]).encode()
        digest = hashlib.sha1(desc).hexdigest()[:12]
        self.key = f"torch/{self.names[0]}..{self.names[-1]}/{digest}"
        tdtype = torch.float64 if np_dtype == np.float64 else torch.float32
        self.tensor = torch.zeros(self.n, dtype=tdtype, pin_memory=pin)
        self.flat = self.tensor.numpy()
        self.pending = len(self.names)
        self.request = None
        self.error = None
        self.started_at = None

    def __repr__(self):
        return (f"Bucket(index={self.index}, key={self.key!r}, params={len(self.names)}, "
                f"n={self.n})")


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
    collective over ``comm``.

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
    gather, nonfinite : str, optional
        As for :func:`mpigc.allreduce`.
    feedback : ErrorFeedback, optional
        The residual store of the buckets; default a new one, :attr:`feedback`.
    gradient_as_bucket_view : bool
        As in DDP: ``param.grad`` of float32 and float64 CPU parameters
        becomes a view of its bucket after the first synchronisation, so
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
    **params
        Compressor parameters, e.g. ``threshold=0.5``.

    Examples
    --------
    >>> sync = mpigc.torch.GradientSync(model, op="2bit", bucket_mb=25)  # doctest: +SKIP
    >>> loss.backward(); sync.wait(); optimizer.step()                  # doctest: +SKIP
    """

    def __init__(self, module, op="2bit", *, bucket_mb=25.0, comm=None, average=True,
                 gather="compressed", nonfinite=None, feedback=None,
                 find_unused_parameters=False, gradient_as_bucket_view=False, **params):
        self.comm = _resolve_comm(comm)
        self.compressor = get_compressor(op, **params)
        self.average = bool(average)
        self.gather = gather
        self.nonfinite = nonfinite
        self.find_unused_parameters = bool(find_unused_parameters)
        self.gradient_as_bucket_view = bool(gradient_as_bucket_view)
        self.feedback = ErrorFeedback() if feedback is None else feedback
        if not isinstance(self.feedback, ErrorFeedback):
            raise ConfigError(f"feedback: expected an ErrorFeedback, got "
                              f"{type(self.feedback).__name__}")
        if not bucket_mb > 0:
            raise ConfigError(f"bucket_mb: expected a positive number, got {bucket_mb!r}")
        named = (list(module.named_parameters()) if isinstance(module, torch.nn.Module)
                 else list(module))
        self._comm = self.comm.Dup()  # this object's own small collectives
        _engine_comm.resolve(self.comm)  # the engine's duplicate, now rather than in a hook
        exc = None
        try:
            for n, p in named:
                if p.requires_grad and p.dtype not in _BUCKET_DTYPES:
                    raise DTypeError(f"parameter {n!r}: expected a float16, bfloat16, "
                                     f"float32 or float64 parameter, got {p.dtype}")
        except MpigcError as e:
            exc = e
        _raise_everywhere(self._comm, exc, "GradientSync")
        named = [(n, p) for n, p in named if p.requires_grad]
        _check_same(self._comm, _describe(named), "GradientSync")
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
                if (self.gradient_as_bucket_view and p.device.type == "cpu"
                        and p.dtype == b.tensor.dtype):
                    self._views[i] = b.tensor[off:off + m].view(p.shape)
        self._ready = [False] * len(self._params)
        self._next = 0
        self._dirty = False
        self._no_sync = 0
        self._handles = []
        for i, p in enumerate(self._params):
            self._handles.append(_accumulate_grad_hook(p, self._make_hook(i)))

    # -- construction ----------------------------------------------------------
    def _make_buckets(self, named, bucket_mb):
        # reverse registration order: roughly the order in which backward
        # produces the gradients (DDP does the same); one dtype per bucket
        pin = torch.cuda.is_available() and any(p.is_cuda for _, p in named)
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
        return [Bucket(k, entries, dt, pin) for k, (_, dt, entries) in enumerate(done)]

    def _make_hook(self, i):
        def hook(p):
            self._grad_ready(i, p)
        return hook

    def remove_hooks(self):
        """Detach from the model (the hooks are removed)."""
        for h, _ in self._handles:
            h.remove()
        self._handles = []

    # -- during backward ---------------------------------------------------------
    def _grad_ready(self, i, p):
        if self._no_sync or p.grad is None:
            return
        b, off, m = self._where[i]
        if self._ready[i]:
            raise StateError(
                f"parameter {self.names[i]!r} got a second gradient before sync.wait(); "
                "accumulate gradients inside `with sync.no_sync():` instead")
        view = self._views.get(i)
        if view is None or not self._is_view(p.grad, view):
            with torch.no_grad():
                b.tensor[off:off + m].copy_(p.grad.detach().reshape(-1))
            if view is not None:
                p.grad = view  # backward accumulates into the bucket from now on
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

    def _launch(self, b):
        b.started_at = time.perf_counter()
        b.request = iallreduce(b.flat, op=self.compressor, comm=self.comm, key=b.key,
                               average=self.average, gather=self.gather,
                               feedback=self.feedback, nonfinite=self.nonfinite)

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
        the last call.

        Raises
        ------
        MpigcError
            On every rank, when a bucket's allreduce failed (e.g.
            :class:`mpigc.NonFiniteError` for NaN/Inf gradients); ``param.grad``
            and the residuals are then unchanged.
        """
        if not self._dirty:
            return
        for b in self.buckets[self._next:]:  # buckets that some parameter did not fill
            for i, off, m in zip(b.param_index, b.offsets, b.numels):
                if not self._ready[i]:
                    b.flat[off:off + m] = 0
            b.pending = 0
        self._launch_ready()
        unused = None
        if self.find_unused_parameters:
            used = np.array(self._ready, np.uint8)
            self._comm.Allreduce(MPI.IN_PLACE, used, op=MPI.MAX)
            unused = ~used.astype(bool)
        errors = []
        for b in self.buckets:
            try:
                if b.error is None:
                    b.request.wait()
            except Exception as e:  # noqa: BLE001
                b.error = e
            if b.error is not None:
                errors.append(b.error)
        self._reset_step()
        if errors:
            raise errors[0]
        with torch.no_grad():
            for i, p in enumerate(self._params):
                b, off, m = self._where[i]
                if unused is not None and unused[i]:
                    self._fold_back(b, off, m)
                    if i in self._views:
                        b.flat[off:off + m] = 0  # a .grad that is the view reads 0
                    continue
                if i in self._views:
                    p.grad = self._views[i]  # the result is in place already
                    continue
                src = b.tensor[off:off + m].view(p.shape)
                if p.grad is None:
                    p.grad = torch.empty_like(p, memory_format=torch.contiguous_format)
                p.grad.copy_(src)

    def _reset_step(self):
        self._ready = [False] * len(self._params)
        self._next = 0
        self._dirty = False
        for b in self.buckets:
            b.pending = len(b.names)
            b.request = None
            b.error = None

    def _fold_back(self, b, off, m):
        """A parameter no rank used: give what its elements delivered back to
        the worker residuals (so nothing is lost), leave its grad alone."""
        entry = self.feedback._entries.get(b.key)
        if entry is None or entry.worker is None:
            return
        delivered = b.flat[off:off + m]
        entry.worker[off:off + m] += delivered if self.average else delivered / self.size

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
        exc = None
        try:
            self._idle("state_dict")
            fbs = self.feedback.state_dict()
        except MpigcError as e:
            exc, fbs = e, {}
        _raise_everywhere(self._comm, exc, "GradientSync.state_dict")
        N, r = self.size, self.rank
        out, sends = {}, [[] for _ in range(N)]
        for b in self.buckets:
            s = fbs.get(b.key)
            if s is None:
                continue
            has_owner = self._uses_owner(s["config"])
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
        for pieces in self._comm.alltoall(sends):
            for name, start, vals in pieces:
                out[name]["owner"][start:start + vals.size] = vals
        return out

    def _uses_owner(self, config):
        return self.gather == "compressed" and get_compressor(dict(config)).uses_feedback

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
        N, r = self.size, self.rank
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
            for name, s in state.items():
                if name not in known:
                    continue
                i = self.names.index(name)
                m = self._params[i].numel()
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
        except MpigcError as e:
            exc = e
        _raise_everywhere(self._comm, exc, "GradientSync.load_state_dict")
        new, sends = {}, [[] for _ in range(N)]
        for b in self.buckets:
            saved = [(name, off, m, state[name]) for name, off, m
                     in zip(b.names, b.offsets, b.numels) if name in state]
            if not saved:
                continue
            dtype = b.flat.dtype
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
        for pieces in self._comm.alltoall(sends):
            for index, start, vals in pieces:
                self_owner = new[self.buckets[index].key]["owner"]
                self_owner[start:start + vals.size] = vals
        self.feedback.load_state_dict(new)

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
        fb = ErrorFeedback()
        info = mpigc.load_checkpoint(path, fb, comm=self.comm)
        self.load_state_dict(fb.state_dict(), strict=strict)
        return info

    def __repr__(self):
        return (f"GradientSync(op={self.compressor!r}, params={len(self.names)}, "
                f"buckets={len(self.buckets)}, ranks={self.size})")


class DistributedOptimizer:
    """An optimizer whose ``step()`` first waits for the compressed gradient
    averaging (Horovod's ``hvd.DistributedOptimizer``, by composition).

    Parameters
    ----------
    optimizer : torch.optim.Optimizer
    module : torch.nn.Module, optional
        The model; a :class:`GradientSync` is built for it with ``**kwargs``.
    sync : GradientSync, optional
        Use an existing one instead.

    Everything else (``zero_grad``, ``state_dict``, ``param_groups``, ...) is
    the wrapped optimizer's.
    """

    def __init__(self, optimizer, module=None, *, sync=None, **kwargs):
        if (module is None) == (sync is None):
            raise ConfigError("DistributedOptimizer: pass either a module or sync=")
        self.optimizer = optimizer
        self.sync = sync if sync is not None else GradientSync(module, **kwargs)

    def step(self, closure=None):
        self.sync.wait()
        return self.optimizer.step() if closure is None else self.optimizer.step(closure)

    def zero_grad(self, set_to_none=True):
        return self.optimizer.zero_grad(set_to_none=set_to_none)

    def __getattr__(self, name):
        return getattr(self.__dict__["optimizer"], name)

    def __repr__(self):
        return f"DistributedOptimizer({self.optimizer!r}, {self.sync!r})"
