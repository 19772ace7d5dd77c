"""Run a test module's slow subprocess checks side by side.

The CUDA-simulator checks each run in a subprocess (the simulator must be on
before ``numba.cuda`` is imported, so never in the pytest process) and each
keeps one core busy for minutes: the simulator runs every CUDA thread as a
Python thread under one GIL. Run one after another, they left the other cores
idle and were most of the suite's time. A module hands its selected runs to
``Runs.start`` when its first such test runs; they start in the background, at
most ``workers()`` at a time, and each test waits for its own result. What a
test checks does not change: the same command, environment and time limit, and
its own assertion on its own output.

A run that needs another's output (the PTX compile of the kernel signatures
that a simulator run records) follows it in the same slot (``then``), so it
starts as soon as its input is there instead of when its test comes up.

``MPIGC_TEST_JOBS=1`` runs them one at a time again.
"""
import concurrent.futures
import os
import subprocess

from support import launcher


def workers():
    """Runs at a time: ``$MPIGC_TEST_JOBS``, else the cores this process may use."""
    env = os.environ.get("MPIGC_TEST_JOBS", "").strip()
    if env:
        return max(1, int(env))
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def _run(argv, env, timeout):
    try:
        # made once more if mpirun itself did not start (tests/support/launcher.py)
        return launcher.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        return exc


def _steps(steps, futures):
    """Run ``steps`` ([(key, argv, env, timeout)]) one after the other, each
    result (or the exception that kept it from running) into its future."""
    for key, argv, env, timeout in steps:
        try:
            futures[key].set_result(_run(list(argv), env, timeout))
        except BaseException as exc:  # noqa: BLE001 - the test waiting for it raises it
            futures[key].set_exception(exc)


class Runs:
    """Subprocess runs by key, started in the background by ``start``; a run's
    time limit counts from when it starts, not from when it was queued."""

    def __init__(self):
        self._pool = None
        self._runs = {}

    def start(self, jobs, then=None):
        """Queue ``jobs`` ({key: (argv, env, timeout)}, in the order given:
        longest first makes the whole shortest) that are not queued yet.
        ``then`` ({key: [(key2, argv2, env2, timeout2), ...]}): runs that
        follow job ``key`` in its slot, one after the other, whatever its
        outcome (each test still checks the runs it needs)."""
        then = then or {}
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(workers())
        for key, (argv, env, timeout) in jobs.items():
            if key in self._runs:
                continue
            steps = [(key, argv, env, timeout)] + [s for s in then.get(key, ())
                                                   if s[0] not in self._runs]
            futures = {s[0]: concurrent.futures.Future() for s in steps}
            self._runs.update(futures)
            self._pool.submit(_steps, steps, futures)

    def result(self, key, argv, env, timeout):
        """The ``subprocess.CompletedProcess`` (or ``subprocess.TimeoutExpired``)
        of run ``key``; a run nobody queued starts now, alone."""
        if key not in self._runs:
            return _run(argv, env, timeout)
        return self._runs[key].result()


def selected(request, test_name, *params):
    """The values of parametrize arguments ``params`` of ``test_name`` (a
    value for one argument, a tuple for several) among the tests of this
    pytest session that are selected to run, in their order."""
    path = str(request.node.path)
    out = []
    for it in request.session.items:
        if (getattr(it, "originalname", None) == test_name and str(it.path) == path
                and hasattr(it, "callspec")):
            vals = tuple(it.callspec.params[p] for p in params)
            out.append(vals[0] if len(params) == 1 else vals)
    return out


def chosen(request, test_name):
    """Whether a test ``test_name`` of this module is selected to run in this
    pytest session (any of its parametrizations)."""
    path = str(request.node.path)
    return any(getattr(it, "originalname", None) == test_name and str(it.path) == path
               for it in request.session.items)
