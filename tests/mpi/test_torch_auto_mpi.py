"""op="auto" in the torch layer (issue 48, item 2): GradientSync and the DDP
hook with ``op="auto"``, per bucket the engine's decision (``none`` or
``auto_op``) taken the same on every rank. Pinned to ``none`` a run is
``op="none"``'s bit for bit, pinned to the compressor ``auto_op``'s; unpinned
(the first calls alternate between the two) error feedback is conserved
across the switches, the fold-back of parameters no rank used included; the
residuals' state_dict works with auto buckets (the FSDP hooks' op="auto":
test_fsdp_mpi.py, test_fsdp_dcp_mpi.py). Run as

    mpirun -n K python -m pytest --with-mpi -q tests/mpi/test_torch_auto_mpi.py
"""
import os
import sys

import numpy as np
import pytest

import mpigc

from conftest import assert_all, fresh_comm, raises_everywhere

torch = pytest.importorskip("torch")
import mpigc.torch as mt  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tests/
from support import torch_dist  # noqa: E402

# ranks: 2 (pairs, the short path), 3 (uneven owner shards)
pytestmark = pytest.mark.ranks(2, 3)

torch.set_num_threads(1)

gloo = torch_dist.gloo  # its module-scoped fixture: torch.distributed over gloo

WHO = ["sync", "hook"]


@pytest.fixture
def dup2(comm):
    """Another fresh communicator beside ``dup`` (conftest's): calls on it
    leave ``dup``'s series of decisions alone."""
    yield from fresh_comm(comm)


class Net(torch.nn.Module):
    """A small MLP and a gate layer used on even steps only (``gated``): on
    odd steps no rank uses it."""

    def __init__(self, gated=False):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Tanh(),
                                        torch.nn.Linear(24, 3))
        self.gate = torch.nn.Linear(12, 3) if gated else None

    def forward(self, x, step):
        y = self.body(x)
        if self.gate is not None and step % 2 == 0:
            y = y + self.gate(x)
        return y


def loss_of(model, rank, step, scale=1.0):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(16, 12, generator=g), torch.randn(16, 3, generator=g)
    return ((model(x, step) - y) ** 2).mean() * scale


class Run:
    """A model trained through GradientSync (``"sync"``) or DDP with the
    hook (``"hook"``), built with ``**kw``."""

    def __init__(self, who, comm, gated=False, find_unused=False, **kw):
        self.who, self.comm = who, comm
        self.model = Net(gated)
        if who == "sync":
            self.obj = mt.GradientSync(self.model, comm=comm,
                                       find_unused_parameters=find_unused, **kw)
            self.front = self.model
        else:
            self.front = torch.nn.parallel.DistributedDataParallel(
                self.model, bucket_cap_mb=0.002, find_unused_parameters=find_unused)
            self.obj = mt.CommHookState(self.front, comm=comm, **kw)
            self.front.register_comm_hook(self.obj, mt.comm_hook)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)

    def local_grads(self, step, scale=1.0):
        """This rank's own gradients of ``step`` (the module itself, not DDP)."""
        named = [(n, p) for n, p in self.model.named_parameters()]
        gs = torch.autograd.grad(loss_of(self.model, self.comm.rank, step, scale),
                                 [p for _, p in named], allow_unused=True)
        return {n: (None if g is None else g.detach().double().reshape(-1).numpy())
                for (n, _), g in zip(named, gs)}

    def step(self, step, scale=1.0, update=True):
        """One step: backward, synchronise; returns ``{name: grad}`` as
        synchronised (float64 copies; None where a parameter got none)."""
        self.opt.zero_grad(set_to_none=True)
        loss_of(self.front, self.comm.rank, step, scale).backward()
        if self.who == "sync":
            self.obj.wait()
        out = {n: (None if p.grad is None else p.grad.detach().double().reshape(-1).numpy()
                   .copy()) for n, p in self.model.named_parameters()}
        if update:
            self.opt.step()
        return out

    def decisions(self):
        """The ops of the last step's calls, in key order."""
        if self.who == "sync":
            return [b.decision.op for b in self.obj.buckets]
        return [self.obj.decisions[k].op for k in sorted(self.obj.decisions)]

    def params(self):
        return [p.detach().numpy().tobytes() for p in self.model.parameters()]


