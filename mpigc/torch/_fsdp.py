"""mpigc's compressed reduce-scatter as FSDP2's gradient reduce-scatter."""
import json

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

from .. import _comm as _engine_comm
from .. import _wire
from .._auto import waiting_with
from .._errors import ConfigError, DTypeError, MismatchError, MpigcError, StateError
from ..feedback import new_entry, shard_bounds
from ..allreduce import iallreduce
from ..reduce_scatter import ireduce_scatter

from ._common import (NP_OF_TORCH, Rendezvous, Wait, agreed_comm, check_feedback, check_same,
                      describe, raise_everywhere, resolve_comm, resolve_timeout,
                      resolve_warn_s, settled, torch_auto, torch_nonfinite, wait_request,
                      warn_if_uncompressed)
from ._residuals import Residuals

__all__ = ["FsdpHookState", "register_fsdp_hooks"]

_REGISTER = Wait("call register_fsdp_hooks",
                 "It is collective: call it on every rank, on the same FSDP2 model",
                 "Its communicator duplication stays posted: this rank cannot use "
                 "mpigc on that communicator any more")
_STEP = Wait("reach this FSDP group's gradient reduce-scatter",
             "Hooks registered on some ranks only, or ranks that run different "
             "backward passes (a parameter group reduced on some ranks only)",
             "The call stays posted")


def _fsdp_groups(model):
    """``[(fqn, module, its FSDP parameter group)]`` of the FSDP2 modules of
    ``model`` that manage parameters, in ``named_modules`` order."""
    from torch.distributed.fsdp import FSDPModule
    found, out = False, []
    for fqn, m in model.named_modules():
        if not isinstance(m, FSDPModule):
            continue
        found = True
        groups = m._get_fsdp_state()._fsdp_param_groups
        if len(groups) > 1:
            raise ConfigError(f"register_fsdp_hooks: FSDP module {fqn or '<root>'!r} has "
                              f"{len(groups)} parameter groups (shard_placement_fn with "
                              "several meshes); one per module is supported")
        if groups:
            out.append((fqn, m, groups[0]))
    if not found:
        raise ConfigError(f"register_fsdp_hooks: {type(model).__name__} holds no FSDP2 "
                          "module: call torch.distributed.fsdp.fully_shard on it (and its "
                          "blocks) first")
    return out


def _with_grad(group):
    """The indices in ``group.fsdp_params`` of the parameters that FSDP2's
    ``post_backward`` is about to reduce (its own test, torch 2.13: an
    accumulated or autograd gradient, or ``set_reduce_scatter_unused_params``
    and trainable): the parameters of the flat input, in its order."""
    return tuple(i for i, fp in enumerate(group.fsdp_params)
                 if hasattr(fp, "_unsharded_param") and (
                     fp.unsharded_accumulated_grad is not None
                     or fp.unsharded_param.grad is not None
                     or (group.reduce_scatter_unused_params
                         and fp.unsharded_param.requires_grad)))


def _shard_ranks(group):
    """The global ranks of FSDP group ``group``'s reduce-scatter, or raise
    for FSDP's native HSDP (a 2-D mesh), whose replica all-reduce FSDP2
    runs itself (its all-reduce hook comes after it)."""
    if group._is_hsdp or getattr(group.mesh_info, "replicate_process_group", None) is not None:
        raise ConfigError("register_fsdp_hooks: fully_shard on a 2-D mesh (native HSDP) "
                          "all-reduces the replicas over its own process group, and FSDP2 "
                          "has no hook to replace that all-reduce: fully_shard over the shard "
                          "dimension alone (mesh['shard']) and register_fsdp_hooks runs the "
                          "replica all-reduce, compressed")
    return dist.get_process_group_ranks(group._reduce_scatter_process_group)


def _comm_ranks(comm, ranks):
    """FSDP's global ranks ``ranks`` as ranks of ``comm``, or raise."""
    mine, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        of = mine.Translate_ranks(list(range(comm.size)), world)
    finally:
        mine.Free()
        world.Free()
    where = {w: i for i, w in enumerate(of)}
    if any(r not in where for r in ranks):
        raise ConfigError(f"register_fsdp_hooks: the FSDP group's ranks {list(ranks)[:8]} are "
                          "not all ranks of comm: pass the communicator of the FSDP mesh's ranks")
    return [where[r] for r in ranks]


def _replica_split(comm, ranks):
    """``(shard position, replica index)`` of this rank, from every rank's
    shard group ``ranks`` (collective): they must cut the ranks into groups
    of one size, as a 2-D mesh's shard dimension does."""
    lists = comm.allgather(ranks)
    exc = None
    me = comm.rank
    for r, rr in enumerate(lists):
        if (r not in rr or len(rr) != len(lists[0]) or any(lists[q] != rr for q in rr)
                or comm.size % len(rr)):
            exc = ConfigError(f"register_fsdp_hooks: the FSDP shard groups do not cut the "
                              f"{comm.size} ranks into groups of one size (rank {r}: {rr})")
            break
    raise_everywhere(comm, exc, "register_fsdp_hooks")
    heads = sorted({min(rr) for rr in lists})
    return lists[me].index(me), heads.index(min(lists[me]))


