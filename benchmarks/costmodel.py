"""The cost model (mpigc.costmodel) against this machine, and at scale on paper.

    # 1. fit: measure the model's parameters (2 ranks; kernels, shared memory, MPI, one call)
    mpirun -n 2 python benchmarks/costmodel.py --fit fit.json
    # 2. measure the calls at 2, 3, 4 ranks (one mpirun each, rank 0 writes the file)
    mpirun -n 3 python benchmarks/costmodel.py --measure m3.json [--sizes 64K,1M,8M,32M]
    # 3. predicted against measured, with ratios
    python benchmarks/costmodel.py --predict fit.json m2.json m3.json m4.json
    # 4. at scale: tables (markdown) for 64-4096 ranks, 8 per node, 10/25/100 Gbit/s,
    #    and an SVG plot
    python benchmarks/costmodel.py --scale fit.json m2.json [--svg docs/images/costmodel-scale.svg]

What --fit measures (each the best of --reps, every rank at once, as in a call):
the compress and decode (decompress, accumulate) throughputs of 2bit and 1bit on
32 MiB; a ping-pong of 8 bytes (half the round trip: ``alpha_intra``); 64 small
Isend/Irecv pairs to the peer (per message: ``overhead``); a 32 MiB Sendrecv
(``beta_intra``); numpy's float32 add (``sum_rate``). ``cores_per_node`` is
``os.cpu_count()``. --predict and --scale complete the fit from the 2-rank
measurement file (``load``): ``beta_intra`` from MPI's 32 MiB Allreduce, each
compressor's rates scaled to its 32 MiB call, ``call_overhead`` from the 64 KiB
calls; --predict marks those points "fitted". --measure warms every op up (30
calls) before timing: a job's first calls are slow. It takes the best of --reps
and records the median.
This is a benchmark, not a test: it asserts nothing.
"""
import argparse
import json
import math
import os
import sys
import time
from dataclasses import replace

import numpy as np

from mpigc import costmodel as cm

OPS = ("none", "2bit", "1bit")


def parse_size(s):
    mult = {"K": 1 << 10, "M": 1 << 20}
    return int(float(s[:-1]) * mult[s[-1]]) if s[-1] in mult else int(s)


def fmt_size(b):
    return f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"


def _best(comm, fn, reps, both=False):
    """The best (and median) of reps, each the slowest rank's time, after a warm-up.

    The best, not the median, is what the model predicts: on a shared, loaded
    machine the median holds the time other processes took the cores."""
    from mpi4py import MPI
    fn()
    out = []
    for _ in range(reps):
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        out.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    return (min(out), float(np.median(out))) if both else min(out)


def network_from(fit, P=None, cores=None):
    """The fitted parameters as a Network of one node of P ranks (shared memory)."""
    rates = {op: cm.Rates(*fit["rates"][op]) for op in fit["rates"]}
    return cm.Network(alpha=fit["alpha_intra"], beta=fit["beta_intra"],
                      ranks_per_node=P or 1, alpha_intra=fit["alpha_intra"],
                      beta_intra=fit["beta_intra"], overhead=fit["overhead"],
                      call_overhead=fit["call_overhead"], sum_rate=fit["sum_rate"],
                      cores_per_node=cores or fit["cores"], rates=rates)


