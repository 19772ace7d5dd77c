"""The recorder behind ``$MPIGC_TRACE`` and :mod:`mpigc.timeline`: what each
rank's calls and steps did, and when, as Chrome trace events (the JSON that
Perfetto and ``chrome://tracing`` read).

Off unless started (:func:`start`, or ``$MPIGC_TRACE`` at import). The
engine's hooks read :data:`ON` first and do nothing more when it is False:
a global read and a branch per hook, a few per call. While on, each hook
appends one tuple to a list in memory; :func:`stop` writes them out.

Events:

- a call: an async span per call (``b``/``e``, id the call's number in this
  process) from its start to its end (calls that started before the
  recording did, or end after it stops, are left out), with its kind, op, bytes, key and how
  it ran (path, inline, chunks) in ``args``; its agreement (from the start to
  the verdict) and every wait of its steps (``wait <effect>``, the state the
  call was in) are nested in it;
- the work of a step on the thread that ran it (``X`` events): compression,
  decoding, a plain MPI sum, MPI's progress in a test of phase 1's receives
  (from 20 µs: over TCP, MPI moves the data inside such calls), a
  progress-thread pass (from 20 µs), a hierarchical call's steps inside
  its node (its values stored for its node peers, the node's sums, the
  results read back), a grouped call's copies, and a device call's staging
  through host memory without CUDA-aware MPI.

Times are microseconds since the Unix epoch, from this process's
``perf_counter`` anchored once to the wall clock, so the files of ranks on
one host line up exactly and those of several hosts as well as their clocks
agree.
"""
import atexit
import itertools
import json
import os
import socket
import threading
import time

from mpi4py import MPI

__all__ = ["ON", "start", "stop", "now", "span", "call_begin", "nested",
           "path_for_rank"]

ON = False  # read by every hook; set by start() and stop() only

_events = []  # (ph, name, cat, ts, dur, tid, id, args)
_ids = itertools.count(1)
_tids = itertools.count(1)  # (next() is atomic: two threads' first events get two ids)
_since = 0  # the first call id of this recording: earlier calls are left out
_threads = {}  # thread ident -> (small tid, name)
_path = None
_anchor = 0  # epoch microseconds minus perf_counter microseconds
_max_events = 500_000  # $MPIGC_TRACE_MAX_EVENTS, read by start()
_dropped = 0  # events beyond it: left out, and counted in the file


def now():
    """Microseconds since the epoch (see the module's docstring)."""
    return time.perf_counter_ns() // 1000 + _anchor


def _tid():
    ident = threading.get_ident()
    t = _threads.get(ident)
    if t is None:
        t = _threads[ident] = (next(_tids), threading.current_thread().name)
    return t[0]


def _add(ev):
    global _dropped
    if len(_events) < _max_events:
        _events.append(ev)
    else:
        _dropped += 1


def span(name, t0, cat="step", args=None, min_us=0):
    """A piece of work of this thread from ``t0`` (:func:`now`) until now
    (left out when shorter than ``min_us``)."""
    d = now() - t0
    if d >= min_us:
        _add(("X", name, cat, t0, d, _tid(), None, args))


def call_begin():
    """A call starts: its span's id and start time."""
    return next(_ids), now()


def nested(cid, name, t0, args=None):
    """A span of call ``cid`` (from :func:`call_begin`) from ``t0`` until
    now: the call's own once it is over, or its agreement, a wait (none for
    a call that started before this recording)."""
    if cid < _since:
        return
    tid = _tid()
    _add(("b", name, "call", t0, 0, tid, cid, args))
    _add(("e", name, "call", now(), 0, tid, cid, None))


def path_for_rank(path, rank):
    """Rank ``rank``'s file for ``path``: ``{rank}`` in it replaced, else
    ``.rank<r>`` put before its extension (``trace.json`` ->
    ``trace.rank0.json``)."""
    if "{rank}" in path:
        return path.replace("{rank}", str(rank))
    root, ext = os.path.splitext(path)
    return f"{root}.rank{rank}{ext or '.json'}"


def _world():
    if MPI.Is_initialized() and not MPI.Is_finalized():
        return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    for var in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID"):
        if var in os.environ:
            return int(os.environ[var]), None
    return 0, None


def start(path):
    """Record from now on; :func:`stop` writes rank r's events to
    :func:`path_for_rank` of ``path``. Restarting drops what was recorded.
    At most ``$MPIGC_TRACE_MAX_EVENTS`` events (default 500,000, about a
    hundred MB) are kept; later ones are counted only."""
    global ON, _path, _anchor, _dropped, _since, _max_events
    try:
        _max_events = max(0, int(os.environ.get("MPIGC_TRACE_MAX_EVENTS", "500000")))
    except ValueError:
        _max_events = 500_000
    _since = next(_ids)
    _anchor = time.time_ns() // 1000 - time.perf_counter_ns() // 1000
    _events.clear()
    _dropped = 0
    _path = os.fspath(path)
    ON = True


def stop():
    """Stop recording and write this rank's file; returns its path (None
    when nothing was started)."""
    global ON, _path
    if _path is None:
        return None
    ON = False
    rank, size = _world()
    out = path_for_rank(_path, rank)
    _path = None
    events = [{"ph": "M", "name": "process_name", "pid": rank,
               "args": {"name": f"rank {rank}"}},
              {"ph": "M", "name": "process_sort_index", "pid": rank,
               "args": {"sort_index": rank}}]
    for ident, (tid, name) in _threads.items():
        events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid,
                       "args": {"name": name}})
    for ph, name, cat, ts, dur, tid, cid, args in _events:
        ev = {"ph": ph, "name": name, "cat": cat, "ts": ts, "pid": rank, "tid": tid}
        if ph == "X":
            ev["dur"] = dur
        else:
            ev["id"] = cid
        if args:
            ev["args"] = args
        events.append(ev)
    _events.clear()
    doc = {"traceEvents": events, "displayTimeUnit": "ms",
           "otherData": {"mpigc_rank": rank, "mpigc_size": size,
                         "host": socket.gethostname(), "clock": "unix epoch, microseconds",
                         "dropped_events": _dropped}}
    d = os.path.dirname(out)
    if d:
        os.makedirs(d, exist_ok=True)
    with open(out, "w") as f:
        json.dump(doc, f, separators=(",", ":"))
    return out


def _from_environment():
    path = os.environ.get("MPIGC_TRACE", "").strip()
    if path:
        start(path)
        atexit.register(stop)  # after mpi4py's own handler: runs before MPI finalizes


_from_environment()
