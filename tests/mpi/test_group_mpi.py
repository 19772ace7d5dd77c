"""Grouped calls (``allreduce([g1, g2, ...])``): one exchange for many
arrays, each keeping its own residual key.

Codecs that act element by element (none on 2 ranks, fp16, bf16, 2bit) give a
group exactly the bits of one single call per member, results and residuals,
since each member's residuals have the shapes of a single call's; the others
(1bit, terngrad) keep error feedback's invariant per member. Bad input on
any member of any rank fails the whole group on every rank with nothing
changed."""
import json
import os
import tempfile

import numpy as np
import pytest

import mpigc
from conftest import assert_all, grads, on_root, raises_everywhere

# ranks: MPIGC_NODE_SPLIT=2: 4 is 2 nodes of 2; 2 the pair path, 3 uneven shards
pytestmark = [pytest.mark.mpi(min_size=1), pytest.mark.ranks(1, 2, 3, 4)]

# sizes below and above the ranks (a member with no element on some rank),
# and one large enough to be pipelined with the chunk size set below
SIZES = [3, 1000, 1, 5000, 20000]


def _members(comm, step, sizes=SIZES, dtype=np.float32):
    return [grads(comm.rank, m, dtype, seed=100 * step + i) for i, m in enumerate(sizes)]


def _same_state(fb1, fb2, keys=None):
    s1, s2 = fb1.state_dict(), fb2.state_dict()
    if keys is not None:
        s1 = {k: s1[k] for k in keys}
        s2 = {k: s2[k] for k in keys}
    if sorted(s1) != sorted(s2):
        return False
    for k in s1:
        if s1[k]["calls"] != s2[k]["calls"] or s1[k]["config"] != s2[k]["config"]:
            return False
        for f in ("worker", "owner"):
            a, b = s1[k][f], s2[k][f]
            if (a is None) != (b is None) or (a is not None and a.tobytes() != b.tobytes()):
                return False
    return True


def _bits(arrays):
    return [a.tobytes() for a in arrays]


#: parameters that make an op element-wise (2bit's absolute mode: its relative
#: mode, the default, has blocks that a group's fused shards cut differently)
ELEMENTWISE = {"2bit": {"threshold": 0.5}}


