# usage: percall.py {new|old|both} ITERS [compressed]  -- per-call time of mpigc.allreduce, interleaved
# per iteration. Default: op="none" (and the 2bit plain fallback at 4 KiB) against comm.Allreduce
# and, on 2 ranks, the Python floor of a 2-rank allreduce (one Sendrecv of the buffer with the
# peer, then np.add: what any Python layer over mpi4py must at least do) at 4 KiB, 64 KiB and
# 1 MiB, medians and minima over the slowest rank, each as a ratio to comm.Allreduce and to the
# floor. "compressed": the medians on rank 0 of 2bit, 1bit, terngrad and nonblocking 2bit (averaged) at
# 16 KiB, 256 KiB and 4 MiB (ITERS calls each, ITERS / 20 at 4 MiB). "new" also times op="none"
# with the short path of small calls off (none-engine: $MPIGC_SHORT_PATH=0) and with the cache
# of prepared calls off (none-nocache and engine-nocache: $MPIGC_PLAN_CACHE=0, each call
# prepared anew: what the cache buys). "old" imports the mpigc package found in
# $MPIGC_OLD_TREE (a directory holding an mpigc/ package, its kernels/ copied in) instead of
# the installed one. "both": the installed package and the one in $MPIGC_OLD_TREE (loaded as
# the package "mpigc_old", its own engine and communicators) in one run, their op="none"
# calls interleaved per iteration as "none" and "old-none" (and "old-none-engine", "old-2bit"):
# before and after, under the same load. At 4 KiB, "none-x64" (and "old-none-x64"): 64 calls
# back to back on 64 keys without a barrier between them, per call. Since issue 51 the short path sends its row alone and
# sums by MPI_Allreduce at every size ($MPIGC_INLINE_PLAIN_BYTES moves only the engine's path:
# "none-engine").
import os
import sys
if sys.argv[1] == "old":
    sys.meta_path = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
    sys.path.insert(0, os.environ["MPIGC_OLD_TREE"])
import time
import numpy as np
from mpi4py import MPI
import mpigc
comm = MPI.COMM_WORLD
N = int(sys.argv[2])
compressed = sys.argv[3:] == ["compressed"]
old_mpigc = None
if sys.argv[1] == "both":
    import oldtree
    old_mpigc = oldtree.load(os.environ["MPIGC_OLD_TREE"])
if comm.rank == 0:
    print(sys.argv[1], mpigc.__file__, "" if old_mpigc is None else old_mpigc.__file__)


def timed(fns, n, warmup):
    for _ in range(warmup):
        for _, fn in fns:
            fn()
    ts = {k: [] for k, _ in fns}
    for i in range(n):
        # "both": every other iteration in reverse order, so that neither tree
        # always runs first after the floor
        for name, fn in (fns[::-1] if old_mpigc is not None and i % 2 else fns):
            comm.Barrier()
            t = time.perf_counter()
            fn()
            ts[name].append(time.perf_counter() - t)
    return ts


