"""op="auto" (issue 48, mpigc/_auto.py): the decision is the same on every
rank even when one rank's clock says otherwise, error feedback is conserved
across switches between "none" and the compressor, pins hold, the first
calls measure before the model decides, and bad settings raise on every
rank. Run as

    mpirun -n K python -m pytest --with-mpi -q tests/mpi/test_auto_mpi.py
"""
import time

import numpy as np
import pytest

import mpigc
from mpigc import _auto, _auto_model

from conftest import assert_all, grads, raises_everywhere

# ranks: 1 (the model alone), 2 (pairs, the short path), 3 (uneven shards), 4 (the
# one-sided calls with later calls in flight: more ranks on each side)
pytestmark = pytest.mark.ranks(1, 2, 3, 4)

N = 1 << 13


@pytest.fixture
def skew():
    """The clock of op="auto" calls, restored after the test."""
    old = _auto.use_clock()
    _auto.use_clock(old)
    yield _auto.use_clock
    _auto.use_clock(old)


def _residuals(fb, key, n, comm, owner_scale=1):
    """This rank's residuals of ``key`` placed on the whole array (float64;
    the owner residual times ``owner_scale``: the size where the engine keeps
    it in units of the average)."""
    out = np.zeros(n)
    st = fb.state_dict().get(key)
    if st is None:
        return out
    if st["worker"] is not None:
        out += st["worker"]
    if st["owner"] is not None:
        lo, hi = mpigc.shard_bounds(n, comm.size)[comm.rank]
        out[lo:hi] += st["owner"] * owner_scale
    return out


def _mpi_sum(x, comm):
    """MPI_Allreduce's sum (op="none" is exactly it)."""
    out = np.empty_like(x)
    comm.Allreduce(x, out)
    return out


def _skewed_clock(rank):
    """Rank 1, 3, ... measure their "none" calls 50 times slower, rank 0, 2,
    ... their compressed calls: on their own figures they would decide
    differently."""
    def clock():
        d = _auto.last_decision()
        slow = d is not None and ((d.op == "none") == (rank % 2 == 1))
        return time.perf_counter() * (50.0 if slow else 1.0)
    return clock


@pytest.mark.mpi
def test_the_decision_is_the_same_on_every_rank_under_skewed_clocks(dup, skew, fb):
    skew(_skewed_clock(dup.rank))
    seen = []
    for i in range(40):
        x = grads(dup.rank, N, seed=i)
        mpigc.allreduce(x, op="auto", key="w", comm=dup, feedback=fb)
        d = _auto.last_decision()
        seen.append((d.op, d.reason, d.predicted_none, d.predicted_compressed))
    every = dup.allgather(seen)
    assert_all(all(s == every[0] for s in every),
               f"decisions differ between ranks: {[s[-5:] for s in every]}", dup)
    reasons = {s[1] for s in seen}
    assert_all("model" in reasons, f"the model never decided: {reasons}", dup)


@pytest.mark.mpi
def test_calls_completed_by_test_are_timed(dup, fb):
    """Nonblocking calls whose completion only ``test()`` sees (as the DDP
    hook's: it polls ``test()`` for its timeout and watch, then waits for a
    call already done) are timed when ``test()`` first finds them done.
    Before, only a ``wait()`` that found the call unfinished timed it: the
    model got the agreement steps' calls alone (one op of the two) and
    measured for ever (H7: the hook's op="auto" 9.6x the 2bit hook's step
    at 100 Mbit/s)."""
    seen = []
    for i in range(40):
        req = mpigc.iallreduce(grads(dup.rank, N, seed=i), op="auto", key="w", comm=dup,
                               feedback=fb)
        while not req.test():
            pass
        req.wait()
        seen.append(req.decision.reason)
    assert_all("model" in seen, f"the model never decided: {seen}", dup)


@pytest.mark.mpi
def test_the_model_moves_only_with_agreed_sums(dup, fb):
    """A rank's own samples reach no decision before an agreement step took
    every rank's: the model after the first calls is the same everywhere."""
    for i in range(12):
        mpigc.allreduce(grads(dup.rank, N, seed=i), op="auto", key="w", comm=dup,
                        feedback=fb)
    m = _auto.model_of(dup)
    table = repr(sorted(m.agreed.items()))
    every = dup.allgather(table)
    assert_all(len(m.agreed) == 2 and all(t == every[0] for t in every),
               f"agreed points differ: {every}", dup)


