"""The FSDP hooks' residuals in torch.distributed.checkpoint (issue 46, item
3): ``dcp.save({"model": ..., "optim": ..., "mpigc": hooks})`` and
``dcp.load`` of the same resume bit for bit at the same world size; at
another world size (``hooks.prepare_load``) the residuals are resharded and
their sum over ranks, per parameter element, is kept; a record of another
op or model raises the same error on every rank and changes nothing.

Other world sizes run on sub-worlds of the job: FSDP over the first N ranks
(a DeviceMesh of them, their MPI sub-communicator), then the first M."""
import os
import sys

import numpy as np
import pytest
from mpi4py import MPI

import mpigc

from conftest import assert_all, raises_everywhere

torch = pytest.importorskip("torch")
import mpigc.torch as mt  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tests/
from support import torch_dist as td  # noqa: E402

# 2: 2 -> 1 (one rank saves no residuals: FSDP2 reduces nothing there); 3:
# uneven shards, 3 -> 2 (two rows merge on one rank) and 2 -> 3; 4: 4 -> 3,
# 3 -> 4, 4 -> 2 and HSDP 2 x 2
pytestmark = pytest.mark.ranks(2, 3, 4)

gloo = td.gloo  # its module-scoped fixture: torch.distributed over gloo


@pytest.fixture
def ckpt(comm):
    with td.shared_dir(comm, "mpigc-dcp-") as path:
        yield path


def _world(comm, n):
    """``(mesh, sub-communicator)`` of the first ``n`` ranks (collective over
    every rank: DeviceMesh makes its group on all); None on the others."""
    mesh = DeviceMesh("cpu", list(range(n)))
    sub = comm.Split(0 if comm.rank < n else MPI.UNDEFINED, comm.rank)
    return (mesh, sub) if comm.rank < n else (None, None)


def _frozen_model(mesh):
    """``td.model`` with the first layer's bias frozen (before fully_shard, as
    a user freezes): FSDP2 never reduce-scatters it."""
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    layers = [torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)]
    layers[0].bias.requires_grad_(False)
    m = torch.nn.Sequential(*layers)
    for layer in layers[::2]:
        fully_shard(layer, mesh=mesh)
    return fully_shard(m, mesh=mesh)


def _setup(mesh, sub, name, extra=0, frozen=False):
    """The model on ``mesh`` (``frozen``: :func:`_frozen_model`), its hooks
    over ``sub`` (None: the world) with op ``name`` (of ``td.OPS``, or the
    keywords themselves), SGD with momentum (state that a checkpoint
    holds)."""
    m = _frozen_model(mesh) if frozen else td.model(extra=extra, mesh=mesh)
    hooks = mt.register_fsdp_hooks(m, comm=sub, **(name if isinstance(name, dict)
                                                   else td.OPS[name]))
    return m, hooks, torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)


def _save(m, opt, hooks, path, mesh):
    msd, osd = get_state_dict(m, opt)
    dcp.save({"model": msd, "optim": osd, "mpigc": hooks}, checkpoint_id=path,
             process_group=mesh.get_group())


def _load(m, opt, hooks, path, mesh, with_hooks=True):
    msd, osd = get_state_dict(m, opt)
    sd = {"model": msd, "optim": osd}
    if with_hooks:
        sd["mpigc"] = hooks
    dcp.load(sd, checkpoint_id=path, process_group=mesh.get_group())
    set_state_dict(m, opt, model_state_dict=msd, optim_state_dict=osd)


