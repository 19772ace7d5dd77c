"""Open MPI's launcher failing before any rank starts: recognised, and run once more.

Once in a while ``mpirun`` itself cannot start: PRRTE's PMIx server fails to open
its listener and ``mpirun`` exits 213 before it launches a single rank (seen once
in CI, 2026-11-28, in a plain test that starts its ``mpirun`` beside others; the
same failure is reported for other projects' CI). Nothing of mpigc ran, so the
test checked nothing; the launch is made again, once. Any other failure, and
this one a second time, stays a failure.

Three places use it: ``tests/conftest.py`` runs a plain test again when its
failure says so, ``background.Runs`` runs a queued launch again (its result is
kept, so a test run again would only see the same result), and ``tests/run.sh``
runs the MPI tests at k ranks again when their ``mpirun`` never started pytest.
"""
import subprocess
import sys

# what mpirun prints when it never got to launch a rank (the text of PRRTE's own
# message; tests/run.sh greps the same string)
DID_NOT_START = ("The PMIx server's listener thread failed to start",)


def did_not_start(text):
    """Whether ``text`` (a launch's output) says mpirun never started its ranks."""
    return bool(text) and any(s in text for s in DID_NOT_START)


def _output(p):
    out = ""
    for part in (p.stdout, p.stderr):
        if isinstance(part, bytes):
            part = part.decode(errors="replace")
        out += part or ""
    return out


def run(argv, **kwargs):
    """``subprocess.run(argv, **kwargs)``, made once more if mpirun did not start."""
    p = subprocess.run(argv, **kwargs)
    if p.returncode != 0 and did_not_start(_output(p)):
        print(f"mpirun did not start (Open MPI's launcher, no rank ran): running "
              f"{argv[0]} once more", file=sys.stderr)
        p = subprocess.run(argv, **kwargs)
    return p
