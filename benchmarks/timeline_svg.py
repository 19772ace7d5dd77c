# usage: timeline_svg.py MERGED.json OUT.svg [--call K] [--title T] [--width PX]
# Draw a merged timeline (python -m mpigc.timeline) as an SVG picture, no dependencies: per
# rank, a lane per thread with the work done there (compress, decode, MPI sums, progress
# passes) and two lanes for the calls (the call's span; its agreement and its waits). --call K
# draws the K-th call of rank 0 (from 0) and what overlaps it; default: the whole timeline.
import argparse
import html
import json

from mpigc.timeline import spans as timeline_spans

COLORS = {"compress": "#4e79a7", "compress (gather)": "#76b7b2", "decode": "#e15759",
          "decode (gather)": "#ff9da7", "MPI sum": "#59a14f", "progress pass": "#bab0ac", "MPI test": "#f28e2b",
          "agreement": "#edc948", "call": "#b07aa1", "wait": "#d9d9d9"}


def color(name):
    if name.startswith("wait"):
        return COLORS["wait"]
    return COLORS.get(name, "#9c755f")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("merged")
    ap.add_argument("out")
    ap.add_argument("--call", type=int)
    ap.add_argument("--title", default="")
    ap.add_argument("--width", type=int, default=1200)
    a = ap.parse_args()
    doc = json.load(open(a.merged))
    evs = doc["traceEvents"]
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in evs
               if e["ph"] == "M" and e["name"] == "thread_name"}
    work = [e for e in evs if e["ph"] == "X"]
    spans = timeline_spans(evs)
    calls = [s for s in spans if "bytes" in s[5]]
    inner = [s for s in spans if "bytes" not in s[5]]
    if a.call is not None:
        mine = sorted((s for s in calls if s[0] == 0), key=lambda s: s[3])[a.call]
        lo, hi = mine[3], mine[4]
        hi = max([s[4] for s in calls if s[3] < hi and s[4] > lo] + [hi])
        lo = min([s[3] for s in calls if s[3] < hi and s[4] > lo] + [lo])
    else:
        lo = min(e["ts"] for e in evs if "ts" in e)
        hi = max([e["ts"] + e.get("dur", 0) for e in evs if "ts" in e])
    pad = (hi - lo) * 0.01
    lo, hi = lo - pad, hi + pad
    left, right, lane, gap = 150, 20, 16, 10
    W = a.width
    sx = (W - left - right) / (hi - lo)
    X = lambda t: left + (min(max(t, lo), hi) - lo) * sx  # noqa: E731
    ranks = sorted({e["pid"] for e in evs if e["ph"] != "M"})
    rows, y = [], 40
    for r in ranks:
        tids = sorted({e["tid"] for e in work if e["pid"] == r})
        lanes = [("thread", t, threads.get((r, t), f"thread {t}")) for t in tids]
        lanes += [("calls", None, "calls"), ("inner", None, "agreement, waits")]
        rows.append((r, y, lanes))
        y += len(lanes) * lane + gap + 14
    H = y + 50
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
           f'font-family="sans-serif" font-size="11">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{left}" y="20" font-size="13">{html.escape(a.title)}</text>']

    def rect(x0, x1, yy, h, fill, tip):
        w = max(x1 - x0, 0.6)
        out.append(f'<rect x="{x0:.1f}" y="{yy}" width="{w:.1f}" height="{h}" fill="{fill}">'
                   f'<title>{html.escape(tip)}</title></rect>')

    for r, y0, lanes in rows:
        out.append(f'<text x="4" y="{y0 + 11}" font-weight="bold">rank {r}</text>')
        for i, (kind, tid, label) in enumerate(lanes):
            yy = y0 + 14 + i * lane
            out.append(f'<text x="12" y="{yy + 11}" fill="#555">{html.escape(label)}</text>')
            out.append(f'<line x1="{left}" x2="{W - right}" y1="{yy + lane - 1}" '
                       f'y2="{yy + lane - 1}" stroke="#eee"/>')
            if kind == "thread":
                for e in work:
                    if e["pid"] == r and e["tid"] == tid and e["ts"] + e["dur"] > lo \
                            and e["ts"] < hi:
                        rect(X(e["ts"]), X(e["ts"] + e["dur"]), yy + 2, lane - 4,
                             color(e["name"]), f'{e["name"]} {e["dur"] / 1e3:.2f} ms')
            else:
                for s in (calls if kind == "calls" else inner):
                    if s[0] == r and s[4] > lo and s[3] < hi:
                        name = "call" if kind == "calls" else s[2]
                        rect(X(s[3]), X(s[4]), yy + 2, lane - 4, color(name),
                             f'{s[2]} {(s[4] - s[3]) / 1e3:.2f} ms')
    # time axis
    span_ms = (hi - lo) / 1e3
    step = next(s for s in (0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
                if span_ms / s <= 12)
    t = 0.0
    while t <= span_ms:
        x = left + t * 1e3 * sx
        out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="34" y2="{H - 40}" stroke="#f3f3f3"/>')
        out.append(f'<text x="{x:.1f}" y="{H - 26}" text-anchor="middle" fill="#555">'
                   f'{t:g} ms</text>')
        t += step
    lx = left
    for name in ("compress", "decode", "compress (gather)", "decode (gather)", "MPI test",
                 "MPI sum", "progress pass", "call", "agreement", "wait"):
        out.append(f'<rect x="{lx}" y="{H - 16}" width="10" height="10" fill="{color(name)}"/>'
                   f'<text x="{lx + 14}" y="{H - 7}">{name}</text>')
        lx += 14 + 7 * len(name) + 14
    out.append("</svg>")
    with open(a.out, "w") as f:
        f.write("\n".join(out))


if __name__ == "__main__":
    main()
