"""Side-by-side peers: mpigc against MPI and torch.distributed (gloo), same buffers.

Run under mpirun, on the plain machine or inside ``benchmarks/fabric.sh``::

    mpirun -n 4 python benchmarks/peers.py --sizes 32M,64M --json peers.json

Needs torch (``pip install torch==2.13.0``; the ``bench`` extra brings matplotlib
for ``--plot``). torch.distributed is initialised with the gloo backend over TCP
on 127.0.0.1 (rank and size from MPI, the port chosen by rank 0 and broadcast),
so on an emulated fabric it crosses the same shaped loopback as MPI.

Methods, for each message size S (float32, S/4 elements per rank):

``mpi``            ``comm.Allreduce`` (the baseline of the ``speedup`` column)
``mpigc-none``     ``mpigc.allreduce(op="none")`` (MPI plus mpigc's agreement step)
``mpigc-2bit``, ``mpigc-1bit``, ``mpigc-fp16``   mpigc's compressed allreduce
``gloo``           ``torch.distributed.all_reduce`` on the same buffer (zero copy)
``ddp-fp16``       DDP with ``fp16_compress_hook``
``ddp-powersgd1``, ``ddp-powersgd4``   DDP with ``powerSGD_hook``,
                   ``matrix_approximation_rank`` 1 and 4, error feedback and warm
                   start on (PyTorch's defaults), compression from the 3rd step

The DDP methods train a model whose parameters are ``--layers`` square float32
matrices with S/4 elements in all (PowerSGD compresses matrices; a layer of a
real network is one). Its loss is ``sum_i (W_i * X_i).sum()``: backward costs
one copy per matrix, so a step is almost only communication. The reported time
of a DDP method is the median step time (forward, backward, the hook's
communication) minus the median of the same step under ``no_sync()`` (no
communication); both are printed. One bucket holds the whole model
(``bucket_cap_mb`` = S), as mpigc and MPI reduce one buffer. Each rank uses
one torch thread (``torch.set_num_threads(1)``), as the 2-core machine the
published figures come from runs 4 ranks.

Every time is the slowest rank's, after a barrier; median of ``--iters``.
"""
import argparse
import json
import math
import os
import socket
import sys
import time

import numpy as np
from mpi4py import MPI

import mpigc
from mpigc.bench import format_size, machine_info, parse_size

METHODS = ("mpi", "mpigc-none", "mpigc-fp16", "mpigc-2bit", "mpigc-1bit", "gloo",
           "ddp-fp16", "ddp-powersgd1", "ddp-powersgd4")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_torch(comm):
    try:
        import torch
        import torch.distributed as dist
    except ImportError as exc:
        raise SystemExit("peers.py needs torch: pip install torch==2.13.0") from exc
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    port = comm.bcast(_free_port() if comm.rank == 0 else None, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=comm.rank, world_size=comm.size)
    return torch, dist


def _timeit(comm, fn, iters, warmup, prepare=None):
    for _ in range(warmup):
        if prepare:
            prepare()
        fn()
    ts = np.empty(iters)
    for i in range(iters):
        if prepare:
            prepare()
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        ts[i] = time.perf_counter() - t0
    tmax = np.empty_like(ts)
    comm.Allreduce(ts, tmax, op=MPI.MAX)
    return tmax


