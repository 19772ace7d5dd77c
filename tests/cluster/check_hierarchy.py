"""Run on the emulated cluster (tests/cluster/run.sh): 4 ranks as 2 nodes x 2.

Checks, with the real node split (no MPIGC_NODE_SPLIT): two nodes of two ranks
with distinct hostnames; ``hierarchy="auto"`` takes the hierarchical path; the
results of a few 2bit and 1bit steps are bit-identical to the numpy reference
(tests/support/reference.py). Rank 0 prints "N passed" or "N failed".
"""
import os
import socket
import sys

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from support import reference  # noqa: E402

import mpigc  # noqa: E402
from mpigc import _hierarchy  # noqa: E402

os.environ.pop("MPIGC_NODE_SPLIT", None)
comm = MPI.COMM_WORLD
fails = []
lay = _hierarchy.layout(comm)
hosts = comm.allgather(socket.gethostname())
nodes = [[r for r in range(comm.size) if lay.node_of[r] == m] for m in range(lay.M)]
if lay.node_sizes != [2, 2] or len(set(hosts)) != 2 or any(
        len({hosts[r] for r in m}) != 1 for m in nodes):
    fails.append(f"node split: sizes {lay.node_sizes}, hosts {hosts}")
n = 100_003
for op in ("2bit", "1bit"):
    fb = mpigc.ErrorFeedback()
    comp = mpigc.get_compressor(op)
    sim = reference.Hierarchical(comp.get_config(), nodes, n, np.float32)
    for step in range(3):
        xs = [np.random.default_rng([r, step]).standard_normal(n).astype(np.float32)
              for r in range(comm.size)]
        want = sim.allreduce(xs)
        got = mpigc.allreduce(xs[comm.rank].copy(), op, key="c", feedback=fb,
                              hierarchy="auto")
        if not any(_hierarchy.parse_slice_key(k) for k in fb.keys()):
            fails.append(f"{op}: hierarchy='auto' did not take the hierarchical path")
            break
        if got.tobytes() != want.tobytes():
            fails.append(f"{op} step {step}: differs from the reference by up to "
                         f"{np.max(np.abs(got - want))}")
            break
allf = comm.gather(fails)
if comm.rank == 0:
    flat = [f"rank {r}: {m}" for r, fs in enumerate(allf) for m in fs]
    for m in flat:
        print("FAILED", m)
    print(f"cluster: nodes {lay.node_sizes}, hosts {sorted(set(hosts))}")
    print("1 failed" if flat else "1 passed")
sys.exit(1 if comm.allreduce(len(fails)) else 0)