class _MpiReduceScatter:
    """FSDP2's custom reduce-scatter (``set_custom_reduce_scatter``) of one
    FSDP parameter group: mpigc's compressed reduce-scatter over MPI."""

    def __init__(self, state, key, group):
        self.state, self.key, self.group = state, key, group

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        return self.state._reduce_scatter(self, output_tensor, input_tensor, group, op)


# the torch.distributed.fsdp class: FSDP checks isinstance(comm, ReduceScatter)
# in places; made a subclass at first use (importing fsdp is slow)
_CLASS = []


def _comm_class():
    if not _CLASS:
        from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
        _CLASS.append(type("MpiReduceScatter", (_MpiReduceScatter, ReduceScatter), {}))
    return _CLASS[0]


class FsdpHookState:
    """What :func:`register_fsdp_hooks` installed: the residuals of each FSDP
    parameter group (key ``"fsdp:<module fqn>"``, ``"fsdp:"`` for the root;
    under HSDP those of its replica allreduce) and the traffic of its calls.

    Attributes
    ----------
    keys : list of str
        The residual keys, one per FSDP parameter group, in module order.
    feedback : ErrorFeedback
        The residuals: on each rank, its worker residual of each group's
        flat (padded) reduce-scatter input.
    reduce_scatters : dict
        Key -> the reduce-scatter object installed on its FSDP module
        (``set_custom_reduce_scatter``; a wrapper may delegate to it).
    replicas : int
        1, or under HSDP the number of replicas that the compressed
        allreduce spans.
    calls, bytes_sent, logical_bytes : int
        This rank's reduce-scatter calls, the payload bytes it handed to MPI
        and the bytes of the inputs they reduced (:func:`mpigc.traffic`'s
        counters, for these calls only).
    auto_pin : str or None
        ``op="auto"``: its pin (``"model"``, ``"none"``, ``"compressed"``);
        else None. :attr:`compressor` is then ``auto_op``'s.
    decisions : dict
        ``op="auto"``: key -> the decision of its last call
        (:attr:`mpigc.AutoRequest.decision`: which op ran and why; the
        same on every rank).
    """

    def __init__(self, model, op, comm, nonfinite, feedback, timeout, params, auto_op=None,
                 auto_pin=None):
        self.comm = resolve_comm(comm)
        exc, settings, named, groups = None, None, [], []
        self.timeout = self._warn_s = None  # a bad timeout: the agreement says so
        self.auto_pin = None
        try:
            self.timeout = resolve_timeout(timeout)
            self._warn_s = resolve_warn_s()
            self.compressor, self.auto_pin = torch_auto(op, auto_op, auto_pin, params)
            self.nonfinite = torch_nonfinite(nonfinite)
            self.feedback = check_feedback(feedback)
            if not isinstance(model, torch.nn.Module):
                raise ConfigError(f"register_fsdp_hooks: expected a torch.nn.Module, got "
                                  f"{type(model).__name__}")
            groups = _fsdp_groups(model)
            if not dist.is_initialized():
                raise ConfigError("register_fsdp_hooks: torch.distributed is not "
                                  "initialised (FSDP2 needs its process group)")
            world = MPI.COMM_WORLD
            if (dist.get_rank(), dist.get_world_size()) != (world.rank, world.size):
                raise ConfigError(
                    f"register_fsdp_hooks: torch.distributed rank {dist.get_rank()} of "
                    f"{dist.get_world_size()} is not MPI rank {world.rank} of "
                    f"{world.size}: start the process group with the MPI rank and size "
                    "(mpigc.torch.init_process_group)")
            shard = sorted({tuple(_shard_ranks(g)) for _, _, g in groups})
            if len(shard) > 1:
                raise ConfigError("register_fsdp_hooks: the FSDP modules shard over "
                                  f"different groups {shard[:3]}; one mesh for all")
            shard = _comm_ranks(self.comm, shard[0]) if shard else list(range(self.comm.size))
            if len(shard) == self.comm.size and shard != sorted(shard):
                raise ConfigError("register_fsdp_hooks: the FSDP group's ranks must be in "
                                  "the communicator's order")
            named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            config = self.compressor.get_config()
            settings = {"op": "auto" if self.auto_pin else config,
                        "auto_op": config if self.auto_pin else None,
                        "auto_pin": self.auto_pin, "nonfinite": self.nonfinite,
                        "groups": [fqn for fqn, _, _ in groups], "shards": len(shard)}
        except (MpigcError, TypeError, ValueError, AttributeError) as e:
            exc = e
        # the first collective, within the timeout: registered on some ranks
        # only raises there instead of waiting for ever
        self._comm = agreed_comm(self.comm, exc, settings, "register_fsdp_hooks",
                                 within=(_REGISTER, self.timeout, self._warn_s))
        _engine_comm.resolve(self._comm)
        self._arrive = Rendezvous(self._comm, self._warn_s)  # its collective methods
        check_same(self._comm, describe(named), "register_fsdp_hooks")
        self._residuals = Residuals(self.feedback, self.comm, self._comm)
        self.size, self.rank = self._comm.size, self._comm.rank
        self.keys = [f"fsdp:{fqn}" for fqn, _, _ in groups]
        self._layouts = {}  # key -> (numel, dtype) of its flat input
        # key -> the parameters (indices in its FSDP group) of its flat input:
        # the last post_backward's (_with_grad), and those of its layout
        self._reducing, self._members = {}, {}
        self._partial = {}  # HSDP, set_requires_all_reduce(False): key -> its kept shard
        # key -> its first call's buffer, until every key has had one (op="auto"
        # runs calls under $MPIGC_MIN_COMPRESS_BYTES as "none" by design: no warning)
        self._first = {} if self.auto_pin is None else None
        self.decisions = {}  # op="auto": key -> the Decision of its last call
        # a step (one call per key) changes the residuals of all its keys or of
        # none: each key's residuals by copy before its call (with several keys)
        self._step = {}      # key -> the record taken before its call in this step
        self._step_spares = {}  # key -> an older step's record, its arrays reused
        self._step_dropped = False  # a call of this step was skipped or failed
        self._step_put_back = set()  # keys of the dropped step put back (or left alone)
        self.calls = self.bytes_sent = self.logical_bytes = 0
        self._groups = groups
        self._names = names = {id(p): n for n, p in model.named_parameters()}
        #: key -> [(parameter name, full shape)] of its FSDP group's trainable
        #: parameters, in its order: those FSDP2 reduce-scatters (it leaves
        #: frozen ones out of the flat input, set_reduce_scatter_unused_params too)
        self._params = {key: [(names.get(id(fp.sharded_param), "?"), list(fp._orig_size))
                              for fp in g.fsdp_params if fp.sharded_param.requires_grad]
                        for key, (_, _, g) in zip(self.keys, groups)}
        self._row_dtype = {key: _row_dtype(g) for key, (_, _, g) in zip(self.keys, groups)}
        fmesh = groups[0][2].mesh_info.mesh if groups else None
        # the mesh of the checkpoint rows: FSDP's (HSDP: the 2-D mesh above it)
        self._mesh = fmesh if fmesh is None or fmesh.size() == self.size else \
            fmesh._get_root_mesh()
        if any(fp.fsdp_placement.dim != 0 for _, _, g in groups for fp in g.fsdp_params):
            self._mesh = None  # FSDP's layout is another (no DCP record)
        self._saved = None  # prepare_load: the checkpoint's meta
        #: the number of replicas (HSDP: FSDP shards over groups of
        #: ``size / replicas`` ranks), 1 for FSDP over every rank
        self.replicas = self.size // len(shard)
        self.reduce_scatters = {}
        for key, (_, _, g) in zip(self.keys, groups):
            self._watch_post_backward(key, g)
        if self.replicas == 1:
            self._replica_comm = None
            cls = _comm_class()
            for key, (_, m, g) in zip(self.keys, groups):
                self.reduce_scatters[key] = cls(self, key, g)
                m.set_custom_reduce_scatter(self.reduce_scatters[key])
        else:  # FSDP's own reduce-scatter in the replica, the replicas' all-reduce here
            pos, replica = _replica_split(self._comm, shard)
            self._replica_comm = self._comm.Split(pos, replica)
            _engine_comm.resolve(self._replica_comm)
            for key, (_, m, g) in zip(self.keys, groups):
                m.set_all_reduce_hook(self._all_reduce_hook(key, g))

    # -- in backward ---------------------------------------------------------------
    def _watch_post_backward(self, key, group):
        """Record, as FSDP2's ``post_backward`` of ``group`` starts, which of
        its parameters the reduce-scatter it may run holds: two parameters
        of one shape, one with a gradient in a step and the other in the
        next, give flat inputs of one size but another meaning."""
        post_backward = group.post_backward

        def watched(*args, **kwargs):
            self._reducing[key] = _with_grad(group)
            return post_backward(*args, **kwargs)
        group.post_backward = watched

    def _all_reduce_hook(self, key, group):
        """FSDP's all-reduce hook of ``group`` (run after its reduce-scatter
        in the replica, on the shard, before FSDP's post-division): the
        compressed allreduce over the replicas, averaged as native HSDP's
        (a sum when ``set_gradient_divide_factor`` set the whole division)."""
        def hook(reduce_output):
            self._check_input(key, reduce_output)
            if not group.all_reduce_grads:
                # set_requires_all_reduce(False): as native HSDP, the shard
                # is kept (summed) here and all-reduced with the next call's;
                # FSDP adds the zeros left in its place to the gradient
                with torch.no_grad():
                    part = self._partial.get(key)
                    if part is None:
                        self._partial[key] = reduce_output.detach().clone()
                    else:
                        part += reduce_output
                    reduce_output.zero_()
                return
            part = self._partial.pop(key, None)
            if part is not None:
                with torch.no_grad():
                    reduce_output += part
            x = reduce_output.detach()
            xs = (x.float() if x.dtype == torch.bfloat16 else x).numpy()
            op, auto = self._op()
            self._run(key, xs, xs, lambda: iallreduce(
                xs, op=op, comm=self._replica_comm, key=key,
                average=group.gradient_divide_factor is None, feedback=self.feedback,
                nonfinite=self.nonfinite, **auto))
            if x.dtype == torch.bfloat16:
                with torch.no_grad():
                    reduce_output.copy_(torch.from_numpy(xs))
        return hook

    def _op(self):
        """``(op, keywords)`` of a call: the compressor, or with ``op="auto"``
        the engine's ``"auto"`` with ``auto_op`` and the pin (the engine
        decides per call, the same on every rank, and adds the residuals
        into a call it runs as ``"none"``, clearing them once delivered)."""
        if self.auto_pin is None:
            return self.compressor, {}
        return "auto", {"auto_op": self.compressor, "auto_pin": self.auto_pin}

    def _run(self, key, buf, result, start):
        """Start a call on ``buf`` whose result is ``result`` (``start()``:
        its request), wait for it within the timeout, count its traffic
        (which a call that completes at its start counts there). Once every
        group has had a call: a warning when they are all under
        $MPIGC_MIN_COMPRESS_BYTES (sent exactly). A step changes the
        residuals of all its keys or of none (:meth:`_begin`)."""
        if self._first is not None:
            self._first.setdefault(key, torch.from_numpy(buf))
            if len(self._first) == sum(1 for k in self.keys if self._params[k]):
                # every group that calls (a group of frozen parameters never does)
                warn_if_uncompressed("register_fsdp_hooks", self.compressor,
                                     list(self._first.values()),
                                     larger="fully_shard fewer, larger modules (one call "
                                            "per group: under HSDP one shard of it")
                self._first = None
        self._begin(key)
        before = _wire.traffic()
        label = f"FSDP gradient reduction of {key} (rank {self.rank} of {self.size})"

        def wait(r):
            wait_request(lambda: settled(r), label, _STEP, timeout=self.timeout,
                         warn_s=self._warn_s, watch=self._arrive.watch(
                             f"the gradient reduction of {key} (call {{step}})", label))
        try:
            # (a model step of op="auto" completes in the call: waited for
            # with the same lines and timeout)
            with waiting_with(wait if self.auto_pin is not None else None):
                req = start()
            self._arrive.step_posted()
            wait(req)
            req.wait()
            if getattr(req, "decision", None) is not None:  # op="auto"
                self.decisions[key] = req.decision
        except MpigcError:  # this call changed no residual (or is still running:
            self._drop_step(but=key)  # its key is left alone); the others go back
            raise
        if self._step_dropped or (self.nonfinite == "skip" and result.size
                                  and np.isnan(result.flat[0])):
            # skipped on every rank (NaN/Inf in a group's gradient: a step a loss
            # scaler skips), this call or an earlier one of the step
            self._drop_step()
        after = _wire.traffic()
        self.calls += after["calls"] - before["calls"]
        self.bytes_sent += after["bytes_sent"] - before["bytes_sent"]
        self.logical_bytes += after["logical_bytes"] - before["logical_bytes"]

    def _begin(self, key):
        """Before ``key``'s call: a key called again starts a new step; with
        several keys, ``key``'s residuals are recorded by copy (in the
        arrays of an older step's record) for :meth:`_drop_step`."""
        if key in self._step:  # a new step: the last one's records serve this one
            self._step_spares.update(self._step)
            self._step.clear()
            self._step_dropped = False
            self._step_put_back.clear()
        if len(self.keys) > 1:
            txn = self.feedback.transaction()
            txn.copy(key, self._step_spares.pop(key, None))
            self._step[key] = txn.saved[key]

    def _drop_step(self, but=None):
        """The step is dropped (a call of it was skipped or failed, the same on
        every rank): the residuals of its calls so far go back to what they
        were before it, each key's once in the step (a later call of the
        dropped step puts back its own only); ``but``: a key whose call failed
        (it changed no residual) or may still run, left alone."""
        self._step_dropped = True
        done = self._step_put_back
        if but is not None:
            done.add(but)
        saved = {k: v for k, v in self._step.items() if k not in done}
        if saved:
            self.feedback.transaction(saved).restore()
            done.update(saved)

    def _check_input(self, key, inp):
        """``inp`` is a CPU float tensor in the layout of ``key``'s first call."""
        if inp.device.type != "cpu":
            raise DTypeError(f"register_fsdp_hooks: {key}: CPU tensors only so far, got "
                             f"{inp.device}")
        layout = (inp.numel(), str(inp.dtype).replace("torch.", ""))
        known, members = self._layouts.get(key), self._reducing.get(key)
        if (known is not None and known == layout and members is not None
                and self._members.get(key, members) != members):
            names = [n for n, _ in self._group_params(key)]
            was, now = ([names[i] for i in m] for m in (self._members[key], members))
            raise StateError(
                f"register_fsdp_hooks: the flat reduce-scatter input of {key} holds other "
                f"parameters than in its first call ({now} instead of {was}; the same size): "
                "its residuals no longer line up (a parameter without a gradient in this "
                "step, FSDP leaves it out: module.set_reduce_scatter_unused_params(True) "
                "reduces every parameter each step)")
        if known is not None and known != layout:
            raise StateError(
                f"register_fsdp_hooks: the flat reduce-scatter input of {key} changed from "
                f"{known[0]} {known[1]} elements to {layout[0]} {layout[1]}: its residuals "
                "no longer line up (a parameter without a gradient in this step? FSDP "
                "leaves it out: module.set_reduce_scatter_unused_params(True) reduces "
                "every parameter each step; or another reduce_dtype)")
        if inp.dtype not in NP_OF_TORCH and inp.dtype != torch.bfloat16:
            raise DTypeError(f"register_fsdp_hooks: {key}: expected float16, bfloat16, "
                             f"float32 or float64 gradients, got {inp.dtype}")
        self._layouts[key] = layout
        if members is not None:
            self._members.setdefault(key, members)

    def _group_params(self, key):
        """``[(name, full shape)]`` of every parameter of ``key``'s FSDP group
        (frozen ones too), in ``fsdp_params`` order."""
        group = self._groups[self.keys.index(key)][2]
        return [(self._names.get(id(fp.sharded_param), "?"), list(fp._orig_size))
                for fp in group.fsdp_params]

    def _reduce_scatter(self, rs, output, inp, group, op):
        key = rs.key
        if group.size() != self.size:
            raise StateError(f"register_fsdp_hooks: {key}'s reduce-scatter group has "
                             f"{group.size()} ranks, the communicator {self.size}")
        self._check_input(key, inp)
        # FSDP's division: AVG (its default over the group), SUM (it divides
        # before/after itself), PREMUL_SUM(1/factor) (set_gradient_divide_factor)
        average, scale = False, None
        kind = getattr(op, "op", op)
        if kind == dist.ReduceOp.AVG:
            average = True
        elif kind == dist.ReduceOp.PREMUL_SUM:
            scale = 1.0 / rs.group.gradient_divide_factor
        elif kind != dist.ReduceOp.SUM:
            raise ConfigError(f"register_fsdp_hooks: {key}: reduce op {kind} is not a sum")
        x = inp.detach()
        if x.dtype == torch.bfloat16 or scale is not None:
            x = x.float() if scale is None else x.to(torch.float32 if x.dtype ==
                                                    torch.bfloat16 else x.dtype) * scale
        xs = x.numpy()
        out = (output.detach().numpy() if output.dtype == x.dtype
               else np.empty(output.numel(), xs.dtype))
        m = output.numel()
        op, auto = self._op()
        self._run(key, xs, out, lambda: ireduce_scatter(
            xs, op=op, recvcounts=[m] * self.size, out=out, comm=self._comm, key=key,
            average=average, feedback=self.feedback, nonfinite=self.nonfinite, **auto))
        if output.dtype != x.dtype:
            with torch.no_grad():
                output.copy_(torch.from_numpy(out))
        return None

    # -- state (torch.distributed.checkpoint's Stateful) ---------------------------
    def state_dict(self):
        """The residuals as ``torch.distributed.checkpoint`` saves them
        (collective only through DCP): ``{"meta": <JSON str>, "rows": {key:
        DTensor}}``, each rank's residuals a row of a DTensor over the FSDP
        mesh (each rank writes its own). Put the state itself into the app
        state: ``dcp.save({"model": ..., "optim": ..., "mpigc": state})``;
        :meth:`load_state_dict` takes it back, at any world size (FSDP; HSDP:
        on the same mesh)."""
        return _dcp_state(self)

    def load_state_dict(self, state):
        """Install :meth:`state_dict` output (collective): on this world size,
        each rank its own residuals (bit-exact continuation); on another, the
        saved residuals resharded (docs/torch.md, "Checkpoints with
        torch.distributed.checkpoint"). On an error on any rank (another op,
        another model), the same :class:`MpigcError` on every rank and
        nothing changed."""
        self._arrive(self.timeout, "FsdpHookState.load_state_dict")
        _dcp_load(self, state)

    def prepare_load(self, checkpoint_id=None, *, name="mpigc", storage_reader=None,
                     process_group=None):
        """Read the hooks' record ``name`` of a DCP checkpoint (collective) and
        check it against these hooks (:class:`MismatchError` on every rank,
        nothing loaded), so that the next ``dcp.load`` of it takes residuals
        saved at another world size (it sizes the next :meth:`state_dict`
        only, the template ``dcp.load`` fills). Not needed at the same world
        size."""
        self._arrive(self.timeout, "FsdpHookState.prepare_load")
        _dcp_prepare(self, checkpoint_id, name, storage_reader, process_group)

    def __repr__(self):
        op = f"'auto', auto_op={self.compressor!r}" if self.auto_pin else repr(self.compressor)
        return f"FsdpHookState(op={op}, groups={len(self.keys)}, ranks={self.size})"