def _residual_totals(state, numel, comm):
    """``{name: (sum over ranks of worker, sum over ranks of owner)}`` of a
    per-parameter state (float64, the owner shards placed)."""
    out = {}
    for name, m in numel.items():
        s = state.get(name)
        w, o = np.zeros(m), np.zeros(m)
        if s is not None and s["worker"] is not None:
            w += np.asarray(s["worker"], np.float64).reshape(-1)
        if s is not None and s["owner"] is not None:
            lo, hi = mpigc.shard_bounds(m, comm.size)[comm.rank]
            o[lo:hi] += np.asarray(s["owner"], np.float64).reshape(-1)
        out[name] = (comm.allreduce(w), comm.allreduce(o))
    return out


# -- pinned: the op it is pinned to, bit for bit -------------------------------------
@pytest.mark.mpi
@pytest.mark.parametrize("who", WHO)
def test_pinned_none_is_op_none_bit_for_bit(dup, gloo, who):
    runs = []
    for kw in ({"op": "auto", "auto_pin": "none"}, {"op": "none"}):
        run = Run(who, dup, bucket_mb=0.002, **kw)
        grads = [run.step(s) for s in range(5)]
        runs.append((grads, run.params(), run))
    (ga, pa, auto), (gb, pb, _) = runs
    ok = pa == pb and all(a[n].tobytes() == b[n].tobytes()
                          for a, b in zip(ga, gb) for n in b)
    ok &= all(op == "none" for op in auto.decisions())
    assert_all(ok, f"op='auto' pinned to none differs from op='none' ({auto.decisions()})",
               dup)


@pytest.mark.mpi
@pytest.mark.parametrize("who", WHO)
@pytest.mark.parametrize("auto_op,pin_by", [(None, "arg"), ("fp16", "arg"), (None, "env")])
def test_pinned_compressed_is_auto_op_bit_for_bit(dup, gloo, monkeypatch, who, auto_op,
                                                  pin_by):
    """Pinned to the compressor (``auto_pin=`` or ``$MPIGC_AUTO_PIN``) a run
    is ``op=auto_op``'s (default relative 2bit: the hook's fixed groups;
    fp16: DDP's buckets in place) bit for bit, residuals included."""
    if pin_by == "env":
        monkeypatch.setenv("MPIGC_AUTO_PIN", "compressed")
    pin = {"auto_pin": "compressed"} if pin_by == "arg" else {}
    given = {} if auto_op is None else {"auto_op": auto_op}
    runs = []
    for kw in ({"op": "auto", **given, **pin}, {"op": auto_op or "2bit"}):
        run = Run(who, dup, bucket_mb=0.002, **kw)
        grads = [run.step(s) for s in range(5)]
        runs.append((grads, run.params(), run.obj.state_dict(), run))
    (ga, pa, sa, auto), (gb, pb, sb, _) = runs
    ok = pa == pb and all(a[n].tobytes() == b[n].tobytes()
                          for a, b in zip(ga, gb) for n in b)
    ok &= sorted(sa) == sorted(sb) and bool(sb)
    for n in sb:
        for part in ("worker", "owner"):
            x, y = sa[n][part], sb[n][part]
            ok &= (x is None) == (y is None) and (x is None or x.tobytes() == y.tobytes())
    want = mpigc.get_compressor(auto_op or "2bit").codec_id
    ok &= all(op == want for op in auto.decisions())
    assert_all(ok, f"op='auto' pinned to {want} differs from op={want!r} "
               f"({auto.decisions()})", dup)


# -- unpinned: the switches keep error feedback ------------------------------------------
_CONSERVE = [(True, "exact"), (False, "compressed"), (True, "compressed")]


@pytest.mark.mpi
@pytest.mark.parametrize("who", WHO)
@pytest.mark.parametrize("average,gather", _CONSERVE)
def test_unpinned_auto_trains_and_conserves_error_feedback(dup, gloo, who, average, gather):
    """One call per step (one bucket, one group), so the model's first
    calls alternate 2bit, none, 2bit, ...; the gate layer is unused on
    every rank at the odd steps (the "none" ones): its residuals went into
    that plain sum and what they delivered goes back into the residuals.
    After every step the sum over the ranks of what was delivered plus the
    residuals left is the exact sum of the inputs; the decisions are the
    same on every rank, and so are the parameters."""
    N = dup.size
    run = Run(who, dup, gated=True, find_unused=True, op="auto", bucket_mb=25,
              average=average, gather=gather)
    numel = {n: p.numel() for n, p in run.model.named_parameters()}
    tin = {n: np.zeros(m) for n, m in numel.items()}
    tout = {n: np.zeros(m) for n, m in numel.items()}
    worst, ran = 0.0, []
    for s in range(8):
        for n, g in run.local_grads(s).items():
            if g is not None:
                tin[n] += dup.allreduce(g)
        for n, g in run.step(s).items():
            if g is not None:
                tout[n] += g * (N if average else 1)
        ran.append(run.decisions())
        left = _residual_totals(run.obj.state_dict(), numel, dup)
        for n in numel:
            w, o = left[n]
            got = tout[n] + w + (N * o if average else o)
            worst = max(worst, float(np.abs(got - tin[n]).max()))
    every = dup.allgather((ran, run.params()))
    ok = worst < 1e-5 * N and all(e == every[0] for e in every)
    ok &= {"2bit", "none"} <= {op for ops in ran for op in ops}
    assert_all(ok, f"conservation off by {worst}; decisions {ran}", dup)


