"""mpigc.torch under mpirun: GradientSync against the compressed-allreduce
reference and against DDP (gloo), overlap, unused/frozen parameters, errors on
every rank, residual state across bucketings, broadcast."""
import copy
import os
import sys
import time
import warnings

import numpy as np
import pytest

import mpigc

from conftest import assert_all, raises_everywhere

torch = pytest.importorskip("torch")
import mpigc.torch as mt  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tests/
from support import torch_dist  # noqa: E402

# ranks: MPIGC_NODE_SPLIT=2 (hierarchy='node'): 4 is 2 nodes of 2
pytestmark = pytest.mark.ranks(1, 2, 3, 4)

torch.set_num_threads(1)

gloo = torch_dist.gloo  # its module-scoped fixture: torch.distributed over gloo


def make_model(seed=0, hidden=24):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, hidden), torch.nn.Tanh(),
                               torch.nn.Linear(hidden, hidden), torch.nn.Tanh(),
                               torch.nn.Linear(hidden, 3))


def batch(rank, step, n=16):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, 12, generator=g), torch.randn(n, 3, generator=g)


def backward(model, rank, step):
    x, y = batch(rank, step)
    ((model(x) - y) ** 2).mean().backward()


def grads_of(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()
            if p.grad is not None}


def _hier_keys(sync):
    return [k for k in sync.feedback.keys() if mpigc._hierarchy.parse_slice_key(k)]


def reference_sync(sync, model, op, fb, **kw):
    """What GradientSync must produce: each bucket built by hand in its
    documented layout, then the blocking mpigc.allreduce."""
    params = dict(model.named_parameters())
    for b in sync.buckets:
        flat = np.zeros(b.n, b.flat.dtype)
        for name, off, m in zip(b.names, b.offsets, b.numels):
            flat[off:off + m] = params[name].grad.detach().reshape(-1).numpy()
        mpigc.allreduce(flat, op=op, key=b.key, average=True, feedback=fb, **kw)
        for name, off, m in zip(b.names, b.offsets, b.numels):
            params[name].grad.copy_(torch.from_numpy(flat[off:off + m]).view_as(params[name]))


@pytest.mark.mpi
@pytest.mark.parametrize("hierarchy", ["flat", "node"])
@pytest.mark.parametrize("op", ["2bit", "1bit", "fp16", "bf16", "terngrad"])
def test_gradients_equal_compressed_allreduce_reference(comm, monkeypatch, op, hierarchy):
    """Each bucket as the blocking mpigc.allreduce gives it; with
    hierarchy="node" (emulated nodes of 2 ranks) the hierarchical one, its
    residuals under the buckets' slice keys."""
    monkeypatch.setenv("MPIGC_NODE_SPLIT", "2")
    model, ref = make_model(), make_model()
    sync = mt.GradientSync(model, op=op, bucket_mb=0.002,  # several buckets
                           hierarchy=hierarchy)
    fb = mpigc.ErrorFeedback()
    ok = len(sync.buckets) >= 2  # agreed on below, no rank-local raise between collectives
    for step in range(3):  # residuals carry over between steps
        model.zero_grad()
        ref.zero_grad()
        backward(model, comm.rank, step)
        backward(ref, comm.rank, step)
        sync.wait()
        reference_sync(sync, ref, sync.compressor, fb, hierarchy=hierarchy)
        got, want = grads_of(model), grads_of(ref)
        ok &= got.keys() == want.keys() and all(
            got[n].numpy().tobytes() == want[n].numpy().tobytes() for n in want)
    ok &= sorted(sync.feedback.keys()) == sorted(fb.keys())
    ok &= hierarchy == "flat" or len(_hier_keys(sync)) == len(fb.keys()) > 0
    assert_all(ok, f"{op} {hierarchy}: synced gradients differ from the reference")


@pytest.mark.mpi
def test_none_matches_ddp_average(comm, gloo):
    model, ddp_model = make_model(), make_model()
    ddp = torch.nn.parallel.DistributedDataParallel(ddp_model, bucket_cap_mb=0.002)
    sync = mt.GradientSync(model, op="none", bucket_mb=0.002)
    ok = True
    for step in range(2):
        model.zero_grad()
        ddp.zero_grad()
        backward(model, comm.rank, step)
        backward(ddp, comm.rank, step)
        sync.wait()
        got = grads_of(model)
        want = {n.replace("module.", "", 1): g for n, g in grads_of(ddp).items()}
        ok &= got.keys() == want.keys() and all(
            torch.allclose(got[n], want[n], rtol=1e-5, atol=1e-7) for n in want)
    assert_all(ok, "op='none' differs from DDP's averaged gradients")


class _Slow(torch.autograd.Function):
    """Identity whose backward sleeps and records when it started."""
    log = []

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        _Slow.log.append(time.perf_counter())
        time.sleep(0.05)
        return g


class SlowFirstLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first = torch.nn.Linear(12, 64)
        self.last = torch.nn.Linear(64, 3)

    def forward(self, x):
        return self.last(_Slow.apply(torch.tanh(self.first(x))))


@pytest.mark.mpi
def test_first_bucket_starts_before_backward_finishes(comm):
    model = SlowFirstLayer()
    sync = mt.GradientSync(model, op="2bit", bucket_mb=0.0005)  # last.* fills bucket 0
    layout_ok = sync.buckets[0].names == ["last.bias", "last.weight"]
    _Slow.log.clear()
    x, y = batch(comm.rank, 0)
    ((model(x) - y) ** 2).mean().backward()
    t_end = time.perf_counter()
    first, last = sync.buckets[0], sync.buckets[-1]
    started_early = first.started_at is not None and first.started_at < _Slow.log[0]
    last_after = last.started_at is not None and last.started_at > _Slow.log[0]
    sync.wait()
    assert_all(layout_ok and started_early and last_after and first.started_at < t_end,
               f"bucket 0 started at {first.started_at}, slow backward at {_Slow.log}")


class WithUnused(torch.nn.Module):
    def __init__(self, rank):
        super().__init__()
        torch.manual_seed(0)
        self.frozen = torch.nn.Linear(12, 12)
        self.frozen.requires_grad_(False)
        self.used = torch.nn.Linear(12, 3)
        self.never = torch.nn.Linear(12, 3)        # no rank uses it
        self.rank0_only = torch.nn.Linear(12, 3)   # only rank 0 uses it
        self.rank = rank

    def forward(self, x):
        h = self.frozen(x)
        out = self.used(h)
        if self.rank == 0:
            out = out + self.rank0_only(h)
        return out


@pytest.mark.mpi
@pytest.mark.parametrize("view", [False, True])
@pytest.mark.parametrize("find_unused", [False, True])
def test_unused_and_frozen_parameters_as_ddp(comm, find_unused, view):
    model = WithUnused(comm.rank)
    sync = mt.GradientSync(model, op="none", find_unused_parameters=find_unused,
                           gradient_as_bucket_view=view)
    local = WithUnused(comm.rank)
    x, y = batch(comm.rank, 0)
    ((model(x) - y) ** 2).mean().backward()
    ((local(x) - y) ** 2).mean().backward()
    sync.wait()
    ok = "frozen.weight" not in sync.names and model.frozen.weight.grad is None
    # rank0_only: rank 0's gradient averaged with zeros from the others
    g0 = comm.bcast(local.rank0_only.weight.grad if comm.rank == 0 else None)
    ok &= torch.allclose(model.rank0_only.weight.grad, g0 / comm.size, atol=1e-7)
    gu = sum(comm.allgather(local.used.weight.grad)) / comm.size
    ok &= torch.allclose(model.used.weight.grad, gu, atol=1e-6)
    if find_unused:  # DDP(find_unused_parameters=True): grad stays None
        ok &= model.never.weight.grad is None
    else:
        ok &= bool((model.never.weight.grad == 0).all())
    assert_all(ok)


