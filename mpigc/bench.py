"""``mpigc-bench``: an OSU / nccl-tests style sweep of mpigc's collectives.

Run it under MPI (``python -m mpigc.bench`` works too)::

    mpirun -n 4 mpigc-bench                                   # 4 KiB .. 256 MiB, all ops
    mpirun -n 4 mpigc-bench --sizes 4K,1M,32M,64M --ops none,2bit,1bit \\
        --json out.json --plot out.png

For every collective, size and op it reduces the same per-rank buffer
(float32 normal noise, seeded by rank) ``--iters`` times and prints one table
per op:

``size``, ``count``
    the logical (uncompressed) message size and element count.
``med/min/max us``
    over the timed iterations; one iteration's time is the slowest rank's
    (every iteration starts after a barrier).
``algbw``, ``busbw`` (GB/s)
    ``size / median time``; busbw = algbw x 2(N-1)/N for allreduce and
    x (N-1)/N for reduce-scatter (nccl-tests' convention), both from the
    logical size, so a compressed op can exceed the link rate.
``wire B/rank``
    payload bytes one rank handed to MPI per call (``mpigc.traffic()``).
``ratio``
    wire bytes of ``none`` / wire bytes of the op.
``max rel err``
    ``||result - exact|| / ||exact||`` (L2) of one call with fresh residuals
    against the float64 sum of the inputs, worst rank. Error feedback makes
    the error of a *sum over steps* small, not the error of one call.
``speedup``
    median time of ``none`` / median time of the op, same size, same run.

``--model`` prints the cost model that ``op="auto"`` fits while a job runs
(``docs/user-guide.md``, "op='auto'"), fitted here from ``op="auto"`` calls
pinned to each op in turn (allreduce, ``--sizes``, default 64K,1M,8M,32M,
``--iters`` calls per size and op, default 6; ``--ops``, default 2bit): per
op the latency and bandwidth of ``T = latency + bytes / bandwidth``, agreed
over every rank; each compressor's encode and decode throughput on this
rank (its kernels on an 8 MiB float32 array, best of 3); and the crossover
size above which the compressor is predicted faster than ``none``.

``--latency`` is the OSU-style small-message mode: 4 B .. 1 MiB (x4), every
op and ``mpi`` in the same run, allreduce only, 200 timed iterations per
point (at least 50), and two more columns:

``vs mpi``
    median time of the op / median time of ``mpi`` (bare ``comm.Allreduce``),
    same size, same run: what mpigc costs on top of MPI.
``wire %``
    with ``--link-gbps R`` (a shaped fabric, e.g. ``benchmarks/fabric.sh``):
    the time the op's wire bytes take at R Gbit/s / the median time, i.e. the
    fraction of the wire ideal reached (100% = the link is busy the whole
    call). Without it: the speedup over ``mpi`` / the ratio of ``mpi``'s wire
    bytes to the op's (the speedup a link-bound call would get).

Besides mpigc's ops, ``mpi`` is the bare ``comm.Allreduce`` /
``comm.Reduce_scatter`` (no agreement step), to show what ``none`` costs on top
of MPI. ``--json`` writes every row, ``--plot`` a PNG (needs matplotlib:
``pip install 'mpigc[bench]'``).
"""
import argparse
import json
import os
import platform
import re
import sys
import time

import numpy as np
from mpi4py import MPI

import mpigc

__all__ = ["main", "run", "parse_size", "format_size", "wire_fraction"]

DEFAULT_OPS = ("mpi", "none", "fp16", "2bit", "1bit", "terngrad")
COLLECTIVES = ("allreduce", "reduce_scatter")
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20,
          "MB": 1 << 20, "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def parse_size(text):
    """``"4K"`` -> 4096, ``"256MiB"`` -> 268435456 (binary units)."""
    m = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected a size such as 4K, 1M or 256MiB, "
                                         f"got {text!r}")
    return int(m.group(1)) * _UNITS[m.group(2).upper()]


