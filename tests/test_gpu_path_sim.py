"""The GPU path of the collectives in Numba's CUDA simulator, at 1 to 4 ranks.

Each test launches ``mpirun -n K python tests/mpi/test_gpu_path_mpi.py GROUP``
with ``NUMBA_ENABLE_CUDASIM=1`` (see that file for the groups and what they
check), so this pytest session never imports the simulator. Sizes are small:
the simulator runs every CUDA thread as a Python thread.

Plus single-process checks of the dispatch layer (subprocesses too): the
simulator's arrays count as device arrays only when the simulator is on, and
host-only use of mpigc touches no CUDA.
"""
import os
import shutil
import subprocess
import sys

import pytest

from support import background

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "mpi", "test_gpu_path_mpi.py")
TIMEOUT = int(os.environ.get("MPIGC_TEST_TIMEOUT", "900"))

# group -> MPIGC_CUDA_AWARE (None: unset, the library is probed)
GROUPS = {"staged": "0", "aware": "1", "detect": None, "hier": "0", "devices": "0"}


def _env(sim, aware=None):
    env = dict(os.environ)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    env.pop("MPIGC_CUDA_AWARE", None)
    env.pop("MPIGC_DEVICE", None)
    if sim:
        env["NUMBA_ENABLE_CUDASIM"] = "1"
    if aware is not None:
        env["MPIGC_CUDA_AWARE"] = aware
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", PYTHONUNBUFFERED="1")
    return env


def _mpirun():
    exe = shutil.which("mpirun") or shutil.which("mpiexec")
    if exe is None:
        pytest.skip("no mpirun on PATH")
    return exe


# the simulator runs every CUDA thread as a Python thread: 1 rank and 3 (uneven
# shards, every rank both owner and peer) keep this under 3 minutes; set
# MPIGC_SIM_RANKS="1 2 3 4" for all counts
_SIM_RANKS = [int(k) for k in os.environ.get("MPIGC_SIM_RANKS", "1 3").split()]


_RUNS = background.Runs()  # the groups run side by side (tests/support/background.py)


@pytest.mark.parametrize("ranks", _SIM_RANKS)
@pytest.mark.parametrize("group", list(GROUPS))
def test_gpu_path_simulator(group, ranks, request):
    mpirun = _mpirun()

    def cmd(g, k):
        return [mpirun, "--oversubscribe", "-n", str(k), sys.executable, SCRIPT, g]

    runs = background.selected(request, "test_gpu_path_simulator", "group", "ranks")
    # the most ranks first (the longest); each (group, ranks) once
    runs = sorted(dict.fromkeys(runs), key=lambda gk: -gk[1])
    _RUNS.start({gk: (cmd(*gk), _env(True, GROUPS[gk[0]]), TIMEOUT) for gk in runs})
    r = _RUNS.result((group, ranks), cmd(group, ranks), _env(True, GROUPS[group]), TIMEOUT)
    if isinstance(r, subprocess.TimeoutExpired):
        pytest.fail(f"{' '.join(cmd(group, ranks))} timed out after {TIMEOUT} s:\n{r.stdout}")
    assert r.returncode == 0 and f"ok {group}" in r.stdout, \
        f"{' '.join(cmd(group, ranks))}: exit {r.returncode}\n{r.stdout[-6000:]}\n" \
        f"{r.stderr[-6000:]}"