@pytest.mark.mpi
@pytest.mark.parametrize("hierarchy", ["flat", "node"])
def test_globally_unused_parameter_keeps_its_residual(comm, monkeypatch, hierarchy):
    """What a parameter no rank used delivered goes back into its worker
    residuals; hierarchically (emulated nodes of 2) into its slices', each of
    a slice's M handlers taking 1/M of it."""
    monkeypatch.setenv("MPIGC_NODE_SPLIT", "2")
    torch.manual_seed(0)
    lin = torch.nn.Linear(200, 1)
    # 1bit: a residual alone still sends something (2bit would send nothing)
    sync = mt.GradientSync([("w", lin.weight), ("b", lin.bias)], op="1bit",
                           find_unused_parameters=True, hierarchy=hierarchy)
    g = torch.Generator().manual_seed(comm.rank)
    lin(torch.randn(1, 200, generator=g)).sum().backward()  # everything used
    sync.wait()
    before = sync.state_dict()
    lin.zero_grad()
    (lin.bias * 1.0).sum().backward()  # w unused on every rank
    sync.wait()
    after = sync.state_dict()
    ok = lin.weight.grad is None and (hierarchy == "flat") != bool(_hier_keys(sync))
    # w's residual total is kept (what it delivered went back into the residuals)
    per = comm.size if hierarchy == "flat" else 1
    tot = lambda s: comm.allreduce(float(s["w"]["worker"].sum() / per
                                         + s["w"]["owner"].sum()))
    ok &= abs(tot(before) - tot(after)) < 1e-4
    assert_all(ok, f"{tot(before)} vs {tot(after)}")


@pytest.mark.mpi
def test_different_parameters_raise_on_every_rank(comm):
    model = make_model()
    if comm.size > 1 and comm.rank == comm.size - 1:
        model.add_module("extra", torch.nn.Linear(2, 2))
    if comm.size == 1:
        mt.GradientSync(model, op="2bit")
        return
    e = raises_everywhere(mpigc.MismatchError, lambda: mt.GradientSync(model, op="2bit"))
    assert_all("extra.weight" in str(e), str(e))
    # frozen on one rank only is a different parameter set too
    model = make_model()
    if comm.rank == 0:
        model[0].weight.requires_grad_(False)
    raises_everywhere(mpigc.MismatchError, lambda: mt.GradientSync(model, op="2bit"))


@pytest.mark.mpi
def test_no_sync_accumulates_then_syncs_the_sum(comm):
    model, ref = make_model(), make_model()
    sync = mt.GradientSync(model, op="none", bucket_mb=0.002)
    with sync.no_sync():
        backward(model, comm.rank, 0)
        sync.wait()  # nothing to do
    backward(model, comm.rank, 1)
    sync.wait()
    backward(ref, comm.rank, 0)
    backward(ref, comm.rank, 1)
    ok = True
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        want = sum(comm.allgather(q.grad)) / comm.size
        ok &= torch.allclose(p.grad, want, rtol=1e-5, atol=1e-6)
    assert_all(ok)


def _in_bucket(sync, p):
    return any(b.tensor.data_ptr() <= p.grad.data_ptr()
               < b.tensor.data_ptr() + b.tensor.numel() * b.tensor.element_size()
               for b in sync.buckets)


@pytest.mark.mpi
@pytest.mark.parametrize("set_to_none", [False, True])
@pytest.mark.parametrize("op", ["2bit", "none"])
def test_gradient_as_bucket_view_gives_the_same_gradients(comm, op, set_to_none):
    model, ref = make_model(), make_model()
    view = mt.GradientSync(model, op=op, bucket_mb=0.002, gradient_as_bucket_view=True)
    copy_ = mt.GradientSync(ref, op=op, bucket_mb=0.002)
    ok, where = True, []
    for step in range(4):
        model.zero_grad(set_to_none=set_to_none)
        ref.zero_grad(set_to_none=set_to_none)
        if step == 2:  # accumulation: the first backward only adds into the views
            with view.no_sync(), copy_.no_sync():
                backward(model, comm.rank, 10)
                backward(ref, comm.rank, 10)
        backward(model, comm.rank, step)
        backward(ref, comm.rank, step)
        view.wait()
        copy_.wait()
        got, want = grads_of(model), grads_of(ref)
        ok &= got.keys() == want.keys() and all(
            got[n].numpy().tobytes() == want[n].numpy().tobytes() for n in want)
        where.append(all(_in_bucket(view, p) for p in model.parameters()))
        ok &= not any(_in_bucket(copy_, p) for p in ref.parameters())
    assert_all(ok and all(where), f"{op}: view mode differs (grads in buckets: {where})")


@pytest.mark.mpi
def test_second_backward_without_wait_is_an_error(comm):
    model = make_model()
    sync = mt.GradientSync(model, op="2bit")
    backward(model, comm.rank, 0)
    try:
        backward(model, comm.rank, 1)
        got = None
    except mpigc.StateError as e:
        got = str(e)
    # that backward added into param.grad after it was sent: wait() says so
    raises_everywhere(mpigc.StateError, sync.wait)
    assert_all(got is not None and "no_sync" in got and "remove_hooks" in got, got)


@pytest.mark.mpi
def test_nonfinite_raises_everywhere_and_changes_nothing(comm):
    model = make_model()
    sync = mt.GradientSync(model, op="2bit", bucket_mb=0.002, nonfinite="raise")
    backward(model, comm.rank, 0)
    sync.wait()
    state = sync.state_dict()
    model.zero_grad()
    x, y = batch(comm.rank, 1)
    if comm.rank == comm.size - 1:
        x[0, 0] = float("nan")  # hooks copy gradients during backward: poison the input
    ((model(x) - y) ** 2).mean().backward()
    local = grads_of(model)
    raises_everywhere(mpigc.NonFiniteError, sync.wait)
    after = sync.state_dict()
    same = all(np.array_equal(state[k]["worker"], after[k]["worker"]) for k in state)
    same &= all(torch.equal(local[n], g) or bool(torch.isnan(local[n]).any())
                for n, g in grads_of(model).items())
    assert_all(same)


def _steps(sync, model, rank, steps):
    for step in steps:
        model.zero_grad()
        backward(model, rank, step)
        sync.wait()
    return grads_of(model)


@pytest.mark.mpi
@pytest.mark.parametrize("op", ["2bit", "1bit"])
def test_state_dict_survives_rebucketing_and_resumes_bit_exact(comm, op):
    model = make_model()
    sync = mt.GradientSync(model, op=op, bucket_mb=0.002)
    _steps(sync, model, comm.rank, range(3))
    state = sync.state_dict()
    names_ok = set(state) == set(sync.names)
    # same bucketing: the next step is bit-identical to an uninterrupted run
    m2 = copy.deepcopy(model)
    s2 = mt.GradientSync(m2, op=op, bucket_mb=0.002)
    s2.load_state_dict(state)
    g1 = _steps(sync, model, comm.rank, [3])
    g2 = _steps(s2, m2, comm.rank, [3])
    ok = all(g1[n].numpy().tobytes() == g2[n].numpy().tobytes() for n in g1)
    # another bucketing (one bucket, other shards): the per-parameter state is kept
    m3 = copy.deepcopy(model)
    s3 = mt.GradientSync(m3, op=op, bucket_mb=25)
    ok &= names_ok and len(s3.buckets) == 1 and len(s2.buckets) > 1
    s3.load_state_dict(state)
    back = s3.state_dict()
    for n in state:
        for part in ("worker", "owner"):
            ok &= np.array_equal(state[n][part], back[n][part])
    assert_all(ok)


@pytest.mark.mpi
def test_load_state_dict_errors_on_every_rank(comm):
    model = make_model()
    sync = mt.GradientSync(model, op="2bit")
    _steps(sync, model, comm.rank, [0])
    state = sync.state_dict()
    if comm.rank == 0:
        state["nope"] = state.pop("0.weight")
    raises_everywhere(mpigc.StateError, lambda: sync.load_state_dict(state))
    assert_all(np.array_equal(sync.state_dict()["2.bias"]["worker"],
                              state["2.bias"]["worker"]))


