"""Run the examples of ``examples/`` under ``mpirun``, as the tests of
``test_example_lm.py``, ``test_example_gpt_ddp.py`` and
``test_example_gpt_fsdp.py`` do: each run's result is the JSON summary the
example prints last on rank 0.

- :func:`run`: one run, one ``mpirun`` job (``launch=True``: under ``python -m
  mpigc.launch``, for scripts written for torchrun).
- :func:`run_in_one_job`: several runs of an example with a ``main(argv)``,
  one after another in one ``mpirun`` job (this module as its script), so the
  job's start and its imports (torch: about 3 CPU s a rank) are paid once, not
  per run. Each run builds its own model, optimizer and residual store, so a
  run sees nothing of the one before it but the imported modules (the
  resume tests compare runs made so: a run that inherited state would not
  resume bit for bit). A run that raises aborts the job (its traceback on
  stdout), so the runs after it report that, not a hang.
"""
import json
import os
import sys

try:
    from support import launcher
except ImportError:  # this file as the job's script: tests/support is on the path
    import launcher

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples")
_MARK = "== example run "


def example(name):
    """The path of ``examples/NAME``."""
    return os.path.join(EXAMPLES, name)


def _env():
    return dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                GLOO_SOCKET_IFNAME="lo")


def _mpirun(ranks, timeout):
    return ["timeout", str(timeout), "mpirun", "--oversubscribe", "-n", str(ranks),
            sys.executable]


def run(script, *args, launch=False, ranks=2, timeout=300):
    """``mpirun -n RANKS python [-m mpigc.launch] SCRIPT ARGS``: its exit must
    be 0; returns the JSON of the last line of its output."""
    cmd = _mpirun(ranks, timeout) + (["-m", "mpigc.launch"] if launch else []) + [script,
                                                                                *args]
    p = launcher.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout + 60)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


class Job:
    """The outcome of :func:`run_in_one_job`: ``result(i)`` is run ``i``'s JSON
    summary, or fails the test with what the job printed."""

    def __init__(self, n, returncode, stdout, stderr):
        self.n, self.returncode, self.stdout, self.stderr = n, returncode, stdout, stderr
        self.outputs = {}
        current = None
        for line in stdout.splitlines():
            if line.startswith(_MARK):
                current = int(line[len(_MARK):].split(":")[0])
                self.outputs[current] = []
            elif current is not None:
                self.outputs[current].append(line)

    def result(self, i):
        if i not in self.outputs:
            raise AssertionError(
                f"run {i} of {self.n} never started: the job ended before it (exit "
                f"{self.returncode}); the output of its last run:\n"
                + "\n".join(self.outputs.get(max(self.outputs, default=-1), []))[-3000:]
                + "\n--- the job's stderr:\n" + self.stderr[-3000:])
        lines = [x for x in self.outputs[i] if x.strip()]
        ended = self.outputs.get(i + 1) is not None or self.returncode == 0
        if not lines or not ended or not lines[-1].startswith("{"):
            raise AssertionError(
                f"run {i} of {self.n} in the job gave no summary (job exit "
                f"{self.returncode}); its output:\n" + "\n".join(lines)[-3000:]
                + "\n--- the job's stderr:\n" + self.stderr[-3000:])
        return json.loads(lines[-1])


def run_in_one_job(script, runs, ranks=2, timeout=1200):
    """The runs ``runs`` (a list of argument lists) of ``SCRIPT``'s
    ``main(argv)``, one after another in one ``mpirun -n RANKS`` job: a
    :class:`Job`."""
    cmd = _mpirun(ranks, timeout) + [os.path.abspath(__file__), script, json.dumps(runs)]
    p = launcher.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout + 60)
    return Job(len(runs), p.returncode, p.stdout, p.stderr)


def _main(script, runs):
    """In each rank of the job: import SCRIPT as a module, then ``main(argv)``
    for each argument list of RUNS (JSON), rank 0 marking where each begins."""
    import importlib.util
    import traceback

    from mpi4py import MPI
    spec = importlib.util.spec_from_file_location("example_under_test", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    comm = MPI.COMM_WORLD
    for i, argv in enumerate(json.loads(runs)):
        if comm.rank == 0:
            print(f"{_MARK}{i}: {' '.join(argv)}", flush=True)
        try:
            module.main(argv)
        except BaseException:  # the other ranks may wait in a collective: end the job
            traceback.print_exc(file=sys.stdout)
            sys.stdout.flush()
            comm.Abort(1)
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(_main(*sys.argv[1:]))