# -- torch.distributed.checkpoint ----------------------------------------------------
# Each rank's residuals of a key are one row of a DTensor over the FSDP mesh
# (global shape mesh.shape + (row length,)): each rank writes its own row. At
# the same mesh each rank reads its row back. FSDP's flat layout depends on
# the world size, so at another one (1-D mesh) a rank reads the rows that
# DTensor's Shard(0) gives it (contiguous, ceil(N/M) each), takes them from
# the old layout to the parameters' elements, sums them (float64, rounded
# once) and lays the sum out at the new world size: the sum over ranks, the
# error not yet delivered, is kept per parameter element (the padding's
# residuals, which FSDP never delivers, are dropped).
_FORMAT = "mpigc.torch.fsdp"


def _row_dtype(group):
    """float64 rows for a float64 reduction, else float32 (which holds the
    float16 and float32 residuals exactly; bf16 is reduced in float32)."""
    mp, fp = group.mp_policy, group.fsdp_params[0] if group.fsdp_params else None
    dt = mp.reduce_dtype or mp.param_dtype or (fp and fp.sharded_param.dtype)
    return torch.float64 if dt == torch.float64 else torch.float32


def _chunks(shapes, n_ranks):
    """FSDP's flat reduce-scatter layout over ``n_ranks`` of parameters of
    full ``shapes`` (torch._chunk_cat on dim 0): ``[(rows, rows per chunk,
    elements per row)]`` and the length of one rank's chunk."""
    out, size = [], 0
    for shape in shapes:
        rows = shape[0] if shape else 1
        per_row = int(np.prod(shape[1:])) if len(shape) > 1 else 1
        c = -(-rows // n_ranks)
        out.append((rows, c, per_row))
        size += c * per_row
    return out, size


def _to_params(flat, shapes, n_ranks):
    """A flat input of FSDP's layout at ``n_ranks`` -> each parameter's
    elements (padding dropped)."""
    lay, size = _chunks(shapes, n_ranks)
    v, out, off = flat.reshape(n_ranks, size), [], 0
    for rows, c, per_row in lay:
        out.append(v[:, off:off + c * per_row].reshape(n_ranks * c, per_row)[:rows].ravel())
        off += c * per_row
    return out


def _from_params(arrays, shapes, n_ranks, dtype):
    """The inverse of :func:`_to_params` (zeros in the padding)."""
    lay, size = _chunks(shapes, n_ranks)
    v, off = np.zeros((n_ranks, size), dtype), 0
    for a, (rows, c, per_row) in zip(arrays, lay):
        blk = np.zeros((n_ranks * c, per_row), dtype)
        blk[:rows] = a.reshape(rows, per_row)
        v[:, off:off + c * per_row] = blk.reshape(n_ranks, c * per_row)
        off += c * per_row
    return v.ravel()


def _row_len(st, key):
    """A key's row length on this mesh: the flat input (FSDP), or the shard
    and the largest owner shard of the replica allreduce (HSDP)."""
    shards = st.size // st.replicas
    _, size = _chunks([sh for _, sh in st._params[key]], shards)
    return shards * size if st.replicas == 1 else size - (-size // st.replicas)


def _rows(st, global_rows, local):
    """The DTensor of rows ``local`` (this rank's) of global shape
    ``global_rows + (row length,)`` over the FSDP mesh, sharded row-wise."""
    from torch.distributed.tensor import DTensor, Shard
    shape = tuple(global_rows) + (local.shape[-1],)
    stride = tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))
    return DTensor.from_local(local, st._mesh, [Shard(i) for i in range(st._mesh.ndim)],
                              run_check=False, shape=shape, stride=stride)