@pytest.mark.mpi
@pytest.mark.skipif(not hasattr(mpigc, "save_checkpoint"),
                    reason="mpigc.save_checkpoint is not in this build")
def test_save_checkpoint_round_trip(comm, tmp_path_factory):
    path = comm.bcast(str(tmp_path_factory.mktemp("ckpt")) if comm.rank == 0 else None)
    model = make_model()
    sync = mt.GradientSync(model, op="2bit", bucket_mb=0.002)
    _steps(sync, model, comm.rank, range(2))
    state = sync.state_dict()
    sync.save_checkpoint(path + "/res", step=2)
    s2 = mt.GradientSync(copy.deepcopy(model), op="2bit", bucket_mb=1)
    s2.load_checkpoint(path + "/res")
    back = s2.state_dict()
    assert_all(all(np.array_equal(state[n][p], back[n][p])
                   for n in state for p in ("worker", "owner")))


@pytest.mark.mpi
def test_broadcast_parameters_and_optimizer(comm):
    model = make_model(seed=comm.rank)
    model.register_buffer("count", torch.tensor([comm.rank], dtype=torch.int64))
    mt.broadcast_parameters(model, root=0)
    ref = make_model(seed=0)
    ok = all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    ok &= int(model.count) == 0
    opt = torch.optim.SGD(model.parameters(), lr=0.1 * (comm.rank + 1), momentum=0.9)
    mt.broadcast_optimizer_state(opt)
    ok &= opt.param_groups[0]["lr"] == pytest.approx(0.1)
    assert_all(ok)


@pytest.mark.mpi
def test_distributed_optimizer_steps_after_wait(comm):
    model, ref = make_model(), make_model()
    opt = mt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                                  op="2bit", bucket_mb=0.002)
    ref_sync = mt.GradientSync(ref, op="2bit", bucket_mb=0.002)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(2):
        opt.zero_grad()
        backward(model, comm.rank, step)
        opt.step()
        ref_opt.zero_grad()
        backward(ref, comm.rank, step)
        ref_sync.wait()
        ref_opt.step()
    ok = all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    assert_all(ok and opt.param_groups[0]["lr"] == 0.1)


# -- issue 13: what PyTorch users expect ---------------------------------------------
def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _average(tensors, comm):
    return [sum(comm.allgather(t)) / comm.size for t in tensors]


def _clip_like_torch(grads, max_norm):
    """torch.nn.utils.clip_grad_norm_'s rule on a list of tensors."""
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    return [g * coef for g in grads]


@pytest.mark.mpi
@pytest.mark.parametrize("recipe", ["plain", "clip", "scaler", "scaler-clip",
                                    "horovod-scaler-clip"])
def test_update_is_the_reference_update(comm, recipe):
    """The documented recipes apply lr x (clipped) average gradient, 1.0x."""
    lr, max_norm = 0.1, 0.05
    model, ref = make_model(), make_model()
    opt = mt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr), model,
                                  op="none", bucket_mb=0.002)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if "scaler" in recipe else None
    ok, ratios = True, []
    for step in range(2):
        ref.load_state_dict(model.state_dict())
        ref.zero_grad()
        backward(ref, comm.rank, step)
        want = _average([p.grad for p in ref.parameters()], comm)
        if "clip" in recipe:
            want = _clip_like_torch(want, max_norm)
        want = [-lr * g for g in want]
        before = _params(model)
        opt.zero_grad()
        x, y = batch(comm.rank, step)
        loss = ((model(x) - y) ** 2).mean()
        if recipe == "plain":
            loss.backward()
            opt.step()
        elif recipe == "clip":  # DDP's recipe: clip after backward
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            opt.step()
        elif recipe == "scaler":  # DDP's AMP recipe
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        elif recipe == "scaler-clip":
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            scaler.step(opt)
            scaler.update()
        else:  # Horovod's AMP recipe
            scaler.scale(loss).backward()
            opt.synchronize()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            with opt.skip_synchronize():
                scaler.step(opt)
            scaler.update()
        got = [a - b for a, b in zip(_params(model), before)]
        ratios.append(float(sum((g * w).sum() for g, w in zip(got, want))
                            / sum((w * w).sum() for w in want)))
        err = (sum(((g - w) ** 2).sum() for g, w in zip(got, want))
               / sum((w * w).sum() for w in want)) ** 0.5
        ok &= bool(err < 1e-3)  # the update is p_after - p_before in float32
    assert_all(ok, f"{recipe}: applied / reference update = {ratios}")


def _example():
    import importlib.util
    path = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "train_torch.py")
    spec = importlib.util.spec_from_file_location("train_torch_example", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.mpi
@pytest.mark.skipif(not hasattr(mpigc, "save_checkpoint"),
                    reason="mpigc.save_checkpoint is not in this build")
@pytest.mark.parametrize("first_run_epochs,hierarchy", [(4, "flat"), (2, "flat"),
                                                      (4, "node")])
def test_example_resume_continues_the_schedule(comm, tmp_path_factory, monkeypatch,
                                               first_run_epochs, hierarchy):
    """examples/train_torch.py's save/resume: the same --epochs resumes bit for
    bit (with --hierarchy node too: emulated nodes of 2 ranks); a longer
    --epochs (the issue: 2, then 4) follows the new schedule (it trained with
    lr 0 before)."""
    import argparse
    monkeypatch.setenv("MPIGC_NODE_SPLIT", "2")
    ex = _example()
    path = comm.bcast(str(tmp_path_factory.mktemp("resume")) if comm.rank == 0 else None)

    def build(epochs):
        args = argparse.Namespace(schedule="cosine", epochs=epochs, checkpoint=path, op="2bit")
        model = make_model()
        opt = mt.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model, op="2bit",
            bucket_mb=0.002, hierarchy=hierarchy)
        return args, model, opt, ex.make_scheduler(opt, args)

    def epoch(model, opt, e):
        for s in range(2):
            opt.zero_grad()
            backward(model, comm.rank, 10 * e + s)
            opt.step()

    args, model, opt, sched = build(4)   # uninterrupted, 4 epochs
    lrs = []
    for e in range(4):
        lrs.append(opt.param_groups[0]["lr"])
        epoch(model, opt, e)
        sched.step()
    args, m1, o1, s1 = build(first_run_epochs)
    for e in range(2):
        epoch(m1, o1, e)
        s1.step()
        ex.save(args, comm, e, m1, o1, s1, o1.sync)
    args, m2, o2, s2 = build(4)
    start = ex.resume(args, comm, m2, o2, s2, o2.sync)
    resumed = []
    for e in range(start, 4):
        resumed.append(o2.param_groups[0]["lr"])
        epoch(m2, o2, e)
        s2.step()
    ok = start == 2 and resumed == lrs[2:] and resumed[0] > 0
    ok &= (hierarchy == "node") == bool(_hier_keys(o2.sync))
    if first_run_epochs == 4:
        ok &= all(torch.equal(a, b) for a, b in zip(_params(model), _params(m2)))
    assert_all(ok, f"start {start}, lrs {resumed} vs {lrs[2:]}")


@pytest.mark.mpi
def test_distributed_optimizer_is_an_optimizer_to_schedulers(comm):
    import warnings
    model = make_model()
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = mt.DistributedOptimizer(base, model, op="none")
    ok = (isinstance(opt, torch.optim.SGD) and isinstance(opt, mt.DistributedOptimizer)
          and opt.optimizer is base)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        for step in range(2):
            opt.zero_grad()
            backward(model, comm.rank, step)
            opt.step()
            sched.step()
    ok &= not [w for w in caught if "lr_scheduler.step()" in str(w.message)]
    ok &= base.param_groups[0]["lr"] == pytest.approx(0.025)
    ok &= opt.param_groups is base.param_groups and opt.state is base.state
    ok &= len(base.state) == len(list(model.parameters()))  # momentum buffers
    opt.load_state_dict(opt.state_dict())
    ok &= opt.param_groups is base.param_groups and opt.state is base.state
    assert_all(ok, f"{type(opt).__mro__}")


