"""The one failure report (issue 51 item 4), searched: each rank draws a failure
of its own or none, from a seed, and every rank must raise the same class with
the same text, the one that the rule below predicts, for flat, grouped,
hierarchical (``hierarchy="node"``, nodes of 2) and blocking agreements
(``mpigc._comm.agree``, what checkpoints and the torch layer use).

The rule (docs/engine.md, "The failure report"): ranks whose rows are complete
and disagree on the size: ``MismatchError``; else any failed rank: the class
of the lowest one's error, with the text ``"{call} failed on {k} of {size}
rank(s): {detail}"``, each failing rank's message once, with the ranks that
reported it (``"ranks 0,2: ..."``); else non-finite values: ``NonFiniteError``.
A rank's own message is what the same call raises on ``COMM_SELF``.
"""
import re

import numpy as np
import pytest
from mpi4py import MPI

import mpigc
from mpigc import _comm

from conftest import assert_all

# ranks: 2 pairs (the short path's peer), 3 uneven (a node of 2 + 1), 4 nodes of 2
pytestmark = pytest.mark.ranks(2, 3, 4)

N = 4096  # float32: above $MPIGC_MIN_COMPRESS_BYTES, a compressed call
SEEDS = 12
FAILURES = [None, None, "dtype", "config", "readonly", "size", "nan"]
EARLY = {"dtype": mpigc.DTypeError, "config": mpigc.ConfigError,
         "readonly": mpigc.InvalidBufferError}


def _draw(seed, path, size):
    """Every rank's failure (or None) in scenario ``seed`` of ``path``: the
    same list on every rank."""
    rng = np.random.default_rng([seed, path])
    return [FAILURES[i] for i in rng.integers(len(FAILURES), size=size)]


def _input(fail, rank, grouped):
    """The buffer(s) and parameters of a rank whose failure is ``fail``."""
    n = N + 8 if fail == "size" else N
    bufs = [np.full(n, rank + 1.0, np.float32) for _ in range(2 if grouped else 1)]
    if fail == "dtype":
        bufs[-1] = bufs[-1].astype(np.int32)
    elif fail == "readonly":
        bufs[-1].flags.writeable = False
    elif fail == "nan":
        bufs[0][3] = np.nan
    params = {"threshold": -1.0} if fail == "config" else {}
    return (bufs if grouped else bufs[0]), params


def _call(fail, rank, comm, path, key):
    buf, params = _input(fail, rank, path == "grouped")
    hierarchy = "node" if path == "hierarchical" else "flat"
    mpigc.allreduce(buf, op="2bit", key=key, comm=comm, hierarchy=hierarchy, **params)


def _outcome(fn):
    try:
        fn()
    except mpigc.MpigcError as e:
        return type(e).__name__, str(e)
    return None, None


_ALONE = re.compile(r"^(.*) failed on 1 of 1 rank\(s\): rank 0: (.*)$", re.S)


def _own_message(fail, path, seed):
    """``(call, message)``: what the call says of this failure on one rank."""
    name, text = _outcome(lambda: _call(fail, 0, MPI.COMM_SELF, path, f"self/{path}/{seed}"))
    assert name == EARLY[fail].__name__, (fail, name, text)
    m = _ALONE.match(text)
    assert m, text
    return m.group(1), m.group(2)


def _ranges(ranks):
    out, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ",".join(out)


def _grouped_detail(texts):
    """``texts``: ``[(rank, text)]`` of the failed ranks, by rank."""
    order = {}
    for r, t in texts:
        order.setdefault(t, []).append(r)
    return "; ".join(f"rank{'s' if len(rs) > 1 else ''} {_ranges(rs)}: {t}"
                     for t, rs in order.items())


def _expected(fails, path, seed):
    """``(class name, text or None)`` that every rank must raise (the text is
    predicted for failed ranks; for a mismatch or non-finite values only the
    class)."""
    sizes = {N + 8 if f == "size" else N for f in fails if f not in EARLY}
    if len(sizes) > 1:
        return "MismatchError", None
    bad = [(r, f) for r, f in enumerate(fails) if f in EARLY]
    if bad:
        call, texts = None, []
        for r, f in bad:
            call, msg = _own_message(f, path, seed)
            texts.append((r, msg))
        return (EARLY[bad[0][1]].__name__,
                f"{call} failed on {len(bad)} of {len(fails)} rank(s): "
                + _grouped_detail(texts))
    if "nan" in fails:
        return "NonFiniteError", None
    return None, None