def _conserved(dup, fb, kind, pins, nonblocking=False, group=False, average=False,
               auto_op="2bit"):
    """Run calls with the pins given (None: the model) and check after each
    that what was delivered plus every rank's residuals is the sum of the
    inputs (float64 reference; with ``average``, the average delivered times
    the size, and the owner residuals, kept in units of the average, too)."""
    times = dup.size if average else 1
    sizes = [N, 3001] if group else [N]
    keys = ["a", "b"] if group else ["w"]
    total_in = [np.zeros(m) for m in sizes]
    total_out = [np.zeros(m) for m in sizes]
    worst = 0.0
    ran = []
    for i, pin in enumerate(pins):
        xs = [grads(dup.rank, m, seed=100 * i + j) for j, m in enumerate(sizes)]
        for j, x in enumerate(xs):
            total_in[j] += dup.allreduce(x.astype(np.float64))
        bufs = [x.copy() for x in xs]
        arg = bufs if group else bufs[0]
        key = keys if group else keys[0]
        if kind == "allreduce":
            if nonblocking:
                req = mpigc.iallreduce(arg, op="auto", key=key, comm=dup, feedback=fb,
                                       auto_pin=pin, average=average, auto_op=auto_op)
                req.wait()
                ran.append(req.decision.op)
            else:
                mpigc.allreduce(arg, op="auto", key=key, comm=dup, feedback=fb, auto_pin=pin,
                                average=average, auto_op=auto_op)
                ran.append(_auto.last_decision().op)
            for j, b in enumerate(bufs):
                total_out[j] += b * times
        elif nonblocking:
            req = mpigc.ireduce_scatter(arg, op="auto", key=key, comm=dup, feedback=fb,
                                        auto_pin=pin, average=average, auto_op=auto_op)
            got = req.wait()
            ran.append(req.decision.op)
        else:
            got = mpigc.reduce_scatter(arg, op="auto", key=key, comm=dup, feedback=fb,
                                       auto_pin=pin, average=average, auto_op=auto_op)
            ran.append(_auto.last_decision().op)
        if kind != "allreduce":
            got = got if group else [got]
            for j, g in enumerate(got):
                total_out[j] += np.concatenate(dup.allgather(g.astype(np.float64))) * times
        for j, m in enumerate(sizes):
            left = dup.allreduce(_residuals(fb, keys[j], m, dup, times))
            worst = max(worst, float(np.abs(total_out[j] + left - total_in[j]).max()))
    return worst, ran


PINS = ["compressed", "compressed", "none", "compressed", "none", "none", "compressed",
        None, None, None, None, None, None, None, None, None, None, None, "none"]


@pytest.mark.mpi
@pytest.mark.parametrize("kind,nonblocking,group,average", [
    ("allreduce", False, False, False), ("allreduce", True, False, False),
    ("allreduce", False, True, False), ("reduce_scatter", False, False, False),
    ("reduce_scatter", True, False, False), ("reduce_scatter", False, True, False),
    ("allreduce", False, False, True), ("allreduce", True, True, True),
    ("reduce_scatter", False, False, True), ("reduce_scatter", True, True, True)])
def test_error_feedback_is_conserved_across_switches(dup, fb, kind, nonblocking, group,
                                                     average):
    """With ``average=True`` too: a call run as "none" adds the owner
    residual (kept in units of the average) times the size (before, as it
    was: only 1/size of it was delivered, and all of it cleared)."""
    worst, ran = _conserved(dup, fb, kind, PINS, nonblocking, group, average)
    assert_all(worst < 1e-4 * dup.size, f"conservation off by {worst} ({ran})", dup)
    assert_all({"2bit", "none"} <= set(ran), f"no switch: {ran}", dup)


@pytest.mark.mpi
@pytest.mark.parametrize("average", [False, True])
def test_error_feedback_of_fp16_is_conserved_across_switches(dup, fb, average):
    """fp16 divides its inputs by the size before it encodes them with
    ``average=True``; its worker residual is still in units of the sum."""
    worst, ran = _conserved(dup, fb, "allreduce", PINS, average=average,
                            auto_op={"type": "fp16", "error_feedback": True})
    assert_all(worst < 1e-4 * dup.size, f"conservation off by {worst} ({ran})", dup)
    assert_all({"fp16", "none"} <= set(ran), f"no switch: {ran}", dup)


