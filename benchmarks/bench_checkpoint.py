"""Save and load time of residual checkpoints vs numpy.save / numpy.load.

Each rank holds ``--mb`` MB of residuals (worker and owner, float32, over
``--keys`` keys); the same bytes are written with ``numpy.save`` (one .npy
per array, in a per-rank directory on the same disk) and read back with
``numpy.load``. Ratios are to numpy.save (the issue's yardstick, for both
save and load); load is also compared with numpy.load. Times are the slowest rank's, best of ``--repeat`` interleaved runs; the fsync
variants flush to stable storage as a checkpoint save does by default.

    mpirun -n 2 python benchmarks/bench_checkpoint.py --dir /tmp
"""
import argparse
import os
import shutil
import tempfile
import time

import numpy as np
from mpi4py import MPI

import mpigc

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()


def timed(fn):
    comm.Barrier()
    t0 = time.perf_counter()
    fn()
    comm.Barrier()
    return comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=256, help="MB of residuals per rank")
    ap.add_argument("--keys", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--dir", default=None, help="where to write (default: $TMPDIR)")
    args = ap.parse_args()

    nbytes = int(args.mb * 2**20)
    # worker n values + owner n/size values per key, float32
    n = int(nbytes / 4 / (1 + 1 / size) / args.keys)
    rng = np.random.default_rng(rank)
    state = {}
    arrays = []
    for k in range(args.keys):
        lo, hi = mpigc.shard_bounds(n, size)[rank]
        w = rng.standard_normal(n, dtype=np.float32)
        o = rng.standard_normal(hi - lo, dtype=np.float32)
        state[f"layer{k}.weight"] = {"worker": w, "owner": o, "config": {"type": "2bit"},
                                     "calls": 10, "world_size": size, "rank": rank, "n": n,
                                     "dtype": "float32"}
        arrays += [w, o]
    fb = mpigc.ErrorFeedback()
    fb.load_state_dict(state)
    del state
    total = sum(a.nbytes for a in arrays)

    root = comm.bcast(tempfile.mkdtemp(prefix="mpigc-bench-", dir=args.dir)
                      if rank == 0 else None)
    ck = os.path.join(root, "ck")
    npdir = os.path.join(root, f"npy-{rank}")
    os.makedirs(npdir, exist_ok=True)

    def np_save(sync):
        def go():
            for i, a in enumerate(arrays):
                with open(os.path.join(npdir, f"{i}.npy"), "wb") as f:
                    np.save(f, a)
                    if sync:
                        f.flush()
                        os.fsync(f.fileno())
        return go

    def np_load():
        for i in range(len(arrays)):
            np.load(os.path.join(npdir, f"{i}.npy"))

    def save(sync):
        return lambda: mpigc.save_checkpoint(ck, feedback=fb, fsync=sync)

    fb2 = mpigc.ErrorFeedback()
    # warm-up (Numba compiles the checksum kernel on first use)
    mpigc.save_checkpoint(ck, feedback=fb, fsync=False)
    mpigc.load_checkpoint(ck, feedback=fb2)
    # interleaved, so a change in the machine's load hits both sides alike
    ops = {("np.save", False): np_save(False), ("save", False): save(False),
           ("np.save", True): np_save(True), ("save", True): save(True),
           "np.load": np_load, "load": lambda: mpigc.load_checkpoint(ck, feedback=fb2)}
    res = {k: float("inf") for k in ops}
    for _ in range(args.repeat):
        for k, fn in ops.items():
            res[k] = min(res[k], timed(fn))
    if rank == 0:
        mb = total / 2**20
        print(f"{size} rank(s), {mb:.0f} MB of residuals per rank ({args.keys} keys), "
              f"dir {root}, best of {args.repeat}")
        for sync in (False, True):
            tag = "fsync   " if sync else "no fsync"
            a, b = res["save", sync], res["np.save", sync]
            print(f"save  {tag}: checkpoint {a:.3f} s, numpy.save {b:.3f} s, "
                  f"ratio {a / b:.2f}x")
        a, b, c = res["load"], res["np.save", False], res["np.load"]
        print(f"load          : checkpoint {a:.3f} s, numpy.save {b:.3f} s, ratio {a / b:.2f}x "
              f"(numpy.load {c:.3f} s, ratio {a / c:.2f}x)")
    comm.Barrier()
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