class _MatModel:
    """``layers`` square matrices, ``n`` elements in all (the last one absorbs
    the remainder as a non-square matrix)."""

    def __init__(self, torch, n, layers, seed):
        nn = torch.nn
        per = n // layers
        d = max(1, int(math.isqrt(per)))
        shapes = [(d, d)] * (layers - 1)
        rest = n - d * d * (layers - 1)
        shapes.append((max(1, rest // d), d) if rest >= d else (1, rest))
        extra = n - sum(a * b for a, b in shapes)
        if extra:
            shapes.append((1, extra))
        g = torch.Generator().manual_seed(seed)

        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.ws = nn.ParameterList(
                    [nn.Parameter(torch.zeros(a, b)) for a, b in shapes])
                self.xs = [torch.randn(a, b, generator=g) for a, b in shapes]

            def forward(self):
                return sum((w * x).sum() for w, x in zip(self.ws, self.xs))

        self.module = M()
        self.shapes = shapes


def _ddp_method(torch, dist, comm, name, n, args):
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    mm = _MatModel(torch, n, args.layers, seed=comm.rank)
    nbytes = 4 * n
    ddp = DDP(mm.module, bucket_cap_mb=nbytes / 2**20 + 1)  # no buffers to sync
    wire = None
    N = comm.size
    if name == "ddp-fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        wire = int(round(2 * (N - 1) / N * 2 * n))
    else:
        r = int(name[len("ddp-powersgd"):])
        state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=r,
                                   start_powerSGD_iter=2, min_compression_rate=0.0,
                                   use_error_feedback=True, warm_start=True)
        ddp.register_comm_hook(state, psgd.powerSGD_hook)
        # P (rows x r) and Q (cols x r) per matrix, each allreduced (ring: 2(N-1)/N)
        elems = sum((a + b) * r if min(a, b) > r else a * b for a, b in mm.shapes)
        wire = int(round(2 * (N - 1) / N * 4 * elems))

    def step():
        loss = ddp()
        loss.backward()

    def local():
        with ddp.no_sync():
            loss = ddp()
            loss.backward()

    def clear():
        ddp.zero_grad(set_to_none=True)

    t_step = _timeit(comm, step, args.iters, args.warmup + 3, clear)
    t_local = _timeit(comm, local, args.iters, 1, clear)
    comm_t = np.maximum(t_step - np.median(t_local), 0.0)
    del ddp, mm
    return comm_t, wire, {"step_median_s": float(np.median(t_step)),
                          "local_median_s": float(np.median(t_local))}


def run(args):
    comm = MPI.COMM_WORLD
    N, rank = comm.size, comm.rank
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise SystemExit(f"peers.py: unknown methods {unknown}; expected some of "
                         f"{', '.join(METHODS)}")
    if "mpi" not in methods:
        methods.insert(0, "mpi")
    need_torch = any(m.startswith(("gloo", "ddp")) for m in methods)
    torch = dist = None
    if need_torch:
        torch, dist = _init_torch(comm)
    rows = []
    sizes = sorted({parse_size(s) for s in args.sizes.split(",")})
    for nbytes in sizes:
        n = nbytes // 4
        src = np.random.default_rng(1000 + rank).standard_normal(n).astype(np.float32)
        work = np.empty_like(src)

        def reset():
            work[...] = src

        for m in methods:
            extra = {}
            wire = int(round(2 * (N - 1) / N * nbytes))
            if m == "mpi":
                t = _timeit(comm, lambda: comm.Allreduce(MPI.IN_PLACE, work, op=MPI.SUM),
                            args.iters, args.warmup, reset)
            elif m.startswith("mpigc-"):
                op = m[len("mpigc-"):]
                fb = mpigc.ErrorFeedback()
                kw = {"threshold": args.threshold} if op == "2bit" and args.threshold else {}
                mpigc.reset_traffic()
                t = _timeit(comm, lambda: mpigc.allreduce(work, op=op, key="peers",
                                                          feedback=fb, **kw),
                            args.iters, args.warmup, reset)
                tr = mpigc.traffic()
                wire = tr["bytes_sent"] // max(1, tr["calls"])
            elif m == "gloo":
                tw = torch.from_numpy(work)
                t = _timeit(comm, lambda: dist.all_reduce(tw), args.iters, args.warmup, reset)
            else:
                t, wire, extra = _ddp_method(torch, dist, comm, m, n, args)
            rows.append({"method": m, "size_bytes": nbytes, "ranks": N,
                         "median_s": float(np.median(t)), "min_s": float(t.min()),
                         "max_s": float(t.max()), "iters": len(t), "wire_bytes": wire,
                         **extra})
            if rank == 0 and args.progress:
                print(f"# {format_size(nbytes)} {m}: {np.median(t) * 1e3:.1f} ms",
                      file=sys.stderr, flush=True)
    base = {r["size_bytes"]: r["median_s"] for r in rows if r["method"] == "mpi"}
    for r in rows:
        r["speedup_vs_mpi"] = base[r["size_bytes"]] / max(r["median_s"], 1e-12)
    if dist is not None:
        dist.destroy_process_group()
    return rows


def format_table(rows):
    out = [f"#{'size':>7} {'method':>14} {'med ms':>10} {'min ms':>10} {'max ms':>10} "
           f"{'wire B/rank':>12} {'speedup vs mpi':>15}  note"]
    for r in rows:
        note = ""
        if "step_median_s" in r:
            note = (f"step {r['step_median_s'] * 1e3:.1f} ms - local "
                    f"{r['local_median_s'] * 1e3:.1f} ms")
        out.append(f"{format_size(r['size_bytes']):>8} {r['method']:>14} "
                   f"{r['median_s'] * 1e3:10.2f} {r['min_s'] * 1e3:10.2f} "
                   f"{r['max_s'] * 1e3:10.2f} {r['wire_bytes']:12d} "
                   f"{r['speedup_vs_mpi']:14.2f}x  {note}")
    return "\n".join(out)


def plot(rows, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    sizes = sorted({r["size_bytes"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, ax = plt.subplots(figsize=(10, 4))
    w = 0.8 / len(sizes)
    for i, s in enumerate(sizes):
        by = {r["method"]: r for r in rows if r["size_bytes"] == s}
        ax.bar(np.arange(len(methods)) + i * w, [by[m]["speedup_vs_mpi"] if m in by else 0
                                                  for m in methods], w,
               label=format_size(s))
    ax.set_xticks(np.arange(len(methods)) + w * (len(sizes) - 1) / 2)
    ax.set_xticklabels(methods, rotation=20)
    ax.set_yscale("log")
    ax.set_ylabel("speedup against MPI_Allreduce (x)")
    ax.axhline(1, color="gray", lw=0.8)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(title="size")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="32M,64M")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--layers", type=int, default=8,
                   help="square matrices in the DDP model (default 8)")
    p.add_argument("--threshold", type=float, help="2bit threshold")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--plot", metavar="PATH")
    p.add_argument("--title", default="")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    args = p.parse_args(argv)
    rows = run(args)
    comm = MPI.COMM_WORLD
    if comm.rank == 0:
        info = machine_info(comm)
        print(f"# peers: {comm.size} ranks, {info['mpi']}, fabric: {info['fabric']}")
        print(format_table(rows))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"machine": info, "args": vars(args), "rows": rows}, f, indent=1)
        if args.plot:
            plot(rows, args.plot, args.title)


if __name__ == "__main__":
    main()
