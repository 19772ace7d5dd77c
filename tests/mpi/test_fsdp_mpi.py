"""FSDP2's gradient reduce-scatter as mpigc's compressed reduce-scatter
(issue 46, item 1): ``op="none"`` matches plain FSDP2 over gloo, the
compressors conserve per shard, accumulation, uneven shards, resume, and
errors on every rank."""
import os
import re
import sys

import numpy as np

import pytest
from mpi4py import MPI

import mpigc

from conftest import assert_all, raises_everywhere

torch = pytest.importorskip("torch")
import mpigc.torch as mt  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tests/
from support import torch_dist as td  # noqa: E402

# 2: the sums of two are order-free (bit-identical to gloo); 3: uneven
# shards and padding of the 7-row layer; 4: gloo's order of sums differs
pytestmark = pytest.mark.ranks(2, 3, 4)

gloo = td.gloo  # its module-scoped fixture: torch.distributed over gloo


@pytest.mark.mpi
@pytest.mark.parametrize("reduce_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("reshard", [True, False])
@pytest.mark.parametrize("accumulate", [False, True])
def test_none_matches_plain_fsdp(comm, gloo, reduce_dtype, reshard, accumulate):
    """20 steps with ``op="none"``: bit for bit FSDP2's gloo reduce-scatter
    where the sum's order cannot differ (fp32 at 2 and 3 ranks, where gloo
    adds in rank order; bf16 at 2, where gloo's bf16 sum of two is rounded
    once, as ours); else within rounding (gloo adds pairwise at 4 ranks and
    rounds each bf16 partial sum, mpigc adds in float32 and rounds once)."""
    dt = torch.float32 if reduce_dtype == "fp32" else torch.bfloat16
    plain = td.train(td.model(dt, reshard), 20, comm.rank, accumulate=accumulate)
    m = td.model(dt, reshard)
    state = mt.register_fsdp_hooks(m, op="none")
    hooked = td.train(m, 20, comm.rank, accumulate=accumulate)
    exact = comm.size <= 3 if dt == torch.float32 else comm.size == 2
    ok = td.compare(plain, hooked, exact, 1e-5 if dt == torch.float32 else 1e-2)
    assert_all(ok, f"op='none' differs from plain FSDP2 (exact={exact})")
    # the hook ran: one call per FSDP parameter group and synchronising step
    assert_all(state.calls == 20 * len(state.keys) and state.bytes_sent > 0,
               f"calls {state.calls}, bytes {state.bytes_sent}")


def _prefetching(m):
    """``td.model`` with FSDP2's explicit prefetching, as PyTorch's FSDP2
    example sets it: each layer's all-gather started by the other's forward
    (first layer) and backward (last layer)."""
    first, last = m[0], m[2]
    first.set_modules_to_forward_prefetch([last])
    last.set_modules_to_backward_prefetch([first])
    return m


@pytest.mark.mpi
@pytest.mark.parametrize("compressed", [False, True])
def test_explicit_prefetching(comm, gloo, compressed):
    """Explicit forward and backward prefetching (PyTorch's FSDP2 example)
    moves FSDP's all-gathers, not the reduce-scatters the hooks run: with
    ``op="none"`` 10 steps are plain FSDP2's with the same prefetching bit
    for bit (fp32, 2 and 3 ranks) and within rounding at 4; with 2bit they
    are the same steps as without prefetching, bit for bit."""
    if not compressed:
        plain = td.train(_prefetching(td.model()), 10, comm.rank)
        m = _prefetching(td.model())
        mt.register_fsdp_hooks(m, op="none")
        ok = td.compare(plain, td.train(m, 10, comm.rank), comm.size <= 3, 1e-5)
        assert_all(ok, "op='none' with prefetching differs from plain FSDP2")
        return
    runs = []
    for prefetch in (False, True):
        m = td.model()
        if prefetch:
            _prefetching(m)
        state = mt.register_fsdp_hooks(m, op="2bit", threshold=0.01)
        runs.append(td.train(m, 10, comm.rank))
        assert_all(state.calls == 10 * len(state.keys), f"calls {state.calls}")
    assert_all(td.same(*runs), "2bit with prefetching differs from 2bit without")


def _residual_state(state):
    return {k: {n: np.copy(v) for n, v in e.items() if isinstance(v, np.ndarray)}
            for k, e in state.feedback.state_dict().items()}


@pytest.mark.mpi
@pytest.mark.parametrize("nonfinite", ["skip", "raise"])
@pytest.mark.parametrize("hsdp", [False, True])
@pytest.mark.parametrize("auto", [False, True])
def test_a_step_with_a_nonfinite_group_changes_no_residual(comm, gloo, nonfinite, hsdp,
                                                           auto):
    """Rank 0's batch holds an Inf: the first layer's gradient is NaN (0 x
    Inf), the last layer's finite, so in backward the last layer's group is
    exchanged first and the first layer's is skipped (``"skip"``: a step that
    a loss scaler skips) or fails (``"raise"``: NonFiniteError from backward
    on every rank). Either way no group's residual changes: the step is
    dropped, and a residual that kept the exchanged group's update would
    count as delivered a gradient the optimizer never applied. ``auto``:
    op="auto" pinned to 2bit, then to "none" for that step (the exchanged
    group's call delivers its residuals and clears them: they come back)."""
    if hsdp and comm.size != 4:
        pytest.skip("HSDP 2 x 2 needs 4 ranks")
    mesh = td.mesh_2x2(comm)["shard"] if hsdp else None
    m = td.model(mesh=mesh)
    op = ({"op": "auto", "auto_op": "2bit", "auto_pin": "compressed"} if auto
          else {"op": "2bit"})
    state = mt.register_fsdp_hooks(m, **op, threshold=0.01, nonfinite=nonfinite)
    td.train(m, 3, comm.rank)
    if auto:
        state.auto_pin = "none"  # on every rank
    before = _residual_state(state)
    assert_all(len(before) == 2, f"keys {sorted(before)}")
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(comm.rank))
    if comm.rank == 0:
        x[0, 0] = float("inf")
    m.zero_grad()
    got = None
    try:
        m(x).pow(2).sum().backward()
    except mpigc.MpigcError as e:
        got = e
    want = mpigc.NonFiniteError if nonfinite == "raise" else type(None)
    assert_all(isinstance(got, want), f"rank {comm.rank}: {got!r}")
    after = _residual_state(state)
    changed = [k for k in before if any(not np.array_equal(after[k][n], v)
                                        for n, v in before[k].items())]
    assert_all(not changed, f"the residuals of {changed} changed in a dropped step")