def _python(code, sim):
    r = subprocess.run([sys.executable, "-c", code], env=_env(sim), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    return r.stdout


def test_simulator_arrays_only_under_the_simulator():
    code = """
import numpy as np
from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
from mpigc import _dispatch
print(_dispatch.is_device_array(FakeCUDAArray(np.zeros(3))),
      _dispatch.is_device_array(np.zeros(3)))
"""
    assert _python(code, sim=False).split() == ["False", "False"]
    code = code.replace("from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray",
                        "from numba import cuda; FakeCUDAArray = lambda a: cuda.to_device(a)")
    assert _python(code, sim=True).split() == ["True", "False"]


def test_host_use_touches_no_cuda():
    """Importing mpigc, host collectives and cuda_aware_mpi() never import
    numba.cuda (so never create a CUDA context)."""
    out = _python("""
import sys, numpy as np, mpigc
g = np.ones(5000, np.float32)
mpigc.allreduce(g, "2bit", key="g")
mpigc.reduce_scatter(g, "1bit")
print(mpigc.cuda_aware_mpi().source)
print("numba.cuda" in sys.modules)
""", sim=False)
    assert out.split()[-1] == "False", out


def test_numpy_too_new_for_numba_cuda_is_a_clear_error():
    """numba-cuda 0.30.4 compiles no kernel with numpy 2.5 (numpy.row_stack is
    gone): the first device call says so, naming both versions; newer
    numba-cuda releases and older numpy pass."""
    import mpigc
    from mpigc import _dispatch
    with pytest.raises(mpigc.DTypeError, match=r"numba-cuda 0\.30\.4 .* numpy 2\.5\.2"):
        _dispatch.check_numpy_for_numba_cuda("0.30.4", "2.5.2")
    with pytest.raises(mpigc.DTypeError, match="numpy<2.5"):
        _dispatch.check_numpy_for_numba_cuda("0.29.0", "2.6.0rc1")
    _dispatch.check_numpy_for_numba_cuda("0.30.4", "2.4.6")
    _dispatch.check_numpy_for_numba_cuda("0.31.0", "2.5.2")


def test_gpu_bench_parses_and_says_when_it_cannot_measure(tmp_path):
    """``benchmarks/gpu_bench.py`` imports and parses its arguments on a
    machine without a GPU; there it says it cannot measure, exits 0 and
    writes ``"measured": false`` (on a GPU machine: tests/gpu/run.sh)."""
    import json
    bench = os.path.join(os.path.dirname(HERE), "benchmarks", "gpu_bench.py")
    r = subprocess.run([sys.executable, bench, "--fixed-kib", "4,x"], env=_env(False),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "--fixed-kib" in r.stderr, r.stderr
    out = str(tmp_path / "bench.json")
    r = subprocess.run([sys.executable, bench, "--mb", "1", "--reps", "1", "--json", out],
                       env=_env(False), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    if "cannot measure" not in r.stdout:
        pytest.skip("a GPU is present: the benchmark measured (tests/gpu/run.sh checks it)")
    with open(out) as f:
        assert json.load(f)["measured"] is False


# ----------------------------------------------------------------------------
# the fixed cost of a device call: launches, synchronisations, small reads
# ----------------------------------------------------------------------------
COUNT_RANKS = [3]


@pytest.mark.parametrize("ranks", COUNT_RANKS)
def test_device_call_costs_do_not_grow_with_shards(ranks):
    """A device call launches one kernel per stage for ALL shards and reads
    back one count per compression: the same launches, synchronisations and
    small device-to-host reads at 3 ranks (3 shards, 3 senders) as on one
    rank, and for absolute ``2bit`` exactly 2 pack and 2 decode launches and 2 small
    reads (the worker's and the owner's non-finite counts). Counted by the
    launch-contract recorder (``tests/support/launch_contract.py``) in the
    simulator; run as ``mpirun -n 3 python tests/test_gpu_path_sim.py``."""
    cmd = [_mpirun(), "--oversubscribe", "-n", str(ranks), sys.executable,
           os.path.abspath(__file__), "counts"]
    # CUDA-aware: MPI takes the device buffers, so no staging copy mixes
    # with the reads of the counts
    r = subprocess.run(cmd, env=_env(True, "1"), capture_output=True, text=True,
                       timeout=TIMEOUT)
    assert r.returncode == 0 and "ok counts" in r.stdout, \
        f"{' '.join(cmd)}: exit {r.returncode}\n{r.stdout[-6000:]}\n{r.stderr[-6000:]}"


# what one allreduce of each op costs on the device, whatever the number of
# shards: launches per kernel, and the small reads (counts)
EXPECTED_2BIT = {"launch _pack_2bit_kernel": 2, "launch _unpack_2bit_kernel": 2,
                 "small read": 2}


def _counts_main():
    """Under mpirun with the simulator: per op, the counters of one call on
    the world communicator (N shards) and on COMM_SELF (one shard) must be
    equal; absolute 2bit's must be EXPECTED_2BIT (plus synchronisations)."""
    import warnings

    import numpy as np
    from mpi4py import MPI
    sys.path.insert(0, HERE)
    from support.simulator_fix import fix_simulator_shared_arrays
    fix_simulator_shared_arrays()
    from support import launch_contract
    from numba import cuda

    import mpigc
    from mpigc.kernels import cuda as kc
    warnings.filterwarnings("ignore", category=RuntimeWarning)
    os.environ["MPIGC_MIN_COMPRESS_BYTES"] = "0"
    launch_contract.install(kc)
    world = MPI.COMM_WORLD
    absolute = {"type": "2bit", "threshold": 0.5}  # MXNet's mode: EXPECTED_2BIT
    ops = [absolute, "2bit", {"type": "2bit", "rel_threshold": 1.5, "block_size": 16},
           {"type": "1bit", "block_size": 16}, {"type": "fp16", "error_feedback": True},
           "bf16", {"type": "terngrad", "error_feedback": True}]
    failures = []
    for op in ops:
        seen = {}
        for name, comm in (("world", world), ("self", MPI.COMM_SELF)):
            g = np.random.default_rng(world.rank).standard_normal(301).astype(np.float32)
            d = cuda.to_device(g)
            fb = mpigc.ErrorFeedback()
            mpigc.allreduce(d, op=op, key="c", comm=comm, feedback=fb)  # warm: residuals
            launch_contract.reset_counts()
            mpigc.allreduce(d, op=op, key="c", comm=comm, feedback=fb)
            seen[name] = launch_contract.counts()
        if seen["world"] != seen["self"]:
            failures.append(f"{op}: {world.size} shards cost {seen['world']}, one shard "
                            f"costs {seen['self']}")
        if op == absolute:
            got = {k: v for k, v in seen["world"].items() if k != "sync"}
            if got != EXPECTED_2BIT:
                failures.append(f"2bit: expected {EXPECTED_2BIT}, got {got}")
        if world.rank == 0:
            print(f"{op}: {seen['world']}")
    allf = world.allgather(failures)
    if world.rank == 0:
        for r, fs in enumerate(allf):
            for f in fs:
                print(f"FAIL rank {r}: {f}")
        if not any(allf):
            print("ok counts")
    sys.stdout.flush()
    return 0 if not any(allf) else 1


if __name__ == "__main__":
    sys.exit({"counts": _counts_main}[sys.argv[1]]())
