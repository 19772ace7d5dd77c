"""The timeline (mpigc.timeline, $MPIGC_TRACE): every rank's calls, their
agreement and waits, and the work of their steps, in files that merge into
one Chrome trace whose spans match how the calls ran (Request.trace)."""
import json
import os
import tempfile

import numpy as np
import pytest

import mpigc
from conftest import assert_all, grads, on_root

# ranks: min_size=2; MPIGC_NODE_SPLIT=2: 3 has a rank alone on its node, 4 nodes of 2
pytestmark = [pytest.mark.mpi(min_size=2), pytest.mark.ranks(2, 3, 4)]


def _shared_dir(comm):
    d = on_root(lambda: tempfile.mkdtemp(prefix="mpigc-timeline-"), comm)
    return d


def _calls(comm, monkeypatch):
    """The calls recorded: name -> how it ran (its CallTrace)."""
    monkeypatch.setenv("MPIGC_CHUNK_BYTES", str(256 << 10))  # 1 MiB: 4 chunks
    g = grads(comm.rank, 1 << 18)
    ran = {}
    mpigc.allreduce(g.copy(), op="2bit", key="tl-2bit")
    ran["allreduce 2bit"] = mpigc.diagnostics.last_trace()
    mpigc.allreduce(np.ones(1024, np.float32), op="none")
    ran["allreduce none"] = mpigc.diagnostics.last_trace()
    req = mpigc.iallreduce(g.copy(), op="1bit", key="tl-1bit")
    req.wait()
    ran["allreduce 1bit"] = req.trace
    mpigc.reduce_scatter(g[:5000].copy(), op="terngrad", key="tl-tern")
    ran["reduce_scatter terngrad"] = mpigc.diagnostics.last_trace()
    bad = np.ones(100 + (comm.rank == 1), np.float32)  # a size mismatch: fails everywhere
    with pytest.raises(mpigc.MismatchError):
        mpigc.allreduce(bad, op="fp16", key="tl-bad")
    ran["allreduce fp16"] = mpigc.diagnostics.last_trace()
    return ran


def test_a_timeline_of_every_rank_merges_into_one(comm, monkeypatch):
    d = _shared_dir(comm)
    assert not mpigc.timeline.recording()
    mpigc.timeline.start(os.path.join(d, "t.json"))
    assert mpigc.timeline.recording()
    ran = _calls(comm, monkeypatch)
    path = mpigc.timeline.stop()
    assert_all(path == os.path.join(d, f"t.rank{comm.rank}.json") and os.path.exists(path))
    assert not mpigc.timeline.recording() and mpigc.timeline.stop() is None
    comm.Barrier()

    def merged():
        out = os.path.join(d, "merged.json")
        n = mpigc.timeline.merge([os.path.join(d, f"t.rank{r}.json")
                                  for r in range(comm.size)], out)
        with open(out) as f:
            return n, json.load(f)
    n, doc = on_root(merged, comm)
    events = [e for e in doc["traceEvents"] if e["ph"] != "M"]
    assert n == len(events)
    assert doc["otherData"]["ranks"] == list(range(comm.size))
    ts = [e["ts"] for e in events]
    assert ts == sorted(ts) and ts[0] == 0
    names = {e["args"]["name"] for e in doc["traceEvents"]
             if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {f"rank {r}" for r in range(comm.size)}

    me = [e for e in events if e["pid"] == comm.rank]
    # every async begin has its end: same id, same name, later
    opened = {}
    for e in sorted(me, key=lambda e: e["ts"]):
        if e["ph"] == "b":
            opened.setdefault((e["id"], e["name"]), []).append(e["ts"])
        elif e["ph"] == "e":
            assert opened[(e["id"], e["name"])].pop() <= e["ts"]
    assert all(not v for v in opened.values())
    calls = {e["name"]: e for e in me if e["ph"] == "b" and e["cat"] == "call"
             and "bytes" in e.get("args", {})}
    assert set(calls) == set(ran)
    ends = {(e["id"], e["name"]): e["ts"] for e in me if e["ph"] == "e"}
    for name, trace in ran.items():
        a = calls[name]["args"]
        assert (a["path"], a["inline"], a["chunks"], a["sum_pieces"]) == (
            trace.path, trace.inline, trace.chunks, trace.sum_pieces), name
        cid, t0 = calls[name]["id"], calls[name]["ts"]
        t1 = ends[(cid, name)]
        # the agreement and the waits, nested in the call's span
        inner = [e for e in me if e["ph"] == "b" and e["id"] == cid and e["name"] != name]
        assert "agreement" in {e["name"] for e in inner}, name
        for e in inner:
            assert t0 <= e["ts"] <= ends[(cid, e["name"])] <= t1, (name, e["name"])
    assert calls["allreduce 2bit"]["args"]["chunks"] == 4
    assert calls["allreduce 2bit"]["args"]["bytes"] == 1 << 20
    assert calls["allreduce 1bit"]["args"]["blocking"] is False
    assert calls["allreduce fp16"]["args"]["error"]
    assert all(calls[k]["args"]["error"] is None for k in calls if k != "allreduce fp16")
    work = {e["name"] for e in me if e["ph"] == "X"}
    assert {"compress", "decode", "compress (gather)", "decode (gather)"} <= work, work
    # op="none" summed by MPI, unless the values came with the rows (2 ranks)
    assert ("MPI sum" in work) == (ran["allreduce none"].sum_pieces > 0), work
    for e in me:
        if e["ph"] == "X":
            assert e["dur"] >= 0


def test_nothing_is_recorded_when_off(comm):
    assert not mpigc.timeline.recording()
    mpigc.allreduce(np.ones(1024, np.float32), op="2bit", key="tl-off")
    assert_all(mpigc.timeline.stop() is None)
    assert_all(mpigc.diagnostics.last_trace().path == "two-phase")
    comm.Barrier()


def test_a_call_pending_at_stop_is_whole_or_absent(comm):
    """A call still pending when the timeline stops is not in the file, or
    is whole (it ended first); the call goes on, and a new timeline holds
    only what follows its start."""
    d = _shared_dir(comm)
    mpigc.timeline.start(os.path.join(d, "p-{rank}.json"))
    req = mpigc.iallreduce(grads(comm.rank, 50000), op="2bit", key="tl-pending")
    path = mpigc.timeline.stop()
    assert_all(path == os.path.join(d, f"p-{comm.rank}.json"))
    mpigc.timeline.start(os.path.join(d, "q-{rank}.json"))
    req.wait()
    mpigc.allreduce(np.ones(1024, np.float32), op="none")
    path2 = mpigc.timeline.stop()
    for p, most in ((path, 1), (path2, 1)):
        with open(p) as f:
            ev = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "call"
                  and "bytes" in e.get("args", {})]
        assert_all(len(ev) <= most, f"{p}: {[e['name'] for e in ev]}")
    with open(path2) as f:
        names = [e["name"] for e in json.load(f)["traceEvents"] if e.get("cat") == "call"
                 and "bytes" in e.get("args", {})]
    # the pending call began before this timeline: its span is not in it
    assert_all(names == ["allreduce none"], str(names))
    comm.Barrier()


