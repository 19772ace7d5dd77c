"""An exception other than an MpigcError on one rank in the middle of a call
(a defect, a failed allocation, an MPI error) aborts the job with the rank and
the traceback on stderr; before, the peers waited forever for the call's
messages (the failing rank raised, went on, and the job hung).

Each case runs ``tests/mpi/internal_error_job.py`` under ``mpirun``: rank 1's
1bit decoder raises after the ranks agreed. With
``MPIGC_ON_INTERNAL_ERROR=raise`` the same job hangs (the case below that
checks it waits 20 s for that).
"""
import os
import shutil
import signal
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "mpi", "internal_error_job.py")
TIMEOUT = 120


def _command(ranks, mode, env, script=SCRIPT):
    """``mpirun`` of a job script (``mode``, if not None, its argument) and
    its environment (``env`` passed on)."""
    mpirun = shutil.which("mpirun") or shutil.which("mpiexec")
    if mpirun is None:
        pytest.skip("no mpirun on PATH")
    e = {k: v for k, v in os.environ.items() if not k.startswith("MPIGC_")}
    e.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
             OMPI_MCA_rmaps_base_oversubscribe="1",
             PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe", PYTHONUNBUFFERED="1",
             **env)
    cmd = [mpirun, "--oversubscribe", "-n", str(ranks)]
    for k in env:
        cmd += ["-x", k]
    return cmd + [sys.executable, script] + ([] if mode is None else [mode]), e


def _run(ranks, mode, **env):
    cmd, e = _command(ranks, mode, env)
    return subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=TIMEOUT)


@pytest.mark.parametrize("ranks,mode,env", [
    (2, "blocking", {}),
    (3, "nonblocking", {}),
    (4, "hier", {"MPIGC_NODE_SPLIT": "2"}),
    (2, "short", {}),
])
def test_a_defect_on_one_rank_aborts_the_job(ranks, mode, env):
    r = _run(ranks, mode, **env)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-4000:]
    assert "RuntimeError in " in out and "aborting the job" in out, out[-4000:]
    if mode == "short":  # in the short path of small calls
        assert "planted defect in verdict" in out and "_shortcall.py" in out, out[-4000:]
    else:
        assert "planted defect in unpack_1bit_shards" in out, out[-4000:]
    assert "MPIGC_ON_INTERNAL_ERROR=raise" in out
    assert ": done" not in r.stdout, out[-4000:]  # nobody got past the barrier


def test_one_rank_raises():
    """Nobody waits at one rank: the exception is the caller's."""
    r = _run(1, "blocking")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "rank 0: raised: planted defect" in r.stdout
    assert "rank 0: done" in r.stdout


def test_raise_setting_leaves_the_peers_waiting():
    """``MPIGC_ON_INTERNAL_ERROR=raise``: rank 1 raises and goes on; rank 0
    waits for it forever (what happened to every such error before)."""
    cmd, e = _command(2, "blocking", {"MPIGC_ON_INTERNAL_ERROR": "raise"})
    p = subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=20)
        pytest.fail(f"the job ended (exit {p.returncode}); expected a hang:\n{out[-4000:]}")
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
    assert "rank 1: raised: planted defect" in out, out[-4000:]
    assert "aborting the job" not in out
