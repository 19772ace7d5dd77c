"""A launch whose mpirun never started is made once more; nothing else is.

``tests/support/launcher.py`` (for launches kept by ``background.Runs`` and the
examples' jobs) and ``tests/conftest.py`` (for any other plain test). The
launcher here is a shell command that prints Open MPI's message and exits 213
(what ``mpirun`` did in CI, 2026-11-28) as many times as a counter file says.
"""
import os
import subprocess
import sys
import textwrap

from support import launcher

HERE = os.path.dirname(os.path.abspath(__file__))
MESSAGE = launcher.DID_NOT_START[0]


def _flaky(tmp_path, fails, code=213, text=MESSAGE):
    """A command that fails ``fails`` times (printing ``text``, exit ``code``),
    then prints "ran" and exits 0; its number of starts in ``tmp_path/n``."""
    n = tmp_path / "n"
    n.write_text("0")
    script = textwrap.dedent(f"""
        import sys
        k = int(open({str(n)!r}).read()) + 1
        open({str(n)!r}, "w").write(str(k))
        if k <= {fails}:
            print({text!r}, file=sys.stderr)
            sys.exit({code})
        print("ran")
    """)
    return [sys.executable, "-c", script], n


def test_a_launch_that_did_not_start_is_made_once_more(tmp_path):
    argv, n = _flaky(tmp_path, 1)
    p = launcher.run(argv, capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout.strip() == "ran"
    assert n.read_text() == "2"


def test_twice_is_a_failure(tmp_path):
    argv, n = _flaky(tmp_path, 2)
    p = launcher.run(argv, capture_output=True, text=True)
    assert p.returncode == 213 and MESSAGE in p.stderr
    assert n.read_text() == "2"


def test_other_failures_are_not_made_again(tmp_path):
    argv, n = _flaky(tmp_path, 1, code=1, text="MismatchError: op differs")
    p = launcher.run(argv, capture_output=True, text=True)
    assert p.returncode == 1
    assert n.read_text() == "1"


def test_bytes_output_is_read_too(tmp_path):
    argv, n = _flaky(tmp_path, 1)
    p = launcher.run(argv, capture_output=True)
    assert p.returncode == 0 and n.read_text() == "2"


def _pytest_tree(tmp_path, fails, *options):
    """A test tree with this suite's conftest and launcher, and one test whose
    launch fails ``fails`` times with Open MPI's message, run by pytest with
    ``options``."""
    root = tmp_path / "tree"
    (root / "support").mkdir(parents=True)
    (root / "support" / "__init__.py").write_text("")
    for name in ("conftest.py", os.path.join("support", "launcher.py")):
        (root / name).write_text(open(os.path.join(HERE, name)).read())
    counter = tmp_path / "count"
    counter.write_text("0")
    (root / "test_job.py").write_text(textwrap.dedent(f"""
        def test_job():
            k = int(open({str(counter)!r}).read()) + 1
            open({str(counter)!r}, "w").write(str(k))
            assert k > {fails}, "mpirun: exit 213\\n" + {MESSAGE!r}
    """))
    p = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
                        "-rA", "-W", "default", *options, str(root)], cwd=root, capture_output=True,
                       text=True, timeout=120)
    return p, int(counter.read_text())


def test_a_plain_test_whose_mpirun_did_not_start_runs_once_more(tmp_path):
    p, runs = _pytest_tree(tmp_path, 1)
    assert p.returncode == 0, p.stdout + p.stderr
    assert runs == 2 and "1 passed" in p.stdout and "the test ran once more" in p.stdout


def test_a_plain_test_that_fails_so_twice_fails(tmp_path):
    p, runs = _pytest_tree(tmp_path, 2)
    assert p.returncode == 1 and runs == 2 and "1 failed" in p.stdout, p.stdout


def test_tests_of_the_mpi_jobs_never_run_twice(tmp_path):
    # the ranks of a job run its tests in step: one rank alone repeating one
    # would leave the others waiting
    p, runs = _pytest_tree(tmp_path, 1, "--with-mpi")
    assert p.returncode == 1 and runs == 1 and "1 failed" in p.stdout, p.stdout