def _scaler_steps(opt, model, scaler, comm):
    """``step(s, poison)``: one AMP step of ``model``; with ``poison``, an Inf
    in the last bucket's gradient on the last rank."""
    def step(s, poison):
        opt.zero_grad()
        x, y = batch(comm.rank, s)
        loss = ((model(x) - y) ** 2).mean()
        if poison and comm.rank == comm.size - 1:
            loss = loss + (model[4].bias * float("inf")).sum()  # one bucket only
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    return step


@pytest.mark.mpi
def test_gradscaler_skips_nonfinite_steps_and_residuals_stay(comm):
    """nonfinite default 'skip': the scaler sees the Inf, skips the step and
    backs off; no residual changes, though only one bucket was non-finite."""
    model = make_model()
    opt = mt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                                  op="2bit", bucket_mb=0.002, threshold=2.0 ** -6)
    several = len(opt.sync.buckets) >= 2
    scaler = torch.amp.GradScaler("cpu", init_scale=65536.0)
    step = _scaler_steps(opt, model, scaler, comm)

    step(0, False)
    state, before = opt.sync.state_dict(), _params(model)
    step(1, True)
    after = opt.sync.state_dict()
    ok = several and scaler.get_scale() == 32768.0 and opt.sync.nonfinite_steps == 1
    ok &= all(torch.equal(a, b) for a, b in zip(before, _params(model)))
    ok &= all(np.array_equal(state[n][k], after[n][k]) for n in state for k in ("worker", "owner"))
    step(2, False)  # and training goes on
    ok &= scaler.get_scale() == 32768.0 and opt.sync.last_step_finite
    # without a scaler, the optimizer refuses a non-finite update on every rank
    opt.zero_grad()
    x, y = batch(comm.rank, 3)
    loss = ((model(x) - y) ** 2).mean()
    if comm.rank == 0:
        loss = loss * float("inf")
    loss.backward()
    raises_everywhere(mpigc.NonFiniteError, opt.step)
    assert_all(ok, f"scale {scaler.get_scale()}, skipped {opt.sync.nonfinite_steps}")


@pytest.mark.mpi
def test_rewrapping_needs_remove_hooks_and_then_works(comm):
    model = make_model()
    model[0].requires_grad_(False)
    opt = mt.DistributedOptimizer(
        torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1), model,
        op="none")
    opt.zero_grad()
    backward(model, comm.rank, 0)
    opt.step()
    model[0].requires_grad_(True)  # unfreeze, wrap again
    e = raises_everywhere(mpigc.StateError, lambda: mt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model, op="none"))
    ok = "remove_hooks" in str(e)
    opt.sync.remove_hooks()
    opt = mt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                                  op="none")
    ref = copy.deepcopy(model)
    opt.zero_grad()
    backward(model, comm.rank, 1)
    backward(ref, comm.rank, 1)
    want = _average([p.grad for p in ref.parameters()], comm)
    ok &= all(torch.allclose(p.grad, w, rtol=1e-5, atol=1e-7)
              for p, w in zip(model.parameters(), want))
    assert_all(ok, str(e))


@pytest.mark.mpi
@pytest.mark.parametrize("op", ["none", "2bit"])
def test_join_shadows_the_steps_of_ranks_with_more_batches(comm, op):
    model, ref = make_model(), make_model()
    opt = mt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                                  op=op, bucket_mb=0.002, timeout=120)
    extra = comm.rank == 0
    ok = True
    with opt.join():
        for step in range(2 + extra):
            opt.zero_grad()
            ref.load_state_dict(model.state_dict())
            ref.zero_grad()
            backward(ref, comm.rank, step)
            backward(model, comm.rank, step)
            if step == 2 and op == "none":  # the others gave zeros: my gradient / N
                ok &= all(torch.allclose(p.grad, q.grad / comm.size, rtol=1e-5, atol=1e-8)
                          for p, q in zip(model.parameters(), ref.parameters()))
            opt.step()
    mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    ok &= all(torch.equal(mine, other) for other in comm.allgather(mine))
    assert_all(ok)


@pytest.mark.mpi
@pytest.mark.ranks(2, 3)  # flat, rank 0 against the others: 2 and 3 cover it, 4 adds nothing
def test_uneven_inputs_without_join_raise_within_the_timeout(comm):
    if comm.size < 2:
        pytest.skip("needs 2 ranks")
    model = make_model()
    opt = mt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                                  op="2bit", bucket_mb=0.002, timeout=3)
    err, took = None, None
    try:
        for step in range(2 + (comm.rank == 0)):
            opt.zero_grad()
            t0 = time.monotonic()
            backward(model, comm.rank, step)
            opt.step()
    except mpigc.StateError as e:
        err, took = e, time.monotonic() - t0
    comm.Barrier()  # the others wait here meanwhile (not in mpigc)
    with opt.join():  # rank 0's step is still pending: join completes it
        pass
    if comm.rank == 0:
        ok = err is not None and "join" in str(err) and took < 60
    else:
        ok = err is None
    mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    ok &= all(torch.equal(mine, other) for other in comm.allgather(mine))
    assert_all(ok, f"{err!r} after {took} s")


def _ddp(model, **kw):
    return torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.002, **kw)


_HOOK_OP = {"op": "2bit", "threshold": 2.0 ** -6}  # sums of +-t are exact: any layout


def _same_hook_state(comm, a, b, hierarchy):
    """Per-parameter states ``a`` and ``b`` are the same: bit for bit when
    flat; when hierarchical, where a node's worker residual sits among its
    ranks depends on the bucket's slices, so the totals over the ranks."""
    ok = set(a) == set(b) and all(np.array_equal(a[n]["owner"], b[n]["owner"]) for n in b)
    for n in sorted(b):
        if hierarchy == "flat":
            ok &= np.array_equal(a[n]["worker"], b[n]["worker"])
        else:  # sums of float32 values in float64: exact, in any order
            ok &= np.array_equal(comm.allreduce(a[n]["worker"].astype(np.float64)),
                                 comm.allreduce(b[n]["worker"].astype(np.float64)))
    return ok


@pytest.mark.mpi
@pytest.mark.parametrize("hierarchy", ["flat", "node"])
def test_comm_hook_equals_gradient_sync_across_ddp_bucket_rebuild(comm, gloo, monkeypatch,
                                                                   hierarchy):
    """DDP with the hook gives GradientSync's gradients and state, across
    DDP's rebuild of its buckets; with hierarchy="node" (emulated nodes of 2
    ranks) the hierarchical ones."""
    monkeypatch.setenv("MPIGC_NODE_SPLIT", "2")
    model, ref = make_model(), make_model()
    ddp = _ddp(model)
    state = mt.CommHookState(ddp, hierarchy=hierarchy, **_HOOK_OP)
    ddp.register_comm_hook(state, mt.comm_hook)
    sync = mt.GradientSync(ref, bucket_mb=0.002, hierarchy=hierarchy, **_HOOK_OP)
    ok, layouts = True, []
    for step in range(4):
        ddp.zero_grad()
        ref.zero_grad()
        backward(ddp, comm.rank, step)
        backward(ref, comm.rank, step)
        sync.wait()
        layouts.append(sorted(lay.key for lay in state._layouts.values()))
        got = {n.replace("module.", "", 1): g for n, g in grads_of(ddp).items()}
        want = grads_of(ref)
        ok &= got.keys() == want.keys() and all(
            got[n].numpy().tobytes() == want[n].numpy().tobytes() for n in want)
    ok &= (hierarchy == "node") == bool(_hier_keys(state)) == bool(_hier_keys(sync))
    ok &= _same_hook_state(comm, state.state_dict(), sync.state_dict(), hierarchy)
    assert_all(ok and layouts[0] != layouts[-1],
               f"DDP buckets {layouts[0]} -> {layouts[-1]}")


@pytest.mark.mpi
@pytest.mark.skipif(not hasattr(mpigc, "save_checkpoint"),
                    reason="mpigc.save_checkpoint is not in this build")
