"""Helpers for the MPI tests (run under mpirun with ``--with-mpi``).

Tests agree on pass/fail across ranks before asserting, so that one failing
rank cannot leave the others blocked in a collective.
"""
import os

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


@pytest.fixture
def fb():
    """A fresh residual store per test (the default store is process-wide)."""
    return mpigc.ErrorFeedback()


def all_ok(cond, comm=MPI.COMM_WORLD):
    """True on every rank iff ``cond`` is true on every rank."""
    return bool(comm.allreduce(bool(cond), op=MPI.LAND))


def assert_all(cond, msg="", comm=MPI.COMM_WORLD):
    ok = all_ok(cond, comm)
    bad = comm.allgather(None if cond else msg)
    assert ok, "failed on " + "; ".join(f"rank {r}: {m}" for r, m in enumerate(bad)
                                         if m is not None)


def raises_everywhere(exc_type, fn, comm=MPI.COMM_WORLD):
    """Call ``fn`` on every rank; assert it raised ``exc_type`` on every rank."""
    try:
        fn()
        got = None
    except Exception as e:  # noqa: BLE001
        got = e
    assert_all(isinstance(got, exc_type),
               f"expected {exc_type.__name__}, got {type(got).__name__}: {got}", comm)
    return got


def grads(rank, n, dtype=np.float32, seed=0, scale=1.0):
    """Deterministic gradient of ``rank`` (every rank can rebuild any rank's)."""
    rng = np.random.default_rng([seed, rank])
    return (rng.standard_normal(n) * scale).astype(dtype)