def _param_totals(m, hooks, comm):
    """Per FSDP group key: the sum over the ranks of ``comm`` of their worker
    residuals, per parameter element (float64), found through FSDP's own
    layout (torch._chunk_cat of the trainable parameters' element numbers:
    FSDP2 leaves frozen ones out)."""
    out = {}
    states = hooks.feedback.state_dict()
    for key, mod in td.hooked_modules(m, hooks.keys):
        shapes = [p.shape for p in mod.parameters(recurse=False) if p.requires_grad]
        numbers, off = [], 1
        for sh in shapes:
            k = int(np.prod(sh))
            numbers.append(torch.arange(off, off + k, dtype=torch.float64).reshape(sh))
            off += k
        where = torch._chunk_cat(numbers, dim=0, num_chunks=comm.size).reshape(-1).numpy()
        e = states.get(key)
        w = (np.zeros(where.size) if e is None or e["worker"] is None
             else e["worker"].astype(np.float64))
        assert w.size == where.size
        mine = np.zeros(off - 1)
        real = where > 0
        mine[where[real].astype(np.int64) - 1] = w[real]
        out[key] = comm.allreduce(mine)
    return out


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["2bit-abs", "1bit"])
def test_same_world_size_resumes_bit_exact(comm, gloo, ckpt, name):
    """10 steps in one go = 5 steps, dcp.save of model, optimizer (momentum)
    and hooks, a new model loaded with dcp.load, 5 steps; without the hooks'
    record in the load the run differs."""
    mesh, sub = _world(comm, comm.size)
    m, hooks, opt = _setup(mesh, sub, name)
    want = td.train(m, 10, comm.rank, 0, opt=opt)
    m, hooks, opt = _setup(mesh, sub, name)
    td.train(m, 5, comm.rank, 0, opt=opt)
    _save(m, opt, hooks, ckpt, mesh)
    runs = []
    for with_hooks in (True, False):
        m2, hooks2, opt2 = _setup(mesh, sub, name)
        _load(m2, opt2, hooks2, ckpt, mesh, with_hooks)
        runs.append(td.train(m2, 5, comm.rank, 5, opt=opt2))
    same = td.compare(want, runs[0], True, 0)
    differs = comm.allreduce(int(not td.compare(want, runs[1], True, 0)))
    assert_all(same and differs > 0, f"{name}: resumed run differs ({not same}) or a run "
                                     f"without the residuals is the same ({differs == 0})")