@pytest.mark.parametrize("hierarchy", ["flat", "node"])
def test_comm_hook_checkpoint_and_no_sync(comm, gloo, tmp_path_factory, monkeypatch,
                                          hierarchy):
    monkeypatch.setenv("MPIGC_NODE_SPLIT", "2")
    path = comm.bcast(str(tmp_path_factory.mktemp("hook")) if comm.rank == 0 else None)
    model, ref = make_model(), make_model()
    ddp = _ddp(model)
    state = mt.CommHookState(ddp, hierarchy=hierarchy, **_HOOK_OP)
    ddp.register_comm_hook(state, mt.comm_hook)
    sync = mt.GradientSync(ref, bucket_mb=1, hierarchy=hierarchy, **_HOOK_OP)  # another layout

    def compare(d):
        got = {n.replace("module.", "", 1): g for n, g in grads_of(d).items()}
        want = grads_of(ref)
        return got.keys() == want.keys() and all(
            got[n].numpy().tobytes() == want[n].numpy().tobytes() for n in want)

    ok = True
    for step in range(3):
        ddp.zero_grad()
        ref.zero_grad()
        if step == 2:  # accumulation
            with ddp.no_sync(), sync.no_sync():
                backward(ddp, comm.rank, 20)
                backward(ref, comm.rank, 20)
        backward(ddp, comm.rank, step)
        backward(ref, comm.rank, step)
        sync.wait()
        ok &= compare(ddp)
    state.save_checkpoint(path + "/res", step=3)
    ddp2 = _ddp(copy.deepcopy(model))
    state2 = mt.CommHookState(ddp2, hierarchy=hierarchy, **_HOOK_OP)
    state2.load_checkpoint(path + "/res")
    ddp2.register_comm_hook(state2, mt.comm_hook)
    ddp2.zero_grad()
    ref.zero_grad()
    backward(ddp2, comm.rank, 3)
    backward(ref, comm.rank, 3)
    sync.wait()
    ok &= compare(ddp2)
    ok &= (hierarchy == "node") == bool(_hier_keys(state2))
    assert_all(ok)


@pytest.mark.mpi
def test_comm_hook_under_ddp_join_with_uneven_inputs(comm, gloo):
    from torch.distributed.algorithms.join import Join
    model = make_model()
    ddp = _ddp(model)
    state = mt.CommHookState(ddp, **_HOOK_OP)
    ddp.register_comm_hook(state, mt.comm_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    with Join([ddp]):  # joined ranks run the hook on zero buckets
        for step in range(2 + (comm.rank == 0)):
            opt.zero_grad()
            backward(ddp, comm.rank, step)
            opt.step()
    mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert_all(all(torch.equal(mine, other) for other in comm.allgather(mine)))


class _FakeBucket:
    """What DDP hands a comm hook (torch.distributed.GradBucket's methods)."""

    def __init__(self, index, params, last):
        self._index, self._params, self._last = index, params, last
        self._buffer = torch.cat([p.grad.reshape(-1) for p in params])

    def index(self):
        return self._index

    def parameters(self):
        return self._params

    def buffer(self):
        return self._buffer

    def is_last(self):
        return self._last


@pytest.mark.mpi
@pytest.mark.parametrize("hierarchy", ["flat", "node"])
def test_comm_hook_takes_residuals_over_when_a_later_bucket_changes(comm, monkeypatch,
                                                                    hierarchy):
    """Layout changes at later buckets while bucket 0 is in flight, and a
    bucket that moves to another index, displacing one that is split."""
    monkeypatch.setenv("MPIGC_NODE_SPLIT", "2")
    model, ref = make_model(), make_model()
    state = mt.CommHookState(model, hierarchy=hierarchy, **_HOOK_OP)
    sync = mt.GradientSync(ref, bucket_mb=0.002, hierarchy=hierarchy, **_HOOK_OP)
    p = list(model.parameters())  # 0.weight 0.bias 2.weight 2.bias 4.weight 4.bias
    layouts = [[[p[5], p[4]], [p[3], p[2], p[1], p[0]]],       # step 0
               [[p[5], p[4]], [p[3], p[2]], [p[1], p[0]]],     # DDP "rebuilt" bucket 1
               [[p[5], p[4]], [p[2], p[3]], [p[0], p[1]]],     # and again, reordered
               # bucket 2 moves to index 0 (its key unchanged) and the bucket it
               # displaces there is split over indices 2 and 3: the displaced
               # bucket's residuals were dropped (review of issue 16)
               [[p[0], p[1]], [p[2], p[3]], [p[5]], [p[4]]],
               [[p[5], p[4]], [p[3], p[2], p[1], p[0]]]]       # back to step 0's
    ok = True
    for step, layout in enumerate(layouts):
        model.zero_grad()
        ref.zero_grad()
        backward(model, comm.rank, step)
        backward(ref, comm.rank, step)
        sync.wait()
        buckets = [_FakeBucket(i, ps, i == len(layout) - 1) for i, ps in enumerate(layout)]
        futures = [mt.comm_hook(state, b) for b in buckets]
        for b, fut in zip(buckets, futures):
            out = fut.wait()
            off = 0
            for q in b.parameters():
                q.grad.copy_(out[off:off + q.numel()].view_as(q))
                off += q.numel()
        want = grads_of(ref)
        ok &= all(got.numpy().tobytes() == want[n].numpy().tobytes()
                  for n, got in grads_of(model).items())
    ok &= (hierarchy == "node") == bool(_hier_keys(state))
    ok &= _same_hook_state(comm, state.state_dict(), sync.state_dict(), hierarchy)
    assert_all(ok)


@pytest.mark.mpi
@pytest.mark.parametrize("hierarchy", ["flat", "node"])
def test_comm_hook_skip_restores_every_residual(comm, monkeypatch, hierarchy):
    """A step with NaN in one bucket (one rank): the hook hands DDP that bucket
    as NaN (GradScaler skips the step) and puts back every other bucket's
    residuals, slice residuals included (key@hier[...])."""
    monkeypatch.setenv("MPIGC_NODE_SPLIT", "2")
    model = make_model()
    state = mt.CommHookState(model, hierarchy=hierarchy, **_HOOK_OP)
    p = list(model.parameters())
    layout = [[p[5], p[4]], [p[3], p[2]], [p[1], p[0]]]
    ok, raw, outs = True, None, []
    for step in range(3):
        model.zero_grad()
        backward(model, comm.rank, step)
        if step == 1 and comm.rank == comm.size - 1:
            p[2].grad[0, 0] = float("nan")
        buckets = [_FakeBucket(i, ps, i == len(layout) - 1) for i, ps in enumerate(layout)]
        outs.append([f.wait().clone() for f in [mt.comm_hook(state, b) for b in buckets]])
        now = {k: (e.worker.copy(), e.calls) for k, e in state.feedback.entries().items()}
        if step == 1:
            ok &= sorted(now) == sorted(raw) and all(
                np.array_equal(now[k][0], raw[k][0]) and now[k][1] == raw[k][1] for k in raw)
        raw = now
    ok &= state.nonfinite_steps == 1 and len(raw) > 0
    ok &= bool(torch.isnan(outs[1][1]).all()) and not torch.isnan(outs[1][0]).any()
    ok &= all(bool(torch.isfinite(t).all()) for t in outs[2])
    ok &= (hierarchy == "node") == bool(_hier_keys(state))
    assert_all(ok, f"skipped {state.nonfinite_steps}, keys {sorted(raw or [])}")


# -- hierarchical buckets (hierarchy="node", emulated nodes of 2 ranks) -----------
@pytest.mark.mpi
def test_hierarchical_skip_restores_every_slice_residual(comm, monkeypatch):
    """nonfinite='skip' with hierarchical buckets: one bucket non-finite, the
    others' slice residuals are put back (a snapshot of the bucket's own key
    alone would miss them: their residuals live under key@hier[...])."""
    monkeypatch.setenv("MPIGC_NODE_SPLIT", "2")
    model = make_model()
    opt = mt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                                  op="2bit", bucket_mb=0.002, threshold=2.0 ** -6,
                                  hierarchy="node")
    scaler = torch.amp.GradScaler("cpu", init_scale=65536.0)
    step = _scaler_steps(opt, model, scaler, comm)

    step(0, False)
    raw = {k: e.worker.copy() for k, e in opt.sync.feedback.entries().items()}
    state, before = opt.sync.state_dict(), _params(model)
    step(1, True)
    after = opt.sync.state_dict()
    ok = len(opt.sync.buckets) >= 2 and opt.sync.nonfinite_steps == 1 and len(raw) > 0
    ok &= all(k in raw for k in _hier_keys(opt.sync))
    ok &= all(torch.equal(a, b) for a, b in zip(before, _params(model)))
    ok &= all(np.array_equal(opt.sync.feedback.entry(k).worker, w) for k, w in raw.items())
    ok &= all(np.array_equal(state[n][k], after[n][k]) for n in state for k in ("worker", "owner"))
    step(2, False)
    ok &= opt.sync.last_step_finite
    assert_all(ok, f"skipped {opt.sync.nonfinite_steps}, keys {sorted(raw)}")


