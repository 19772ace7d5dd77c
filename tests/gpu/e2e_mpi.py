"""Device collectives at several ranks against host calls, bit for bit.

Run by ``tests/gpu/run.sh`` as ``mpirun -n K python tests/gpu/e2e_mpi.py
JSON_FILE`` (K = 2 and 4 ranks sharing one GPU), once staged
(``MPIGC_CUDA_AWARE=0``) and once as the MPI library is probed. For every
compressor (``none``, ``fp16``, ``bf16``, ``2bit`` in both modes, ``1bit``,
``terngrad`` without clip), float32 / float64 / float16, both gathers, with
averaging: three steps of ``allreduce`` and of ``reduce_scatter`` on device
arrays give the results and residuals of the same calls on host arrays (the
comparison of ``tests/mpi/test_gpu_path_mpi.py``, at GPU sizes); then
hierarchical calls (``hierarchy="node"``, ``MPIGC_NODE_SPLIT=2``) of 2bit and
1bit, blocking and nonblocking, the same way; and grouped calls
(``allreduce([...])``, ``reduce_scatter([...])``) of every compressor on
device members against host members. Ranks agree
on pass/fail; rank 0 writes a JSON summary to JSON_FILE and prints
``ok e2e`` or every rank's failures.

With ``MPIGC_GPU_SIM=1`` (the runner's simulator mode, under
``NUMBA_ENABLE_CUDASIM=1``) the sizes are tiny.
"""
import json
import os
import sys
import time
import traceback
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "mpi"))  # test_gpu_path_mpi
sys.path.insert(0, os.path.dirname(HERE))  # launch_contract, simulator_fix

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mpigc  # noqa: E402
from test_gpu_path_mpi import OPS, Checks, _compare, _compare_grouped  # noqa: E402

SIM = os.environ.get("MPIGC_GPU_SIM") == "1"
N = 45 if SIM else (1 << 20) + 3
# grouped calls: members of odd sizes, one of a single element
GROUP = (3, 50, 1, 77) if SIM else (3, (1 << 16) + 5, 1, 300001, 4096)
STEPS = 3


def main(path):
    from numba import cuda
    os.environ["MPIGC_MIN_COMPRESS_BYTES"] = "0"
    warnings.filterwarnings("ignore", category=RuntimeWarning)  # the staging warning
    if SIM:
        assert os.environ.get("NUMBA_ENABLE_CUDASIM") == "1", "MPIGC_GPU_SIM=1 needs the simulator"
        from support.simulator_fix import fix_simulator_shared_arrays
        fix_simulator_shared_arrays()
        from support import launch_contract
        from mpigc.kernels import cuda as kc
        launch_contract.install(kc)
    else:
        assert not os.environ.get("NUMBA_ENABLE_CUDASIM"), "NUMBA_ENABLE_CUDASIM is set"
        assert cuda.is_available(), "no CUDA GPU"
    comm = MPI.COMM_WORLD
    c = Checks(comm)
    cases = 0
    t0 = time.perf_counter()
    try:
        aware = mpigc.cuda_aware_mpi()
        for op in OPS:
            name = op if isinstance(op, str) else op["type"]
            for dtype in (np.float32, np.float64, np.float16):
                gathers = ["compressed"] if name == "none" else ["compressed", "exact"]
                for gather in gathers:
                    _compare(c, cuda, "allreduce", op, gather, dtype, N, STEPS, average=True)
                    cases += 1
                _compare(c, cuda, "reduce_scatter", op, "compressed", dtype, N, STEPS)
                cases += 1
        # grouped calls: the members gathered into one fused device buffer and
        # scattered back, results and each member's residuals as on the host
        for op in OPS:
            for dtype in (np.float32, np.float16):
                _compare_grouped(c, cuda, op, dtype, sizes=GROUP)
                cases += 1
        # hierarchical calls (emulated nodes of 2 ranks: 1x2 at 2 ranks, 2x2 at 4):
        # the intra-node steps staged through the host window, the inter-node
        # calls on the GPU
        os.environ["MPIGC_NODE_SPLIT"] = "2"
        for op in ("2bit", "1bit"):
            for dtype in (np.float32, np.float16):
                _compare(c, cuda, "allreduce", op, "compressed", dtype, N, STEPS,
                         average=True, hierarchy="node")
                _compare(c, cuda, "allreduce", op, "compressed", dtype, N, STEPS,
                         hierarchy="node", nonblocking=True, seed=7)
                cases += 2
            _compare(c, cuda, "reduce_scatter", op, "compressed", np.float32, N, STEPS,
                     hierarchy="node")
            cases += 1
    except Exception:  # noqa: BLE001 - reported with the others
        aware = None
        c.failures.append(traceback.format_exc())
    seconds = time.perf_counter() - t0
    allf = comm.allgather(c.failures)
    rc = c.finish("e2e")
    if comm.rank == 0:
        failures = [f"rank {r}: {f}" for r, fs in enumerate(allf) for f in fs]
        summary = {"ranks": comm.size, "n": N, "steps": STEPS, "cases": cases,
                   "cuda_aware": None if aware is None else {"aware": aware.aware,
                                                               "source": aware.source},
                   "seconds": round(seconds, 3), "failures": failures[:20],
                   "ok": not failures}
        with open(path, "w") as f:
            json.dump(summary, f, indent=1)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
