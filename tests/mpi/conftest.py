"""Helpers for the MPI tests (run under mpirun with ``--with-mpi``).

Tests agree on pass/fail across ranks before asserting, so that one failing
rank cannot leave the others blocked in a collective. Rank-local work (``if
RANK == 0: ...``) goes through :func:`on_root`, which hands its result or its
error to every rank.

A watchdog backs this up for the tests that miss a case: after every phase of
every test (setup, call, teardown) the ranks agree, on a private communicator,
that they all finished it. A rank whose phase failed (or was skipped) waits
``MPIGC_TEST_AGREE_TIMEOUT`` seconds (default 10) for the others; if they do not
arrive, they are stuck in a collective of that test that this rank will never
join, and the rank prints its failure and aborts the whole job
(``MPI.COMM_WORLD.Abort``) instead of leaving the job to hang until the outer
``timeout``. A rank that passed waits as long as it takes.

Each test file declares the world sizes that matter for it, near its top::

    pytestmark = pytest.mark.ranks(2, 3)  # why these counts

(1 for single-rank semantics, 2 for the short path and pairs, 3 for uneven
shards, 4 for nodes of 2, the house style). Under
``mpirun -n K`` a file's tests are skipped, with the reason in ``-rs``, at a
K it does not declare; a file that declares nothing (or something that is not
a list of rank counts) is a collection error, so a new file must choose.
``MPIGC_TEST_ALL_RANKS=1`` runs every file at every K.

A test that matters at fewer counts than its file's narrows them with a marker
of its own, which wins over the file's (``@pytest.mark.ranks(2)`` above the
test: a pair-only check skips at 3 and 4 while the rest of the file runs
there); its counts must be among the file's.
"""
import faulthandler
import os
import re
import sys
import time

import numpy as np
import pytest
from mpi4py import MPI

# the tests check the compressed path bit for bit on small buffers too: no
# small-buffer fallback to plain MPI unless a test asks for it
os.environ["MPIGC_MIN_COMPRESS_BYTES"] = "0"

import mpigc


@pytest.fixture
def comm():
    return MPI.COMM_WORLD


class _Since:
    """``counter[0]``: how much ``mpigc.diagnostics.counters()[name]`` grew
    since the fixture was made (on this rank)."""

    def __init__(self, name):
        self.name = name
        self.base = mpigc.diagnostics.counters()[name]

    def __getitem__(self, i):
        assert i == 0
        return mpigc.diagnostics.counters()[self.name] - self.base


@pytest.fixture
def starts():
    """How many calls took the pipelined path on this rank."""
    return _Since("pipelined_calls")


@pytest.fixture
def typed():
    """How many messages this rank sent or received as a derived datatype
    (beyond ``$MPIGC_MAX_COUNT`` bytes)."""
    return _Since("typed_messages")


@pytest.fixture
def fb():
    """A fresh residual store per test (the default store is process-wide)."""
    return mpigc.ErrorFeedback()


def fresh_comm(comm):
    """A duplicate of ``comm``, hence a fresh op="auto" model (yielded; then
    the model's last posted sums waited for and the duplicate freed)."""
    from mpigc import _auto
    c = comm.Dup()
    yield c
    _auto.model_of(c).settle()
    c.Free()


@pytest.fixture
def dup(comm):
    """A fresh communicator per test: a fresh op="auto" model (:func:`fresh_comm`)."""
    yield from fresh_comm(comm)


def all_ok(cond, comm=MPI.COMM_WORLD):
    """True on every rank iff ``cond`` is true on every rank."""
    return bool(comm.allreduce(bool(cond), op=MPI.LAND))


def assert_all(cond, msg="", comm=MPI.COMM_WORLD):
    ok = all_ok(cond, comm)
    bad = comm.allgather(None if cond else msg)
    assert ok, "failed on " + "; ".join(f"rank {r}: {m}" for r, m in enumerate(bad)
                                         if m is not None)


def raises_everywhere(exc_type, fn, comm=MPI.COMM_WORLD, match=None):
    """Call ``fn`` on every rank; assert it raised ``exc_type`` (whose message
    matches the regular expression ``match``, when given) on every rank."""
    try:
        fn()
        got = None
    except Exception as e:  # noqa: BLE001
        got = e
    ok = isinstance(got, exc_type) and (match is None or re.search(match, str(got)))
    assert_all(ok, f"expected {exc_type.__name__}"
               + (f" matching {match!r}" if match else "")
               + f", got {type(got).__name__}: {got}", comm)
    return got


def grads(rank, n, dtype=np.float32, seed=0, scale=1.0):
    """Deterministic gradient of ``rank`` (every rank can rebuild any rank's)."""
    rng = np.random.default_rng([seed, rank])
    return (rng.standard_normal(n) * scale).astype(dtype)