@pytest.mark.mpi
def test_hierarchical_state_dict_resumes_and_moves_between_layouts(comm, monkeypatch):
    """The per-parameter state of hierarchical buckets: reloaded on the same
    layout the next step is bit-identical; loaded by a flat GradientSync (or
    another bucketing) it is the same state; and back again."""
    monkeypatch.setenv("MPIGC_NODE_SPLIT", "2")
    model = make_model()
    sync = mt.GradientSync(model, op="1bit", bucket_mb=0.002, hierarchy="node")
    _steps(sync, model, comm.rank, range(3))
    state = sync.state_dict()
    ok = set(state) == set(sync.names) and len(_hier_keys(sync)) > 0
    m2 = copy.deepcopy(model)
    s2 = mt.GradientSync(m2, op="1bit", bucket_mb=0.002, hierarchy="node")
    s2.load_state_dict(state)
    ok &= sorted(s2.feedback.keys()) == sorted(sync.feedback.keys())
    g1 = _steps(sync, model, comm.rank, [3])
    g2 = _steps(s2, m2, comm.rank, [3])
    ok &= all(g1[n].numpy().tobytes() == g2[n].numpy().tobytes() for n in g1)
    # flat, one bucket: the same per-parameter state
    state = s2.state_dict()
    s3 = mt.GradientSync(copy.deepcopy(model), op="1bit", bucket_mb=25)
    s3.load_state_dict(state)
    back = s3.state_dict()
    ok &= all(np.array_equal(state[n][p], back[n][p]) for n in state for p in ("worker", "owner"))
    # and back to hierarchical buckets (worker residuals summed per node: the
    # totals are kept)
    s4 = mt.GradientSync(copy.deepcopy(model), op="1bit", bucket_mb=0.004, hierarchy="node")
    s4.load_state_dict(back)
    again = s4.state_dict()
    for n in state:
        tw = comm.allreduce(state[n]["worker"].astype(np.float64))
        ta = comm.allreduce(again[n]["worker"].astype(np.float64))
        ok &= np.allclose(tw, ta, rtol=1e-6, atol=1e-6)
        ok &= np.array_equal(state[n]["owner"], again[n]["owner"])
    assert_all(ok)


@pytest.mark.mpi
def test_hierarchy_must_agree_and_be_known(comm):
    model = make_model()
    raises_everywhere(mpigc.ConfigError,
                      lambda: mt.GradientSync(model, op="2bit", hierarchy="nodes"))
    if comm.size > 1:
        raises_everywhere(mpigc.MismatchError, lambda: mt.GradientSync(
            model, op="2bit", hierarchy="node" if comm.rank == 0 else "flat"))


@pytest.mark.mpi
def test_constructor_arguments_refused_on_one_rank_raise_everywhere(comm):
    """A rank whose arguments are refused says so to the others at the
    constructor's first collective (before, it raised alone and the others
    waited forever in it); settings that differ between ranks raise too."""
    last = comm.rank == comm.size - 1
    model = make_model()
    raises_everywhere(mpigc.ConfigError, lambda: mt.GradientSync(
        model, op="2bit", bucket_mb=0 if last else 25), match="bucket_mb")
    raises_everywhere(mpigc.ConfigError, lambda: mt.CommHookState(
        model, op="2bit", nonfinite="bogus" if last else "skip"), match="nonfinite")
    raises_everywhere(mpigc.ConfigError, lambda: mt.CompressedAdamW(
        model.parameters(), freeze_steps=0 if last else 10), match="freeze_steps")
    raises_everywhere(mpigc.ConfigError, lambda: mt.GradientSync(
        model, op="2bit" if not last else "3bit"), match="3bit")
    if comm.size > 1:
        raises_everywhere(mpigc.MismatchError, lambda: mt.GradientSync(
            model, op="2bit", bucket_mb=1 if last else 25), match="bucket_mb=1")
        raises_everywhere(mpigc.MismatchError, lambda: mt.CompressedAdamW(
            model.parameters(), lr=0.1 if last else 0.01), match="lr")
    sync = mt.GradientSync(model, op="2bit")  # and a good one still builds
    backward(model, comm.rank, 0)
    sync.wait()


@pytest.mark.mpi
@pytest.mark.parametrize("hook", [False, True])
def test_raise_keeps_the_residuals_of_every_bucket(comm, gloo, hook):
    """nonfinite="raise" with a NaN in one bucket on one rank: NonFiniteError
    on every rank, and the residuals of the other (finite) buckets stay as
    they were too, as wait()'s docstring promises (before, only the failed
    bucket's call left its residuals alone)."""
    model = make_model()
    if hook:
        ddp = _ddp(model)
        state = mt.CommHookState(ddp, op="2bit", nonfinite="raise")
        ddp.register_comm_hook(state, mt.comm_hook)
        net, holder = ddp, state
    else:
        holder = mt.GradientSync(model, op="2bit", bucket_mb=0.002, nonfinite="raise")
        net = model

    def step(s):
        net.zero_grad()
        x, y = batch(comm.rank, s)
        ((net(x) - y) ** 2).mean().backward()
        if not hook:
            holder.wait()

    for s in range(3):  # DDP rebuilds its buckets after the first step
        step(s)
    before = holder.state_dict()
    bias = model[4].bias  # the last layer: its own bucket (the first one sent)
    h = bias.register_hook(lambda g: g * float("nan")) if comm.rank == comm.size - 1 else None
    # through DDP too, backward() raises the hook's NonFiniteError itself
    raises_everywhere(mpigc.NonFiniteError, lambda: step(3), match="non-finite")
    if h is not None:
        h.remove()
    after = holder.state_dict()
    same = set(before) == set(after)
    for n in before:
        for part in ("worker", "owner"):
            a, b = before[n][part], after[n][part]
            same &= (a is None and b is None) or np.array_equal(a, b)
    assert_all(same, "a residual changed in the failed step")


@pytest.mark.mpi
def test_changed_after_backward_counts_ranks(comm):
    """The "changed after backward" error counts the ranks that changed a
    gradient (it summed the changed parameters over the ranks)."""
    model = make_model()
    sync = mt.GradientSync(model, op="2bit", bucket_mb=0.002)
    backward(model, comm.rank, 0)
    with torch.no_grad():
        for p in list(model.parameters())[:3]:  # three parameters on every rank
            p.grad.mul_(0.5)
    raises_everywhere(mpigc.StateError, sync.wait, match=rf"on {comm.size} rank\(s\)")