@pytest.mark.mpi
def test_a_dropped_step_puts_each_key_back_once(comm, gloo):
    """A step whose every group is skipped (rank 0's loss times Inf: every
    gradient non-finite there, ``nonfinite="skip"``): each of its keys is put
    back once. Before, each call after the first skipped one restored every
    key recorded so far in the step again (the first exchanged group's twice
    with two groups: a copy per later call), though the residuals ended the
    same."""
    m = td.model()
    state = mt.register_fsdp_hooks(m, op="2bit", threshold=0.01, nonfinite="skip")
    td.train(m, 2, comm.rank)
    before = _residual_state(state)
    assert_all(len(before) == 2, f"keys {sorted(before)}")
    fb, put = state.feedback, []
    restore = fb.put_back

    def counted(saved, *args, **kw):
        put.extend(saved)
        return restore(saved, *args, **kw)
    fb.put_back = counted
    try:
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(comm.rank))
        m.zero_grad()
        (m(x).pow(2).sum() * (float("inf") if comm.rank == 0 else 1.0)).backward()
    finally:
        del fb.put_back
    counts = {k: put.count(k) for k in before}
    assert_all(counts == {k: 1 for k in before} and len(put) == len(before),
               f"keys put back {counts} ({put})")
    after = _residual_state(state)
    changed = [k for k in before if any(not np.array_equal(after[k][n], v)
                                        for n, v in before[k].items())]
    assert_all(not changed, f"the residuals of {changed} changed in a dropped step")
    td.train(m, 1, comm.rank, first=5)  # the next step goes on


def _divide_by(m, factor, force_sum=False):
    from torch.distributed.fsdp import FSDPModule
    for mod in m.modules():
        if isinstance(mod, FSDPModule):
            mod.set_gradient_divide_factor(factor)
            mod.set_force_sum_reduction_for_comms(force_sum)
    return m


@pytest.mark.mpi
@pytest.mark.parametrize("setting", ["factor", "factor=N", "fp16"])
def test_none_keeps_fsdp_division(comm, gloo, setting):
    """FSDP's other divisions: ``set_gradient_divide_factor`` (PREMUL_SUM
    of 1/factor; AVG when the factor is the group size) and an fp16
    ``reduce_dtype`` (a SUM, FSDP divides before and after). Gloo has no
    PREMUL_SUM: plain FSDP2 sums and divides after (force_sum), within
    rounding of the hook's premultiplied sum."""
    dt = torch.float16 if setting == "fp16" else torch.float32
    factor = {"factor": 2.5 * comm.size, "factor=N": comm.size}.get(setting)

    def build(force_sum):
        m = td.model(dt)
        return _divide_by(m, factor, force_sum) if factor is not None else m

    plain = td.train(build(setting == "factor"), 10, comm.rank)
    m = build(False)
    state = mt.register_fsdp_hooks(m, op="none")
    hooked = td.train(m, 10, comm.rank)
    exact = (comm.size <= 3 and setting == "factor=N") or (setting == "fp16"
                                                            and comm.size == 2)
    ok = td.compare(plain, hooked, exact, 1e-5 if dt == torch.float32 else 1e-2)
    assert_all(ok and state.calls == 10 * len(state.keys),
               f"{setting}: differs from plain FSDP2 (exact={exact}) or no calls")