def _pairs(k):
    """(saved on, loaded on) at ``k`` ranks: one rank saves no residuals
    (FSDP2 reduces nothing there), so 2 ranks only go down."""
    return {2: [(2, 1)], 3: [(3, 2), (2, 3)]}.get(k, [(k, k - 1), (k - 1, k), (k, k // 2)])


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["2bit-abs", "2bit-rel", "1bit"])
@pytest.mark.parametrize("pair", [0, 1, 2])
def test_other_world_size_keeps_the_residual_sum(comm, gloo, ckpt, name, pair):
    """Saved on N ranks, loaded on M (prepare_load, then dcp.load): the sum
    over ranks of the worker residuals, per parameter element, is the saved
    one (bit for bit when M >= N: each rank takes at most one row; within
    rounding when rows merge); training goes on (3 steps, the hooks' calls)."""
    if pair >= len(_pairs(comm.size)):
        pytest.skip(f"{comm.size} ranks: {len(_pairs(comm.size))} pairs of world sizes")
    n_old, n_new = _pairs(comm.size)[pair]
    mesh, sub = _world(comm, n_old)
    saved = None
    if mesh is not None:
        m, hooks, opt = _setup(mesh, sub, name)
        td.train(m, 4, comm.rank, 0, opt=opt)
        saved = _param_totals(m, hooks, sub)
        _save(m, opt, hooks, ckpt, mesh)
    saved = comm.bcast(saved)
    mesh, sub = _world(comm, n_new)
    ok, msg = True, ""
    if mesh is not None:
        m, hooks, opt = _setup(mesh, sub, name)
        hooks.prepare_load(ckpt)
        _load(m, opt, hooks, ckpt, mesh)
        got = _param_totals(m, hooks, sub)
        for key, want in saved.items():
            exact = n_new >= n_old
            good = (np.array_equal(got[key], want) if exact
                    else np.allclose(got[key], want, rtol=1e-6, atol=1e-7))
            if not good:
                ok, msg = False, f"{key}: residual sum differs ({n_old} -> {n_new})"
        kept = max(float(np.abs(v).max()) for v in saved.values())
        calls = hooks.calls
        after = td.train(m, 3, comm.rank, 4, opt=opt)
        # on one rank FSDP2 reduces nothing (no reduce-scatter to hook)
        ok &= kept > 0 and hooks.calls == calls + (3 * len(hooks.keys) if n_new > 1 else 0)
        ok &= all(bool(torch.isfinite(t).all()) for t in after.values())
        msg = msg or f"no residuals ({kept}) or training did not go on ({hooks.calls})"
    assert_all(ok, msg)


@pytest.mark.mpi
@pytest.mark.parametrize("where", ["same", "other"])
def test_frozen_parameter_saves_and_reshards(comm, gloo, ckpt, where):
    """A frozen parameter in an FSDP group (FSDP2 leaves it out of the flat
    reduce-scatter input): dcp.save works, the same world size resumes bit
    for bit, another one keeps the residual sum per parameter element. Before,
    the record counted the frozen parameter: state_dict raised StateError
    ("do not fit FSDP's layout") on every save."""
    if where == "same":
        mesh, sub = _world(comm, comm.size)
        m, hooks, opt = _setup(mesh, sub, "2bit-abs", frozen=True)
        want = td.train(m, 6, comm.rank, 0, opt=opt)
        m, hooks, opt = _setup(mesh, sub, "2bit-abs", frozen=True)
        td.train(m, 3, comm.rank, 0, opt=opt)
        _save(m, opt, hooks, ckpt, mesh)
        m2, hooks2, opt2 = _setup(mesh, sub, "2bit-abs", frozen=True)
        _load(m2, opt2, hooks2, ckpt, mesh)
        got = td.train(m2, 3, comm.rank, 3, opt=opt2)
        assert_all(td.compare(want, got, True, 0), "resumed run differs")
        return
    n_old, n_new = _pairs(comm.size)[0]
    mesh, sub = _world(comm, n_old)
    saved = None
    if mesh is not None:
        m, hooks, opt = _setup(mesh, sub, "2bit-rel", frozen=True)
        td.train(m, 4, comm.rank, 0, opt=opt)
        saved = _param_totals(m, hooks, sub)
        _save(m, opt, hooks, ckpt, mesh)
    saved = comm.bcast(saved)
    mesh, sub = _world(comm, n_new)
    ok = True
    if mesh is not None:
        m, hooks, opt = _setup(mesh, sub, "2bit-rel", frozen=True)
        hooks.prepare_load(ckpt)
        _load(m, opt, hooks, ckpt, mesh)
        got = _param_totals(m, hooks, sub)
        ok = all(np.allclose(got[k], v, rtol=1e-6, atol=1e-7) for k, v in saved.items())
        ok &= max(float(np.abs(v).max()) for v in saved.values()) > 0
        after = td.train(m, 2, comm.rank, 4, opt=opt)
        ok &= all(bool(torch.isfinite(t).all()) for t in after.values())
    assert_all(ok, f"residual sum not kept ({n_old} -> {n_new})")


@pytest.mark.mpi
def test_parameters_of_the_layout_survive_a_resume(comm, gloo, ckpt):
    """HSDP 2 x 2 (whose record holds a layout of fewer parameters than the
    group's; FSDP's must hold them all): expert 0 before the save, expert 1
    (the same shape) after the load. The record names the parameters of each
    layout, so the resumed run raises StateError on every rank, as the
    uninterrupted one does (before: after a load the first call set them,
    and expert 0's residuals were added to expert 1's gradient silently)."""
    mesh = td.mesh_2x2(comm)["shard"]

    def setup():
        m = td.experts(mesh)
        return m, mt.register_fsdp_hooks(m, **td.OPS["2bit-abs"])

    m, hooks = setup()
    td.expert_step(m, comm.rank, 0)
    dcp.save({"mpigc": hooks}, checkpoint_id=ckpt)
    m2, hooks2 = setup()
    dcp.load({"mpigc": hooks2}, checkpoint_id=ckpt)
    raises_everywhere(mpigc.StateError, lambda: td.expert_step(m2, comm.rank, 1),
                      match="other parameters than in its first call")


class _Caught(Exception):
    pass


def _caught(fn):
    """DCP's CheckpointException is a BaseException: returned for
    raises_everywhere, which catches Exception."""
    try:
        fn()
    except CheckpointException as e:
        raise _Caught() from e


@pytest.mark.mpi
def test_other_world_size_needs_prepare_load(comm, gloo, ckpt):
    """Without prepare_load, DCP finds rows of another size: its error on
    every rank, before anything is read."""
    mesh, sub = _world(comm, comm.size - 1)
    if mesh is not None:
        m, hooks, opt = _setup(mesh, sub, "1bit")
        td.train(m, 2, comm.rank, 0, opt=opt)
        _save(m, opt, hooks, ckpt, mesh)
    comm.Barrier()
    mesh, sub = _world(comm, comm.size)
    m, hooks, opt = _setup(mesh, sub, "1bit")
    before = td.local_params(m)
    got = raises_everywhere(_Caught, lambda: _caught(lambda: _load(m, opt, hooks, ckpt, mesh)))
    assert_all("Size mismatch" in str(got.__cause__), str(got.__cause__)[:300])
    now = td.local_params(m)
    assert_all(td.compare(before, now, True, 0) and len(hooks.feedback) == 0,
               "the model or the residuals changed")


@pytest.mark.mpi
@pytest.mark.parametrize("other", ["op", "model"])
def test_mismatched_record_raises_everywhere(comm, gloo, ckpt, other):
    """A record of another op or another model: MismatchError on every rank
    from prepare_load and from load_state_dict, the residuals unchanged."""
    mesh, sub = _world(comm, comm.size)
    m, hooks, opt = _setup(mesh, sub, "2bit-abs")
    td.train(m, 2, comm.rank, 0, opt=opt)
    _save(m, opt, hooks, ckpt, mesh)
    m2, hooks2, opt2 = _setup(mesh, sub, "1bit" if other == "op" else "2bit-abs",
                              extra=1 if other == "model" else 0)
    td.train(m2, 1, comm.rank, 0, opt=opt2)
    before = hooks2.feedback.state_dict()
    match = "saved with op" if other == "op" else "another model"
    raises_everywhere(mpigc.MismatchError, lambda: hooks2.prepare_load(ckpt), match=match)
    raises_everywhere(mpigc.MismatchError,
                      lambda: hooks2.load_state_dict(hooks.state_dict()), match=match)
    now = hooks2.feedback.state_dict()
    assert_all(all(np.array_equal(before[k]["worker"], now[k]["worker"]) for k in before)
               and set(before) == set(now), "residuals changed")


@pytest.mark.mpi
def test_prepare_load_without_record(comm, gloo, ckpt):
    mesh, sub = _world(comm, comm.size)
    m, hooks, opt = _setup(mesh, sub, "1bit")
    msd, osd = get_state_dict(m, opt)
    dcp.save({"model": msd}, checkpoint_id=ckpt, process_group=mesh.get_group())
    raises_everywhere(mpigc.StateError, lambda: hooks.prepare_load(ckpt),
                      match="no record 'mpigc'")


@pytest.mark.mpi
def test_hsdp_same_mesh_resumes_bit_exact(comm, gloo, ckpt):
    """HSDP 2 x 2 (worker and owner residuals of the replica allreduce):
    dcp.save and dcp.load on the same mesh continue bit for bit."""
    mesh = td.mesh_2x2(comm)["shard"]
    m, hooks, opt = _setup(mesh, None, "1bit")
    want = td.train(m, 8, comm.rank, 0, opt=opt)
    m, hooks, opt = _setup(mesh, None, "1bit")
    td.train(m, 4, comm.rank, 0, opt=opt)
    owners = [e["owner"] is not None for e in hooks.feedback.state_dict().values()]
    msd, osd = get_state_dict(m, opt)
    dcp.save({"model": msd, "optim": osd, "mpigc": hooks}, checkpoint_id=ckpt)
    m2, hooks2, opt2 = _setup(mesh, None, "1bit")
    msd, osd = get_state_dict(m2, opt2)
    dcp.load({"model": msd, "optim": osd, "mpigc": hooks2}, checkpoint_id=ckpt)
    set_state_dict(m2, opt2, model_state_dict=msd, optim_state_dict=osd)
    got = td.train(m2, 4, comm.rank, 4, opt=opt2)
    assert_all(all(owners) and td.compare(want, got, True, 0),
               f"HSDP resume differs (owner residuals {owners})")


@pytest.mark.mpi
def test_prepare_load_sizes_one_state_dict_only(comm, gloo, ckpt):
    """prepare_load, then a dcp.load that fails before load_state_dict (a
    key the checkpoint lacks): the next state_dict() holds the residuals
    again, not an empty template a later save would write."""
    mesh, sub = _world(comm, comm.size)
    m, hooks, opt = _setup(mesh, sub, "1bit")
    td.train(m, 2, comm.rank, 0, opt=opt)
    _save(m, opt, hooks, ckpt, mesh)
    hooks.prepare_load(ckpt)
    raises_everywhere(_Caught, lambda: _caught(lambda: dcp.load(
        {"mpigc": hooks, "absent": torch.zeros(1)}, checkpoint_id=ckpt)))
    rows = hooks.state_dict()["rows"]
    now = hooks.feedback.state_dict()
    ok = all(np.array_equal(rows[k].to_local().reshape(-1).numpy(), now[k]["worker"])
             for k in now) and any(np.abs(e["worker"]).max() > 0 for e in now.values())
    assert_all(ok, "state_dict() after a failed load is not the residuals")


@pytest.mark.mpi
@pytest.mark.parametrize("pair", [0, 1])
def test_lightning_record_reshards(comm, gloo, pair):
    """MpigcFsdpHooks' record in Lightning's checkpoint (every rank's rows
    gathered on one rank) taken back on another world size: the residual
    sum per parameter element is kept as through DCP. The callback is driven
    without a Trainer (its communicator and writing rank set as on_fit_start
    sets them)."""
    pytest.importorskip("lightning")
    from mpigc.torch.lightning import CHECKPOINT_KEY, MpigcFsdpHooks
    if pair >= len(_pairs(comm.size)):
        pytest.skip(f"{comm.size} ranks: {len(_pairs(comm.size))} pairs of world sizes")
    n_old, n_new = _pairs(comm.size)[pair]

    def callback(hooks, sub):
        cb = MpigcFsdpHooks(**td.OPS["2bit-abs"], comm=sub)
        cb.state, cb._comm, cb._root = hooks, sub, 0
        return cb

    mesh, sub = _world(comm, n_old)
    record = saved = None
    if mesh is not None:
        m, hooks, opt = _setup(mesh, sub, "2bit-abs")
        td.train(m, 4, comm.rank, 0, opt=opt)
        saved = _param_totals(m, hooks, sub)
        checkpoint = {}
        callback(hooks, sub).on_save_checkpoint(None, None, checkpoint)
        record = checkpoint.get(CHECKPOINT_KEY)
    record, saved = comm.bcast(record), comm.bcast(saved)
    mesh, sub = _world(comm, n_new)
    ok = True
    if mesh is not None:
        m, hooks, opt = _setup(mesh, sub, "2bit-abs")
        callback(hooks, sub)._load(record)
        got = _param_totals(m, hooks, sub)
        ok = all(np.array_equal(got[k], v) if n_new >= n_old
                 else np.allclose(got[k], v, rtol=1e-6, atol=1e-7) for k, v in saved.items())
        ok &= max(float(np.abs(v).max()) for v in saved.values()) > 0
        td.train(m, 2, comm.rank, 4, opt=opt)
    assert_all(ok, f"{n_old} -> {n_new}: the residual sum differs (or none kept)")


# -- op="auto" (issue 48, item 2) -----------------------------------------------------
_AUTO = {"op": "auto", "auto_op": "2bit", "threshold": 0.5, "auto_pin": "compressed"}


@pytest.mark.mpi
@pytest.mark.parametrize("direction", ["auto->op", "op->auto"])
def test_auto_record_loads_into_auto_op_and_back(comm, gloo, ckpt, direction):
    """The residuals of op="auto" carry auto_op's config: 5 steps pinned to
    the compressor, dcp.save, dcp.load into op=auto_op's hooks, 5 steps = 10
    steps of op=auto_op bit for bit; and the other way round."""
    mesh, sub = _world(comm, comm.size)
    first, then = ((_AUTO, "2bit-abs") if direction == "auto->op" else ("2bit-abs", _AUTO))
    m, hooks, opt = _setup(mesh, sub, "2bit-abs")
    want = td.train(m, 10, comm.rank, 0, opt=opt)
    m, hooks, opt = _setup(mesh, sub, first)
    td.train(m, 5, comm.rank, 0, opt=opt)
    _save(m, opt, hooks, ckpt, mesh)
    m2, hooks2, opt2 = _setup(mesh, sub, then)
    _load(m2, opt2, hooks2, ckpt, mesh)
    got = td.train(m2, 5, comm.rank, 5, opt=opt2)
    kept = any(np.abs(e["worker"]).max() > 0 for e in hooks.feedback.state_dict().values())
    assert_all(kept and td.compare(want, got, True, 0),
               f"{direction}: resumed run differs (residuals kept {kept})")


@pytest.mark.mpi
@pytest.mark.parametrize("where", ["same", "other"])
def test_auto_after_a_none_call_saves_and_loads(comm, gloo, ckpt, where):
    """op="auto", 3 steps pinned to 2bit, then one pinned to "none" (each
    group's residuals delivered and cleared: entries without residuals),
    dcp.save: on the same world size the load resumes bit for bit (3 more
    compressed steps); on another (prepare_load) the loaded residuals are
    zero and training goes on."""
    n_old, n_new = (comm.size, comm.size) if where == "same" else _pairs(comm.size)[0]

    def steps(m, hooks, opt, first, pins):
        for i, pin in enumerate(pins):
            hooks.auto_pin = pin  # on every rank
            td.train(m, 1, comm.rank, first + i, opt=opt)
        return td.local_params(m)

    mesh, sub = _world(comm, n_old)
    want, cleared = None, True
    if mesh is not None:
        m, hooks, opt = _setup(mesh, sub, _AUTO)
        want = steps(m, hooks, opt, 0, ["compressed"] * 3 + ["none"] + ["compressed"] * 3)
        m, hooks, opt = _setup(mesh, sub, _AUTO)
        steps(m, hooks, opt, 0, ["compressed"] * 3 + ["none"])
        left = hooks.feedback.state_dict()
        cleared = len(left) == 2 and all(e["worker"] is None for e in left.values())
        _save(m, opt, hooks, ckpt, mesh)
    comm.Barrier()
    mesh, sub = _world(comm, n_new)
    ok = zero = True
    if mesh is not None:
        m2, hooks2, opt2 = _setup(mesh, sub, _AUTO)
        if where == "other":
            hooks2.prepare_load(ckpt)
        _load(m2, opt2, hooks2, ckpt, mesh)
        zero = all(not np.any(v) for v in _param_totals(m2, hooks2, sub).values())
        got = steps(m2, hooks2, opt2, 4, ["compressed"] * 3)
        ok = (td.compare(want, got, True, 0) if where == "same"
              else all(bool(torch.isfinite(t).all()) for t in got.values()))
    assert_all(ok and zero and cleared, f"{where}: the load after a none call differs or "
                                        f"fails (loaded zeros {zero}, cleared {cleared})")
