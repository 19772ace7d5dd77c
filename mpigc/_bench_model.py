"""``mpigc-bench --model`` (:mod:`mpigc.bench`): the cost model that
``op="auto"`` fits while a job runs (:mod:`mpigc._auto_model`), fitted on a
duplicate of the communicator from ``op="auto"`` calls pinned to each op in
turn, and printed with each compressor's kernel throughputs and its
crossover size."""
import re
import sys
import time

import numpy as np

import mpigc

from .bench import _params, format_size, machine_info

__all__ = ["run_model", "crossover", "MODEL_SIZES"]


MODEL_SIZES = [64 << 10, 1 << 20, 8 << 20, 32 << 20]


def _kernel_rates(comp, n=2 << 20, reps=3):
    """This rank's encode and decode throughput of ``comp`` (bytes of
    float32 values per second, best of ``reps``)."""
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    res = np.zeros(n, np.float32)
    out = np.empty(comp.payload_nbytes(n), np.uint8)
    dec = np.empty(n, np.float32)
    comp.compress(x, res, out, check_finite=False)  # compiles
    comp.decompress(out, n, dec, accumulate=True)
    enc_t = dec_t = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        comp.compress(x, res, out, check_finite=False)
        t1 = time.perf_counter()
        comp.decompress(out, n, dec, accumulate=True)
        t2 = time.perf_counter()
        enc_t, dec_t = min(enc_t, t1 - t0), min(dec_t, t2 - t1)
    return x.nbytes / enc_t, x.nbytes / dec_t


def crossover(fn, fc):
    """The size in bytes above which ``fc`` (a compressor's :class:`Fit`)
    predicts less time than ``fn`` (none's): 0 when it is always faster,
    None when never."""
    pn, pc = 1.0 / fn.bandwidth, 1.0 / fc.bandwidth  # seconds per byte
    if pc >= pn:  # slower per byte: not faster above any size, unless equal
        return 0 if pc == pn and fc.latency < fn.latency else None
    return max(0.0, (fc.latency - fn.latency) / (pn - pc))


def run_model(args, comm, argv=None):
    """``--model``: fit op="auto"'s model on a duplicate of ``comm`` and print it."""
    from . import _auto
    argv = sys.argv[1:] if argv is None else argv
    ops = [o for o in args.ops if o not in ("mpi", "none")]
    if not any(a.startswith("--ops") for a in argv):
        ops = ["2bit"]
    if not any(a.startswith("--iters") for a in argv):
        args.iters = 6
    sizes = args.sizes or MODEL_SIZES
    c = comm.Dup()
    model = _auto.model_of(c, window=None)
    dtype = np.dtype(args.dtype)
    for nbytes in sizes:
        n = max(1, nbytes // dtype.itemsize)
        x = (np.random.default_rng([1, comm.rank]).standard_normal(n) * args.scale
             ).astype(dtype)
        for op in ops:
            for pin in ("none", "compressed"):
                for _ in range(args.iters + 1):  # the first of each is a warm-up
                    mpigc.allreduce(x.copy(), op="auto", auto_op=op, auto_pin=pin,
                                    key=f"bench-model/{op}/{n}", comm=c,
                                    **_params(op, args))
    # the sums of the last calls: one more agreement step, then settle
    before = model.syncs  # the same count on every rank: a function of the calls made
    while model.syncs == before:
        mpigc.allreduce(np.zeros(16, dtype), op="auto", auto_pin="none", comm=c)
    model.settle()
    fits = model.describe()
    rates = {op: _kernel_rates(mpigc.get_compressor(op, **_params(op, args))) for op in ops}
    every = comm.gather(rates, root=0)
    c.Free()
    if comm.rank:
        return 0
    info = machine_info(comm)
    print(f"# mpigc-bench --model {mpigc.__version__}: {comm.size} ranks, {info['mpi']}, "
          f"fabric: {info['fabric']}")
    print("# op='auto''s model of this job: T = latency + bytes / bandwidth, fitted from "
          f"{args.iters} timed calls per op and size ({', '.join(map(format_size, sizes))}), "
          "agreed over every rank")
    print(f"{'op':>10} {'kind':>14} {'samples':>8} {'latency us':>11} {'bandwidth GB/s':>15}")
    none_fit = None
    rows = []
    for label, f in sorted(fits.items(), key=lambda kv: repr(kv[0])):
        if label[0] != "allreduce":
            continue
        name = "none" if label[1] == "none" else _auto_label_op(label)
        if name == "none":
            none_fit = f
        rows.append((name, f))
        bw = "inf" if f.bandwidth == float("inf") else f"{f.bandwidth / 1e9:.3f}"
        print(f"{name:>10} {label[0]:>14} {f.count:>8} {f.latency * 1e6:>11.1f} {bw:>15}")
    print("# kernels (float32 bytes/s, this job's slowest rank): encode, decode")
    for op in ops:
        enc = min(r[op][0] for r in every)
        dec = min(r[op][1] for r in every)
        print(f"{op:>10} encode {enc / 1e9:7.3f} GB/s  decode {dec / 1e9:7.3f} GB/s")
    print("# crossover: op='auto' predicts the compressor faster than none above")
    for name, f in rows:
        if name == "none" or none_fit is None:
            continue
        x = crossover(none_fit, f)
        where = ("never (none is faster at every size)" if x is None else
                 "every size" if x == 0 else format_size(int(x)))
        print(f"{name:>10} {where}")
    return 0


def _auto_label_op(label):
    """The compressor's id in a slot label of mpigc._auto (its config's repr)."""
    m = re.search(r"\('id', '([^']+)'\)", label[-1])
    return m.group(1) if m else str(label[-1])
