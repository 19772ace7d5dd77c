"""The residual store keeps a grouped call's residuals fused between calls
(issue 51 item 6): a search over random sequences of grouped calls (in the
keys' order, another order, a subset; allreduce and reduce_scatter), single
calls on member keys, resets, state and checkpoint round trips, calls that
fail or are skipped, each compared, bit for bit, with the same gradients
sent by single calls only to another store (results every step, residuals
whenever the sequence reads them, and at its end; call counts against
their model)."""
import os
import tempfile

import numpy as np
import pytest

import mpigc
from conftest import assert_all, grads, on_root, raises_everywhere

# ranks: 2 the pair path, 3 uneven shards (members with no element on a
# rank), 4 the general case
pytestmark = [pytest.mark.mpi(min_size=2), pytest.mark.ranks(2, 3, 4)]

KEYS = ["a", "b", "c", "d", "e"]
SIZES = {"a": 3, "b": 1000, "c": 1, "d": 5000, "e": 2500}
#: 2bit's absolute mode acts element by element, so a group gives the single
#: calls' bits (its relative mode, the default, has blocks that the fused
#: shards cut differently)
PARAMS = {"2bit": {"threshold": 0.5}, "fp16": {}}
ACTIONS = ["group", "group", "group", "order", "subset", "rs", "single", "reset",
           "state", "ckpt", "fail", "skip", "compare"]


def _same_state(fb1, fb2, calls):
    """None if ``fb1`` holds the residuals of ``fb2`` and the call counts
    ``calls`` (a grouped call counts max(its members' counts) + 1 for each:
    terngrad's streams are the group's), else what differs."""
    s1, s2 = fb1.state_dict(), fb2.state_dict()
    if sorted(s1) != sorted(s2) or sorted(s1) != sorted(calls):
        return f"keys {sorted(s1)} != {sorted(s2)} or {sorted(calls)}"
    for k in s1:
        if s1[k]["calls"] != calls[k] or s1[k]["config"] != s2[k]["config"]:
            return f"{k}: calls ({s1[k]['calls']}, expected {calls[k]}) or config differ"
        for f in ("worker", "owner"):
            a, b = s1[k][f], s2[k][f]
            if f == "owner" and (a is None) != (b is None):
                # a grouped reduce_scatter gives the members without an owner
                # residual zeros (as it did before residuals stayed fused); a
                # single one leaves None: the same to every later call
                a, b = (np.zeros_like(b) if a is None else a), (np.zeros_like(a) if b is None
                                                               else b)
            if (a is None) != (b is None) or (a is not None and a.tobytes() != b.tobytes()):
                return f"{k}: {f} residual differs"
    return None


def _grads(comm, keys, step):
    return [grads(comm.rank, SIZES[k], seed=1000 * step + KEYS.index(k)) for k in keys]


def _run(comm, op, seed, steps, path):
    """One random sequence; returns the actions taken."""
    rng = np.random.default_rng(seed)  # the same on every rank
    kw = PARAMS[op]
    fb, ref = mpigc.ErrorFeedback(), mpigc.ErrorFeedback()
    taken, calls = [], {}

    def grouped(keys):
        m = max(calls.get(k, 0) for k in keys) + 1
        calls.update((k, m) for k in keys)
    for step in range(steps):
        what = ACTIONS[rng.integers(len(ACTIONS))]
        taken.append(what)
        keys = list(KEYS)
        if what == "order":
            keys = [KEYS[i] for i in rng.permutation(len(KEYS))]
        elif what == "subset":
            keys = sorted(rng.choice(KEYS, size=3, replace=False), key=KEYS.index)
        if what in ("group", "order", "subset"):
            xs = _grads(comm, keys, step)
            out = mpigc.allreduce([x.copy() for x in xs], op=op, key=keys, feedback=fb, **kw)
            single = [mpigc.allreduce(x.copy(), op=op, key=k, feedback=ref, **kw)
                      for x, k in zip(xs, keys)]
            grouped(keys)
            assert_all([a.tobytes() for a in out] == [a.tobytes() for a in single],
                       f"step {step} ({what} {keys}): results differ")
        elif what == "rs":
            xs = _grads(comm, keys, step)
            out = mpigc.reduce_scatter([x.copy() for x in xs], op=op, key=keys, feedback=fb,
                                       **kw)
            single = [mpigc.reduce_scatter(x.copy(), op=op, key=k, feedback=ref, **kw)
                      for x, k in zip(xs, keys)]
            grouped(keys)
            assert_all([a.tobytes() for a in out] == [a.tobytes() for a in single],
                       f"step {step} (reduce_scatter): shards differ")
        elif what == "single":
            k = KEYS[rng.integers(len(KEYS))]
            x = _grads(comm, [k], step)[0]
            a = mpigc.allreduce(x.copy(), op=op, key=k, feedback=fb, **kw)
            b = mpigc.allreduce(x.copy(), op=op, key=k, feedback=ref, **kw)
            calls[k] = calls.get(k, 0) + 1
            assert_all(a.tobytes() == b.tobytes(), f"step {step} (single {k}): differ")
        elif what == "reset":
            k = KEYS[rng.integers(len(KEYS))]
            fb.reset(k)
            ref.reset(k)
            calls.pop(k, None)
        elif what == "state":
            fb.load_state_dict(fb.state_dict())
        elif what == "ckpt":
            mpigc.save_checkpoint(path, feedback=fb, step=step)
            mpigc.load_checkpoint(path, feedback=fb)
        elif what in ("fail", "skip"):
            xs = _grads(comm, keys, step)
            if comm.rank == comm.size - 1:
                xs[3][7] = np.nan
            if what == "fail":
                raises_everywhere(mpigc.NonFiniteError, lambda: mpigc.allreduce(
                    xs, op=op, key=keys, feedback=fb, **kw))
            else:
                mpigc.allreduce(xs, op=op, key=keys, feedback=fb, nonfinite="skip", **kw)
                assert_all(fb.skipped_steps == taken.count("skip"))
        else:  # compare now (reading the state moves the fused residuals out)
            bad = _same_state(fb, ref, calls)
            assert_all(bad is None, f"step {step} after {taken}: {bad}")
    bad = _same_state(fb, ref, calls)
    assert_all(bad is None, f"after {taken}: {bad}")
    return taken