def fit(path, reps):
    import mpigc
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    if comm.size != 2:
        sys.exit("--fit runs at 2 ranks")
    peer = 1 - comm.rank
    n = (32 << 20) // 4
    x = np.random.default_rng(comm.rank).standard_normal(n).astype(np.float32)
    out = np.zeros_like(x)
    rates = {}
    for op in OPS[1:]:
        c = mpigc.get_compressor(op)
        res = np.zeros_like(x)
        payload = c.compress(x, res)
        tc = _best(comm, lambda: c.compress(x, res), reps)
        td = _best(comm, lambda: c.decompress(payload, n, out, accumulate=True), reps)
        rates[op] = (4 * n / tc, 4 * n / td)
    rates["none"] = (math.inf, math.inf)
    small = np.zeros(1, np.float64)

    def pingpong():
        for _ in range(50):
            if comm.rank == 0:
                comm.Send(small, 1)
                comm.Recv(small, 1)
            else:
                comm.Recv(small, 0)
                comm.Send(small, 0)
    alpha = _best(comm, pingpong, reps) / 100
    k = 64
    bufs = [np.zeros(1, np.float64) for _ in range(2 * k)]

    def many():
        reqs = [comm.Irecv(bufs[i], peer, tag=i) for i in range(k)]
        reqs += [comm.Isend(bufs[k + i], peer, tag=i) for i in range(k)]
        MPI.Request.Waitall(reqs)
    overhead = max(0.0, (_best(comm, many, reps) - alpha) / (2 * k))
    big, recv = x.copy(), np.empty_like(x)
    t = _best(comm, lambda: comm.Sendrecv(big, peer, recvbuf=recv, source=peer), reps)
    beta_intra = 4 * n / max(t - alpha, 1e-9)
    a, b = x.copy(), x.copy()
    sum_rate = 4 * n / _best(comm, lambda: np.add(a, b, out=a), reps)
    f = dict(alpha_intra=alpha, beta_intra=beta_intra, overhead=overhead, sum_rate=sum_rate,
             rates=rates, cores=os.cpu_count(), call_overhead=0.0)
    if comm.rank == 0:
        with open(path, "w") as fh:
            json.dump(f, fh, indent=1)
        print(json.dumps(f, indent=1))