@pytest.mark.mpi
@pytest.mark.ranks(2, 3)  # flat, rank 0 alone against the others: 4 adds nothing
@pytest.mark.parametrize("hook", [False, True])
def test_state_dict_on_one_rank_fails_there_within_the_timeout(comm, gloo, hook):
    """A DDP script saves inside `if master_process:`: the hook's (or
    GradientSync's) state_dict called on rank 0 only ends there with a
    StateError that says what to do, within the timeout (it hung every rank);
    called again on every rank, it completes."""
    if comm.size < 2:
        pytest.skip("needs 2 ranks")
    model = make_model()
    if hook:
        holder = mt.CommHookState(_ddp(model), op="2bit", timeout=2)
    else:
        holder = mt.GradientSync(model, op="2bit", timeout=2)
    err, took = None, None
    if comm.rank == 0:
        t0 = time.monotonic()
        try:
            holder.state_dict()
        except mpigc.StateError as e:
            err, took = e, time.monotonic() - t0
    comm.Barrier()
    ok = comm.rank != 0 or (err is not None and "every rank" in str(err)
                            and "if rank == 0" in str(err) and took < 30)
    state = holder.state_dict()  # every rank now: rank 0's barrier completes
    assert_all(ok and isinstance(state, dict), f"{err!r} after {took} s")


class _Trainer:
    """One model trained by ``kind``: ``sync`` (GradientSync and wait()),
    ``optimizer`` (DistributedOptimizer: opt.step()) or ``hook``
    (CommHookState in DDP); ``holder`` has the collective methods."""

    def __init__(self, kind, comm):
        self.kind, self.rank = kind, comm.rank
        model = make_model()
        if kind == "hook":
            self.net = _ddp(model)
            self.holder = mt.CommHookState(self.net, op="2bit")
            self.net.register_comm_hook(self.holder, mt.comm_hook)
        else:
            self.net = model
            self.opt = mt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                               model, op="2bit", bucket_mb=0.002)
            self.holder = self.opt.sync
            self.holder.sync_on_backward = kind == "optimizer"

    def step(self, step):
        if self.kind == "optimizer":
            self.opt.zero_grad()
            backward(self.net, self.rank, step)
            self.opt.step()
        else:
            self.net.zero_grad()
            backward(self.net, self.rank, step)
            if self.kind == "sync":
                self.holder.wait()

    def call(self, method, path):
        if method == "save_checkpoint":
            return self.holder.save_checkpoint(path)
        return self.holder.state_dict()

    def params(self):
        return torch.cat([p.detach().reshape(-1) for p in self.net.parameters()])


@pytest.mark.mpi
@pytest.mark.parametrize("method", ["state_dict", "save_checkpoint"])
@pytest.mark.parametrize("kind", ["sync", "optimizer", "hook"])
def test_a_collective_method_on_rank_0_only_raises_on_every_rank_at_once(
        comm, gloo, monkeypatch, tmp_path_factory, kind, method, watchdog):
    """The checkpoint of a DDP script saved inside `if rank == 0:` with the
    default timeout (1800 s): rank 0 waits in the method, the others in the
    next step; a MismatchError on every rank, promptly, that names the
    method on rank 0 and the step on the others (before, both waited 1800 s).
    Then rank 0 does its step, the others complete theirs, and the method on
    every rank completes (rank 0 takes up its gather)."""
    if comm.size < 2:
        pytest.skip("needs 2 ranks")
    monkeypatch.delenv("MPIGC_TORCH_TIMEOUT", raising=False)
    path = comm.bcast(str(tmp_path_factory.mktemp("one")) if comm.rank == 0 else None)
    t = _Trainer(kind, comm)
    err, took = None, None
    try:
        t0 = time.monotonic()
        for step in range(3):
            t.step(step)
            if comm.rank == 0 and step == 1:  # the mistake
                t.call(method, path + "/a")
    except mpigc.MpigcError as e:
        err, took = e, time.monotonic() - t0
    name = {"hook": "CommHookState", "sync": "GradientSync",
            "optimizer": "GradientSync"}[kind] + "." + method
    ok = (isinstance(err, mpigc.MismatchError) and took < 60
          and f"rank 0 is in {name}" in str(err) and "not inside `if rank == 0:`" in str(err)
          and (comm.rank == 0 or f"rank {comm.rank} is in the gradient synchronisation "
               "of step 3" in str(err)))
    comm.Barrier()  # every rank raised (rank 0 stays out of the step meanwhile)
    # recovery: rank 0's step 2 completes the others' pending one
    if kind == "hook":  # the others' calls of step 2 stay posted: their next step ends them
        if comm.rank == 0:
            t.step(2)
        t.step(3)
    elif comm.rank == 0:
        t.step(2)
    elif kind == "optimizer":
        t.opt.step()
    else:
        t.holder.wait()
    state = t.call(method, path + "/b")
    ok &= state is not None
    if kind != "hook":
        mine = t.params()
        ok &= all(torch.equal(mine, other) for other in comm.allgather(mine))
    assert_all(ok, f"{err!r} after {took} s")


@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["sync", "optimizer", "hook"])
def test_collective_methods_on_every_rank_at_different_times_just_work(
        comm, gloo, monkeypatch, tmp_path_factory, kind, watchdog):
    """The methods on every rank, twice in a row at two steps, with the last
    rank late for them (the others wait long enough to tell it which method
    they are in) and rank 0 late for the step after (the others wait in it
    long enough to read what was announced before): no error, and nothing
    left over confuses the next calls."""
    monkeypatch.delenv("MPIGC_TORCH_TIMEOUT", raising=False)
    path = comm.bcast(str(tmp_path_factory.mktemp("all")) if comm.rank == 0 else None)
    t = _Trainer(kind, comm)
    err = None
    try:
        for step in range(5):
            if comm.rank == 0 and step in (2, 3):
                time.sleep(0.5)
            t.step(step)
            if step in (1, 2):
                if comm.rank == comm.size - 1:
                    time.sleep(0.5)
                t.call("state_dict", None)
                t.call("save_checkpoint", f"{path}/{step}")
                t.call("save_checkpoint", f"{path}/{step}b")
    except mpigc.MpigcError as e:
        err = e
    ok = err is None
    if kind != "hook":
        mine = t.params()
        ok &= all(torch.equal(mine, other) for other in comm.allgather(mine))
    assert_all(ok, repr(err))


@pytest.mark.mpi
def test_a_collective_method_while_a_rank_shadows_in_join_raises_on_every_rank(
        comm, monkeypatch, watchdog):
    """Uneven inputs under join(), and state_dict in the loop: rank 0 ran out of
    batches and shadows the others' steps in join() while they call
    state_dict (default timeout): a MismatchError on every rank naming both
    sides (before, rank 0's agreement met the others' barrier on one
    communicator). On a communicator of its own: the object is left as the
    error left it."""
    if comm.size < 2:
        pytest.skip("needs 2 ranks")
    monkeypatch.delenv("MPIGC_TORCH_TIMEOUT", raising=False)
    sub = comm.Dup()
    model = make_model()
    opt = mt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                                  op="2bit", bucket_mb=0.002, comm=sub)
    err = None
    try:
        with opt.join():
            for step in range(2 + (comm.rank != 0)):  # rank 0: one batch less
                opt.zero_grad()
                backward(model, comm.rank, step)
                opt.step()
                if step == 2:
                    opt.sync.state_dict()
    except mpigc.MpigcError as e:
        err = e
    ok = (isinstance(err, mpigc.MismatchError)
          and "GradientSync.state_dict" in str(err) and "join()" in str(err))
    assert_all(ok, repr(err))


@pytest.mark.mpi
@pytest.mark.parametrize("hook", [False, True])
def test_two_different_collective_methods_raise_on_every_rank(comm, gloo, tmp_path_factory,
                                                              hook, watchdog):
    """Rank 0 in load_checkpoint, the others in state_dict: a MismatchError on
    every rank naming both, instead of each going on into another collective."""
    path = comm.bcast(str(tmp_path_factory.mktemp("two")) if comm.rank == 0 else None)
    t = _Trainer("hook" if hook else "sync", comm)
    t.step(0)
    t.holder.save_checkpoint(path + "/a")
    if comm.size == 1:
        t.holder.load_checkpoint(path + "/a")
        return
    got = raises_everywhere(mpigc.MismatchError, lambda: (
        t.holder.load_checkpoint(path + "/a") if comm.rank == 0 else t.holder.state_dict()),
        comm, match="different collective methods")
    assert_all("load_checkpoint" in str(got) and "state_dict" in str(got), str(got))