@pytest.mark.mpi
def test_a_plain_call_clears_the_residuals_it_delivered(dup, fb):
    x = grads(dup.rank, N)
    mpigc.allreduce(x.copy(), op="auto", key="w", comm=dup, feedback=fb,
                    auto_pin="compressed")
    had = fb.state_dict()["w"]["worker"] is not None
    y = x.copy()
    mpigc.allreduce(y, op="auto", key="w", comm=dup, feedback=fb, auto_pin="none")
    st = fb.state_dict()["w"]
    assert_all(had and st["worker"] is None and st["owner"] is None,
               f"residuals after the plain call: {st['worker']}, {st['owner']}", dup)
    # the next plain call has nothing to add: exactly the plain sum
    z = x.copy()
    mpigc.allreduce(z, op="auto", key="w", comm=dup, feedback=fb, auto_pin="none")
    exact = _mpi_sum(x, dup)
    assert_all(np.array_equal(z, exact), "a plain call without residuals is not the sum", dup)


@pytest.mark.mpi
def test_a_skipped_plain_call_leaves_residuals_and_conservation(dup, fb):
    x = grads(dup.rank, N)
    mpigc.allreduce(x.copy(), op="auto", key="w", comm=dup, feedback=fb,
                    auto_pin="compressed")
    before = fb.state_dict()["w"]
    y = x.copy()
    if dup.rank == 0:
        y[5] = np.nan
    mpigc.allreduce(y, op="auto", key="w", comm=dup, feedback=fb, auto_pin="none",
                    nonfinite="skip")
    after = fb.state_dict()["w"]
    same = all(np.array_equal(before[p], after[p]) for p in ("worker", "owner")
               if before[p] is not None)
    assert_all(same and np.isnan(y).all(), "a skipped call changed the residuals", dup)
    bad = mpigc.NonFiniteError
    raises_everywhere(bad, lambda: mpigc.allreduce(
        y, op="auto", key="w", comm=dup, feedback=fb, auto_pin="none"))
    after = fb.state_dict()["w"]
    same = all(np.array_equal(before[p], after[p]) for p in ("worker", "owner")
               if before[p] is not None)
    assert_all(same, "a failed call changed the residuals", dup)


@pytest.mark.mpi
def test_pinned_decisions(dup, fb, monkeypatch):
    for _ in range(6):
        mpigc.allreduce(grads(dup.rank, N), op="auto", key="w", comm=dup, feedback=fb,
                        auto_pin="none")
        d = _auto.last_decision()
        path = mpigc.diagnostics.last_trace().path
        assert_all((d.op, d.reason, path) == ("none", "pinned", "plain"), f"{d} {path}", dup)
    monkeypatch.setenv("MPIGC_AUTO_PIN", "compressed")
    for _ in range(6):
        req = mpigc.iallreduce(grads(dup.rank, N), op="auto", key="w", comm=dup,
                               feedback=fb)
        req.wait()
        d = req.decision
        assert_all((d.op, d.reason, req.trace.path) == ("2bit", "pinned", "two-phase"),
                   f"{d} {req.trace.path}", dup)


@pytest.mark.mpi
def test_the_first_calls_measure_both_before_the_model_decides(dup, fb):
    seen = []
    for i in range(2 * _auto_model.SYNC_EVERY):
        mpigc.allreduce(grads(dup.rank, N, seed=i), op="auto", key="w", comm=dup,
                        feedback=fb)
        seen.append(_auto.last_decision())
    want = [("2bit" if i % 2 == 0 else "none", "measuring", None, None)
            for i in range(2 * _auto_model.SYNC_EVERY)]
    got = [(d.op, d.reason, d.predicted_none, d.predicted_compressed) for d in seen]
    assert_all(got == want, f"got {got}", dup)


@pytest.mark.mpi
@pytest.mark.parametrize("bad", [
    {"auto_op": "3bit"}, {"auto_op": "none"}, {"auto_op": "auto"},
    {"auto_pin": "sometimes"}, {"hierarchy": "node"}, {"rel_threshold": -1.0},
    {"feedback": "yes"}])