def _size_list(text):
    """``--sizes``: ``"4K,1M,32M"`` -> [4096, 1048576, 33554432] (sorted, unique)."""
    sizes = sorted({parse_size(s) for s in str(text).split(",") if s.strip()})
    if not sizes or sizes[0] == 0:
        raise argparse.ArgumentTypeError(f"expected sizes above 0 such as 4K,1M,32M, "
                                         f"got {text!r}")
    return sizes


def _op_list(text):
    """``--ops``: a comma-separated list of ``mpi`` and mpigc's compressor ids."""
    known = ["mpi"] + mpigc.available_compressors()
    ops = [o.strip().lower() for o in str(text).split(",") if o.strip()]
    bad = [o for o in ops if o not in known]
    if not ops or bad:
        raise argparse.ArgumentTypeError(f"expected some of {', '.join(known)}, got "
                                         f"{', '.join(bad) if bad else repr(text)}")
    return list(dict.fromkeys(ops))


def _collective_list(text):
    colls = [c.strip() for c in str(text).split(",") if c.strip()]
    bad = [c for c in colls if c not in COLLECTIVES]
    if not colls or bad:
        raise argparse.ArgumentTypeError(f"expected some of {', '.join(COLLECTIVES)}, got "
                                         f"{', '.join(bad) if bad else repr(text)}")
    return list(dict.fromkeys(colls))


def format_size(nbytes):
    for unit, k in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= k and nbytes % k == 0:
            return f"{nbytes // k}{unit}"
    return f"{nbytes}B"


def _sizes(args):
    if args.sizes:
        return _size_list(args.sizes) if isinstance(args.sizes, str) else list(args.sizes)
    out, s = [], args.min_size
    while s <= args.max_size:
        out.append(s)
        s *= args.factor
    return out


class _Progress:
    """A one-line progress bar on rank 0's stderr (``\\r`` updates)."""

    def __init__(self, total, enabled):
        self.total, self.done, self.enabled = total, 0, enabled
        self.t0 = time.perf_counter()

    def step(self, label):
        self.done += 1
        if not self.enabled:
            return
        frac = self.done / max(1, self.total)
        width = 30
        bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
        el = time.perf_counter() - self.t0
        eta = el / frac - el if frac > 0 else 0.0
        sys.stderr.write(f"\r[{bar}] {self.done}/{self.total} {label:<28} "
                         f"{el:6.0f}s elapsed, ~{eta:4.0f}s left")
        sys.stderr.flush()

    def close(self):
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


def _call(collective, op, src, work, comm, fb, params):
    """One timed call; returns the result array (buffer or shard)."""
    work[...] = src
    comm.Barrier()
    t0 = time.perf_counter()
    if op == "mpi":
        if collective == "allreduce":
            comm.Allreduce(MPI.IN_PLACE, work, op=MPI.SUM)
            res = work
        else:
            counts = [hi - lo for lo, hi in mpigc.shard_bounds(work.size, comm.size)]
            res = np.empty(counts[comm.rank], work.dtype)
            comm.Reduce_scatter(work, res, counts, op=MPI.SUM)
    elif collective == "allreduce":
        res = mpigc.allreduce(work, op=op, comm=comm, key="bench", feedback=fb, **params)
    else:
        res = mpigc.reduce_scatter(work, op=op, comm=comm, key="bench", feedback=fb,
                                   **params)
    return time.perf_counter() - t0, res


def _params(op, args):
    if op == "2bit" and getattr(args, "rel_threshold", None) is not None:
        return {"rel_threshold": args.rel_threshold}
    if op == "2bit" and args.threshold is not None:
        return {"threshold": args.threshold}
    if op == "1bit" and args.block_size is not None:
        return {"block_size": args.block_size}
    return {}


def _exact(collective, src, comm):
    tot = np.empty(src.size, np.float64)
    comm.Allreduce(src.astype(np.float64), tot, op=MPI.SUM)
    if collective == "reduce_scatter":
        lo, hi = mpigc.shard_bounds(src.size, comm.size)[comm.rank]
        tot = tot[lo:hi]
    return tot