class _Recorder:
    """Delegates to mpigc's reduce-scatter of one group and records, per
    call, the input, this rank's delivered shard and the worker residual
    after the call (all float64), and with ``op="auto"`` the op it ran."""

    def __init__(self, state, key):
        self.inner, self.state, self.key, self.rows = state.reduce_scatters[key], state, key, []

    def allocate(self, size, *, dtype, device):
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        x = input_tensor.double().numpy().copy()
        self.inner(output_tensor, input_tensor, group, op)
        # no entry, or a worker residual cleared by a call op="auto" ran as "none": zeros
        res = self.state.feedback.state_dict().get(self.key, {}).get("worker")
        d = self.state.decisions.get(self.key)
        self.rows.append((x, output_tensor.double().numpy().copy(),
                          np.zeros_like(x) if res is None else res.astype(np.float64),
                          None if d is None else d.op))


def _record(m, state):
    recs = {}
    for key, mod in td.hooked_modules(m, state.reduce_scatters):
        recs[key] = _Recorder(state, key)
        mod.set_custom_reduce_scatter(recs[key])
    return recs


def _conserved(comm, recs):
    """Per group and shard, over the recorded steps: what the ranks put in
    (their inputs) = N x what the owner delivered (the average) + the change
    of the ranks' worker residuals. Returns ``(ok, worst error in units of
    the tolerance, largest residual left)``."""
    ok, worst, kept = True, 0.0, 0.0
    for key, rec in recs.items():
        rows = comm.allgather(rec.rows)
        n = rows[0][0][0].size
        m_ = n // comm.size
        prev = np.zeros((comm.size, n))
        for step in range(len(rows[0])):
            inputs = sum(rows[r][step][0] for r in range(comm.size))
            res = np.stack([rows[r][step][2] for r in range(comm.size)])
            delivered = np.concatenate([rows[r][step][1] for r in range(comm.size)])
            assert delivered.size == n and n == m_ * comm.size
            err = np.abs(inputs - (comm.size * delivered + res.sum(0) - prev.sum(0)))
            scale = 1e-5 * (1 + np.abs(inputs).max() + np.abs(res).max())
            worst = max(worst, float(err.max() / scale))
            ok &= bool(err.max() <= scale)
            prev = res
        kept = max(kept, float(np.abs(prev).max()))
    return ok, worst, kept


@pytest.mark.mpi
@pytest.mark.parametrize("name", list(td.OPS))
@pytest.mark.parametrize("accumulate", [False, True])
def test_conservation_per_shard(comm, gloo, name, accumulate):
    """Per group and shard, over the steps: what the ranks put in (their
    inputs) = N x what the owner delivered (the average) + the change of
    the ranks' residuals; the residuals are not all zero (the compressor
    kept something back)."""
    m = td.model()
    state = mt.register_fsdp_hooks(m, **td.OPS[name])
    recs = _record(m, state)
    td.train(m, 6, comm.rank, accumulate=accumulate)
    ok, worst, kept = _conserved(comm, recs)
    assert_all(ok and kept > 0, f"{name}: conservation off by {worst:g} x tolerance, "
                                f"largest residual {kept:g}")


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["2bit-abs", "1bit"])
def test_resume_bit_exact(comm, gloo, name):
    """10 steps in one go = 5 steps, the model, optimizer and hook state
    into a new model, 5 steps; without the residuals it differs."""
    m = td.model()
    mt.register_fsdp_hooks(m, **td.OPS[name])
    want = td.train(m, 10, comm.rank)
    m = td.model()
    state = mt.register_fsdp_hooks(m, **td.OPS[name])
    td.train(m, 5, comm.rank)
    saved = state.state_dict()
    params = td.local_params(m)
    runs = []
    for load in (True, False):
        m2 = td.model()
        state2 = mt.register_fsdp_hooks(m2, **td.OPS[name])
        with torch.no_grad():
            for n, p in m2.named_parameters():
                p.to_local().copy_(params[n])
        if load:
            state2.load_state_dict(saved)
        runs.append(td.train(m2, 5, comm.rank, first=5))
    assert_all(td.compare(want, runs[0], True, 0), f"{name}: resumed run differs")
    assert_all(comm.allreduce(int(not td.compare(want, runs[1], True, 0))) > 0,
               f"{name}: a run without the residuals is the same (test too weak)")