def test_bad_settings_raise_on_every_rank(dup, fb, bad):
    """Given on rank 0 only (every rank at 1 rank): ConfigError everywhere,
    then the next call works on every rank."""
    args = dict(op="auto", key="w", comm=dup, feedback=fb)
    if dup.rank == 0:
        args.update(bad)
    x = grads(dup.rank, N)
    raises_everywhere(mpigc.ConfigError, lambda: mpigc.allreduce(x.copy(), **args))
    y = x.copy()
    mpigc.allreduce(y, op="auto", key="w", comm=dup, feedback=fb, auto_pin="none")
    assert_all(np.array_equal(y, _mpi_sum(x, dup)), "the next call is wrong", dup)


@pytest.mark.mpi
def test_a_bad_probe_period_raises_on_every_rank(dup, fb, monkeypatch):
    if dup.rank == 0:
        monkeypatch.setenv("MPIGC_AUTO_PROBE", "often")
    raises_everywhere(mpigc.ConfigError, lambda: mpigc.allreduce(
        grads(dup.rank, N), op="auto", key="w", comm=dup, feedback=fb),
        match="MPIGC_AUTO_PROBE")


@pytest.mark.mpi
@pytest.mark.parametrize("pin", ["none", None])
def test_outstanding_requests_across_agreement_steps_waited_in_reverse(dup, fb, pin):
    """Ten nonblocking calls on ten keys (the agreement steps of calls 0, 4
    and 8 among them), waited last first: no hang, the same decisions on
    every rank, and pinned to none the exact sums."""
    xs = [grads(dup.rank, N, seed=i) for i in range(10)]
    bufs = [x.copy() for x in xs]
    reqs = [mpigc.iallreduce(b, op="auto", key=f"k{i}", comm=dup, feedback=fb, auto_pin=pin)
            for i, b in enumerate(bufs)]
    for r in reversed(reqs):
        r.wait()
    ops = [(r.decision.op, r.decision.reason) for r in reqs]
    every = dup.allgather(ops)
    assert_all(all(o == every[0] for o in every), f"decisions differ: {every}", dup)
    if pin == "none":
        exact = all(np.array_equal(b, _mpi_sum(x, dup)) for b, x in zip(bufs, xs))
        assert_all(exact, "a pinned plain call is not the MPI sum", dup)


@pytest.mark.mpi
@pytest.mark.ranks(2, 3)
@pytest.mark.parametrize("blocking", [True, False])
@pytest.mark.parametrize("other", ["2bit", "none"])
def test_auto_on_rank_0_only_raises_on_every_rank_then_the_calls_work(dup, fb, other,
                                                                       blocking):
    """op="auto" on rank 0, ``other`` on the rest: MismatchError on every
    rank at that call (the mark in the settings; before, rank 0's agreement
    step, a call on this communicator, paired with the others' call and
    rank 0 hung in its own), then the same op on every rank works: ``other``,
    then op="auto" (the model joins at its first call that went through)."""
    x = grads(dup.rank, N)

    def call(op, y):
        kw = dict(op=op, key="w", comm=dup, feedback=fb)
        if blocking:
            return mpigc.allreduce(y, **kw)
        return mpigc.iallreduce(y, **kw).wait()

    raises_everywhere(mpigc.MismatchError, lambda: call(
        "auto" if dup.rank == 0 else other, x.copy()), comm=dup, match="auto")
    for _ in range(2):
        y = x.copy()
        call(other, y)
        if other == "none":
            assert_all(np.array_equal(y, _mpi_sum(x, dup)), "the next call is wrong", dup)
        every = dup.allgather(y.tobytes())
        assert_all(all(b == every[0] for b in every), "results differ", dup)
    decisions = []
    for i in range(2 * _auto_model.SYNC_EVERY + 1):
        y = grads(dup.rank, N, seed=i)
        call("auto", y)
        decisions.append(tuple(_auto.last_decision()[:2]))
    every = dup.allgather(decisions)
    assert_all(all(d == every[0] for d in every), f"decisions differ: {every}", dup)


@pytest.mark.mpi
@pytest.mark.ranks(2, 3)
@pytest.mark.parametrize("differ", [
    {"auto_pin": "compressed"}, {"auto_pin": "none"},
    {"auto_op": {"type": "2bit", "block_size": 512}}])