def _bench_one(collective, op, src, work, exact, comm, args):
    """Warm up, measure the error of the first call, then time ``--iters`` calls."""
    fb = mpigc.ErrorFeedback()
    params = _params(op, args)
    mpigc.reset_traffic()
    t_first, res = _call(collective, op, src, work, comm, fb, params)
    tr = mpigc.traffic()
    if op == "mpi":
        N = comm.size
        factor = 2 * (N - 1) / N if collective == "allreduce" else (N - 1) / N
        wire = int(round(factor * src.nbytes))
    else:
        wire = tr["bytes_sent"] // max(1, tr["calls"])
    err = float(np.linalg.norm(res.astype(np.float64) - exact)
                / max(np.linalg.norm(exact), 1e-300))
    err = comm.allreduce(err, op=MPI.MAX)
    for _ in range(args.warmup - 1):
        _call(collective, op, src, work, comm, fb, params)
    # as many iterations as fit in --time-per-point, within [--min-iters, --iters]
    t_first = comm.allreduce(t_first, op=MPI.MAX)
    iters = args.iters
    if args.time_per_point > 0:
        iters = int(min(args.iters, max(args.min_iters, args.time_per_point / max(t_first,
                                                                                   1e-9))))
    times = np.empty(iters)
    for i in range(iters):
        times[i], _ = _call(collective, op, src, work, comm, fb, params)
    tmax = np.empty_like(times)
    comm.Allreduce(times, tmax, op=MPI.MAX)
    return {"wire_bytes": wire, "max_rel_err": err, "iters": iters,
            "median_s": float(np.median(tmax)), "min_s": float(tmax.min()),
            "max_s": float(tmax.max()), "times_s": tmax.tolist()}