# -- errors ---------------------------------------------------------------------------
@pytest.mark.mpi
def test_load_state_dict_on_one_rank_fails_there_within_the_timeout(comm, gloo):
    """load_state_dict is collective: called on rank 0 only, a StateError
    there after the timeout that says so (before, rank 0 waited for ever in
    its agreement); called again on every rank, it takes up rank 0's
    rendezvous and loads, and training goes on."""
    import faulthandler
    faulthandler.dump_traceback_later(120, exit=True)  # a hang fails the test
    m = td.model()
    state = mt.register_fsdp_hooks(m, op="2bit", timeout=60)
    state.timeout = 1.0  # for the load (the construction's wait may take longer)
    td.train(m, 1, comm.rank)
    saved = state.state_dict()
    err = None
    if comm.rank == 0:
        try:
            state.load_state_dict(saved)
        except mpigc.StateError as e:
            err = e
    comm.Barrier()
    ok = comm.rank != 0 or (err is not None and "FsdpHookState.load_state_dict" in str(err)
                            and "if rank == 0:" in str(err))
    state.load_state_dict(saved)
    td.train(m, 1, comm.rank, first=1)
    faulthandler.cancel_dump_traceback_later()
    assert_all(ok, repr(err))


@pytest.mark.mpi
def test_settings_differ(comm, gloo):
    m = td.model()
    op = {"op": "2bit", "threshold": 0.5 if comm.rank == 0 else 0.25}
    raises_everywhere(mpigc.MismatchError, lambda: mt.register_fsdp_hooks(m, **op),
                      match="different settings")
    td.train(m, 1, comm.rank)  # nothing installed: FSDP's own reduce-scatter


@pytest.mark.mpi
def test_parameters_differ(comm, gloo):
    m = td.model(extra=1 if comm.rank == 1 else 0)
    raises_everywhere(mpigc.MismatchError,
                      lambda: mt.register_fsdp_hooks(m, op="2bit", threshold=0.5),
                      match="different parameters")


@pytest.mark.mpi
def test_not_fsdp_on_one_rank(comm, gloo):
    m = td.model() if comm.rank else torch.nn.Linear(3, 3)
    raises_everywhere(mpigc.ConfigError,
                      lambda: mt.register_fsdp_hooks(m, op="2bit", threshold=0.5),
                      match="no FSDP2 module")


@pytest.mark.mpi
def test_registered_on_one_rank_only(comm, gloo):
    sub = comm.Dup()  # rank 0's registration stays posted on it; no one uses it again
    m = td.model()
    if comm.rank == 0:
        raises_everywhere(mpigc.StateError, lambda: mt.register_fsdp_hooks(
            m, op="none", comm=sub, timeout=1.0), comm=MPI.COMM_SELF,
            match="call register_fsdp_hooks")


@pytest.mark.mpi
def test_layout_change_raises_everywhere(comm, gloo):
    """A parameter without a gradient in one step (FSDP leaves it out of the
    flat input): StateError on every rank, the residuals unchanged."""
    m = td.model()
    state = mt.register_fsdp_hooks(m, op="2bit", threshold=0.5)
    td.train(m, 2, comm.rank)
    before = state.feedback.state_dict()
    m[2].bias.requires_grad_(False)
    raises_everywhere(mpigc.StateError, lambda: td.train(m, 1, comm.rank),
                      match="changed from")
    after = state.feedback.state_dict()
    assert_all(all(np.array_equal(before[k]["worker"], after[k]["worker"]) for k in before),
               "residuals changed")


def _expert_steps(m, rank, steps, first=0):
    for step in range(first, first + steps):
        td.expert_step(m, rank, step)
        for p in m.parameters():
            p.grad = None


@pytest.mark.mpi
@pytest.mark.parametrize("unused", [False, True])
def test_other_parameters_of_the_same_size_raise_everywhere(comm, gloo, unused):
    """Expert 0 in one step, expert 1 (the same shape) in the next: FSDP's
    flat input has the same size and other parameters, so the residuals of
    expert 0 would be added to expert 1's gradient. StateError on every rank,
    residuals unchanged (before: no error, the residuals mixed silently);
    with set_reduce_scatter_unused_params(True) every step holds both."""
    m = td.experts()
    m.set_reduce_scatter_unused_params(unused)
    state = mt.register_fsdp_hooks(m, op="2bit", threshold=0.5)
    _expert_steps(m, comm.rank, 1)
    before = state.feedback.state_dict()
    if unused:
        _expert_steps(m, comm.rank, 3, 1)
        assert_all(state.calls == 4, f"calls {state.calls}")
        return
    raises_everywhere(mpigc.StateError, lambda: _expert_steps(m, comm.rank, 1, 1),
                      match="other parameters than in its first call")
    after = state.feedback.state_dict()
    assert_all(all(np.array_equal(before[k]["worker"], after[k]["worker"]) for k in before),
               "residuals changed")