def test_auto_settings_differing_between_ranks_raise_on_every_rank(dup, fb, differ):
    """auto_pin or auto_op differing between ranks: MismatchError on every
    rank at the first call (before: pins whose decisions happened to agree,
    or two auto_op's while both ran "none", went through, and the models'
    slots could differ), then the same settings on every rank work."""
    kw = dict(op="auto", key="w", comm=dup, feedback=fb)
    x = grads(dup.rank, N)
    raises_everywhere(mpigc.MismatchError, lambda: mpigc.allreduce(
        x.copy(), **kw, **(differ if dup.rank == 0 else {})), comm=dup,
        match="auto_")
    for i in range(_auto_model.SYNC_EVERY + 1):
        y = grads(dup.rank, N, seed=i)
        mpigc.allreduce(y, **kw, auto_pin="none")
        assert_all(np.array_equal(y, _mpi_sum(grads(dup.rank, N, seed=i), dup)),
                   "a pinned plain call is not the MPI sum", dup)


def _one_sided(dup, fb, kind, blocking, x):
    """One call whose op="auto" settings differ between ranks (``kind``
    "op": op="auto" on rank 0, "2bit" on the rest; "pin": auto_pin
    "compressed" on rank 0, "none" on the rest): MismatchError everywhere."""
    kw = dict(op="auto", key="w", comm=dup, feedback=fb)
    if kind == "op" and dup.rank != 0:
        kw["op"] = "2bit"
    elif kind == "pin":
        kw["auto_pin"] = "compressed" if dup.rank == 0 else "none"

    def call():
        if blocking:
            return mpigc.allreduce(x, **kw)
        return mpigc.iallreduce(x, **kw).wait()
    raises_everywhere(mpigc.MismatchError, call, comm=dup, match="auto")


@pytest.mark.mpi
@pytest.mark.ranks(2, 3)
@pytest.mark.parametrize("blocking", [True, False])
@pytest.mark.parametrize("kind", ["op", "pin"])
@pytest.mark.parametrize("bad", [1, 5])
def test_one_sided_auto_calls_after_the_join_leave_the_models_alike(dup, fb, kind, bad,
                                                                    blocking, watchdog):
    """After the model joined, ``bad`` calls whose op="auto" settings differ
    between ranks (the first at an agreement step: call 4): MismatchError on
    every rank each time, and every model is as it was before them, so
    op="auto" calls on every rank then work on every rank (across agreement
    steps, with the same decisions) and error feedback is conserved (the
    failed calls changed no residual). Before, rank 0's model counted the
    calls with op="auto" on rank 0 only and posted its table alone: every
    later call raised MismatchError, and from 4 such calls on rank 0 waited
    forever for a table the others never posted."""
    total_in, total_out = np.zeros(N), np.zeros(N)
    ran = []

    def auto(seed):
        x = grads(dup.rank, N, seed=seed)
        total_in[:] += dup.allreduce(x.astype(np.float64))
        if blocking:
            mpigc.allreduce(x, op="auto", key="w", comm=dup, feedback=fb)
            ran.append(tuple(_auto.last_decision()[:2]))
        else:
            req = mpigc.iallreduce(x, op="auto", key="w", comm=dup, feedback=fb)
            req.wait()
            ran.append(tuple(req.decision[:2]))
        total_out[:] += x

    for i in range(_auto_model.SYNC_EVERY - (bad > 1)):
        auto(i)
    for i in range(bad):
        x = grads(dup.rank, N, seed=50 + i)
        _one_sided(dup, fb, kind, blocking, x)
        assert_all(np.array_equal(x, grads(dup.rank, N, seed=50 + i)),
                   "a failed call changed its buffer", dup)
    for i in range(4 * _auto_model.SYNC_EVERY):
        try:
            auto(100 + i)
            got = "ok"
        except mpigc.MpigcError as exc:
            got = f"{type(exc).__name__}: {exc}"
        every = dup.allgather(got)
        assert_all(all(g == "ok" for g in every), f"call {i} after: {every}", dup)
    every = dup.allgather(ran)
    assert_all(all(r == every[0] for r in every), f"decisions differ: {every}", dup)
    assert_all({"2bit", "none"} <= {r[0] for r in ran}, f"no switch: {ran}", dup)
    m = _auto.model_of(dup)
    every = dup.allgather((m.calls, m.syncs))
    assert_all(all(e == every[0] for e in every), f"models differ: {every}", dup)
    left = dup.allreduce(_residuals(fb, "w", N, dup))
    worst = float(np.abs(total_out + left - total_in).max())
    assert_all(worst < 1e-4 * dup.size, f"conservation off by {worst}", dup)


