"""A script that ends on one rank with an exception, or ``sys.exit(n)``, n not
0, aborts the job (issue 50 item 2), as ``torchrun`` tears a job down when a
worker fails and ``python -m mpi4py`` aborts: under ``python -m mpigc.launch``
and, for exceptions, from a plain ``python`` script that called
``mpigc.torch.init_process_group()``. Before, the job hung: the failing rank
waited in ``MPI_Finalize`` at exit and the others in their next call.

Each case runs ``tests/mpi/launch_abort_job.py`` under ``mpirun`` (rank 1
fails, the others wait for it) under a timeout: a hang fails the test. Only
the failing rank's output is read (its stderr file, written before it
aborts); the others are killed by ``mpirun`` wherever they are.
"""
import os
import signal
import subprocess
import sys

import pytest

from test_internal_error import _command

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "mpi", "launch_abort_job.py")
# A job ends in 4-8 s here, 15-31 s where it imports torch (load average 18 on
# 2 cores): a hang fails the test after
TIMEOUT, TORCH_TIMEOUT = 60, 120


def _run(ranks, case, tmp_path, *, how="launch", env=None):
    """``mpirun`` of the job, under the launcher or plain ``python`` (``how``,
    see the job): its exit status and ``mpirun``'s output. Fails the test
    when the job outlives its timeout (it is killed)."""
    timeout = TORCH_TIMEOUT if how != "launch" or case == "ddp" else TIMEOUT
    cmd, e = _command(ranks, case, env or {}, script=SCRIPT)
    cmd.append(str(tmp_path))
    if how != "launch":
        cmd.append(how)
    else:
        i = cmd.index(sys.executable) + 1
        cmd[i:i] = ["-m", "mpigc.launch"]
    p = subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        pytest.fail(f"{case} at {ranks} ranks: the job hung ({timeout} s); "
                    f"rank 1 wrote:\n{_read(tmp_path, 1)[-3000:]}\nmpirun:\n{out[-3000:]}")
    return p.returncode, out


def _read(d, rank, what="err"):
    try:
        with open(os.path.join(d, f"rank{rank}.{what}")) as f:
            return f.read()
    except FileNotFoundError:
        return ""


def _done(d, ranks):
    return [r for r in range(ranks) if os.path.exists(os.path.join(d, f"rank{r}.done"))]


# At 3 ranks: rank 1 fails with a rank waiting on either side of it, which
# covers the 2-rank job (one rank waiting) that each case also ran before (a
# job of 2-3 ranks costs 3-7 CPU s of imports; tests/README.md, where the time
# goes). "during" without the progress thread at 2: neither it nor the
# reduction threads keep the abort from happening
CASES = [pytest.param(3, case, {}, id=f"3-{case}") for case in ("before", "during", "after",
                                                                "ddp")]
CASES.append(pytest.param(2, "during", {"MPIGC_PROGRESS_THREAD": "0"},
                          id="2-during-no-progress-thread"))


@pytest.mark.parametrize("ranks,case,env", CASES)
def test_a_rank_that_raises_aborts_the_job_under_the_launcher(ranks, case, env, tmp_path):
    if case == "ddp":
        pytest.importorskip("torch")
    rc, out = _run(ranks, case, tmp_path, env=env)
    err = _read(tmp_path, 1)
    assert rc == 1, f"exit {rc}\n{err[-3000:]}\n{out[-3000:]}"
    assert (f"mpigc: rank 1 of {ranks}: unhandled RuntimeError in {SCRIPT}: aborting the job "
            f"(MPI_Abort, status 1)") in err, err[-3000:]
    # the traceback, from the script's frame on (not the launcher's)
    assert f'Traceback (most recent call last):\n  File "{SCRIPT}"' in err, err[-3000:]
    assert f"RuntimeError: planted failure on rank 1 ({case})" in err, err[-3000:]
    assert _done(tmp_path, ranks) == [], out[-3000:]  # nobody went past the failure


@pytest.mark.parametrize("ranks", [3])
def test_sys_exit_on_one_rank_aborts_the_job_with_its_status(ranks, tmp_path):
    rc, out = _run(ranks, "exit3", tmp_path)
    err = _read(tmp_path, 1)
    assert rc == 3, f"exit {rc}\n{err[-3000:]}\n{out[-3000:]}"
    assert (f"mpigc: rank 1 of {ranks}: {SCRIPT} exited with status 3: aborting the job "
            f"(MPI_Abort, status 3)") in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]  # an exit, not an error
    assert _done(tmp_path, ranks) == [], out[-3000:]


@pytest.mark.parametrize("ranks", [3])
def test_a_clean_exit_stays_clean(ranks, tmp_path):
    """``sys.exit(0)`` on rank 1, the end of the script on the others."""
    rc, out = _run(ranks, "clean", tmp_path)
    assert rc == 0, out[-3000:]
    assert _done(tmp_path, ranks) == list(range(ranks)), out[-3000:]
    assert all("aborting" not in _read(tmp_path, r) for r in range(ranks)), out[-3000:]


def test_at_one_rank_the_exception_is_raised_as_by_python(tmp_path):
    """Nobody waits: no abort, Python's own traceback and status."""
    rc, out = _run(1, "after", tmp_path)
    err = _read(tmp_path, 0)
    assert rc == 1, f"exit {rc}\n{err[-3000:]}\n{out[-3000:]}"
    assert "RuntimeError: planted failure on rank 0 (after)" in err, err[-3000:]
    assert "aborting" not in err and "MPI_ABORT" not in out, out[-3000:]


@pytest.mark.parametrize("ranks,case,how", [(3, "during", "plain"), (3, "ddp", "plain"),
                                            (2, "during", "hook-first")])
def test_init_process_group_makes_an_exception_abort_the_job(ranks, case, how, tmp_path):
    """Plain ``mpirun python script.py``: ``mpigc.torch.init_process_group``
    installs the hook that aborts the job (``abort_on_exception``), around
    torch.distributed's (which prefixes the traceback's lines with the rank).
    ``hook-first``: ``abort_on_exception()`` before torch.distributed's
    ``init_process_group``, whose hook then wraps it and writes the traceback
    only once mpigc's returns; the job is aborted at exit instead."""
    pytest.importorskip("torch")
    rc, out = _run(ranks, case, tmp_path, how=how)
    err = _read(tmp_path, 1)
    assert rc == 1, f"exit {rc}\n{err[-3000:]}\n{out[-3000:]}"
    # the traceback (torch.distributed's hook prefixes each line with the
    # rank), then mpigc's line
    assert f"[rank1]: RuntimeError: planted failure on rank 1 ({case})\n" in err, err[-3000:]
    assert (f"mpigc: rank 1 of {ranks}: unhandled RuntimeError: aborting the job "
            f"(MPI_Abort, status 1)") in err, err[-3000:]
    assert _done(tmp_path, ranks) == [], out[-3000:]


def test_init_process_group_leaves_a_clean_exit_clean(tmp_path):
    pytest.importorskip("torch")
    rc, out = _run(2, "clean", tmp_path, how="plain")
    assert rc == 0, out[-3000:]
    assert _done(tmp_path, 2) == [0, 1], out[-3000:]
