"""The short path of small calls (mpigc._shortcall) in a fresh job: the MPI
suite runs ``tests/mpi/test_shortcall_mpi.py`` after files whose threads call
mpigc, after which a process never takes the short path; here it runs alone
under ``mpirun -n 2``, where every rank may take it, and must
(``$MPIGC_TEST_EXPECT_SHORT=1``)."""
import os
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="no mpirun on PATH")
def test_short_path_alone_under_mpirun():
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               MPIGC_TEST_EXPECT_SHORT="1")
    env.pop("MPIGC_SHORT_PATH", None)
    cmd = ["timeout", "300", "mpirun", "--oversubscribe", "-n", "2", sys.executable, "-m",
           "pytest", "-p", "no:cacheprovider", "-q", "--color=no", "--with-mpi",
           "test_shortcall_mpi.py"]
    p = subprocess.run(cmd, env=env, cwd=os.path.join(HERE, "mpi"), capture_output=True,
                       text=True, timeout=360)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-3000:]
    assert " passed" in p.stdout and "failed" not in p.stdout