@pytest.mark.mpi
@pytest.mark.parametrize("who", WHO)
def test_unpinned_auto_leaves_its_first_calls(dup, gloo, who):
    """The model decides after its first, alternating calls, for both: the
    DDP hook polls a call's ``test()`` until it is done (its timeout and
    watch) and only then waits, so before the engine timed a call at the
    first ``test()`` that saw it done, none of the hook's calls was timed
    and every step stayed "measuring" (H7: the hook's op="auto" step 9.6x the
    2bit hook's at 100 Mbit/s, 40 of 40 steps measuring)."""
    run = Run(who, dup, op="auto", bucket_mb=25)
    reasons = []
    for s in range(40):
        run.step(s)
        if who == "sync":
            reasons += [b.decision.reason for b in run.obj.buckets]
        else:
            reasons += [d.reason for d in run.obj.decisions.values()]
    assert_all("model" in reasons, f"the model never decided: {reasons}", dup)


# -- residual state with auto buckets ----------------------------------------------------
@pytest.mark.mpi
@pytest.mark.parametrize("who", WHO)
def test_state_dict_of_auto_buckets_loads_and_is_delivered(dup, dup2, gloo, who):
    """The residuals of an op="auto" run (2bit, none, 2bit: residuals held)
    load into a new one pinned to none, whose next step (zero gradients)
    delivers them: per parameter the sum over the ranks of worker and owner.
    After a "none" step (residuals cleared, entries kept) the state is
    taken and loads too, holding nothing."""
    kw = dict(op="auto", bucket_mb=25, average=False)
    run = Run(who, dup, **kw)
    for s in range(3):
        run.step(s)
    numel = {n: p.numel() for n, p in run.model.named_parameters()}
    state = run.obj.state_dict()
    held = _residual_totals(state, numel, dup)
    into = Run(who, dup2, auto_pin="none", **kw)
    into.obj.load_state_dict(state)
    got = into.step(3, scale=0.0)
    ok = run.decisions() == ["2bit"] and into.decisions() == ["none"]
    ok &= any(np.abs(held[n][0] + held[n][1]).max() > 0 for n in numel)
    for n in numel:
        ok &= bool(np.allclose(got[n], held[n][0] + held[n][1], rtol=0, atol=1e-6))
    after = _residual_totals(into.obj.state_dict(), numel, dup)
    ok &= all(not np.any(w) and not np.any(o) for w, o in after.values())
    run.step(3)  # "none": the entries stay, their residuals cleared
    cleared = run.obj.state_dict()
    again = Run(who, dup2, **kw)
    again.obj.load_state_dict(cleared)
    again.step(0)
    ok &= run.decisions() == ["none"] and sorted(cleared) == sorted(numel)
    ok &= all(not np.any(w) and not np.any(o)
              for w, o in _residual_totals(cleared, numel, dup).values())
    assert_all(ok, f"decisions {run.decisions()} {into.decisions()}", dup)


# -- what op="auto" refuses ----------------------------------------------------------------
@pytest.mark.mpi
@pytest.mark.parametrize("who", WHO)
@pytest.mark.parametrize("kw,match", [
    ({"op": "auto", "hierarchy": "node"}, "flat calls only"),
    ({"op": "auto", "auto_pin": "sometimes"}, "auto_pin"),
    ({"op": "auto", "auto_op": "none"}, "auto_op must name a compressor"),
    ({"op": "2bit", "auto_pin": "none"}, "op='auto' only")])
def test_bad_auto_settings_raise_on_every_rank(dup, gloo, who, kw, match):
    raises_everywhere(mpigc.ConfigError, lambda: Run(who, dup, **kw), dup, match=match)


@pytest.mark.mpi
@pytest.mark.parametrize("who", WHO)
def test_auto_on_some_ranks_only_raises_on_every_rank(dup, gloo, who):
    kw = {"op": "auto"} if dup.rank == 0 else {"op": "2bit"}
    raises_everywhere(mpigc.MismatchError, lambda: Run(who, dup, **kw), dup,
                      match="different settings")
