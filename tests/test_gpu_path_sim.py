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

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "mpi", "test_gpu_path_mpi.py")
TIMEOUT = int(os.environ.get("MPIGC_TEST_TIMEOUT", "900"))

# group -> MPIGC_CUDA_AWARE (None: unset, the library is probed)
GROUPS = {"staged": "0", "aware": "1", "detect": None}


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


@pytest.mark.parametrize("ranks", _SIM_RANKS)
@pytest.mark.parametrize("group", list(GROUPS))
def test_gpu_path_simulator(group, ranks):
    cmd = [_mpirun(), "--oversubscribe", "-n", str(ranks), sys.executable, SCRIPT, group]
    try:
        r = subprocess.run(cmd, env=_env(True, GROUPS[group]), capture_output=True,
                           text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{' '.join(cmd)} timed out after {TIMEOUT} s:\n{exc.stdout}")
    assert r.returncode == 0 and f"ok {group}" in r.stdout, \
        f"{' '.join(cmd)}: exit {r.returncode}\n{r.stdout[-6000:]}\n{r.stderr[-6000:]}"


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
