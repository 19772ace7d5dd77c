"""The DDP communication hook under mpirun (issue 28, items 6 and 9):
block-based compressors (1bit, relative 2bit) resume bit for bit whatever
DDP's bucketing, and parameters that no rank used (``find_unused_parameters``)
keep what their residuals delivered, as GradientSync does."""
import copy
import os
import sys

import numpy as np
import pytest

import mpigc

from conftest import assert_all, raises_everywhere

torch = pytest.importorskip("torch")
import mpigc.torch as mt  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tests/
from support import torch_dist  # noqa: E402
# the DDP helpers of the GradientSync tests
from test_torch_mpi import _ddp, _hier_keys, backward, batch, grads_of, make_model  # noqa: E402

# ranks: MPIGC_NODE_SPLIT=2 (hierarchy='node'): 4 is 2 nodes of 2
pytestmark = pytest.mark.ranks(1, 2, 3, 4)

gloo = torch_dist.gloo  # its module-scoped fixture: torch.distributed over gloo

_BLOCK_OPS = {"1bit": {"op": "1bit"},
              "2bit-rel": {"op": "2bit", "rel_threshold": 1.5}}
# and an element-wise one (DDP's buckets reduced in place), its threshold small
# enough that a residual alone delivers something
_UNUSED_OPS = {**_BLOCK_OPS, "2bit-abs": {"op": "2bit", "threshold": 2.0 ** -10}}


def _bits(tensors):
    return {n: t.detach().numpy().tobytes() for n, t in tensors.items()}


def _unwrapped(d):
    return {n.replace("module.", "", 1): g for n, g in d.items()}


def _same_state(a, b):
    """Per-parameter states ``a`` and ``b`` are the same, bit for bit."""
    ok = set(a) == set(b)
    for n in sorted(set(a) & set(b)):
        for part in ("worker", "owner"):
            x, y = a[n][part], b[n][part]
            ok &= (x is None and y is None) or (x is not None and y is not None
                                                and np.array_equal(x, y))
    return ok


def _twin_step(ddp, ref, sync, rank, step, accumulate=False):
    """One step of DDP with the hook and of ``sync`` (a GradientSync) on the
    twin model ``ref``, a backward under ``no_sync`` first if ``accumulate``:
    the gradients of both."""
    for net in (ddp, ref):
        net.zero_grad()
    if accumulate:  # DDP calls no hook
        with ddp.no_sync(), sync.no_sync():
            for net in (ddp, ref):
                backward(net, rank, 20 + step)
    for net in (ddp, ref):
        backward(net, rank, step)
    sync.wait()
    return _unwrapped(grads_of(ddp)), grads_of(ref)


class _Trainer:
    """DDP (gloo, buckets of ``cap_mb``) with the hook and SGD with momentum."""

    def __init__(self, model, op, cap_mb, hierarchy, **kw):
        self.model = model
        self.ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cap_mb,
                                                             **kw)
        self.state = mt.CommHookState(self.ddp, hierarchy=hierarchy, **op)
        self.ddp.register_comm_hook(self.state, mt.comm_hook)
        self.opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(self, rank, step):
        self.opt.zero_grad()
        backward(self.ddp, rank, step)
        grads = _unwrapped(grads_of(self.ddp))
        self.opt.step()
        return grads


# -- item 6: resume is bit for bit for block-based ops ----------------------------
@pytest.mark.mpi
@pytest.mark.parametrize("cap_mb, via, hierarchy", [(0.002, "state_dict", "flat"),
                                                    (0.01, "state_dict", "flat"),
                                                    (0.002, "checkpoint", "flat"),
                                                    (0.01, "state_dict", "node")])
@pytest.mark.parametrize("op", sorted(_BLOCK_OPS))
def test_comm_hook_resume_is_bit_exact_for_block_ops(comm, gloo, tmp_path_factory,
                                                     monkeypatch, op, cap_mb, via, hierarchy):
    """Train k steps, save (residuals, model, optimizer), build a fresh DDP and
    hook (DDP's first step then uses its initial buckets again, not the
    rebuilt ones), load and continue: the same gradients, parameters and
    residuals as the run that never stopped; hierarchical calls too
    (emulated nodes of 2 ranks). Before, the 1024-value blocks of 1bit and
    relative 2bit followed DDP's bucket layout, so they moved on the resumed
    run's first step."""
    if via == "checkpoint" and not hasattr(mpigc, "save_checkpoint"):
        pytest.skip("mpigc.save_checkpoint is not in this build")
    monkeypatch.setenv("MPIGC_NODE_SPLIT", "2")
    path = comm.bcast(str(tmp_path_factory.mktemp("resume")) if comm.rank == 0 else None)
    k, total = 3, 6
    run = _Trainer(make_model(hidden=64), _BLOCK_OPS[op], cap_mb, hierarchy)
    for s in range(k):
        run.step(comm.rank, s)
    if via == "checkpoint":
        run.state.save_checkpoint(path + "/res", step=k)
    else:
        saved = run.state.state_dict()
    model_sd = copy.deepcopy(run.model.state_dict())
    opt_sd = copy.deepcopy(run.opt.state_dict())
    want = [_bits(run.step(comm.rank, s)) for s in range(k, total)]

    model = make_model(hidden=64, seed=1)
    model.load_state_dict(model_sd)
    again = _Trainer(model, _BLOCK_OPS[op], cap_mb, hierarchy)
    again.opt.load_state_dict(opt_sd)
    if via == "checkpoint":
        again.state.load_checkpoint(path + "/res")
    else:
        again.state.load_state_dict(saved)
    got = [_bits(again.step(comm.rank, s)) for s in range(k, total)]
    first = [k + i for i, (g, w) in enumerate(zip(got, want)) if g != w]
    ok = not first and (hierarchy == "node") == bool(_hier_keys(again.state))
    ok &= all(torch.equal(p, q) for p, q in zip(run.model.parameters(),
                                                 again.model.parameters()))
    a, b = run.state.state_dict(), again.state.state_dict()
    ok &= hierarchy != "flat" or _same_state(a, b)
    assert_all(ok, f"{op}: gradients differ from the uninterrupted run at steps {first}")