@pytest.mark.mpi
@pytest.mark.parametrize("op", ["2bit", "fp16"])
@pytest.mark.parametrize("chunked", [False, True])
def test_random_sequences_give_the_single_calls_bits(comm, op, chunked, monkeypatch):
    monkeypatch.setenv("MPIGC_CHUNK_BYTES", str(4 << 10) if chunked else "0")
    d = on_root(lambda: tempfile.mkdtemp(prefix="mpigc-fused-"), comm)
    path = os.path.join(d, "ckpt")
    seen = set()
    for seed in range(6):
        seen.update(_run(comm, op, 100 * seed + (7 if chunked else 0), 14, path))
    assert_all(seen == set(ACTIONS), f"not every action ran: {set(ACTIONS) - seen}")


@pytest.mark.mpi
def test_grouped_calls_keep_residuals_fused(comm, fb):
    """A repeated grouped call gathers and scatters no residual; the
    members' residuals are their own again once read, and a failed call
    leaves the fused ones as they were, bit for bit."""
    from mpigc import _timeline
    spans = []
    real = _timeline.span

    def span(name, t0, *a, **kw):
        spans.append(name)
        return real(name, t0, *a, **kw)

    xs = _grads(comm, KEYS, 0)
    mpigc.allreduce([x.copy() for x in xs], op="2bit", key=KEYS, feedback=fb)
    mpigc.timeline.start(os.path.join(on_root(lambda: tempfile.mkdtemp(), comm), "t.json"))
    try:
        _timeline.span = span
        for step in range(3):
            mpigc.allreduce(_grads(comm, KEYS, step), op="2bit", key=KEYS, feedback=fb)
        copies = [s for s in spans if s.startswith("group: residuals")]
        assert_all(copies == [], f"repeated grouped calls copied residuals: {copies}")
        before = fb.state_dict()  # moves them out
        assert_all([s for s in spans if s.startswith("group: residuals")]
                   == ["group: residuals out"], spans)
        bad = _grads(comm, KEYS, 9)
        if comm.rank == 0:
            bad[1][0] = np.inf
        mpigc.allreduce(_grads(comm, KEYS, 4), op="2bit", key=KEYS, feedback=fb)
        kept = fb.state_dict()
        mpigc.allreduce(_grads(comm, KEYS, 5), op="2bit", key=KEYS, feedback=fb)
        raises_everywhere(mpigc.NonFiniteError, lambda: mpigc.allreduce(
            bad, op="2bit", key=KEYS, feedback=fb))
    finally:
        _timeline.span = real
        mpigc.timeline.stop()
    after = fb.state_dict()
    ok = sorted(before) == sorted(after) == KEYS and all(
        after[k]["calls"] == kept[k]["calls"] + 1 for k in KEYS)
    ref = mpigc.ErrorFeedback()
    ref.load_state_dict(kept)
    mpigc.allreduce(_grads(comm, KEYS, 5), op="2bit", key=KEYS, feedback=ref)
    want = ref.state_dict()
    ok &= all(after[k][f] is not None and after[k][f].tobytes() == want[k][f].tobytes()
              for k in KEYS for f in ("worker", "owner") if want[k][f] is not None)
    assert_all(ok, "a failed grouped call changed the residuals")