@pytest.mark.mpi
@pytest.mark.parametrize("path", ["flat", "grouped", "hierarchical"])
def test_random_failures_raise_one_report_everywhere(comm, path, monkeypatch):
    monkeypatch.setenv("MPIGC_NODE_SPLIT", "2")
    for seed in range(SEEDS):
        fails = _draw(seed, ["flat", "grouped", "hierarchical"].index(path), comm.size)
        want = _expected(fails, path, seed)
        got = _outcome(lambda: _call(fails[comm.rank], comm.rank, comm, path,
                                     f"rep/{path}/{seed}"))
        every = comm.allgather(got)
        same = all(g == every[0] for g in every)
        right = got[0] == want[0] and (want[1] is None or got[1] == want[1])
        assert_all(same and right,
                   f"seed {seed}, failures {fails}: want {want}, got {got}; all same: {same}")


# the blocking agreement: a caller's classes (by name) and default, as
# checkpoint.py and the torch layer pass them
CLASSES = {c.__name__: c for c in (mpigc.ConfigError, mpigc.StateError, TypeError)}
DEFAULT = mpigc.MismatchError
ERRORS = [None, None, lambda r: mpigc.ConfigError("bad config"),
          lambda r: mpigc.StateError(f"state of rank {r % 2}"), lambda r: OSError("disk full"),
          lambda r: TypeError(""), lambda r: mpigc.MpigcError("plain"),
          lambda r: mpigc.DTypeError("int32")]


def _blocking_text(exc):
    """A rank's message: its own text where its class is carried (one of
    CLASSES), else its class's name first; the class's name if it has none."""
    msg, name = str(exc), type(exc).__name__
    if type(exc) in CLASSES.values():
        return msg or name
    return f"{name}: {msg}" if msg else name


@pytest.mark.mpi
def test_random_failures_of_a_blocking_agreement(comm):
    for seed in range(3 * SEEDS):
        rng = np.random.default_rng([seed, 9])
        make = [ERRORS[i] for i in rng.integers(len(ERRORS), size=comm.size)]
        excs = [None if m is None else m(r) for r, m in enumerate(make)]
        bad = [(r, e) for r, e in enumerate(excs) if e is not None]
        want = (None, None)
        if bad:
            cls = type(bad[0][1]) if type(bad[0][1]) in CLASSES.values() else DEFAULT
            want = (cls.__name__,
                    f"checking failed on {len(bad)} of {comm.size} rank(s): "
                    + _grouped_detail([(r, _blocking_text(e)) for r, e in bad]))
        try:
            _comm.agree(comm, excs[comm.rank], "checking", classes=CLASSES, default=DEFAULT)
            got, chained = (None, None), True
        except Exception as e:  # noqa: BLE001 - compared below
            got, chained = (type(e).__name__, str(e)), e.__cause__ is excs[comm.rank]
        every = comm.allgather(got)
        assert_all(all(g == every[0] for g in every) and got == want and chained,
                   f"seed {seed}: want {want}, got {got}, chained to its own: {chained}")


@pytest.mark.mpi
def test_a_hierarchical_skip_is_one_skipped_step_everywhere(comm, monkeypatch):
    """Non-finite values on one rank under nonfinite="skip": every slice group's
    call fails with a non-finite sum (mpigc._plan.slice_verdict: "nonfinite"),
    every rank gets NaN and counts one skipped step in its store
    (ErrorFeedback.count_skipped_step)."""
    monkeypatch.setenv("MPIGC_NODE_SPLIT", "2")
    fb = mpigc.ErrorFeedback()
    x = np.ones(N, np.float32)
    if comm.rank == comm.size - 1:
        x[5] = np.inf
    y = mpigc.allreduce(x, op="2bit", key="skip", feedback=fb, comm=comm, hierarchy="node",
                        nonfinite="skip")
    assert_all(bool(np.isnan(y).all()) and fb.skipped_steps == 1,
               f"NaN: {bool(np.isnan(y).all())}, skipped_steps {fb.skipped_steps}")
