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
