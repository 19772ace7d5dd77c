"""The timeline's files and their merge (mpigc.timeline), and $MPIGC_TRACE
in a job under mpirun. The spans themselves: tests/mpi/test_timeline_mpi.py."""
import json
import os
import subprocess
import sys

import pytest

from mpigc import _timeline, timeline
from test_internal_error import _command


def test_each_rank_has_its_file():
    assert _timeline.path_for_rank("out/trace.json", 3) == "out/trace.rank3.json"
    assert _timeline.path_for_rank("trace", 0) == "trace.rank0.json"
    assert _timeline.path_for_rank("t-{rank}.trace", 12) == "t-12.trace"


def _rank_file(path, rank, events):
    doc = {"traceEvents": [{"ph": "M", "name": "process_name", "pid": rank,
                            "args": {"name": f"rank {rank}"}}] + events,
           "otherData": {"mpigc_rank": rank, "host": "h"}}
    with open(path, "w") as f:
        json.dump(doc, f)


def test_merge_puts_every_rank_on_one_clock(tmp_path):
    a, b = tmp_path / "t.rank0.json", tmp_path / "t.rank1.json"
    _rank_file(a, 0, [{"ph": "X", "name": "compress", "ts": 1_000_050, "dur": 5, "pid": 0,
                       "tid": 1}])
    _rank_file(b, 1, [{"ph": "b", "name": "allreduce 2bit", "cat": "call", "id": 1,
                       "ts": 1_000_000, "pid": 1, "tid": 1},
                      {"ph": "e", "name": "allreduce 2bit", "cat": "call", "id": 1,
                       "ts": 1_000_100, "pid": 1, "tid": 1}])
    out = tmp_path / "m.json"
    assert timeline.merge([a, b], out) == 3
    doc = json.loads(out.read_text())
    ev = doc["traceEvents"]
    assert [e["ph"] for e in ev] == ["M", "M", "b", "X", "e"]
    assert [e["ts"] for e in ev if e["ph"] != "M"] == [0, 50, 100]
    assert doc["otherData"]["ranks"] == [0, 1]
    assert doc["otherData"]["start_us_since_epoch"] == 1_000_000


def test_merge_of_no_events_says_so(tmp_path):
    a = tmp_path / "t.rank0.json"
    _rank_file(a, 0, [])
    with pytest.raises(ValueError, match="no events"):
        timeline.merge([a], tmp_path / "m.json")


def test_the_command_merges(tmp_path):
    a = tmp_path / "t.rank0.json"
    _rank_file(a, 0, [{"ph": "X", "name": "decode", "ts": 7, "dur": 1, "pid": 0, "tid": 1}])
    r = subprocess.run([sys.executable, "-m", "mpigc.timeline", str(a), "-o",
                        str(tmp_path / "m.json")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "1 events from 1 file(s)" in r.stdout
    assert "RuntimeWarning" not in r.stderr  # no double import by runpy


JOB = """
import numpy as np, mpigc
from mpi4py import MPI
x = np.ones(20000, np.float32)
mpigc.allreduce(x, op="2bit", key="a")
mpigc.iallreduce(np.ones(100, np.float32), op="none").wait()
print("rank", MPI.COMM_WORLD.rank, "recording", mpigc.timeline.recording())
"""


def test_mpigc_trace_records_a_whole_job(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    trace = tmp_path / "trace.json"
    cmd, env = _command(2, None, {"MPIGC_TRACE": str(trace),
                                  "MPIGC_MIN_COMPRESS_BYTES": "0"}, script=str(script))
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert r.stdout.count("recording True") == 2
    files = sorted(str(p) for p in tmp_path.glob("trace.rank*.json"))
    assert [os.path.basename(f) for f in files] == ["trace.rank0.json", "trace.rank1.json"]
    for rank, f in enumerate(files):
        with open(f) as fh:
            doc = json.load(fh)
        assert doc["otherData"]["mpigc_rank"] == rank and doc["otherData"]["mpigc_size"] == 2
        calls = [e["name"] for e in doc["traceEvents"] if e["ph"] == "b"
                 and "bytes" in e.get("args", {})]
        assert calls == ["allreduce 2bit", "allreduce none"]
    assert timeline.merge(files, tmp_path / "m.json") > 4


def test_the_summary_says_where_the_time_went(tmp_path):
    a = tmp_path / "t.rank0.json"
    call = {"cat": "call", "id": 1, "pid": 0, "tid": 1}
    _rank_file(a, 0, [
        dict(call, ph="b", name="allreduce 2bit", ts=0, args={"bytes": 8}),
        dict(call, ph="b", name="agreement", ts=0),
        dict(call, ph="e", name="agreement", ts=1000),
        dict(call, ph="b", name="wait Any (phases)", ts=3000),
        dict(call, ph="e", name="wait Any (phases)", ts=5000),
        dict(call, ph="b", name="wait Any (phases)", ts=6000),
        dict(call, ph="e", name="wait Any (phases)", ts=6500),
        dict(call, ph="e", name="allreduce 2bit", ts=8000),
        {"ph": "X", "name": "compress", "ts": 1000, "dur": 1500, "pid": 0, "tid": 1},
        {"ph": "M", "name": "thread_name", "pid": 0, "tid": 1, "args": {"name": "Main"}}])
    text = timeline.summary(a)
    assert text.splitlines() == [
        "rank 0: 1 call(s) (allreduce 2bit), mean 8.00 ms",
        "  work per call (ms): Main: compress 1.50",
        "  waits per call (ms): wait Any (phases) 2.50, agreement 1.00"]
    r = subprocess.run([sys.executable, "-m", "mpigc.timeline", "--summary", str(a)],
                       capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == text, r.stderr


def test_events_beyond_the_cap_are_counted(tmp_path, monkeypatch):
    monkeypatch.setenv("MPIGC_TRACE_MAX_EVENTS", "3")
    timeline.start(tmp_path / "c.json")
    t0 = _timeline.now()
    for _ in range(5):
        _timeline.span("compress", t0)
    path = timeline.stop()
    with open(path) as f:
        doc = json.load(f)
    assert [e["name"] for e in doc["traceEvents"] if e["ph"] != "M"] == ["compress"] * 3
    assert doc["otherData"]["dropped_events"] == 2