def run(args, comm=None):
    """Run the sweep described by ``args`` (from :func:`build_parser`);
    return the rows (every rank gets the same list)."""
    comm = MPI.COMM_WORLD if comm is None else comm
    N, rank = comm.size, comm.rank
    ops = _op_list(args.ops) if isinstance(args.ops, str) else list(args.ops)
    if "none" not in ops:
        ops.insert(0, "none")  # the reference of the speedup column
    colls = (_collective_list(args.collectives) if isinstance(args.collectives, str)
             else list(args.collectives))
    sizes = _sizes(args)
    dtype = np.dtype(args.dtype)
    progress = args.progress
    if progress is None:  # default: only where someone watches (not in a Slurm log)
        progress = sys.stderr.isatty()
    prog = _Progress(len(sizes) * len(ops) * len(colls), rank == 0 and progress)
    rows = []
    for nbytes in sizes:
        n = max(1, nbytes // dtype.itemsize)
        rng = np.random.default_rng(1000 + rank)
        src = (args.scale * rng.standard_normal(n)).astype(dtype)
        work = np.empty_like(src)
        for coll in colls:
            exact = _exact(coll, src, comm)
            for op in ops:
                r = _bench_one(coll, op, src, work, exact, comm, args)
                factor = 2 * (N - 1) / N if coll == "allreduce" else (N - 1) / N
                algbw = n * dtype.itemsize / r["median_s"] / 1e9
                rows.append({"collective": coll, "op": op, "ranks": N,
                             "size_bytes": n * dtype.itemsize, "count": n,
                             "dtype": dtype.name, **r, "algbw_GBps": algbw,
                             "busbw_GBps": algbw * factor})
                prog.step(f"{coll} {format_size(nbytes)} {op}")
            del exact
        del src, work
    prog.close()
    # speedup and compression ratio against `none` of the same size and collective
    ref = {(r["collective"], r["size_bytes"]): r for r in rows if r["op"] == "none"}
    mpi = {(r["collective"], r["size_bytes"]): r for r in rows if r["op"] == "mpi"}
    link = getattr(args, "link_gbps", None)
    for r in rows:
        b = ref[(r["collective"], r["size_bytes"])]
        r["speedup_vs_none"] = b["median_s"] / r["median_s"]
        # one rank sends nothing: call that a ratio of 1
        r["compression_ratio"] = (b["wire_bytes"] / r["wire_bytes"] if r["wire_bytes"]
                                  else 1.0)
        m = mpi.get((r["collective"], r["size_bytes"]))
        if m is not None:
            r["time_vs_mpi"] = r["median_s"] / m["median_s"]
        r["wire_fraction"] = wire_fraction(r, m, link)
    return rows


def wire_fraction(row, mpi_row, link_gbps=None):
    """The fraction of the wire ideal that ``row`` reached: with a link rate,
    (wire bytes at ``link_gbps``) / median time; without, the speedup over
    ``mpi_row`` / the ratio of its wire bytes to ``row``'s. None when neither
    applies."""
    if link_gbps:
        return row["wire_bytes"] * 8 / (link_gbps * 1e9) / row["median_s"]
    if mpi_row is None or not row["wire_bytes"]:
        return None
    ideal = mpi_row["wire_bytes"] / row["wire_bytes"]
    return mpi_row["median_s"] / row["median_s"] / ideal


def format_tables(rows, nranks):
    """The text tables, one per collective and op."""
    lines = []
    keys = []
    for r in rows:
        k = (r["collective"], r["op"])
        if k not in keys:
            keys.append(k)
    keys.sort(key=lambda k: COLLECTIVES.index(k[0]))
    for coll, op in keys:
        sub = [r for r in rows if r["collective"] == coll and r["op"] == op]
        its = sorted({r["iters"] for r in sub})
        its = f"{its[0]}" if len(its) == 1 else f"{its[0]}-{its[-1]}"
        lines.append(f"# {coll}, op={op}, {nranks} ranks, {sub[0]['dtype']}, "
                     f"time = slowest rank, {its} timed iterations per size")
        extra = any("time_vs_mpi" in r for r in sub)
        lines.append(f"#{'size':>9} {'count':>10} {'med us':>11} {'min us':>11} "
                     f"{'max us':>11} {'algbw':>8} {'busbw':>8} {'wire B/rank':>12} "
                     f"{'ratio':>7} {'max rel err':>11} {'speedup':>8}"
                     + (f" {'vs mpi':>8} {'wire %':>7}" if extra else ""))
        for r in sub:
            wf = r.get("wire_fraction")
            lines.append(
                f"{format_size(r['size_bytes']):>10} {r['count']:>10} "
                f"{r['median_s'] * 1e6:11.1f} {r['min_s'] * 1e6:11.1f} "
                f"{r['max_s'] * 1e6:11.1f} {r['algbw_GBps']:8.3f} {r['busbw_GBps']:8.3f} "
                f"{r['wire_bytes']:12d} {r['compression_ratio']:6.1f}x "
                f"{r['max_rel_err']:11.2e} {r['speedup_vs_none']:7.2f}x"
                + (f" {r['time_vs_mpi']:7.2f}x "
                   + (f"{100 * wf:6.1f}%" if wf is not None else f"{'-':>7}")
                   if extra else ""))
        lines.append("")
    # summary: speedup against none, sizes x ops
    for coll in dict.fromkeys(r["collective"] for r in rows):
        sub = [r for r in rows if r["collective"] == coll]
        ops = list(dict.fromkeys(r["op"] for r in sub))
        lines.append(f"# {coll}: speedup against none (median time of none / of op)")
        lines.append(f"#{'size':>9} " + " ".join(f"{o:>9}" for o in ops))
        for s in dict.fromkeys(r["size_bytes"] for r in sub):
            by = {r["op"]: r for r in sub if r["size_bytes"] == s}
            lines.append(f"{format_size(s):>10} " + " ".join(
                f"{by[o]['speedup_vs_none']:8.2f}x" if o in by else f"{'':>9}" for o in ops))
        lines.append("")
    return "\n".join(lines)


def plot(rows, path, title=""):
    """Time and speedup against size, one line per op (a PNG)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit("mpigc-bench --plot needs matplotlib: pip install 'mpigc[bench]' "
                         f"({exc})") from exc
    colls = list(dict.fromkeys(r["collective"] for r in rows))
    fig, axes = plt.subplots(len(colls), 2, figsize=(11, 4 * len(colls)), squeeze=False)
    for i, coll in enumerate(colls):
        sub = [r for r in rows if r["collective"] == coll]
        for op in dict.fromkeys(r["op"] for r in sub):
            rs = [r for r in sub if r["op"] == op]
            x = [r["size_bytes"] for r in rs]
            style = dict(marker="o", ms=3, label=op,
                         ls="--" if op in ("mpi", "none") else "-")
            axes[i, 0].plot(x, [r["median_s"] * 1e3 for r in rs], **style)
            axes[i, 1].plot(x, [r["speedup_vs_none"] for r in rs], **style)
        for ax in axes[i]:
            ax.set_xscale("log", base=2)
            ax.set_xlabel("message size (bytes, uncompressed)")
            ax.grid(True, which="both", alpha=0.3)
        axes[i, 0].set_yscale("log")
        axes[i, 0].set_ylabel("median time (ms)")
        axes[i, 0].set_title(f"{coll}: time")
        axes[i, 1].set_yscale("log")
        axes[i, 1].set_ylabel("speedup against none (x, log)")
        axes[i, 1].set_title(f"{coll}: speedup against none")
        axes[i, 1].axhline(1.0, color="gray", lw=0.8)
        axes[i, 0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def machine_info(comm):
    """What the run was on (for the JSON file)."""
    info = {"hostname": platform.node(), "platform": platform.platform(),
            "python": platform.python_version(), "cpus": os.cpu_count(),
            "mpi": MPI.Get_library_version().strip().splitlines()[0].split(",")[0],
            "mpigc": mpigc.__version__, "numpy": np.__version__,
            "ranks": comm.size,
            "fabric": os.environ.get("MPIGC_FABRIC", "none (plain machine)"),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next((ln.split(":", 1)[1].strip() for ln in f
                                if ln.startswith("model name")), "")
    except OSError:
        pass
    return info


def build_parser():
    p = argparse.ArgumentParser(
        prog="mpigc-bench",
        description="Sweep mpigc's compressed collectives over message sizes (run under "
                    "mpirun).",
        epilog="Sizes take K/M/G suffixes (binary). Example: mpirun -n 4 mpigc-bench "
               "--sizes 4K,1M,32M --ops none,2bit,1bit --json out.json --plot out.png")
    p.add_argument("--ops", type=_op_list, default=list(DEFAULT_OPS),
                   help="comma-separated: mpi (bare MPI), none, fp16, bf16, 2bit, 1bit, "
                        "terngrad, any registered id (default: all but bf16; none is "
                        "always added as the reference)")
    p.add_argument("--collectives", type=_collective_list, default=list(COLLECTIVES),
                   help="allreduce and/or reduce_scatter (default: both)")
    p.add_argument("--min-size", type=parse_size, default=4 << 10, help="default 4K")
    p.add_argument("--max-size", type=parse_size, default=256 << 20, help="default 256M")
    p.add_argument("--factor", type=int, default=4, help="size step (default x4)")
    p.add_argument("--sizes", type=_size_list,
                   help="explicit list, e.g. 4K,1M,32M (overrides min/max)")
    p.add_argument("--iters", type=int, default=20, help="timed iterations at most")
    p.add_argument("--min-iters", type=int, default=5, help="timed iterations at least")
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed calls first (the first one measures the error)")
    p.add_argument("--time-per-point", type=float, default=2.0,
                   help="seconds to aim at per size and op (cuts --iters down to "
                        "--min-iters for slow points; 0: always --iters)")
    p.add_argument("--dtype", default="float32", choices=("float32", "float64", "float16"))
    p.add_argument("--scale", type=float, default=1.0,
                   help="standard deviation of the synthetic per-rank input (default 1)")
    thr = p.add_mutually_exclusive_group()
    thr.add_argument("--threshold", type=float,
                     help="2bit in MXNet's absolute mode at this threshold (MXNet's "
                          "default is 0.5); without it, 2bit is the relative mode")
    thr.add_argument("--rel-threshold", type=float, metavar="C",
                     help="2bit in its relative mode: values with |v| >= C x the RMS of "
                          "their block send +- the block's mean |v| (default 1.5)")
    p.add_argument("--block-size", type=int, help="1bit block size (default mpigc's)")
    p.add_argument("--json", metavar="PATH", help="write every row (and the machine) here")
    p.add_argument("--plot", metavar="PATH", help="write a PNG (needs matplotlib)")
    p.add_argument("--title", default="", help="title of the plot")
    p.add_argument("--progress", dest="progress", action="store_true", default=None,
                   help="a progress bar on rank 0's stderr (default: only when stderr is "
                        "a terminal, so not in a Slurm log)")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar")
    p.add_argument("--latency", action="store_true",
                   help="OSU-style small messages: 4B..1M (x4), allreduce, every op and "
                        "mpi, 200 timed iterations (at least 50); adds the columns "
                        "'vs mpi' and 'wire %%'")
    p.add_argument("--link-gbps", type=float, metavar="R",
                   help="the link rate of a shaped fabric (Gbit/s): 'wire %%' is then the "
                        "time the wire bytes take at R / the median time")
    p.add_argument("--trace", metavar="PATH",
                   help="record a timeline of the run's calls (mpigc.timeline): each "
                        "rank's file next to PATH, merged into PATH by rank 0")
    p.add_argument("--model", action="store_true",
                   help="print the fitted model of op='auto' (latency, bandwidth, kernel "
                        "throughputs) and the crossover size per compressor")
    p.add_argument("--from-json", metavar="PATH",
                   help="print the tables (and --plot) of an earlier --json file; "
                        "measures nothing")
    return p


LATENCY_SIZES = [4 << (2 * k) for k in range(10)]  # 4 B .. 1 MiB


def apply_latency_defaults(args, argv=None):
    """``--latency``: the small-message sweep, unless the command line set
    the sizes, ops, collectives or iteration counts itself."""
    given = set(sys.argv[1:] if argv is None else argv)
    named = {a.split("=", 1)[0] for a in given}
    if "--sizes" not in named:
        args.sizes = list(LATENCY_SIZES)
    if "--ops" not in named:
        args.ops = ["mpi"] + [o for o in mpigc.available_compressors()]
    elif "mpi" not in args.ops:
        args.ops = ["mpi"] + list(args.ops)
    if "--collectives" not in named:
        args.collectives = ["allreduce"]
    if "--iters" not in named:
        args.iters = 200
    if "--min-iters" not in named:
        args.min_iters = 50
    if "--time-per-point" not in named:
        args.time_per_point = 0.5
    if "--warmup" not in named:
        args.warmup = 10
    return args


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            doc = json.load(f)
        rows, info = doc["rows"], doc["machine"]
        print(f"# mpigc-bench {info['mpigc']}: {info['ranks']} ranks, {info['mpi']}, "
              f"fabric: {info['fabric']}, {info['time']}")
        print(format_tables(rows, info["ranks"]))
        if args.plot:
            plot(rows, args.plot, args.title)
        return 0
    if args.warmup < 1:
        args.warmup = 1
    if args.latency:
        apply_latency_defaults(args, argv)
    comm = MPI.COMM_WORLD
    if args.model:
        from ._bench_model import run_model
        return run_model(args, comm, argv)
    if args.trace:
        from . import timeline
        timeline.start(args.trace)
    rows = run(args, comm)
    if args.trace:
        mine = timeline.stop()
        files = comm.gather(mine, root=0)
        if comm.rank == 0:
            n = timeline.merge(files, args.trace)
            print(f"# timeline of {n} events written to {args.trace} (one file per rank: "
                  f"{files[0]}, ...)")
    if comm.rank == 0:
        info = machine_info(comm)
        print(f"# mpigc-bench {mpigc.__version__}: {comm.size} ranks, "
              f"{info['mpi']}, fabric: {info['fabric']}")
        print(format_tables(rows, comm.size))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"machine": info, "args": vars(args), "rows": rows}, f, indent=1)
            print(f"# rows written to {args.json}")
        if args.plot:
            plot(rows, args.plot, args.title)
            print(f"# plot written to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