@pytest.mark.mpi
@pytest.mark.parametrize("op", ["2bit", "1bit"])
def test_gathered_state_in_a_rank_0_torch_save_resumes_bit_exact(comm, op, tmp_path_factory):
    """The residuals go where a DDP script's checkpoint goes: state_dict(gather=True)
    on every rank, torch.save by rank 0 only, torch.load(weights_only=True) on
    every rank, load_state_dict of the record: the next step is that of an
    uninterrupted run, bit for bit (1bit keeps owner residuals too); on a
    sub-communicator of fewer ranks the record loads as mpigc.load_checkpoint
    of the same residuals does."""
    d = comm.bcast(str(tmp_path_factory.mktemp("rec")) if comm.rank == 0 else None)
    path = os.path.join(d, "ckpt.pt")
    model = make_model()
    sync = mt.GradientSync(model, op=op, bucket_mb=0.002)
    _steps(sync, model, comm.rank, range(3))
    record = sync.state_dict(gather=True)
    sync.save_checkpoint(os.path.join(d, "residuals"))  # the same residuals, HDF5
    ok = (record is None) == (comm.rank != 0)
    if comm.rank == 0:
        torch.save({"model": model.state_dict(), "mpigc": record}, path)
    comm.Barrier()
    ck = torch.load(path, weights_only=True)
    m2 = make_model()
    m2.load_state_dict(ck["model"])
    s2 = mt.GradientSync(m2, op=op, bucket_mb=0.002)
    s2.load_state_dict(ck["mpigc"])
    g1 = _steps(sync, model, comm.rank, [3])
    g2 = _steps(s2, m2, comm.rank, [3])
    ok &= all(g1[n].numpy().tobytes() == g2[n].numpy().tobytes() for n in g1)
    # fewer ranks (a sub-communicator): as mpigc.load_checkpoint reshards them
    m = max(1, comm.size - 1)
    sub = comm.Split(int(comm.rank < m), comm.rank)
    if comm.rank < m:
        a = mt.GradientSync(make_model(), op=op, bucket_mb=0.002, comm=sub)
        a.load_state_dict(ck["mpigc"])
        b = mt.GradientSync(make_model(), op=op, bucket_mb=0.002, comm=sub)
        b.load_checkpoint(os.path.join(d, "residuals"))
        sa, sb = a.state_dict(), b.state_dict()
        ok &= set(sa) == set(sb)
        for n in sa:
            for part in ("worker", "owner"):
                x, y = sa[n][part], sb[n][part]
                ok &= (x is None and y is None) or np.array_equal(x, y)
    sub.Free()
    assert_all(ok)


@pytest.mark.mpi
def test_2bit_means_the_relative_mode_in_the_torch_layer(comm):
    """op="2bit" without a threshold is 2bit's relative mode (rel_threshold=1.5)
    in GradientSync, the DDP hook and CompressedAdamW, as in mpigc.allreduce;
    threshold= gives MXNet's absolute mode in both."""
    rel = {"id": "2bit", "rel_threshold": 1.5, "block_size": 1024, "error_feedback": True}
    got = [mt.GradientSync(make_model(), op="2bit").compressor.get_config(),
           mt.CommHookState(make_model(), op="2bit").compressor.get_config(),
           mt.CompressedAdamW(make_model().parameters(), op="2bit").compressor.get_config(),
           mt.GradientSync(make_model(), op={"type": "2bit"},
                           block_size=256).compressor.get_config()]
    want = [rel, rel, rel, dict(rel, block_size=256)]
    absolute = mt.GradientSync(make_model(), op="2bit",
                               threshold=0.5).compressor.get_config()
    ok = (got == want and rel == mpigc.get_compressor("2bit").get_config()
          and absolute == mpigc.get_compressor("2bit", threshold=0.5).get_config())
    assert_all(ok, f"{got} {absolute}")


@pytest.mark.mpi
@pytest.mark.parametrize("hook", [False, True])
def test_warns_when_the_absolute_threshold_lets_nothing_through(comm, gloo, monkeypatch, hook):
    """2bit with MXNet's absolute threshold 0.5 on gradients far below it: a
    RuntimeWarning (once, every rank) pointing to the relative mode; none in
    the relative mode."""
    from mpigc.torch._common import ThresholdWatch
    monkeypatch.setattr(ThresholdWatch, "SETTLE", 1)
    monkeypatch.setattr(ThresholdWatch, "STEPS", 3)
    got = {}
    for name, params in (("absolute", {"threshold": 0.5}), ("relative", {})):
        model = make_model()
        if hook:
            net = _ddp(model)
            net.register_comm_hook(mt.CommHookState(net, op="2bit", **params), mt.comm_hook)
        else:
            net = model
            sync = mt.GradientSync(model, op="2bit", **params)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            for step in range(6):
                net.zero_grad()
                x, y = batch(comm.rank, step)
                ((net(x) - y) ** 2).mean().mul(1e-3).backward()
                if not hook:
                    sync.wait()
        got[name] = [str(m.message) for m in w if "absolute threshold" in str(m.message)]
    ok = len(got["absolute"]) == 1 and "rel_threshold" in got["absolute"][0]
    assert_all(ok and not got["relative"], str(got))


@pytest.mark.mpi
def test_warns_when_ddp_never_calls_the_hook(comm, gloo, monkeypatch):
    """A CommHookState whose hook DDP never calls (not registered; Lightning's
    DDPStrategy on CPU) warns after UNCALLED backward passes; a registered one
    does not."""
    monkeypatch.setattr(mt.CommHookState, "UNCALLED", 3)
    got = {}
    for registered in (False, True):
        model = make_model()
        ddp = _ddp(model)
        state = mt.CommHookState(ddp, op="none")
        if registered:
            ddp.register_comm_hook(state, mt.comm_hook)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            for step in range(5):
                ddp.zero_grad()
                x, y = batch(comm.rank, step)
                ((ddp(x) - y) ** 2).mean().backward()
        got[registered] = [str(m.message) for m in w if "has not called" in str(m.message)]
    ok = len(got[False]) == 1 and "register_comm_hook" in got[False][0] and not got[True]
    assert_all(ok, str(got))



@pytest.mark.mpi
@pytest.mark.parametrize("kwargs", [{"backward_passes_per_step": 2},
                                    {"compression": "fp16"}, {"op": 0},
                                    {"op": "1bit", "rel_threshold": 1.5}],
                         ids=["backward_passes_per_step", "compression", "op=hvd.Average",
                              "rel_threshold-with-1bit"])
def test_a_horovod_keyword_on_one_rank_raises_on_every_rank(comm, kwargs):
    """A half-migrated call on the last rank only: DistributedOptimizer's
    ConfigError (naming the mpigc way) on every rank, none left waiting in
    the constructor's collectives."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mine = kwargs if comm.rank == comm.size - 1 else {}
    e = raises_everywhere(mpigc.ConfigError,
                          lambda: mt.DistributedOptimizer(opt, model, **mine))
    assert_all(("Horovod" in str(e) or "parameter of 2bit" in str(e))
               and f"rank {comm.size - 1}" in str(e), str(e))
    mt.DistributedOptimizer(opt, model, op="none").sync.remove_hooks()  # nothing hooked


@pytest.mark.mpi
def test_a_model_under_the_cutoff_warns_on_every_rank(comm, monkeypatch):
    """Every rank warns once that no bucket is compressed (the conftest's
    cutoff 0 put back to the default)."""
    monkeypatch.setenv("MPIGC_MIN_COMPRESS_BYTES", "8192")
    model = torch.nn.Linear(20, 1)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        opt = mt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                                      op="2bit")
        for _ in range(2):
            opt.zero_grad()
            model(torch.ones(2, 20)).sum().backward()
            opt.step()
    got = [str(w.message) for w in record if "MPIGC_MIN_COMPRESS_BYTES" in str(w.message)]
    opt.sync.remove_hooks()
    assert_all(len(got) == 1 and "8192-byte cutoff" in got[0], repr(got))