def on_root(fn, comm=MPI.COMM_WORLD):
    """``fn()`` on rank 0 only, its result broadcast to every rank; if it raises
    on rank 0, the same exception is raised on every rank (before any other
    collective), so rank-local work cannot leave the others waiting. The other
    ranks sleep while they wait (a blocking MPI call spins: a child job that
    rank 0 runs would get no core)."""
    result = error = None
    if comm.rank == 0:
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001
            error = e
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.01)
    result, what = comm.bcast((result, None if error is None else
                               f"{type(error).__name__}: {error}") if comm.rank == 0 else None)
    if error is not None:
        raise error
    if what is not None:
        raise RuntimeError(f"rank 0 failed: {what}")
    return result


@pytest.fixture
def watchdog():
    """A hang of this test kills the rank, with its traceback on stderr,
    after 120 s (for tests of waits whose default timeout is 1800 s, so that
    a hang fails the test instead of stalling the run until the outer
    ``timeout``); disarmed when the test ends."""
    faulthandler.dump_traceback_later(120, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


# -- watchdog: a rank never leaves a test alone -----------------------------------
_AGREE = {}


def pytest_sessionstart(session):
    # the watchdog's private communicator, made while every rank is here
    # (Dup is collective: made later, it could wait on a rank stuck in a test)
    if "comm" not in _AGREE:
        _AGREE["comm"] = MPI.COMM_WORLD.Dup()


def _agree_timeout():
    return float(os.environ.get("MPIGC_TEST_AGREE_TIMEOUT", "10"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if MPI.COMM_WORLD.Get_size() == 1 or not item.config.getoption("with_mpi", False):
        return
    comm = _AGREE["comm"]
    left_early = not report.passed  # failed, or skipped/xfailed on this rank
    req = comm.Ibarrier()
    deadline = time.monotonic() + _agree_timeout()
    while not req.Test():
        if left_early and time.monotonic() > deadline:
            rank = MPI.COMM_WORLD.Get_rank()
            sys.stderr.write(
                f"\n{report.longreprtext}\n\nmpigc tests: rank {rank}: {item.nodeid} "
                f"{report.outcome} in its {report.when} phase (report above), and the other "
                f"ranks did not finish that phase within {_agree_timeout():g} s "
                f"(MPIGC_TEST_AGREE_TIMEOUT): they wait in a collective this rank will not "
                f"join. Aborting every rank.\n")
            sys.stderr.flush()
            sys.stdout.flush()
            MPI.COMM_WORLD.Abort(3)
        time.sleep(0.01)


# -- rank counts: each test file declares the world sizes that matter for it -------
def _ranks_error(module):
    """Why ``module`` (a collected test file) has no valid ``ranks`` marker, or None."""
    marks = [m for m in module.own_markers if m.name == "ranks"]
    if not marks:
        return ("declares no rank counts: add `pytestmark = pytest.mark.ranks(...)` near "
                "its top (1 single-rank semantics, 2 the short path and pairs, 3 uneven "
                "shards, 4 nodes of 2; see tests/mpi/conftest.py)")
    for m in marks:
        if m.kwargs or not m.args or not all(isinstance(k, int) and not isinstance(k, bool)
                                             and k >= 1 for k in m.args):
            args = ", ".join(map(repr, m.args))
            return f"has an invalid marker ranks({args}): expected ranks(K, ...), each K >= 1"
    return None


class _RankedModule(pytest.Module):
    def collect(self):
        items = super().collect()  # imports the file: its pytestmark is in own_markers
        why = _ranks_error(self)
        if why is not None:
            raise self.CollectError(f"{self.path.name} {why}")
        return items


def pytest_pycollect_makemodule(module_path, parent):
    if module_path.name.startswith("test_") and module_path.suffix == ".py":
        return _RankedModule.from_parent(parent, path=module_path)
    return None


def pytest_collection_modifyitems(config, items):
    if os.environ.get("MPIGC_TEST_ALL_RANKS", "") not in ("", "0"):
        return
    size = MPI.COMM_WORLD.Get_size()
    for item in items:
        mark = item.get_closest_marker("ranks")
        own = [m for m in item.own_markers if m.name == "ranks"]
        if own:  # a test's own counts: valid, and among its file's
            module = item.getparent(pytest.Module)
            outer = [m for m in module.own_markers if m.name == "ranks"] if module else []
            bad = (own[0].kwargs or not own[0].args
                   or not all(isinstance(k, int) and not isinstance(k, bool) and k >= 1
                              for k in own[0].args)
                   or (outer and not set(own[0].args) <= set(outer[0].args)))
            if bad:
                raise pytest.UsageError(
                    f"{item.nodeid}: invalid marker ranks({', '.join(map(repr, own[0].args))}):"
                    f" expected ranks(K, ...), each K >= 1 and among its file's counts")
        if mark is not None and size not in mark.args:
            counts = ", ".join(map(str, mark.args))
            who = item.name if own else item.path.name
            item.add_marker(pytest.mark.skip(
                reason=f"{who} runs at {counts} rank(s) only (its "
                       f"pytest.mark.ranks; MPIGC_TEST_ALL_RANKS=1 runs it at {size})"))
