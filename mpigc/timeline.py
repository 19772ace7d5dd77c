"""A timeline of mpigc's calls: each rank's calls and steps as Chrome trace
events, for Perfetto (https://ui.perfetto.dev) or ``chrome://tracing``.

Record with ``MPIGC_TRACE=FILE`` in the environment (the whole run: each
rank writes its file at exit), or around a part of a program::

    mpigc.timeline.start("trace.json")
    ...                       # the steps to look at
    mpigc.timeline.stop()     # writes this rank's file, trace.rank<r>.json

then merge the ranks' files into one timeline::

    python -m mpigc.timeline trace.rank*.json -o trace.json
    python -m mpigc.timeline --summary trace.json     # where the time went, per rank

Rank r's file is ``FILE`` with ``{rank}`` replaced by r, or, without
``{rank}``, ``.rank<r>`` put before its extension. In the merged timeline
each rank is a process; its tracks are its threads (the caller's, the
progress thread, a reduction thread), with the work done there (compression,
decoding, MPI sums, progress-thread passes), and one track per call, from
its start to its end, with its agreement and its waits nested in it. See
``docs/user-guide.md`` (A timeline of the calls).

Recording costs a global read and a branch per hook when off; when on, a
tuple per event in memory until :func:`stop` writes them.
"""
import argparse
import json
import sys

from . import _timeline

__all__ = ["start", "stop", "recording", "merge", "spans", "summary", "main"]


def start(path):
    """Record this rank's calls from now on (dropping what was recorded
    before); :func:`stop` writes them to rank r's file of ``path``. Not
    collective: each rank records what it does."""
    _timeline.start(path)


def stop():
    """Stop recording and write this rank's file; returns its path, or None
    when nothing was being recorded. Calls still pending are not in it."""
    return _timeline.stop()


def recording():
    """Whether a timeline is being recorded."""
    return _timeline.ON


def merge(paths, out):
    """Merge the ranks' files ``paths`` into one timeline ``out``: every
    event of every rank, the times made relative to the earliest event (the
    clocks of ranks on one host agree; of several hosts, as their clocks
    do). Returns the number of events written."""
    events, meta, ranks, hosts = [], [], [], set()
    for p in paths:
        with open(p) as f:
            doc = json.load(f)
        other = doc.get("otherData", {})
        ranks.append(other.get("mpigc_rank"))
        hosts.add(other.get("host"))
        for ev in doc["traceEvents"]:
            (meta if ev.get("ph") == "M" else events).append(ev)
    if not events:
        raise ValueError(f"no events in {list(paths)}")
    t0 = min(ev["ts"] for ev in events)
    for ev in events:
        ev["ts"] -= t0
    events.sort(key=lambda ev: (ev["ts"], ev["pid"]))
    doc = {"traceEvents": meta + events, "displayTimeUnit": "ms",
           "otherData": {"ranks": sorted(r for r in ranks if r is not None),
                         "hosts": sorted(h for h in hosts if h),
                         "start_us_since_epoch": t0}}
    with open(out, "w") as f:
        json.dump(doc, f, separators=(",", ":"))
    return len(events)


def spans(events):
    """The calls' spans in trace events ``events`` (a timeline's
    ``traceEvents``): ``(rank, id, name, t0, t1, args)`` for each call and
    each of its agreements and waits, an end matched with the earliest open
    begin of the same rank, id and name."""
    opened, out = {}, []
    for ev in sorted((e for e in events if e.get("ph") in ("b", "e")),
                     key=lambda e: (e["ts"], e["ph"] == "b")):
        k = (ev["pid"], ev["id"], ev["name"])
        if ev["ph"] == "b":
            opened.setdefault(k, []).append(ev)
        elif opened.get(k):
            b = opened[k].pop(0)
            out.append((ev["pid"], ev["id"], ev["name"], b["ts"], ev["ts"], b.get("args", {})))
    return out


def summary(path):
    """Where the time of a timeline's calls went, per rank, as text: the
    calls (count, mean time), then, per call, the work on each thread and
    the waits (milliseconds per call)."""
    with open(path) as f:
        doc = json.load(f)
    evs = doc["traceEvents"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in evs
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    found = spans(evs)
    lines = []
    for r in sorted({e["pid"] for e in evs if e.get("ph") != "M"}):
        calls = [s for s in found if s[0] == r and "bytes" in s[5]]
        if not calls:
            continue
        n = len(calls)
        kinds = sorted({s[2] for s in calls})
        lines.append(f"rank {r}: {n} call(s) ({', '.join(kinds)}), mean "
                     f"{sum(s[4] - s[3] for s in calls) / n / 1e3:.2f} ms")
        work = {}
        for e in evs:
            if e.get("ph") == "X" and e["pid"] == r:
                k = f"{names.get((r, e['tid']), e['tid'])}: {e['name']}"
                work[k] = work.get(k, 0) + e["dur"]
        waits = {}
        for s in found:
            if s[0] == r and "bytes" not in s[5]:
                waits[s[2]] = waits.get(s[2], 0) + s[4] - s[3]
        for title, d in (("work", work), ("waits", waits)):
            if d:
                lines.append(f"  {title} per call (ms): " + ", ".join(
                    f"{k} {v / n / 1e3:.2f}" for k, v in sorted(d.items(), key=lambda kv: -kv[1])))
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m mpigc.timeline",
                                 description="Merge the ranks' timeline files "
                                             "(MPIGC_TRACE) into one.")
    ap.add_argument("files", nargs="+", help="the ranks' files (trace.rank*.json)")
    ap.add_argument("-o", "--out", help="the merged timeline")
    ap.add_argument("--summary", action="store_true",
                    help="print where the calls' time went, per rank (of the merged "
                         "timeline, or of the one file given)")
    a = ap.parse_args(argv)
    if a.out is None and not (a.summary and len(a.files) == 1):
        ap.error("expected -o OUT (or --summary of one merged file)")
    if a.out is not None:
        n = merge(a.files, a.out)
        print(f"{a.out}: {n} events from {len(a.files)} file(s)")
    if a.summary:
        print(summary(a.out or a.files[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