@pytest.mark.mpi
def test_two_threads_making_the_first_auto_call_at_once(dup, monkeypatch, watchdog):
    """Two threads start op="auto" calls on a new communicator at once (the
    same values on both: however the threads' calls pair across ranks, every
    sum is the same): both get one model, one makes the first call and the
    model joins before the other's call starts (it waits in the model's
    order), every call is the MPI sum, and the models are alike. Before,
    each thread could make a model of its own (both joined: a hang, 1 run
    in 5 at 3 ranks; the making of a model slowed by 0.2 s so that both
    threads are in it, every run), and the second thread's calls ran while
    the first joined (the join slowed by 0.2 s), an agreement step among
    them posting on a model without its communicator."""
    import threading
    events, lock = [], threading.Lock()
    join, launch, init = _auto_model.Model.join, _auto._launch, _auto_model.Model.__init__

    def slow_init(self, *args, **kwargs):
        time.sleep(0.2)
        init(self, *args, **kwargs)

    def slow_join(self, comm):
        time.sleep(0.2)
        with lock:
            events.append("join")
        join(self, comm)

    def logged_launch(*args, **kwargs):
        with lock:
            events.append("launch")
        return launch(*args, **kwargs)
    monkeypatch.setattr(_auto_model.Model, "join", slow_join)
    monkeypatch.setattr(_auto_model.Model, "__init__", slow_init)
    monkeypatch.setattr(_auto, "_launch", logged_launch)
    x = grads(dup.rank, N)
    want = _mpi_sum(x, dup)
    out, models = [None, None], [None, None]
    go = threading.Barrier(2)

    def run(t):
        go.wait()
        try:
            models[t] = _auto.model_of(dup)
            ok = True
            for _ in range(6):
                y = x.copy()
                mpigc.allreduce(y, op="auto", key="t", comm=dup, feedback=False,
                                auto_pin="none")
                ok = ok and np.array_equal(y, want)
            out[t] = "ok" if ok else "a sum differs"
        except Exception as exc:  # noqa: BLE001 - compared across ranks
            out[t] = f"{type(exc).__name__}: {exc}"
    threads = [threading.Thread(target=run, args=(t,), daemon=True) for t in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert_all(out == ["ok", "ok"] and models[0] is models[1],
               f"threads: {out}, one model: {models[0] is models[1]}", dup)
    assert_all(events[:2] == ["launch", "join"] and events.count("launch") == 12,
               f"another call started before the join: {events}", dup)
    m = _auto.model_of(dup)
    every = dup.allgather((m.calls, m.syncs))
    assert_all(m.chan is not None and all(e == every[0] for e in every),
               f"models differ: {every}", dup)


def _models_alike_then_16_calls(dup, fb, went):
    """The models alike on every rank, then 16 op="auto" calls on key "w"
    that go through everywhere (``went(key, x, y)`` records each), with the
    same decisions and models after."""
    m = _auto.model_of(dup)
    every = dup.allgather(_model_state(m))
    assert_all(all(e == every[0] for e in every), f"models differ: {every}", dup)
    ran = []
    for i in range(16):
        x = grads(dup.rank, N, seed=100 + i)
        y = x.copy()
        res = _outcome(lambda: mpigc.allreduce(y, op="auto", key="w", comm=dup, feedback=fb))
        every = dup.allgather(res)
        assert_all(all(g == "ok" for g in every), f"call {i} after: {every}", dup)
        went("w", x, y)
        ran.append(tuple(_auto.last_decision()[:2]))
    every = dup.allgather((ran, _model_state(m)))
    assert_all(all(e == every[0] for e in every), f"decisions or models differ: {every}", dup)


def _model_state(m):
    """What a model's next decisions depend on, as text (the same on every
    rank where the models are alike)."""
    with m.book:
        return repr((m.calls, m.syncs, sorted(m.series.items()), sorted(m.slots.items()),
                     sorted((k, v) for k, v in m.agreed.items()), m.pending is None))


class _Ledger:
    """Per key, the inputs of the calls that went through (summed over the
    ranks, float64) and what they delivered: with every rank's residuals
    left, conservation."""

    def __init__(self, comm, fb):
        self.comm, self.fb, self.ins, self.outs = comm, fb, {}, {}

    def went(self, key, x, delivered):
        n = x.size
        self.ins.setdefault(key, np.zeros(n))
        self.outs.setdefault(key, np.zeros(n))
        self.ins[key] += self.comm.allreduce(x.astype(np.float64))
        self.outs[key] += delivered

    def worst(self):
        worst = 0.0
        for key in sorted(self.ins):
            left = self.comm.allreduce(_residuals(self.fb, key, self.ins[key].size, self.comm))
            worst = max(worst, float(np.abs(self.outs[key] + left - self.ins[key]).max()))
        return worst


def _outcome(fn):
    """"ok" or the exception's type name."""
    try:
        fn()
        return "ok"
    except mpigc.MpigcError as exc:
        return type(exc).__name__


@pytest.mark.mpi
@pytest.mark.ranks(2, 3, 4)
@pytest.mark.parametrize("pin", ["none", None])
@pytest.mark.parametrize("who", ["rank 0", "all but rank 0"])
@pytest.mark.parametrize("k", [1, 3, 6])
@pytest.mark.parametrize("before", [_auto_model.SYNC_EVERY - 1, _auto_model.SYNC_EVERY + 1])
def test_a_one_sided_call_failing_while_later_auto_calls_are_in_flight(dup, fb, before, k,
                                                                         who, pin, watchdog):
    """A nonblocking call, op="auto" on some ranks and "2bit" on the others
    (MismatchError everywhere), then ``k`` nonblocking op="auto" calls
    started before any is waited (after ``before`` calls: the agreement
    step of call 4 among them, which completes in its start, or none),
    then waited in order: every call's outcome
    is the same on every rank, the models are alike after them, 16 more
    op="auto" calls work on every rank with the same decisions, and error
    feedback is conserved. Before, with ``auto_pin="none"`` (the decisions
    of the calls in flight agree whatever the models), a call in flight
    that paired with another rank's call of another number went through:
    the ranks that made the one-sided call as op="auto" kept it counted,
    and later op="auto" calls raised MismatchError on every rank (the cases
    after 5 calls; with the index planted out of the mark, those fail).
    Unpinned, after 5 calls with 3 in flight, an agreement step that failed
    on some ranks kept the sums it took in (models differ: 1 step against
    0; they fail with the step's undo planted out)."""
    led = _Ledger(dup, fb)
    for i in range(before):
        x = grads(dup.rank, N, seed=i)
        y = x.copy()
        mpigc.allreduce(y, op="auto", key="w", comm=dup, feedback=fb)
        led.went("w", x, y)
    auto_here = (dup.rank == 0) == (who == "rank 0")
    x0 = grads(dup.rank, N, seed=40)
    bad = mpigc.iallreduce(x0.copy(), op="auto" if auto_here else "2bit", key="x", comm=dup,
                           feedback=fb)
    xs = [grads(dup.rank, N, seed=50 + j) for j in range(k)]
    bufs = [x.copy() for x in xs]
    reqs, outs = [], []
    for j in range(k):
        try:
            reqs.append(mpigc.iallreduce(bufs[j], op="auto", key=f"b{j}", comm=dup,
                                         feedback=fb, auto_pin=pin))
            outs.append(None)
        except mpigc.MpigcError as exc:  # an agreement step completes in its start
            reqs.append(None)
            outs.append(type(exc).__name__)
    first = _outcome(bad.wait)
    for j, r in enumerate(reqs):
        if r is not None:
            outs[j] = _outcome(r.wait)
        if outs[j] == "ok":
            led.went(f"b{j}", xs[j], bufs[j])
    every = dup.allgather((first, outs))
    assert_all(all(e == every[0] for e in every) and first == "MismatchError",
               f"outcomes differ: {every}", dup)
    _models_alike_then_16_calls(dup, fb, led.went)
    worst = led.worst()
    assert_all(worst < 1e-4 * dup.size, f"conservation off by {worst}", dup)


def _script(seed, size, steps=40):
    """A random sequence of calls, the same on every rank (``seed``): op="auto"
    calls (blocking or not, pinned or not, on a few keys) and one-sided ones
    (op="auto" on some ranks, another op or another pin on the rest), and
    the waits of the calls in flight, in a random order."""
    rng = np.random.default_rng(seed)
    ops, flying = [], []
    for i in range(steps):
        what = rng.choice(["auto", "auto", "auto", "one-sided", "wait"])
        if what == "wait" or len(flying) >= 6:
            if flying:
                ops.append(("wait", flying.pop(int(rng.integers(len(flying))))))
            continue
        blocking = bool(rng.random() < 0.3)
        pin = [None, "none", "none", "compressed"][int(rng.integers(4))]
        key = f"k{int(rng.integers(4))}"
        if what == "one-sided":
            ranks = set(rng.choice(size, int(rng.integers(1, size)), replace=False).tolist())
            other = ["2bit", "none", "pin"][int(rng.integers(3))]
            ops.append(("one-sided", i, blocking, key, (ranks, other)))
        else:
            ops.append(("auto", i, blocking, key, pin))
        if not blocking:
            flying.append(i)
    order = rng.permutation(len(flying)).tolist()
    ops += [("wait", flying[j]) for j in order]
    return ops


@pytest.mark.mpi
@pytest.mark.ranks(2, 3, 4)
@pytest.mark.parametrize("seed", range(16))
def test_random_mixes_of_auto_and_one_sided_calls_leave_the_models_alike(dup, fb, seed,
                                                                           watchdog):
    """Random sequences (:func:`_script`) of op="auto" calls, blocking and
    nonblocking, pinned or not, and one-sided calls that fail with
    MismatchError, with up to 6 calls in flight, waited in a random order:
    every call's outcome is the same on every rank, nothing hangs (the
    watchdog), the models are alike once no call is in flight, 16 more
    op="auto" calls then work on every rank with the same decisions, and
    error feedback is conserved over the calls that went through. With the
    index out of the mark (before), seeds 7 (2 ranks), 11 (3 ranks) and 8
    (4 ranks) among others fail: models differ."""
    ins, outs = {}, {}
    reqs, got = {}, {}

    def went(key, x, y):
        ins.setdefault(key, np.zeros(N))
        outs.setdefault(key, np.zeros(N))
        ins[key] += x
        outs[key] += y

    busy = {}  # key -> the call in flight on it (a key is reused once it is waited)

    def settle(i):
        if i not in reqs:
            return  # waited before its key was reused
        r, key, x, y = reqs.pop(i)
        if r is not None:
            got[i] = _outcome(r.wait)
        if got[i] == "ok":
            went(key, x, y)
        busy.pop(key, None)

    for op in _script(seed, dup.size):
        if op[0] == "wait":
            settle(op[1])
            continue
        what, i, blocking, key, arg = op
        if key in busy:
            settle(busy[key])
        x = grads(dup.rank, N, seed=1000 * seed + i)
        y = x.copy()
        kw = dict(op="auto", key=key, comm=dup, feedback=fb)
        if what == "one-sided":
            ranks, other = arg
            if dup.rank not in ranks:
                if other == "pin":
                    kw["auto_pin"] = "compressed"
                else:
                    kw["op"] = other
            else:
                kw["auto_pin"] = "none"
        else:
            kw["auto_pin"] = arg
        if blocking:
            got[i] = _outcome(lambda: mpigc.allreduce(y, **kw))
            if got[i] == "ok":
                went(key, x, y)
            continue
        try:
            reqs[i] = (mpigc.iallreduce(y, **kw), key, x, y)
        except mpigc.MpigcError as exc:  # an agreement step completes in its start
            reqs[i] = (None, key, x, y)
            got[i] = type(exc).__name__
        busy[key] = i
    assert not reqs
    outcome = sorted(got.items())
    every = dup.allgather(outcome)
    assert_all(all(e == every[0] for e in every), f"outcomes differ: {every}", dup)
    _models_alike_then_16_calls(dup, fb, went)
    worst = 0.0
    for key in sorted(ins):
        total_in = dup.allreduce(ins[key].astype(np.float64))
        left = dup.allreduce(_residuals(fb, key, N, dup))
        worst = max(worst, float(np.abs(outs[key] + left - total_in).max()))
    assert_all(worst < 1e-4 * dup.size, f"conservation off by {worst}", dup)
    failed = sum(g != "ok" for _, g in outcome)
    assert_all(0 < failed < len(outcome), f"outcomes: {outcome}", dup)
