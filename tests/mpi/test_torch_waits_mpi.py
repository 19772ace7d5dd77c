"""The torch layer's waits for the other ranks (issue 50, item 5), at 2 and 3
ranks (not 1, nor 4: nothing there is new): a wait that lasts says on stderr, on the
waiting rank, what it waits for and the likely causes ($MPIGC_TORCH_WARN_S,
1 s here), and an error raised in the DDP communication hook reaches
``backward()`` as itself, not as torch's "Unable to cast ... to Tensor".

Each scenario leaves the ranks in different places on purpose (a collective
method on rank 0 only, a step on one rank only): every rank's own wait ends
by its timeout, whatever the order in which the ranks get there, and the
ranks then meet in a ``comm.Barrier()`` outside mpigc. Each rank reads its
own stderr (pytest's ``capfd``, a file of its own process): nothing depends
on another rank's output surviving. Afterwards the test completes what it
left posted, so that the next tests find the communicators clean.
"""
import os
import re
import sys

import pytest

import mpigc

from conftest import assert_all

torch = pytest.importorskip("torch")
import mpigc.torch as mt  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tests/
from support import torch_dist  # noqa: E402
from test_torch_mpi import _ddp, backward, make_model  # noqa: E402

# ranks: skipped at 1; flat waits: 2 pairs, 3 a rank neither first nor last; 4 adds nothing
pytestmark = pytest.mark.ranks(2, 3)

gloo = torch_dist.gloo  # its module-scoped fixture: torch.distributed over gloo

_TIMEOUT = 3  # s; the lines come after 1 s ($MPIGC_TORCH_WARN_S) and then every 5 s


def _lines(capfd):
    """This rank's lines of mpigc's waits on stderr since the last call."""
    return [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("mpigc: ")]


def _said(lines, who, *words):
    """Whether one of ``lines`` comes from ``who``, says "still waiting after
    N s" (N is how long it had waited when it said so: 1 s, later on a loaded
    machine, where a poll can wait for a core) and holds every one of
    ``words``."""
    return any(ln.startswith(f"mpigc: {who}: still waiting after ")
               and re.match(r"\d+ s ", ln[len(f"mpigc: {who}: still waiting after "):])
               and all(w in ln for w in words) for ln in lines)


@pytest.fixture
def warn_soon(comm, monkeypatch):
    if comm.size < 2:
        pytest.skip("needs 2 ranks")
    monkeypatch.setenv("MPIGC_TORCH_WARN_S", "1")


@pytest.mark.mpi
@pytest.mark.parametrize("op", [{"op": "2bit"},  # relative: the fixed groups
                                {"op": "2bit", "threshold": 2.0 ** -6}],  # DDP's buckets
                         ids=["groups", "in-place"])
def test_a_checkpoint_saved_on_one_rank_is_reported_by_every_rank(comm, gloo, warn_soon,
                                                                  capfd, tmp_path_factory, op):
    """Waits that no other rank's announcement can end (the others outside
    mpigc), so that the timeout ends them: rank 0 alone in save_checkpoint
    (the others in a barrier) raises StateError that says to call it on
    every rank; then the others alone in a step of the hook (rank 0 in a
    barrier) raise the hook's own StateError from backward() (it read
    "RuntimeError: Unable to cast comm_hook (...) to Tensor"); each rank
    said on stderr, before its timeout, what it waits for and why. Then
    rank 0 takes the step the others are in, and the job goes on. (The
    mistake itself, save_checkpoint inside `if rank == 0:` while the others
    step, is a MismatchError on every rank at once since fef79f9:
    test_torch_mpi::test_a_collective_method_on_rank_0_only_raises_on_every_rank_at_once.)"""
    ddp = _ddp(make_model())
    state = mt.CommHookState(ddp, timeout=_TIMEOUT, **op)
    ddp.register_comm_hook(state, mt.comm_hook)
    for step in range(3):  # DDP rebuilds its buckets after the first step
        backward(ddp, comm.rank, step)
    path = comm.bcast(str(tmp_path_factory.mktemp("res") / "r") if comm.rank == 0 else None)
    _lines(capfd)
    err = None
    try:  # rank 0 alone in the method; the others wait outside mpigc
        if comm.rank == 0:
            state.save_checkpoint(path)
    except Exception as e:  # noqa: BLE001 - checked below
        err = e
    comm.Barrier()  # outside mpigc: rank 0's wait has ended by its timeout
    try:  # the others alone in a step; rank 0 waits outside mpigc
        if comm.rank != 0:
            backward(ddp, comm.rank, 3)
    except Exception as e:  # noqa: BLE001 - checked below
        err = e
    comm.Barrier()  # outside mpigc: every rank's wait has ended by its timeout
    lines = _lines(capfd)
    me = f"(rank {comm.rank} of {comm.size})"
    if comm.rank == 0:
        ok = (isinstance(err, mpigc.StateError)
              and f"CommHookState.save_checkpoint {me}" in str(err)
              and "call it on every rank" in str(err)
              and _said(lines, f"CommHookState.save_checkpoint {me}",
                        "for the other ranks to call it",
                        "if rank == 0:"))
    else:
        ok = (type(err) is mpigc.StateError and str(err).startswith(f"comm_hook {me}: ")
              and "Unable to cast" not in str(err)
              and _said(lines, f"comm_hook {me}",
                        "for the other ranks to reach this step's gradient "
                        "synchronisation", "called on some ranks only", "join()"))
    assert_all(ok, f"{type(err).__name__}: {err}; stderr: {lines}")
    # rank 0 takes up the others' step, and they go on with one more (their
    # hook completes the step that timed out first)
    for step in (3, 4) if comm.rank == 0 else (4,):
        backward(ddp, comm.rank, step)
    state.save_checkpoint(path)  # every rank: rank 0's posted gather completes too
    again = mt.CommHookState(_ddp(make_model()), timeout=_TIMEOUT, **op)
    again.load_checkpoint(path)
    assert_all(set(again.state_dict()) == set(state.names))