if compressed:
    rng = np.random.default_rng(comm.rank)
    for size in (16384, 262144, 4 << 20):
        buf = rng.standard_normal(size // 4).astype(np.float32)
        # averaged, as gradients are: a sum in place doubles the values at every
        # call on 2 ranks, and overflows float32 (NonFiniteError) within ~128 calls
        fns = [(op, (lambda op=op, size=size: mpigc.allreduce(buf, op=op, key=f"k{op}{size}",
                                                              average=True)))
               for op in ("2bit", "1bit", "terngrad")]
        fns.append(("2bit-nb", lambda size=size: mpigc.iallreduce(buf, op="2bit",
                                                                   key=f"nb{size}",
                                                                   average=True).wait()))
        ts = timed(fns, N if size < 1 << 20 else max(N // 20, 10), 5)
        if comm.rank == 0:
            print(size, " ".join(f"{k} {np.median(v) * 1e6:.1f}" for k, v in ts.items()),
                  flush=True)
    sys.exit(0)


def with_env(fn, **env):
    """``fn`` with environment variables set (read at each call; setting and
    restoring them is part of the time, a microsecond or two: compare with
    the "old" mode run twice, MPIGC_OLD_TREE the old tree, then the new)."""
    keep = {k: os.environ.get(k) for k in env}

    def g():
        os.environ.update(env)
        try:
            fn()
        finally:
            for k, v in keep.items():
                if v is None:
                    del os.environ[k]
                else:
                    os.environ[k] = v
    return g


def floor_of(buf):
    """The Python floor of a 2-rank allreduce of ``buf``: one Sendrecv of
    the buffer with the peer, then np.add."""
    peer, tmp = 1 - comm.rank, np.empty_like(buf)

    def floor():
        comm.Sendrecv(buf, peer, recvbuf=tmp, source=peer)
        np.add(buf, tmp, out=buf)
    return floor


for size in (4096, 65536, 1 << 20):
    buf = np.zeros(size // 4, np.float32)
    fns = [("mpi", lambda: comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM))]
    if comm.size == 2:
        fns.append(("floor", floor_of(buf)))
    fns.append(("none", lambda: mpigc.allreduce(buf, op="none", key="k")))
    if old_mpigc is not None:
        def old_none():
            old_mpigc.allreduce(buf, op="none", key="k")
        fns += [("old-none", old_none),
                ("none-engine", with_env(lambda: mpigc.allreduce(buf, op="none", key="k"),
                                         MPIGC_SHORT_PATH="0")),
                ("old-none-engine", with_env(old_none, MPIGC_SHORT_PATH="0"))]
        if size == 4096:
            fns.append(("old-2bit", lambda: old_mpigc.allreduce(buf, op="2bit", key="k2")))
    if sys.argv[1] == "new":
        def none():
            mpigc.allreduce(buf, op="none", key="k")
        # the same calls on the engine's path (no short path), and each call
        # prepared anew (no cache of prepared calls)
        fns += [("none-engine", with_env(none, MPIGC_SHORT_PATH="0")),
                ("none-nocache", with_env(none, MPIGC_PLAN_CACHE="0")),
                ("engine-nocache", with_env(none, MPIGC_SHORT_PATH="0",
                                            MPIGC_PLAN_CACHE="0"))]
    if size == 4096:  # below the default cutoff (8192 bytes): the plain fallback
        fns.append(("2bit", lambda: mpigc.allreduce(buf, op="2bit", key="k2")))
        # 64 calls back to back on 64 keys, as a training step's small layers
        # (no barrier between them), timed per call (the total / 64)
        bufs = [np.zeros(size // 4, np.float32) for _ in range(64)]

        def x64(m):
            def run():
                for i, b in enumerate(bufs):
                    m.allreduce(b, op="none", key=f"x{i}")
            return run
        fns.append(("none-x64", x64(mpigc)))
        if old_mpigc is not None:
            fns.append(("old-none-x64", x64(old_mpigc)))
    ts = timed(fns, N, 20)
    for k in ts:
        if k.endswith("-x64"):
            ts[k] = [t / 64 for t in ts[k]]
    med = {k: comm.allreduce(np.median(v) * 1e6, op=MPI.MAX) for k, v in ts.items()}
    mn = {k: comm.allreduce(np.min(v) * 1e6, op=MPI.MAX) for k, v in ts.items()}
    if comm.rank == 0:
        print(f"{size:>8} B median: " + "  ".join(
            f"{k} {v:8.1f} us ({v / med['mpi']:.2f}x)" for k, v in med.items())
            + "   min: " + "  ".join(f"{k} {v:.1f}" for k, v in mn.items()))
        if "floor" in med:
            print(f"{size:>8} B / floor: " + "  ".join(
                f"{k} {v / med['floor']:.2f}x" for k, v in med.items() if k != "floor"))