@pytest.mark.mpi
@pytest.mark.parametrize("op", ["none", "fp16", "bf16", "2bit"])
@pytest.mark.parametrize("gather", ["compressed", "exact"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_group_allreduce_is_the_single_calls_bits(comm, op, gather, dtype, monkeypatch):
    if op == "none" and comm.size > 2:
        pytest.skip("MPI picks its sum's order by the message's size: a fused "
                    "buffer's bits may differ from the members' beyond 2 ranks")
    monkeypatch.setenv("MPIGC_CHUNK_BYTES", str(16 << 10))  # the group is pipelined
    fb1, fb2 = mpigc.ErrorFeedback(), mpigc.ErrorFeedback()
    kw = ELEMENTWISE.get(op, {})
    for step in range(3):
        xs = _members(comm, step, dtype=dtype)
        group = [x.copy() for x in xs]
        out = mpigc.allreduce(group, op=op, key="p", gather=gather, average=step == 1,
                              feedback=fb1, **kw)
        singles = [mpigc.allreduce(x.copy(), op=op, key=f"p/{i}", gather=gather,
                                   average=step == 1, feedback=fb2, **kw)
                   for i, x in enumerate(xs)]
        assert_all(isinstance(out, list) and all(a is b for a, b in zip(out, group)))
        assert_all(_bits(group) == _bits(singles), f"step {step}: results differ")
        assert_all(_same_state(fb1, fb2), f"step {step}: residuals differ")


@pytest.mark.mpi
@pytest.mark.parametrize("op", ["fp16", "2bit"])
def test_group_reduce_scatter_is_the_single_calls_bits(comm, op):
    fb1, fb2 = mpigc.ErrorFeedback(), mpigc.ErrorFeedback()
    for step in range(2):
        xs = _members(comm, step)
        shards = mpigc.reduce_scatter([x.copy() for x in xs], op=op, key=["a", "b", 7, "d", "e"],
                                      feedback=fb1, **ELEMENTWISE.get(op, {}))
        singles = [mpigc.reduce_scatter(x, op=op, key=k, feedback=fb2, **ELEMENTWISE.get(op, {}))
                   for x, k in zip(xs, ["a", "b", 7, "d", "e"])]
        assert_all([s.shape for s in shards] == [s.shape for s in singles])
        assert_all(_bits(shards) == _bits(singles), f"step {step}: shards differ")
        assert_all(_same_state(fb1, fb2))


@pytest.mark.mpi
@pytest.mark.parametrize("op", ["1bit", "terngrad"])
def test_group_keeps_error_feedback_per_member(comm, op, fb):
    """gather="exact": each member's result is the sum over ranks of what its
    residual let through, x + e_old - e_new (error feedback's invariant; 0
    for terngrad, which has no error feedback: then the call counts, which
    its random streams depend on, are checked); every rank gets the same
    bits."""
    for step in range(3):
        xs = _members(comm, step)
        state = fb.state_dict()
        olds = [state[f"w/{i}"]["worker"] if f"w/{i}" in state else None
                for i, x in enumerate(xs)]
        group = [x.copy() for x in xs]
        mpigc.allreduce(group, op=op, key="w", gather="exact", feedback=fb)
        state = fb.state_dict()
        ok = all(state[f"w/{i}"]["calls"] == step + 1 for i in range(len(xs)))
        for i, (x, g, e0) in enumerate(zip(xs, group, olds)):
            ok &= comm.allgather(g.tobytes()) == [g.tobytes()] * comm.size
            if op == "terngrad":
                ok &= state[f"w/{i}"]["worker"] is None
                continue
            e1 = state[f"w/{i}"]["worker"]
            ok &= e1.shape == x.shape
            e0 = np.zeros_like(x) if e0 is None else e0
            sent = comm.allreduce((x + e0 - e1).astype(np.float64))
            ok &= np.allclose(g, sent, rtol=1e-5, atol=1e-5)
        assert_all(ok, f"step {step}")


@pytest.mark.mpi
def test_group_and_single_calls_take_turns_on_keys(comm, monkeypatch):
    """A key's residuals go on from a single call to a group and back: the
    bits of single calls throughout."""
    monkeypatch.setenv("MPIGC_CHUNK_BYTES", "0")
    fb1, fb2 = mpigc.ErrorFeedback(), mpigc.ErrorFeedback()
    keys = ["x", "y", "z", "u", "v"]
    for step in range(4):
        xs = _members(comm, step)
        a = [x.copy() for x in xs]
        if step % 2:
            mpigc.allreduce(a, op="2bit", key=keys, feedback=fb1, threshold=0.5)
        else:
            for x, k in zip(a, keys):
                mpigc.allreduce(x, op="2bit", key=k, feedback=fb1, threshold=0.5)
        b = [mpigc.allreduce(x.copy(), op="2bit", key=k, feedback=fb2, threshold=0.5)
             for x, k in zip(xs, keys)]
        assert_all(_bits(a) == _bits(b) and _same_state(fb1, fb2), f"step {step}")


@pytest.mark.mpi
def test_nonblocking_groups(comm, fb):
    xs = [_members(comm, s) for s in range(3)]
    reqs = [mpigc.iallreduce([x.copy() for x in g], op="2bit", key=f"g{s}", feedback=fb,
                             threshold=0.5)
            for s, g in enumerate(xs)]
    rs = mpigc.ireduce_scatter(xs[0], op="fp16", key="rs", feedback=fb)
    outs = [r.wait() for r in reqs]
    shards = rs.wait()
    fb2 = mpigc.ErrorFeedback()
    for s, g in enumerate(xs):
        ref = [mpigc.allreduce(x.copy(), op="2bit", key=f"g{s}/{i}", feedback=fb2,
                               threshold=0.5)
               for i, x in enumerate(g)]
        assert_all(_bits(outs[s]) == _bits(ref))
    ref = [mpigc.reduce_scatter(x, op="fp16", key=f"rs/{i}", feedback=fb2)
           for i, x in enumerate(xs[0])]
    assert_all(_bits(shards) == _bits(ref))
    assert_all(_same_state(fb, fb2))


@pytest.mark.mpi
def test_default_keys_are_per_member(comm, fb):
    mpigc.allreduce([np.ones(4000, np.float32), np.ones(4000, np.float32)], op="2bit",
                    feedback=fb)
    assert_all(sorted(fb.keys()) == ["auto/group/0/4000/float32",
                                     "auto/group/1/4000/float32"], sorted(fb.keys()))


def _bad_member(case, comm):
    """The group of a rank whose input is bad (on the last rank only)."""
    g = [grads(comm.rank, m) for m in (1000, 2000, 300)]
    if comm.rank != comm.size - 1:
        return g, {}
    if case == "int_dtype":
        g[1] = np.arange(2000)
    elif case == "mixed_dtype":
        g[2] = g[2].astype(np.float64)
    elif case == "noncontiguous":
        g[1] = np.repeat(g[1], 2)[::2]
    elif case == "readonly":
        g[0].flags.writeable = False
    elif case == "empty_member":
        g[2] = np.zeros(0, np.float32)
    elif case == "empty_group":
        g = []
    elif case == "duplicate_keys":
        return g, {"key": ["a", "b", "a"]}
    elif case == "key_count":
        return g, {"key": ["a", "b"]}
    return g, {}


BAD = {"int_dtype": mpigc.DTypeError, "mixed_dtype": mpigc.DTypeError,
       "noncontiguous": mpigc.InvalidBufferError, "readonly": mpigc.InvalidBufferError,
       "empty_member": mpigc.InvalidBufferError, "empty_group": mpigc.InvalidBufferError,
       "duplicate_keys": mpigc.ConfigError, "key_count": mpigc.ConfigError}


@pytest.mark.mpi
@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_member_fails_the_group_everywhere(comm, fb, case):
    mpigc.allreduce([grads(comm.rank, m) for m in (1000, 2000, 300)], op="2bit",
                    key=["a", "b", "c"], feedback=fb)
    before = fb.state_dict()
    g, kw = _bad_member(case, comm)
    kw.setdefault("key", ["a", "b", "c"])
    g0 = _bits(g)
    err = raises_everywhere(mpigc.MpigcError,
                            lambda: mpigc.allreduce(g, op="2bit", feedback=fb, **kw))
    last = comm.size - 1
    assert_all(isinstance(err, BAD[case]) or comm.rank != last, f"{type(err)}: {err}")
    assert_all(f"rank {last}" in str(err), str(err))
    assert_all(_bits(g) == g0, "a member changed")
    after = fb.state_dict()
    assert_all(all(before[k]["worker"].tobytes() == after[k]["worker"].tobytes()
                   and before[k]["calls"] == after[k]["calls"] for k in before)
               and sorted(before) == sorted(after), "residuals changed")
    y = mpigc.allreduce([np.ones(8, np.float32)], op="none")[0]
    assert_all(np.all(y == comm.size))


@pytest.mark.mpi
@pytest.mark.parametrize("what", ["sizes", "order", "single", "keys"])
def test_groups_that_differ_between_ranks(comm, fb, what):
    if comm.size == 1:
        pytest.skip("needs two ranks to disagree")
    g = [grads(comm.rank, m) for m in (1000, 3000)]
    kw = {"key": "g"}
    if comm.rank == 1:
        if what == "sizes":
            g = [grads(1, m) for m in (1000, 3001)]
        elif what == "order":  # the same total, cut elsewhere
            g = [grads(1, m) for m in (3000, 1000)]
        elif what == "single":
            g = grads(1, 4000)
        elif what == "keys":
            kw["key"] = "h"
    raises_everywhere(mpigc.MismatchError, lambda: mpigc.allreduce(g, op="2bit",
                                                                   feedback=fb, **kw))
    assert_all(len(fb.keys()) == 0)


@pytest.mark.mpi
def test_group_nonfinite(comm, fb):
    mpigc.allreduce([grads(comm.rank, m) for m in (1000, 2000)], op="2bit", key="n",
                    feedback=fb)
    before = fb.state_dict()
    g = [grads(comm.rank, m, seed=5) for m in (1000, 2000)]
    if comm.rank == comm.size - 1:
        g[1][1500] = np.nan
    g0 = _bits(g)
    raises_everywhere(mpigc.NonFiniteError,
                      lambda: mpigc.allreduce(g, op="2bit", key="n", feedback=fb))
    assert_all(_bits(g) == g0 and _same_before(before, fb))
    out = mpigc.allreduce(g, op="2bit", key="n", feedback=fb, nonfinite="skip")
    assert_all(all(np.isnan(a).all() for a in out) and _same_before(before, fb)
               and fb.skipped_steps == 1)


def _same_before(before, fb):
    after = fb.state_dict()
    return sorted(before) == sorted(after) and all(
        before[k]["worker"].tobytes() == after[k]["worker"].tobytes() for k in before)


@pytest.mark.mpi
def test_key_of_a_member_in_use(comm, fb):
    x = grads(comm.rank, 5000)
    req = mpigc.iallreduce(x, op="2bit", key="busy", feedback=fb)
    g = [grads(comm.rank, 100), grads(comm.rank, 5000)]
    g0 = _bits(g)
    raises_everywhere(mpigc.StateError, lambda: mpigc.allreduce(
        g, op="2bit", key=["free", "busy"], feedback=fb), match="busy")
    req.wait()
    assert_all(_bits(g) == g0 and "free" not in fb)
    mpigc.allreduce(g, op="2bit", key=["free", "busy"], feedback=fb)  # both free now
    assert_all(fb.state_dict()["busy"]["calls"] == 2)


@pytest.mark.mpi
def test_group_with_hierarchy_node_fails_everywhere(comm, fb, monkeypatch):
    raises_everywhere(mpigc.ConfigError, lambda: mpigc.allreduce(
        [np.ones(1000, np.float32)], op="2bit", hierarchy="node", feedback=fb),
        match="flat")
    # "auto" reduces a group flat, also where it would take a single call
    # across (emulated) nodes
    monkeypatch.setenv("MPIGC_NODE_SPLIT", "2")
    g = [np.ones(1000, np.float32), np.ones(7, np.float32)]
    out = mpigc.allreduce(g, op="none", hierarchy="auto", feedback=fb)
    assert_all(out is g and all(np.all(a == comm.size) for a in g))


@pytest.mark.mpi
def test_grouped_reduce_scatter_rejects_recvcounts_and_out(comm, fb):
    raises_everywhere(mpigc.ConfigError, lambda: mpigc.reduce_scatter(
        [np.ones(100, np.float32)], op="2bit", recvcounts=[100] + [0] * (comm.size - 1),
        feedback=fb))
    raises_everywhere(mpigc.ConfigError, lambda: mpigc.reduce_scatter(
        [np.ones(100, np.float32)], op="2bit", out=np.empty(100, np.float32), feedback=fb))


@pytest.mark.mpi
def test_group_copies_in_the_timeline(comm, fb):
    d = on_root(lambda: tempfile.mkdtemp(prefix="mpigc-group-tl-"), comm)
    mpigc.allreduce([grads(comm.rank, m) for m in SIZES], op="2bit", key="tl", feedback=fb)
    mpigc.timeline.start(os.path.join(d, "t.json"))
    # the residuals stay fused between grouped calls on the same keys: they
    # are copied out when something else reads them (the state), and in by
    # the next grouped call
    fb.state_dict()
    mpigc.allreduce([grads(comm.rank, m) for m in SIZES], op="2bit", key="tl", feedback=fb)
    mpigc.allreduce([grads(comm.rank, m) for m in SIZES], op="2bit", key="tl", feedback=fb)
    with open(mpigc.timeline.stop()) as f:
        events = json.load(f)["traceEvents"]
    work = [e["name"] for e in events if e["ph"] == "X"]
    calls = [e for e in events if e["ph"] == "b" and e["cat"] == "call"
             and "members" in e.get("args", {})]
    assert_all({"group: members in", "group: results out"} <= set(work), sorted(work))
    assert_all(work.count("group: residuals out") == 1
               and work.count("group: residuals in") == 1, sorted(work))
    assert_all(len(calls) == 2 and calls[0]["args"]["members"] == len(SIZES)
               and calls[0]["args"]["bytes"] == 4 * sum(SIZES), calls)