def _meta(st, states):
    entries = {}
    for key in st.keys:
        e = states.get(key)
        if e is not None:
            entries[key] = {"n": e["n"], "dtype": e["dtype"], "calls": e["calls"],
                            "owner": e["owner"] is not None,
                            "input": list(st._layouts.get(key, (e["n"], e["dtype"])))}
            if key in st._members:  # the parameters of that layout, by name
                names = st._group_params(key)
                entries[key]["members"] = [names[i][0] for i in st._members[key]]
    return {"format": _FORMAT, "version": 1, "mesh": list(st._mesh.shape),
            "replicas": st.replicas, "op": st.compressor.get_config(), "keys": list(st.keys),
            "params": {k: [[n, list(sh)] for n, sh in v] for k, v in st._params.items()},
            "entries": entries}


def _dcp_state(st):
    if st._mesh is None or st._mesh.size() != st.size:
        raise StateError("FsdpHookState.state_dict: the FSDP mesh does not span the "
                         f"{st.size} ranks of the hooks' communicator, or a parameter is "
                         "sharded on another dim than 0 (shard_placement_fn)")
    # prepare_load's record sizes the next state_dict() only (dcp.load's
    # template): a load that fails before load_state_dict leaves nothing set
    saved, ndim, st._saved = st._saved, st._mesh.ndim, None
    states = st._residuals.states(st.keys) if saved is None else {}
    meta, rows = _meta(st, states), {}
    for key in st.keys:
        dt = st._row_dtype[key]
        if saved is not None and saved["mesh"] != list(st._mesh.shape):
            n_old, me = saved["mesh"][0], st._mesh.get_coordinate()[0]
            c = -(-n_old // st.size)
            lo = min(me * c, n_old)
            _, size = _chunks([sh for _, sh in st._params[key]], n_old)
            local = torch.zeros(min(lo + c, n_old) - lo, n_old * size, dtype=dt)
            rows[key] = _rows(st, saved["mesh"], local)
            continue
        row = np.zeros(_row_len(st, key), torch.empty(0, dtype=dt).numpy().dtype)
        e = states.get(key)
        if e is not None:
            w = e["worker"] if e["worker"] is not None else np.zeros(e["n"])
            o = e["owner"] if e["owner"] is not None else np.zeros(0)
            if (w.size + o.size > row.size if st.replicas > 1
                    else w.size != row.size or o.size):
                raise StateError(f"FsdpHookState.state_dict: {key}'s residuals ({w.size}, "
                                 f"{o.size}) do not fit the layout of its trainable "
                                 f"parameters ({row.size}): FSDP left a trainable parameter "
                                 "out of its reduce-scatters (no gradient in its first "
                                 "step: module.set_reduce_scatter_unused_params(True)), or "
                                 "requires_grad changed after register_fsdp_hooks")
            row[:w.size] = w
            row[w.size:w.size + o.size] = o
        rows[key] = _rows(st, st._mesh.shape, torch.from_numpy(row).reshape(
            (1,) * ndim + (row.size,)))
    return {"meta": json.dumps(meta, sort_keys=True), "rows": rows}


def _check_meta(st, meta, what):
    """``meta`` (a saved record) fits these hooks, else raise."""
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
        raise StateError(f"{what}: not the record of FsdpHookState.state_dict()")
    if meta["op"] != st.compressor.get_config():
        raise MismatchError(f"{what}: the residuals were saved with op {meta['op']}, these "
                            f"hooks use {st.compressor.get_config()}: register the hooks "
                            "with the saved op")
    ours = json.loads(json.dumps({k: [[n, list(sh)] for n, sh in v]
                                  for k, v in st._params.items()}))
    if meta["keys"] != list(st.keys) or meta["params"] != ours:
        diff = sorted(set(meta["keys"]) ^ set(st.keys)) or [
            k for k in st.keys if meta["params"].get(k) != ours[k]]
        raise MismatchError(f"{what}: the residuals belong to another model (FSDP groups or "
                            f"parameters differ: {diff[:3]})")
    here = list(st._mesh.shape)
    if meta["mesh"] != here and (len(meta["mesh"]) != 1 or len(here) != 1):
        raise ConfigError(f"{what}: HSDP residuals reload on the same mesh only (saved on "
                          f"{meta['mesh']}, this mesh {here})")


def _parse(text, what):
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        raise StateError(f"{what}: not the record of FsdpHookState.state_dict()") from None


def _dcp_prepare(st, checkpoint_id, name, reader, group):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException
    what, exc, sd, meta = "FsdpHookState.prepare_load", None, {name: {"meta": ""}}, None
    if group is None and st._mesh is not None and st._mesh.ndim == 1:
        group = st._mesh.get_group()
    try:
        dcp.load(sd, checkpoint_id=checkpoint_id, storage_reader=reader,
                 process_group=group)
        meta = _parse(sd[name]["meta"], what)
        _check_meta(st, meta, what)
    except MpigcError as e:
        exc = e
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP's, on every rank
        exc = StateError(f"{what}: no record {name!r} read ({type(e).__name__}: {e})")
    raise_everywhere(st._comm, exc, what)
    st._saved = meta


def _dcp_load(st, state):
    what, layouts, members = "FsdpHookState.load_state_dict", {}, {}
    entries = st._residuals.load_keys(
        st.keys, lambda: _dcp_entries(st, state, what, layouts, members), what)
    for key in st.keys:
        st._members.pop(key, None)
        if key not in entries:
            st._layouts.pop(key, None)
    st._layouts.update(layouts)
    st._members.update(members)  # else the next call's parameters are the layout's
    st._saved = None


def _dcp_entries(st, state, what, layouts, members):
    """The residual entries ``{key: entry}`` of the DCP record ``state`` (its
    keys' flat input layouts into ``layouts``, their parameters into
    ``members``), or raise; nothing installed."""
    entries = {}
    if not isinstance(state, dict) or set(state) != {"meta", "rows"}:
        raise StateError(f"{what}: expected the output of FsdpHookState.state_dict() "
                         "(as dcp.load fills it)")
    meta = _parse(state["meta"], what)
    _check_meta(st, meta, what)
    same = meta["mesh"] == list(st._mesh.shape)
    sub = st._replica_comm if st.replicas > 1 else st._comm
    for key, info in meta["entries"].items():
        rows = state["rows"][key]
        rows = (rows.to_local() if hasattr(rows, "to_local") else rows).detach()
        rows = rows.reshape(-1, rows.shape[-1]).double().numpy()
        dtype, n, owner = np.dtype(info["dtype"]), info["n"], None
        if same:
            if rows.shape[0] != 1:
                raise StateError(f"{what}: {key}: expected one row, got {rows.shape[0]}")
            worker = rows[0, :n].astype(dtype)
            if info["owner"]:
                lo, hi = shard_bounds(n, sub.size)[sub.rank]
                owner = rows[0, n:n + hi - lo].astype(dtype)
            layouts[key] = tuple(info["input"])
            names = [name for name, _ in st._group_params(key)]
            if all(name in names for name in info.get("members", [None])):
                members[key] = tuple(names.index(name) for name in info["members"])
        else:
            shapes, old = [sh for _, sh in st._params[key]], meta["mesh"][0]
            total = [np.zeros(int(np.prod(sh))) for sh in shapes]
            for row in rows:
                total = [t + a for t, a in zip(total, _to_params(row, shapes, old))]
            worker = _from_params(total, shapes, st.size, dtype)
            n = worker.size
            layouts[key] = (n, info["input"][1])
            group = st._groups[st.keys.index(key)][2]  # every trainable parameter
            members[key] = tuple(i for i, fp in enumerate(group.fsdp_params)
                                 if fp.sharded_param.requires_grad)
        entries[key] = new_entry(n, dtype, sub.size, sub.rank, st.compressor.get_config(),
                                 info["calls"], worker, owner)
    return entries


def register_fsdp_hooks(model, op="2bit", *, comm=None, nonfinite=None, feedback=None,
                        timeout=None, auto_op=None, auto_pin=None, **params):
    """Make every FSDP2 module of ``model`` reduce-scatter its gradients with
    mpigc's compressed :func:`mpigc.reduce_scatter` over MPI, with error
    feedback per FSDP parameter group (collective over ``comm``).

    >>> state = mpigc.torch.register_fsdp_hooks(model, op="2bit",
    ...                                         rel_threshold=1.5)  # doctest: +SKIP

    ``model`` is sharded already (``fully_shard`` on its blocks and on
    itself) over a 1-D mesh whose process group has the ranks of ``comm``
    (default ``MPI.COMM_WORLD``) in the same order. FSDP keeps its process
    group for its all-gathers; only the gradient reduce-scatter moves to
    MPI, compressed.

    HSDP: sharded over ``mesh["shard"]`` of a 2-D mesh (replicas x shards),
    FSDP's own reduce-scatter in each replica stays (exact, or in
    ``reduce_dtype``), and the all-reduce across the replicas
    (``set_all_reduce_hook``) is mpigc's compressed :func:`mpigc.allreduce`
    with error feedback (:attr:`FsdpHookState.replicas` > 1). FSDP2's native
    HSDP (``fully_shard`` on the 2-D mesh) is refused: it all-reduces over
    its own group before any hook runs. FSDP's division is kept (its average over the group,
    ``set_gradient_divide_factor``, the sum it divides itself for fp16), as
    are its padded layout (uneven shards), ``reduce_dtype`` (bf16 is reduced
    in float32 and rounded once), ``set_requires_gradient_sync(False)``
    (no call) and ``reshard_after_forward``.

    A group's flat layout is fixed from its first call (its trainable
    parameters with a gradient; frozen ones are never in it): a later call of
    another size or dtype, or of the same size with other parameters (a
    parameter without a gradient, which FSDP leaves out), raises
    :class:`mpigc.StateError` on every rank, residuals unchanged
    (``set_reduce_scatter_unused_params(True)`` keeps the layout). Under
    HSDP, ``set_requires_all_reduce(False)`` keeps the shard and all-reduces
    the sum with the next call, as native HSDP does.

    Parameters
    ----------
    op, **params
        The compressor (as :class:`GradientSync`'s: ``"2bit"`` without a
        threshold is the relative mode), or ``"auto"``: per call (each
        group's reduce-scatter; under HSDP its replica allreduce)
        ``"none"`` or ``auto_op``, whichever the model of the communicator
        predicts faster (the engine's ``op="auto"``, the same on every rank;
        ``**params`` are then ``auto_op``'s).
    auto_op, auto_pin
        With ``op="auto"``, as for :class:`GradientSync`: the compressor it
        may choose (default ``"2bit"``, the relative mode) and the pin
        (``"model"``, ``"none"``, ``"compressed"``; default
        ``$MPIGC_AUTO_PIN`` or ``"model"``), agreed at registration.
    comm, nonfinite, feedback, timeout
        As for :class:`GradientSync`. ``timeout`` also bounds the wait in
        this function (registered on some ranks only: :class:`StateError`
        there) and in each reduce-scatter.

    Returns
    -------
    FsdpHookState
        The residuals (``state_dict()``/``load_state_dict()``) and the
        traffic counters.
    """
    return FsdpHookState(model, op, comm, nonfinite, feedback, timeout, params, auto_op,
                         auto_pin)