@pytest.mark.mpi
def test_load_bad_state_everywhere(comm, gloo):
    m = td.model()
    state = mt.register_fsdp_hooks(m, op="2bit", threshold=0.5)
    td.train(m, 1, comm.rank)
    good, was = state.state_dict(), state.feedback.state_dict()
    bad = dict(good, meta="{}") if comm.rank == 0 else good
    raises_everywhere(mpigc.StateError, lambda: state.load_state_dict(bad),
                      match="load_state_dict")
    now = state.feedback.state_dict()
    assert_all(all(np.array_equal(was[k]["worker"], now[k]["worker"]) for k in now),
               "residuals changed")


# -- HSDP (item 2) --------------------------------------------------------------------


@pytest.mark.mpi
@pytest.mark.parametrize("reduce_dtype", ["fp32", "bf16"])
def test_hsdp_none_matches_native_hsdp(comm, gloo, reduce_dtype):
    """HSDP 2 x 2: FSDP over mesh['shard'] with the hooks (FSDP's own
    reduce-scatter in the replica, mpigc's allreduce across the replicas)
    = native HSDP (fully_shard on the 2-D mesh) bit for bit with op='none'
    (sums of two)."""
    mesh = td.mesh_2x2(comm)
    dt = torch.float32 if reduce_dtype == "fp32" else torch.bfloat16
    native = td.train(td.model(dt, mesh=mesh), 20, comm.rank)
    m = td.model(dt, mesh=mesh["shard"])
    state = mt.register_fsdp_hooks(m, op="none")
    hooked = td.train(m, 20, comm.rank)
    assert_all(state.replicas == 2 and state.calls == 20 * len(state.keys)
               and td.compare(native, hooked, True, 0),
               f"differs from native HSDP (replicas {state.replicas}, calls {state.calls})")


def _train_all_reduce_accumulating(m, steps, rank):
    """``td.train`` with accumulation as HSDP does it: each step first
    reduce-scatters another batch without the replicas' all-reduce
    (``set_requires_all_reduce(False)``)."""
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    for step in range(steps):
        opt.zero_grad()
        m.set_requires_all_reduce(False)
        td.backward(m, rank, 500 + step)
        m.set_requires_all_reduce(True)
        td.backward(m, rank, step)
        opt.step()
    return td.local_params(m)


@pytest.mark.mpi
def test_hsdp_set_requires_all_reduce(comm, gloo):
    """HSDP 2 x 2, set_requires_all_reduce(False) on a step's first batch:
    one replica all-reduce per step and group, bit for bit native HSDP's
    (op='none'). Before, the hook all-reduced every batch (twice the calls
    and bytes; the sum in another order)."""
    mesh = td.mesh_2x2(comm)
    native = _train_all_reduce_accumulating(td.model(mesh=mesh), 6, comm.rank)
    m = td.model(mesh=mesh["shard"])
    state = mt.register_fsdp_hooks(m, op="none")
    hooked = _train_all_reduce_accumulating(m, 6, comm.rank)
    assert_all(state.calls == 6 * len(state.keys) and td.compare(native, hooked, True, 0),
               f"calls {state.calls} (want {6 * len(state.keys)}) or differs from native")


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["2bit-abs", "1bit"])
def test_hsdp_compressed_replicas_agree(comm, gloo, name):
    """HSDP 2 x 2 compressed: the replicas' parameters stay identical (each
    rank of a shard position gets the same allreduce result), residuals
    are kept, and it is not the exact result; resume is bit-exact."""
    mesh = td.mesh_2x2(comm)
    m = td.model(mesh=mesh["shard"])
    state = mt.register_fsdp_hooks(m, **td.OPS[name])
    got = td.train(m, 5, comm.rank)
    saved = state.state_dict()
    flat = np.concatenate([t.numpy().ravel() for t in got.values()])
    others = comm.allgather(flat)
    twin = others[comm.rank ^ 2]  # the same shard position in the other replica
    kept = max(float(np.abs(e["worker"]).max()) for e in state.feedback.state_dict().values())
    exact = td.train(td.model(mesh=mesh), 5, comm.rank)
    differs = comm.allreduce(int(not td.compare(exact, got, True, 0)))
    assert_all(np.array_equal(flat, twin) and kept > 0 and differs > 0,
               f"{name}: replicas differ, no residuals ({kept}) or exact")
    # resume: 5 more steps from the saved state = 5 more steps on
    more = td.train(m, 5, comm.rank, first=5)
    m2 = td.model(mesh=mesh["shard"])
    state2 = mt.register_fsdp_hooks(m2, **td.OPS[name])
    with torch.no_grad():
        for n, p in m2.named_parameters():
            p.to_local().copy_(got[n])
    state2.load_state_dict(saved)
    assert_all(td.compare(more, td.train(m2, 5, comm.rank, first=5), True, 0),
               f"{name}: HSDP resume differs")