def test_hierarchical_calls_and_their_inter_node_calls(comm, monkeypatch):
    """Nodes of 2 ranks (MPIGC_NODE_SPLIT; one rank alone: the flat path): a
    hierarchical call's span holds its size and slices, its inter-node calls
    are calls of their own, and a call that fails (a size that differs) says
    so."""
    monkeypatch.setenv("MPIGC_NODE_SPLIT", "2")
    d = _shared_dir(comm)
    mpigc.timeline.start(os.path.join(d, "h.json"))
    g = grads(comm.rank, 20000)
    mpigc.allreduce(g.copy(), op="2bit", key="tl-h", hierarchy="node")
    hierarchical = mpigc.diagnostics.last_trace().path == "hierarchical"
    req = mpigc.iallreduce(g.copy(), op="1bit", key="tl-h1", hierarchy="node")
    req.wait()
    bad = np.ones(500 + (comm.rank == 0), np.float32)
    with pytest.raises(mpigc.MismatchError):
        mpigc.allreduce(bad, op="2bit", key="tl-hbad", hierarchy="node")
    path = mpigc.timeline.stop()
    with open(path) as f:
        ev = json.load(f)["traceEvents"]
    calls = [e for e in ev if e["ph"] == "b" and "bytes" in e.get("args", {})]
    hier = [e for e in calls if e["name"] == "allreduce (hierarchical)"]
    if hierarchical:
        assert_all(len(hier) == 3, str([e["name"] for e in calls]))
        assert_all([e["args"]["bytes"] for e in hier][:2] == [80000, 80000])
        assert_all(hier[2]["args"]["error"] is not None
                   and all(e["args"]["error"] is None for e in hier[:2]))
        # the inter-node calls: flat calls with slice keys
        assert_all(any("@hier" in str(e["args"]["key"]) for e in calls if e not in hier))
        work = {e["name"] for e in ev if e["ph"] == "X"}
        node_of_several = comm.rank < comm.size - comm.size % 2  # else alone on its node
        assert_all(not node_of_several
                   or {"node sum", "read node results", "store for node peers"} <= work,
                   str(work))
    else:
        assert_all(not hier and len(calls) == 3, str([e["name"] for e in calls]))
    comm.Barrier()