@pytest.mark.mpi
@pytest.mark.parametrize("hierarchy", ["flat", "node"])
@pytest.mark.parametrize("op", sorted(_BLOCK_OPS))
def test_comm_hook_block_ops_equal_gradient_sync(comm, gloo, monkeypatch, op, hierarchy):
    """With block-based ops the hook compresses GradientSync's buckets of the
    same size (DDP's ``bucket_cap_mb``) whatever DDP's own bucketing, so its
    gradients and residuals are GradientSync's bit for bit across DDP's
    rebuild."""
    monkeypatch.setenv("MPIGC_NODE_SPLIT", "2")
    model, ref = make_model(hidden=64), make_model(hidden=64)
    ddp = _ddp(model)
    state = mt.CommHookState(ddp, hierarchy=hierarchy, **_BLOCK_OPS[op])
    ddp.register_comm_hook(state, mt.comm_hook)
    sync = mt.GradientSync(ref, bucket_mb=0.002, hierarchy=hierarchy, **_BLOCK_OPS[op])
    ok = True
    for step in range(4):
        got, want = _twin_step(ddp, ref, sync, comm.rank, step, accumulate=step == 2)
        ok &= _bits(got) == _bits(want)
    a, b = state.state_dict(), sync.state_dict()
    if hierarchy == "flat":
        ok &= _same_state(a, b)
    else:  # where a node's worker residual sits among its ranks: the totals
        ok &= all(np.array_equal(a[n]["owner"], b[n]["owner"]) and np.allclose(
            comm.allreduce(a[n]["worker"].astype(np.float64)),
            comm.allreduce(b[n]["worker"].astype(np.float64)), rtol=0, atol=1e-6)
            for n in b)
    assert_all(ok, f"{op} {hierarchy}: the hook differs from GradientSync")


# -- item 9: find_unused_parameters ----------------------------------------------
class _Branchy(torch.nn.Module):
    """make_model's network and a branch beside its last layer, used only
    when ``use_branch``."""

    def __init__(self):
        super().__init__()
        self.net = make_model(hidden=40)
        self.branch = torch.nn.Linear(40, 3)
        self.use_branch = True

    def forward(self, x):
        h = self.net[:4](x)
        return self.net[4](h) + self.branch(h) if self.use_branch else self.net[4](h)


def _branch_total(state, comm, hierarchy):
    """What the branch's residuals hold, summed over the ranks and scaled as
    in test_globally_unused_parameter_keeps_its_residual."""
    per = comm.size if hierarchy == "flat" else 1
    return comm.allreduce(sum(float(s["worker"].astype(np.float64).sum() / per
                                    + s["owner"].astype(np.float64).sum())
                              for n, s in state.items() if n.startswith("branch.")))