@pytest.mark.mpi
def test_native_hsdp_refused(comm, gloo):
    mesh = td.mesh_2x2(comm)
    raises_everywhere(mpigc.ConfigError, lambda: mt.register_fsdp_hooks(
        td.model(mesh=mesh), op="2bit", threshold=0.5), match="mesh\\['shard'\\]")


@pytest.mark.mpi
def test_warns_when_nothing_is_compressed(comm, gloo, monkeypatch):
    """Every group's call under $MPIGC_MIN_COMPRESS_BYTES (the engine sends
    it exactly): one warning at the first step, as the DDP hook's."""
    monkeypatch.setenv("MPIGC_MIN_COMPRESS_BYTES", "8192")  # the default, every rank
    m = td.model()
    mt.register_fsdp_hooks(m, op="2bit", threshold=0.5)
    with pytest.warns(UserWarning, match="none of its 2 bucket") as got:
        td.train(m, 2, comm.rank)
    assert_all(len([w for w in got if "none of its" in str(w.message)]) == 1,
               "warned more than once")
    # a cutoff the groups reach together: the advice is FSDP's (fewer, larger
    # fully_shard modules), not the DDP hook's bucket_mb=, which the hooks lack
    text = next(str(w.message) for w in got if "none of its" in str(w.message))
    total = int(re.search(r"gradients are (\d+) bytes in all", text).group(1))
    monkeypatch.setenv("MPIGC_MIN_COMPRESS_BYTES", str(total))
    m = td.model()
    mt.register_fsdp_hooks(m, op="2bit", threshold=0.5)
    with pytest.warns(UserWarning, match="none of its 2 bucket") as got:
        td.train(m, 2, comm.rank)
    text = next(str(w.message) for w in got if "none of its" in str(w.message))
    assert_all("fully_shard fewer, larger modules" in text and "bucket_mb" not in text,
               text)


@pytest.mark.mpi
def test_warns_with_a_frozen_group(comm, gloo, monkeypatch):
    """A group whose parameters are all frozen never calls: the warning
    comes once the other groups have had their call (before: never)."""
    monkeypatch.setenv("MPIGC_MIN_COMPRESS_BYTES", "8192")
    m = td.model()
    for p in m[0].parameters():
        p.requires_grad_(False)
    mt.register_fsdp_hooks(m, op="2bit", threshold=0.5)
    with pytest.warns(UserWarning, match="none of its 1 bucket"):
        td.train(m, 2, comm.rank)


# -- op="auto" (issue 48, item 2) -----------------------------------------------------
def _decided(state):
    """``{key: (op, reason)}`` of each key's last op="auto" call."""
    return {k: (d.op, d.reason) for k, d in sorted(state.decisions.items())}


def _one_group():
    """``td.model``'s layers in one FSDP group (the root only): one call a
    step, so op="auto"'s first calls alternate the compressor and none on
    that group (with two groups each would keep its op)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    torch.manual_seed(0)
    layers = [torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)]
    return td.fully_shard_layers(torch.nn.Sequential(*layers), [],
                                 mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32))


@pytest.mark.mpi
@pytest.mark.parametrize("pin", ["none", "compressed", "env"])
@pytest.mark.parametrize("hsdp", [False, True])
def test_auto_pinned_is_that_op_bit_for_bit(comm, gloo, monkeypatch, pin, hsdp):
    """op="auto" pinned to "none" is op="none" bit for bit, pinned to the
    compressor (auto_pin= with auto_op="1bit", or $MPIGC_AUTO_PIN with the
    default relative 2bit) op=auto_op's, residuals included: FSDP's
    reduce-scatter and, under HSDP 2 x 2, the replicas' allreduce."""
    mesh = td.mesh_2x2(comm)["shard"] if hsdp else None
    if pin == "env":
        monkeypatch.setenv("MPIGC_AUTO_PIN", "compressed")
    auto, plain, want = {
        "none": ({"auto_pin": "none"}, {"op": "none"}, "none"),
        "compressed": ({"auto_op": "1bit", "auto_pin": "compressed"}, {"op": "1bit"}, "1bit"),
        "env": ({}, {"op": "2bit"}, "2bit")}[pin]
    runs = []
    for kw in ({"op": "auto", **auto}, plain):
        m = td.model(mesh=mesh)
        state = mt.register_fsdp_hooks(m, **kw)
        runs.append((td.train(m, 5, comm.rank), _residual_state(state), _decided(state),
                     state.calls))
    (pa, ra, da, ca), (pb, rb, _, cb) = runs
    same_res = sorted(ra) == sorted(rb) and all(
        sorted(ra[k]) == sorted(rb[k]) and all(ra[k][n].tobytes() == rb[k][n].tobytes()
                                               for n in rb[k]) for k in rb)
    ok = td.same(pa, pb) and same_res and (want == "none" or bool(rb))
    ok &= sorted(da) == sorted(ra or rb or da) and len(da) == 2
    # the model's agreement tables (an op="none" allreduce posted at calls 4
    # and 8 of 10) count in mpigc.traffic() when they complete in a call
    ok &= all(d == (want, "pinned") for d in da.values()) and cb <= ca <= cb + 2
    assert_all(ok, f"op='auto' pinned to {want} differs from op={want!r} (params "
                   f"{td.same(pa, pb)}, residuals {same_res}, decisions {da}, calls {ca} {cb})")


