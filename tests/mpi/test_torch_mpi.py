"""mpigc.torch under mpirun: GradientSync against the compressed-allreduce
reference and against DDP (gloo), overlap, unused/frozen parameters, errors on
every rank, residual state across bucketings, broadcast."""
import copy
import os
import socket
import time

import numpy as np
import pytest
from mpi4py import MPI

import mpigc

from conftest import assert_all, raises_everywhere

torch = pytest.importorskip("torch")
import mpigc.torch as mt  # noqa: E402

torch.set_num_threads(1)


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
@pytest.mark.parametrize("op", ["2bit", "1bit", "fp16", "bf16", "terngrad"])
def test_gradients_equal_compressed_allreduce_reference(comm, op):
    model, ref = make_model(), make_model()
    sync = mt.GradientSync(model, op=op, bucket_mb=0.002)  # several buckets
    assert len(sync.buckets) >= 2
    fb = mpigc.ErrorFeedback()
    ok = True
    for step in range(3):  # residuals carry over between steps
        model.zero_grad()
        ref.zero_grad()
        backward(model, comm.rank, step)
        backward(ref, comm.rank, step)
        sync.wait()
        reference_sync(sync, ref, op, fb)
        got, want = grads_of(model), grads_of(ref)
        ok &= got.keys() == want.keys() and all(
            got[n].numpy().tobytes() == want[n].numpy().tobytes() for n in want)
    assert_all(ok, f"{op}: synced gradients differ from the reference")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def gloo():
    dist = torch.distributed
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    comm = MPI.COMM_WORLD
    port = comm.bcast(_free_port() if comm.rank == 0 else None)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=comm.rank, world_size=comm.size)
    yield dist
    dist.destroy_process_group()


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
    assert sync.buckets[0].names == ["last.bias", "last.weight"]
    _Slow.log.clear()
    x, y = batch(comm.rank, 0)
    ((model(x) - y) ** 2).mean().backward()
    t_end = time.perf_counter()
    first, last = sync.buckets[0], sync.buckets[-1]
    started_early = first.started_at is not None and first.started_at < _Slow.log[0]
    last_after = last.started_at is not None and last.started_at > _Slow.log[0]
    sync.wait()
    assert_all(started_early and last_after and first.started_at < t_end,
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
def test_globally_unused_parameter_keeps_its_residual(comm):
    torch.manual_seed(0)
    lin = torch.nn.Linear(200, 1)
    # 1bit: a residual alone still sends something (2bit would send nothing)
    sync = mt.GradientSync([("w", lin.weight), ("b", lin.bias)], op="1bit",
                           find_unused_parameters=True)
    g = torch.Generator().manual_seed(comm.rank)
    lin(torch.randn(1, 200, generator=g)).sum().backward()  # everything used
    sync.wait()
    before = sync.state_dict()
    lin.zero_grad()
    (lin.bias * 1.0).sum().backward()  # w unused on every rank
    sync.wait()
    after = sync.state_dict()
    ok = lin.weight.grad is None
    # w's residual total is kept (what it delivered went back into the residuals)
    tot = lambda s: comm.allreduce(float(s["w"]["worker"].sum() / comm.size
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
    assert "extra.weight" in str(e)
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
    with pytest.raises(mpigc.StateError, match="no_sync"):
        backward(model, comm.rank, 1)
    sync.wait()


@pytest.mark.mpi
def test_nonfinite_raises_everywhere_and_changes_nothing(comm):
    model = make_model()
    sync = mt.GradientSync(model, op="2bit", bucket_mb=0.002)
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
    assert set(state) == set(sync.names)
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
    assert len(s3.buckets) == 1 and len(s2.buckets) > 1
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