@pytest.mark.mpi
@pytest.mark.parametrize("hierarchy", ["flat", "node"])
@pytest.mark.parametrize("op", sorted(_UNUSED_OPS))
def test_comm_hook_folds_back_what_unused_parameters_delivered(comm, gloo, monkeypatch, op,
                                                               hierarchy):
    """DDP(find_unused_parameters=True): a branch unused on every rank for 3
    steps, then used on rank 0 only, then on every rank. What its residuals
    delivered in those steps (DDP leaves its .grad untouched) goes back into
    them, as with GradientSync(find_unused_parameters=True), the reference:
    the same gradients, the same residuals (bit for bit when flat), and the
    branch's residual totals kept. Before, the hook lost it."""
    monkeypatch.setenv("MPIGC_NODE_SPLIT", "2")
    model, ref = _Branchy(), _Branchy()
    ddp = _ddp(model, find_unused_parameters=True)
    state = mt.CommHookState(ddp, hierarchy=hierarchy, **_UNUSED_OPS[op])
    ddp.register_comm_hook(state, mt.comm_hook)
    sync = mt.GradientSync(ref, bucket_mb=0.002, find_unused_parameters=True,
                           hierarchy=hierarchy, **_UNUSED_OPS[op])
    ok, totals = True, []
    for step in range(7):
        model.use_branch = ref.use_branch = (step not in (2, 3, 4)
                                             and (step != 5 or comm.rank == 0))
        got, want = _twin_step(ddp, ref, sync, comm.rank, step)
        ok &= _bits(got) == _bits(want)
        ok &= ("branch.weight" in got) == (step not in (2, 3, 4))
        s = state.state_dict()
        if step >= 1:
            totals.append(_branch_total(s, comm, hierarchy))
        if hierarchy == "flat":
            ok &= _same_state(s, sync.state_dict())
        else:
            sync.state_dict()  # collective
    # steps 2-4: nothing taken out of the branch's residuals
    kept = np.allclose(totals[1:4], totals[0], rtol=0, atol=1e-4)
    assert_all(ok and kept, f"{op} {hierarchy}: branch residual totals {totals}")


@pytest.mark.mpi
def test_comm_hook_unused_parameters_with_bucket_views(comm, gloo):
    """With DDP's gradient_as_bucket_view a globally unused parameter whose
    .grad is a view of its bucket reads zeros, as with DDP's own allreduce
    (not what its residual delivered), and the residuals keep it."""
    model = _Branchy()
    ddp = _ddp(model, find_unused_parameters=True, gradient_as_bucket_view=True)
    state = mt.CommHookState(ddp, op="1bit")
    ddp.register_comm_hook(state, mt.comm_hook)
    totals, ok = [], True
    for step in range(4):
        model.use_branch = step < 2
        ddp.zero_grad(set_to_none=False)
        backward(ddp, comm.rank, step)
        totals.append(_branch_total(state.state_dict(), comm, "flat"))
        if not model.use_branch:
            ok &= bool((model.branch.weight.grad == 0).all())
    assert_all(ok and abs(totals[3] - totals[1]) < 1e-4, f"totals {totals}")


# -- the groups' other paths -------------------------------------------------------
@pytest.mark.mpi
@pytest.mark.parametrize("nonfinite", ["skip", "raise"])
def test_comm_hook_block_ops_nonfinite_change_no_residual(comm, gloo, nonfinite):
    """A NaN in one rank's gradient with the groups of a block-based op:
    "skip" hands DDP NaN for the parameters of the affected group and the
    others' results, "raise" fails backward on every rank (NonFiniteError,
    from backward() itself); either way no residual changes, and the next
    step is finite."""
    model = make_model()
    ddp = _ddp(model)
    state = mt.CommHookState(ddp, op="1bit", nonfinite=nonfinite)
    ddp.register_comm_hook(state, mt.comm_hook)
    for s in range(3):
        ddp.zero_grad()
        backward(ddp, comm.rank, s)
    before = state.state_dict()
    bias = model[4].bias  # in the first group, 0.* in the second
    h = bias.register_hook(lambda g: g * float("nan")) if comm.rank == comm.size - 1 else None
    ddp.zero_grad()
    if nonfinite == "raise":
        raises_everywhere(mpigc.NonFiniteError, lambda: backward(ddp, comm.rank, 3),
                          match="non-finite")
        ok = state.nonfinite_steps == 0
    else:
        backward(ddp, comm.rank, 3)
        ok = state.nonfinite_steps == 1 and bool(torch.isnan(model[2].weight.grad).all())
        ok &= bool(torch.isfinite(model[0].weight.grad).all())
    if h is not None:
        h.remove()
    ok &= len(state.groups) == 2 and _same_state(before, state.state_dict())
    ddp.zero_grad()
    backward(ddp, comm.rank, 4)
    ok &= all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
    assert_all(ok, f"{nonfinite}: skipped {state.nonfinite_steps}")


@pytest.mark.mpi
def test_comm_hook_block_ops_under_ddp_join(comm, gloo):
    """DDP's Join with the groups and find_unused_parameters: ranks that ran
    out of batches shadow the others with zero buckets (and no used
    parameters); every rank ends with the same parameters."""
    from torch.distributed.algorithms.join import Join
    model = _Branchy()
    ddp = _ddp(model, find_unused_parameters=True)
    state = mt.CommHookState(ddp, op="1bit")
    ddp.register_comm_hook(state, mt.comm_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    with Join([ddp]):
        for step in range(2 + 2 * (comm.rank == 0)):
            model.use_branch = step != 1
            opt.zero_grad()
            x, y = batch(comm.rank, step)
            ((ddp(x) - y) ** 2).mean().backward()
            opt.step()
    mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    ok = state.find_unused_parameters and state.groups is not None
    assert_all(ok and all(torch.equal(mine, o) for o in comm.allgather(mine)))