_SWITCHES = ["compressed", "compressed", "none", "compressed", "none", "none", "compressed",
             "none"]


@pytest.mark.mpi
@pytest.mark.parametrize("how", ["measuring", "pinned"])
def test_auto_conserves_error_feedback_across_switches(comm, gloo, how):
    """8 steps that switch between the compressor and "none" on every group:
    the model's first calls (one group: they alternate), or the pin changed
    between steps on every rank (two groups, :data:`_SWITCHES`). Per group
    and shard, the inputs = N x delivered + the change of the residuals at
    every step (a call run as "none" adds the residuals into its exact sum
    and clears them: none left after it); both ops ran on every group; the
    decisions are the same on every rank."""
    m = _one_group() if how == "measuring" else td.model()
    state = mt.register_fsdp_hooks(m, op="auto", auto_op="2bit", threshold=0.01,
                                   auto_pin=None if how == "measuring" else "compressed")
    recs = _record(m, state)
    for step in range(8):
        if how == "pinned":
            state.auto_pin = _SWITCHES[step]  # on every rank: the calls' marks agree
        td.train(m, 1, comm.rank, first=step)
    ok, worst, _ = _conserved(comm, recs)
    # the compressed calls kept residuals back (the last call ran "none")
    kept = max(float(np.abs(row[2]).max()) for rec in recs.values() for row in rec.rows)
    ran = {k: [row[3] for row in rec.rows] for k, rec in recs.items()}
    cleared = all(not np.any(row[2]) for rec in recs.values() for row in rec.rows
                  if row[3] == "none")
    ok &= cleared and kept > 0 and all({"2bit", "none"} == set(ops) for ops in ran.values())
    if how == "pinned":
        ok &= all(ops == [p if p == "none" else "2bit" for p in _SWITCHES]
                  for ops in ran.values())
    every = comm.allgather(ran)
    alike = all(e == ran for e in every)
    assert_all(ok and alike, f"conservation off by {worst:g} x tolerance (residual "
                             f"{kept:g}, cleared after none {cleared}); ops {ran}, alike "
                             f"on every rank {alike}")


@pytest.mark.mpi
def test_auto_decisions_alike_with_a_skewed_clock(comm, gloo):
    """Rank 0 times its op="auto" calls with a clock 50 times too fast (a
    slow rank): 20 steps of one group leave the first, alternating calls
    for the model's decisions, and every decision (op and reason) is the
    same on every rank (a decision of one rank alone would be a hang or
    another sum)."""
    import time
    from mpigc import _auto
    old = _auto.use_clock((lambda: 50 * time.perf_counter()) if comm.rank == 0 else None)
    try:
        m = _one_group()
        state = mt.register_fsdp_hooks(m, op="auto")
        seen = []
        for step in range(20):
            td.train(m, 1, comm.rank, first=step)
            seen.append(_decided(state))
    finally:
        _auto.use_clock(old)
    every = comm.allgather(seen)
    reasons = {r for d in seen for _, r in d.values()}
    ok = all(e == seen for e in every) and "model" in reasons
    assert_all(ok, f"decisions differ between ranks or the model never decided "
                   f"({sorted(reasons)})")


@pytest.mark.mpi
@pytest.mark.parametrize("bad,err,match", [
    ({"op": "auto", "auto_pin": "sometimes"}, mpigc.ConfigError, "auto_pin"),
    ({"op": "auto", "auto_op": "none"}, mpigc.ConfigError, "auto_op must name a compressor"),
    ({"op": "2bit", "auto_pin": "none"}, mpigc.ConfigError, "op='auto' only"),
    ("env on rank 0", mpigc.ConfigError, "MPIGC_AUTO_PIN"),
    ("auto on rank 0", mpigc.MismatchError, "different settings"),
    ("auto_op on rank 0", mpigc.MismatchError, "different settings")])
