"""A process stays in the one-user-thread mode (waits may block in MPI)
while one user thread calls mpigc: the progress thread, which starts a
nonblocking hierarchical call's inter-node calls, does not count as a
second user thread. Before, it did: one such call advanced by the thread
switched the process to polling waits for good (found in review: 4 of 4
ranks). Runs ``tests/mpi/thread_mode_job.py`` under ``mpirun``."""
import os
import re
import subprocess

from test_internal_error import _command

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "mpi", "thread_mode_job.py")


def test_the_progress_thread_is_not_a_user_thread():
    cmd, env = _command(4, None, {"MPIGC_NODE_SPLIT": "2"}, script=SCRIPT)
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    lines = re.findall(r"rank \d+: thread (\w+) advanced (\d+) several_threads (\w+)",
                       r.stdout)
    assert len(lines) == 4, out[-4000:]
    for thread, advanced, several in lines:
        assert thread == "True" and int(advanced) > 0, out[-4000:]  # the thread ran them
        assert several == "False", out[-4000:]


FIRST_CALL = os.path.join(HERE, "mpi", "thread_first_call_job.py")


def _per_rank(tmp_path, ranks, suffix):
    """The ranks' files ``rank{R}.{suffix}`` written by the job, joined."""
    return "".join((tmp_path / f"rank{r}.{suffix}").read_text()
                   for r in range(ranks) if (tmp_path / f"rank{r}.{suffix}").exists())


def test_a_second_threads_first_call_while_the_first_blocks_in_mpi(tmp_path):
    """The documented pattern (the main thread calls first): rank 0's main
    thread blocks in MPI on communicator A, holding the lock, when its second
    thread's first call (on B) comes; rank 1's second thread calls first.
    Hangs when a second thread does not end the one-thread mode (with
    ``_sched.note_caller`` a no-op: both ranks print HUNG). The lock is held
    for well under ``$MPIGC_FIRST_CALL_WARN_S`` (1 s here): no warning."""
    cmd, env = _command(2, None, {"MPIGC_FIRST_CALL_WARN_S": "1", "JOB_OUT_DIR": str(tmp_path)},
                        script=FIRST_CALL)
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    lines, err = _per_rank(tmp_path, 2, "out"), _per_rank(tmp_path, 2, "err")
    out = r.stdout + r.stderr + err
    assert r.returncode == 0, out[-4000:]
    assert sorted(re.findall(r"rank (\d+): ok several_threads True", lines)) == ["0", "1"], \
        out[-4000:]
    assert "first mpigc call came" not in err, out[-4000:]


def test_a_rank_that_hangs_so_says_why(tmp_path):
    """The hang the contract rules out (two threads race to the first call,
    won by different threads on the two ranks): each rank says on stderr,
    after ``$MPIGC_FIRST_CALL_WARN_S`` seconds, that a second thread's first
    call waits for the engine lock while the first thread waits in MPI, and
    what to do. The job gives up after 6 s (HUNG). Each rank's line and
    stderr are read from its own files, written before any rank exits (read
    from mpirun's output, rank 1's line was lost 1 time in 6: the launcher
    ended it at rank 0's exit)."""
    cmd, env = _command(2, "race", {"MPIGC_FIRST_CALL_WARN_S": "1", "JOB_OUT_DIR": str(tmp_path)},
                        script=FIRST_CALL)
    r = subprocess.run(cmd + ["6"], env=env, capture_output=True, text=True, timeout=180)
    lines, err = _per_rank(tmp_path, 2, "out"), _per_rank(tmp_path, 2, "err")
    out = r.stdout + r.stderr + err
    assert r.returncode != 0, out[-4000:]
    assert sorted(re.findall(r"rank (\d+): HUNG", lines)) == ["0", "1"], out[-4000:]
    warned = re.findall(r"mpigc: rank (\d+): a second thread's first mpigc call came 1 s ago",
                        err)
    assert sorted(warned) == ["0", "1"], out[-4000:]
    assert "make the process's first mpigc call from the main thread" in err