def measure(path, sizes, reps):
    import mpigc
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rows = []
    fb = mpigc.ErrorFeedback()
    # the job's first calls are slow (at 2 ranks the first size's best of 15 took 5-30 ms
    # at 64 KiB, 0.1-0.4 ms measured after a 1 MiB size): warm every op up first
    w = np.zeros((64 << 10) // 4, np.float32)
    for op in OPS:
        for _ in range(30):
            mpigc.allreduce(w, op=op, key="warm" + op, feedback=fb)
    for nb in sizes:
        n = nb // 4
        x = np.random.default_rng(comm.rank).standard_normal(n).astype(np.float32)
        buf = np.empty_like(x)

        copy = _best(comm, lambda: np.copyto(buf, x), reps)
        for op in ("mpi",) + OPS:
            def call(op=op):
                buf[...] = x
                if op == "mpi":
                    comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
                else:
                    mpigc.allreduce(buf, op=op, key=f"m{nb}{op}", feedback=fb)
            best, med = _best(comm, call, reps, both=True)
            rows.append(dict(P=comm.size, bytes=nb, op=op, t=best - copy, median=med - copy))
        if comm.rank == 0:
            print(f"# {comm.size} ranks {fmt_size(nb)}: " + ", ".join(
                f"{r['op']} {r['t'] * 1e3:.2f} ms" for r in rows[-4:]), flush=True)
    if comm.rank == 0:
        with open(path, "w") as fh:
            json.dump(rows, fh, indent=1)


def predict_one(net, op, nb, P):
    if op == "mpi":
        return cm.mpi_allreduce(nb, P, net).total
    return cm.flat_allreduce(op, nb, P, net).total


FIT_BIG = 32 << 20  # the 2-rank calls of this size fit beta_intra and the kernel rates


def load(fitpath, paths):
    """The fit, completed from the 2-rank measurements (when a file has them):

    1. ``beta_intra`` from MPI's Allreduce of 32 MiB (the ring's bandwidth term:
       measured minus its other terms);
    2. per compressor, its compress and decode rates scaled by one factor so that
       the 32 MiB call's compute term is what was measured minus the rest (the
       kernels alone, timed by --fit through ``Compressor.compress``, ran slower
       than inside a call: 2bit's encode at 0.19 GB/s would take 176 ms of a
       32 MiB call measured at 78 ms);
    3. ``call_overhead`` from the 64 KiB calls (measured minus the model
       without it, the mean of none/2bit/1bit).
    """
    f = json.load(open(fitpath))
    rows = [r for p in paths for r in json.load(open(p))]
    at2 = {(r["bytes"], r["op"]): r["t"] for r in rows if r["P"] == 2}
    if (FIT_BIG, "mpi") in at2:
        net = network_from(f, 2)
        rest = cm.mpi_allreduce(FIT_BIG, 2, replace(net, beta_intra=math.inf)).total
        f["beta_intra"] = FIT_BIG / max(at2[FIT_BIG, "mpi"] - rest, 1e-9)  # 2 (P-1)/P = 1
    for op in OPS[1:]:
        if (FIT_BIG, op) in at2:
            net = network_from(f, 2)
            c = cm.flat_allreduce(op, FIT_BIG, 2, net)
            k = c.compute / max(at2[FIT_BIG, op] - (c.total - c.compute), 1e-9)
            f["rates"][op] = [k * v for v in f["rates"][op]]
    extra = [t - cm.flat_allreduce(op, nb, 2, network_from(f, 2)).total
             for (nb, op), t in at2.items() if nb == 64 << 10 and op != "mpi"]
    if extra:
        f["call_overhead"] = max(0.0, float(np.mean(extra)))
    return f, rows


def is_fitted(r):
    return r["P"] == 2 and ((r["bytes"] == 64 << 10 and r["op"] != "mpi")
                            or r["bytes"] == FIT_BIG)


def predict(fitpath, paths):
    f, rows = load(fitpath, paths)
    print(f"fitted (--fit, then the 2-rank calls of 64 KiB and 32 MiB): alpha_intra {f['alpha_intra'] * 1e6:.1f} us, overhead "
          f"{f['overhead'] * 1e6:.2f} us/message, beta_intra {f['beta_intra'] / 1e9:.2f} GB/s, "
          f"sum {f['sum_rate'] / 1e9:.2f} GB/s, call_overhead {f['call_overhead'] * 1e6:.0f} us, "
          f"cores {f['cores']}; compress/decode GB/s: " + ", ".join(
              f"{op} {c / 1e9:.2f}/{d / 1e9:.2f}" for op, (c, d) in f["rates"].items()
              if op != "none"))
    print()
    print("| ranks | size | op | measured ms (best) | median | predicted ms | predicted / best |")
    print("|---|---|---|---|---|---|---|")
    ratios = []
    if True:
        for r in rows:
            net = network_from(f, r["P"])
            pred = predict_one(net, r["op"], r["bytes"], r["P"])
            ratio = pred / r["t"] if r["t"] > 0 else math.inf
            fitted = is_fitted(r)
            if not fitted:
                ratios.append(ratio)
            print(f"| {r['P']} | {fmt_size(r['bytes'])} | {r['op']} | {r['t'] * 1e3:.2f} | "
                  f"{r['median'] * 1e3:.2f} | {pred * 1e3:.2f} | {ratio:.2f}{' (fitted)' if fitted else ''} |")
    if ratios:
        within = sum(0.75 <= q <= 1.25 for q in ratios)
        g = math.exp(np.mean(np.log(ratios)))
        print(f"\n{within} of {len(ratios)} predictions within 25% (fitted points excluded); "
              f"geometric mean of predicted/measured {g:.2f}")


LINKS = (10, 25, 100)
RANKS = (64, 256, 1024, 4096)
BUCKETS = (1 << 20, 4 << 20, 16 << 20, 32 << 20, 100 << 20)


SCALE = {}  # --scale's overrides: call_overhead, kernel_speedup, beta_intra
FULL = False


def scale_net(f, gbit, alpha):
    k = SCALE.get("kernel_speedup", 1.0)
    rates = {op: cm.Rates(k * f["rates"][op][0], k * f["rates"][op][1]) for op in f["rates"]}
    return cm.Network(alpha=alpha, beta=gbit * 1e9 / 8, ranks_per_node=8,
                      alpha_intra=f["alpha_intra"],
                      beta_intra=SCALE.get("beta_intra", f["beta_intra"]),
                      overhead=f["overhead"],
                      call_overhead=SCALE.get("call_overhead", f["call_overhead"]),
                      sum_rate=f["sum_rate"], cores_per_node=8, rates=rates)


CANDIDATES = (("MPI", lambda op, b, P, n: cm.mpi_allreduce(b, P, n)),
              ("flat 2bit", lambda op, b, P, n: cm.flat_allreduce("2bit", b, P, n)),
              ("hier 2bit", lambda op, b, P, n: cm.hierarchical_allreduce("2bit", b, P, n)),
              ("flat 1bit", lambda op, b, P, n: cm.flat_allreduce("1bit", b, P, n)),
              ("hier 1bit", lambda op, b, P, n: cm.hierarchical_allreduce("1bit", b, P, n)),
              ("2-D 2bit", lambda op, b, P, n: cm.grid_allreduce("2bit", b, P, n)))


def scale(paths, svg, alpha):
    f, _ = load(paths[0], paths[1:])
    net = scale_net(f, 25, alpha)
    print(f"# alpha {alpha * 1e6:g} us between nodes, 8 ranks per node, a core each; "
          f"overhead {net.overhead * 1e6:.2f} us/message, call_overhead "
          f"{net.call_overhead * 1e6:.0f} us, shared memory {net.beta_intra / 1e9:.2f} GB/s, "
          "kernels (compress/decode GB/s) " + ", ".join(
              f"{op} {r.compress / 1e9:.2f}/{r.decode / 1e9:.2f}"
              for op, r in net.rates.items() if op != "none")
          + "; times in ms")
    print("\n#### The fastest of MPI, flat/hierarchical 2bit/1bit and the 2-D exchange "
          "(its time / MPI's time, ms)\n")
    print("| link | ranks | " + " | ".join(fmt_size(b) for b in BUCKETS) + " |")
    print("|---|---|" + "---|" * len(BUCKETS))
    for gbit in LINKS:
        net = scale_net(f, gbit, alpha)
        for P in RANKS:
            cells = []
            for b in BUCKETS:
                ts = [(fn(None, b, P, net).total, name) for name, fn in CANDIDATES]
                t, name = min(ts)
                cells.append(f"{name} {t * 1e3:.1f} / {ts[0][0] * 1e3:.1f}")
            print(f"| {gbit} Gbit/s | {P} | " + " | ".join(cells) + " |")
    if FULL:
        for gbit in LINKS:
            net = scale_net(f, gbit, alpha)
            print(f"\n#### {gbit} Gbit/s per node, every candidate (ms)\n")
            print("| ranks | bucket | " + " | ".join(c for c, _ in CANDIDATES) + " |")
            print("|---|---|" + "---|" * len(CANDIDATES))
            for P in RANKS:
                for b in BUCKETS:
                    cells = " | ".join(f"{fn(None, b, P, net).total * 1e3:.1f}"
                                       for _, fn in CANDIDATES)
                    print(f"| {P} | {fmt_size(b)} | {cells} |")
    net = scale_net(f, 25, alpha)
    print("\n#### Share of the flat 2bit call spent on latency and per-message costs, "
          "25 Gbit/s\n")
    print("| ranks | " + " | ".join(fmt_size(b) for b in BUCKETS) + " |")
    print("|---|" + "---|" * len(BUCKETS))
    for P in RANKS:
        cells = []
        for b in BUCKETS:
            c = cm.flat_allreduce("2bit", b, P, net)
            cells.append(f"{(c.latency + c.messages) / c.total:.0%}")
        print(f"| {P} | " + " | ".join(cells) + " |")
    print("\n#### Flat 2bit at 25 Gbit/s: pipelined in 2 MiB chunks (the default) against "
          "one chunk (MPIGC_CHUNK_BYTES=0), ms\n")
    print("| ranks | " + " | ".join(fmt_size(b) for b in BUCKETS) + " |")
    print("|---|" + "---|" * len(BUCKETS))
    whole = replace(net, chunk_bytes=0)
    for P in RANKS:
        cells = [f"{cm.flat_allreduce('2bit', b, P, net).total * 1e3:.1f} / "
                 f"{cm.flat_allreduce('2bit', b, P, whole).total * 1e3:.1f}" for b in BUCKETS]
        print(f"| {P} | " + " | ".join(cells) + " |")
    if svg:
        write_svg(svg, f, alpha)


def write_svg(path, f, alpha):
    """log-log: time per call against ranks, 32 MiB, one panel per link speed."""
    W, H, pad = 300, 240, 45
    colors = ("#4e79a7", "#e15759", "#59a14f", "#f28e2b", "#76b7b2", "#b07aa1")
    Ps = [8 * 2 ** k for k in range(0, 10)]  # 8 .. 4096
    b = 32 << 20
    panels = []
    for gbit in LINKS:
        net = scale_net(f, gbit, alpha)
        panels.append([[fn(None, b, P, net).total for P in Ps] for _, fn in CANDIDATES])
    lo = min(min(min(s) for s in p) for p in panels)
    hi = max(max(max(s) for s in p) for p in panels)
    ylo, yhi = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{3 * W + 160}" height="{H + 40}" '
           'font-family="sans-serif" font-size="11">',
           f'<rect width="{3 * W + 160}" height="{H + 40}" fill="white"/>']
    for i, (gbit, series) in enumerate(zip(LINKS, panels)):
        x0 = i * W + pad

        def X(P):
            return x0 + (math.log2(P) - 3) / 9 * (W - pad - 10)

        def Y(t):
            return 20 + (yhi - math.log10(t)) / (yhi - ylo) * (H - 40)
        k = SCALE.get("kernel_speedup", 1.0)
        label = f"{gbit} Gbit/s, 32 MiB" + (f", kernels x{k:g}" if k != 1 else "")
        out.append(f'<text x="{x0 + 40}" y="14">{label}</text>')
        out.append(f'<rect x="{x0}" y="20" width="{W - pad - 10}" height="{H - 40}" '
                   'fill="none" stroke="#888"/>')
        for e in range(ylo, yhi + 1):
            out.append(f'<text x="{x0 - 40}" y="{Y(10 ** e) + 4:.1f}">{10 ** e * 1e3:g} ms</text>')
        for P in (8, 64, 512, 4096):
            out.append(f'<text x="{X(P) - 8:.1f}" y="{H - 6}">{P}</text>')
        for s, c in zip(series, colors):
            pts = " ".join(f"{X(P):.1f},{Y(t):.1f}" for P, t in zip(Ps, s))
            out.append(f'<polyline points="{pts}" fill="none" stroke="{c}" stroke-width="1.5"/>')
    out.append(f'<text x="{3 * W // 2}" y="{H + 30}">ranks (8 per node)</text>')
    for j, ((name, _), c) in enumerate(zip(CANDIDATES, colors)):
        out.append(f'<rect x="{3 * W + 10}" y="{30 + 16 * j}" width="12" height="3" fill="{c}"/>')
        out.append(f'<text x="{3 * W + 28}" y="{35 + 16 * j}">{name}</text>')
    out.append("</svg>")
    with open(path, "w") as fh:
        fh.write("\n".join(out) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--fit", metavar="OUT.json")
    g.add_argument("--measure", metavar="OUT.json")
    g.add_argument("--predict", nargs="+", metavar="FILE")
    g.add_argument("--scale", nargs="+", metavar="FILE")
    ap.add_argument("--sizes", default="64K,1M,8M,32M")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--svg")
    ap.add_argument("--alpha", type=float, default=5e-6,
                    help="--scale: latency of a message between nodes (s)")
    ap.add_argument("--call-overhead", type=float,
                    help="--scale: fixed cost of one mpigc call (s), instead of the fitted one")
    ap.add_argument("--beta-intra", type=float,
                    help="--scale: shared-memory bytes/s per rank, instead of the fitted one")
    ap.add_argument("--full", action="store_true", help="--scale: every candidate's time")
    ap.add_argument("--kernel-speedup", type=float, default=1.0,
                    help="--scale: multiply the fitted kernel throughputs (a faster CPU, a GPU)")
    a = ap.parse_args()
    if a.fit:
        fit(a.fit, a.reps)
    elif a.measure:
        measure(a.measure, [parse_size(s) for s in a.sizes.split(",")], a.reps)
    elif a.predict:
        predict(a.predict[0], a.predict[1:])
    else:
        global FULL
        FULL = a.full
        SCALE["kernel_speedup"] = a.kernel_speedup
        if a.beta_intra is not None:
            SCALE["beta_intra"] = a.beta_intra
        if a.call_overhead is not None:
            SCALE["call_overhead"] = a.call_overhead
        scale(a.scale, a.svg, a.alpha)


if __name__ == "__main__":
    main()