def test_bad_auto_settings_raise_on_every_rank(comm, gloo, monkeypatch, bad, err, match):
    """Bad op="auto" settings, on every rank or on rank 0 only: the same
    error on every rank at registration, nothing installed (FSDP's own
    reduce-scatter runs the next step)."""
    kw = bad if isinstance(bad, dict) else {"op": "auto"}
    if comm.rank == 0 and bad == "env on rank 0":
        monkeypatch.setenv("MPIGC_AUTO_PIN", "sometimes")
    if bad == "auto on rank 0" and comm.rank:
        kw = {"op": "2bit"}
    if bad == "auto_op on rank 0":
        kw = {"op": "auto", "auto_op": "1bit" if comm.rank == 0 else "2bit"}
    m = td.model()
    raises_everywhere(err, lambda: mt.register_fsdp_hooks(m, **kw), match=match)
    td.train(m, 1, comm.rank)


def _record_all_reduce(m, state):
    """Wrap each FSDP group's all-reduce hook (HSDP: the hooks' replica
    allreduce): per call, ``(input, result, worker, owner placed in the
    flat shard, op)``, float64 copies (zeros for residuals it has none of)."""
    rows, replica = {}, MPI.COMM_WORLD.rank // 2  # 2 x 2: ranks 0, 1 and 2, 3
    for key, mod in td.hooked_modules(m, state.keys):
        group = mod._get_fsdp_state()._fsdp_param_groups[0]
        inner, rows[key] = group._all_reduce_hook, []

        def hook(t, inner=inner, key=key):
            x = t.double().numpy().copy()
            inner(t)
            e = state.feedback.state_dict().get(key, {})
            w, o = np.zeros_like(x), np.zeros_like(x)
            if e.get("worker") is not None:
                w[:] = e["worker"]
            if e.get("owner") is not None:
                lo, hi = mpigc.shard_bounds(x.size, 2)[replica]
                o[lo:hi] = e["owner"]
            rows[key].append((x, t.double().numpy().copy(), w, o, state.decisions[key].op))
        mod.set_all_reduce_hook(hook)
    return rows


@pytest.mark.mpi
def test_hsdp_auto_switches(comm, gloo):
    """HSDP 2 x 2, op="auto" (1bit: worker and owner residuals) with the pin
    changed between steps on every rank: the replicas' allreduce runs the op
    of each step; per shard position, at every step, the replicas' inputs =
    2 x the average delivered + the change of their worker residuals + 2 x
    that of their owner residuals (kept in units of the average); a "none"
    step leaves no residual; the replicas' parameters stay identical."""
    mesh = td.mesh_2x2(comm)
    m = td.model(mesh=mesh["shard"])
    state = mt.register_fsdp_hooks(m, op="auto", auto_op="1bit", auto_pin="compressed")
    rows = _record_all_reduce(m, state)
    for step, pin in enumerate(_SWITCHES):
        state.auto_pin = pin
        got = td.train(m, 1, comm.rank, first=step)
    every = comm.allgather(rows)
    ok, worst, kept = True, 0.0, 0.0
    for key in rows:
        prev = 0.0
        pair = [every[comm.rank % 2][key], every[comm.rank % 2 + 2][key]]
        for step in range(len(_SWITCHES)):
            (x0, y0, w0, o0, op0), (x1, y1, w1, o1, op1) = pair[0][step], pair[1][step]
            left = w0 + w1 + 2 * (o0 + o1)
            err = np.abs(x0 + x1 - (2 * y0 + left - prev)).max()
            scale = 1e-5 * (1 + np.abs(x0 + x1).max() + np.abs(left).max())
            worst = max(worst, float(err / scale))
            ok &= bool(err <= scale) and np.array_equal(y0, y1) and op0 == op1
            ok &= op0 == ("none" if _SWITCHES[step] == "none" else "1bit")
            ok &= op0 != "none" or not np.any(left)
            kept = max(kept, float(np.abs(o0).max()), float(np.abs(w0).max()))
            prev = left
    flat = np.concatenate([t.numpy().ravel() for t in got.values()])
    twin = comm.allgather(flat)[comm.rank ^ 2]  # the same shard in the other replica
    ok &= np.array_equal(flat, twin) and bool(np.isfinite(flat).all()) and kept > 0
    assert_all(ok, f"conservation off by {worst:g} x tolerance, residual {kept:g}, "
                   f"replicas alike {np.array_equal(flat, twin)}")