@pytest.mark.mpi
def test_uneven_inputs_say_why_before_the_timeout(comm, warn_soon, capfd):
    """GradientSync: a rank with one more batch than the others waits in the
    step's agreement; it says so on stderr after 1 s, naming the step's
    synchronisation and join(), then raises StateError at the timeout; the
    ranks that are not in mpigc say nothing. join() then completes the step.
    (The lines are read from the extra step on: a step of every rank may
    wait more than 1 s for a rank slowed by load, and say so.)"""
    model = make_model()
    opt = mt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                                  op="2bit", bucket_mb=0.002, timeout=_TIMEOUT)

    def step(s):
        opt.zero_grad()
        backward(model, comm.rank, s)
        opt.step()

    for s in range(2):
        step(s)
    comm.Barrier()
    _lines(capfd)
    err = None
    try:
        if comm.rank == 0:
            step(2)
    except mpigc.StateError as e:
        err = e
    comm.Barrier()  # the others wait here meanwhile (not in mpigc)
    lines = _lines(capfd)
    me = f"GradientSync (rank {comm.rank} of {comm.size})"
    if comm.rank == 0:
        ok = (err is not None and _said(
            lines, me, "for the other ranks to reach this step's gradient "
            "synchronisation", "uneven inputs", "with sync.join():"))
    else:
        ok = err is None and lines == []
    with opt.join():  # rank 0's step is still pending: join completes it
        pass
    mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    ok &= all(torch.equal(mine, other) for other in comm.allgather(mine))
    assert_all(ok, f"{err!r}; stderr: {lines}")


@pytest.mark.mpi
def test_a_join_that_waits_says_why_and_is_taken_up_again(comm, warn_soon, capfd):
    """A rank inside join() while another rank is neither stepping nor
    joining: it says so on stderr after 1 s (naming join()), raises
    StateError at the timeout, and its posted agreement is taken up by the
    next join() (it posted a second one, which the others' collectives
    then met in the wrong order)."""
    model = make_model()
    sync = mt.GradientSync(model, op="2bit", bucket_mb=0.002, timeout=_TIMEOUT)
    backward(model, comm.rank, 0)
    sync.wait()
    _lines(capfd)
    err = None
    if comm.rank == 0:
        try:
            with sync.join():
                pass
        except mpigc.StateError as e:
            err = e
    comm.Barrier()
    lines = _lines(capfd)
    me = f"GradientSync.join (rank {comm.rank} of {comm.size})"
    if comm.rank == 0:
        ok = (err is not None and str(err).startswith(me)
              and _said(lines, me, "for the other ranks to reach their next step or "
                        "join()", "with sync.join():"))
    else:
        ok = lines == []
    ok_before = ok
    with sync.join():  # every rank; rank 0 takes up its posted agreement
        pass
    backward(model, comm.rank, 1)  # and the steps go on
    sync.wait()
    ok &= isinstance(sync.state_dict(), dict)
    mine = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    ok &= all(torch.equal(mine, other) for other in comm.allgather(mine))
    assert_all(ok, f"{err!r}; stderr: {lines}; before the second join: {ok_before}")


@pytest.mark.mpi
@pytest.mark.parametrize("hook", [False, True])
def test_an_error_in_the_hook_reaches_backward_as_itself(comm, gloo, hook):
    """nonfinite="raise" and a NaN in one rank's gradient: DDP's backward()
    raises the hook's NonFiniteError on every rank, as GradientSync.wait()
    does (it raised RuntimeError: Unable to cast ... to Tensor), and DDP
    finished its step: the next steps run."""
    model = make_model()
    if hook:
        ddp = _ddp(model)
        state = mt.CommHookState(ddp, op="2bit", nonfinite="raise")
        ddp.register_comm_hook(state, mt.comm_hook)
        net = ddp
    else:
        sync = mt.GradientSync(model, op="2bit", bucket_mb=0.002, nonfinite="raise")
        net = model

    def step(s):
        net.zero_grad()
        backward(net, comm.rank, s)
        if not hook:
            sync.wait()

    for s in range(2):
        step(s)
    h = (model[4].bias.register_hook(lambda g: g * float("nan"))
         if comm.rank == comm.size - 1 else None)
    err = None
    try:
        step(2)
    except Exception as e:  # noqa: BLE001 - checked below
        err = e
    if h is not None:
        h.remove()
    ok = (type(err) is mpigc.NonFiniteError and "Unable to cast" not in str(err)
          and "non-finite" in str(err))
    for s in range(3, 5):
        step(s)
    ok &= all(torch.isfinite(p.grad).all() for p in model.parameters())
    assert_all(ok, f"{type(err).__name__}: {err}")
