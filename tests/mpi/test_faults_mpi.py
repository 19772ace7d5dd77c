"""Faults on some ranks: the same error class on every rank, no hang, nothing
changed (no buffer, no residual, no call count).

Three parts: every combination of "this rank's buffer is rejected before its
size is read" with "the other ranks disagree with each other" (3 and 4
ranks); finite values that a wire format cannot carry, per compressor and
dtype, in the worker and the owner stage; and a seeded random mix of
per-rank faults at any rank count.
"""
import time

import numpy as np
import pytest

import mpigc

from conftest import assert_all, grads

# ranks: a search over faults: 3 and 4 each give their own disagreeing combinations
pytestmark = pytest.mark.ranks(1, 2, 3, 4)

N = 3000  # elements per buffer (conftest sets MPIGC_MIN_COMPRESS_BYTES=0: all compressed)


def _state_bytes(fb):
    """The residuals and call counts of store ``fb``, as comparable bytes."""
    out = {}
    for key, st in fb.state_dict().items():
        parts = [st["calls"]]
        for part in ("worker", "owner"):
            a = st[part]
            parts.append(None if a is None else (a.dtype.str, a.tobytes()))
        out[key] = tuple(parts)
    return out


def _reject(how, x):
    """``x`` made unacceptable, in a way found before its size is read."""
    if how == "not_array":
        return x.tolist()
    if how == "int_dtype":
        return x.astype(np.int32)
    if how == "empty":
        return x[:0]
    if how == "noncontiguous":
        return np.repeat(x, 2)[::2]
    if how == "readonly":
        x = x.copy()
        x.flags.writeable = False
        return x
    raise AssertionError(how)


def _outcome(fn):
    """(exception class name or None, message)"""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - compared across ranks
        return type(exc).__name__, str(exc)
    return None, ""


def _same_everywhere(value, comm):
    return len({repr(v) for v in comm.allgather(value)}) == 1


REJECTED = ["not_array", "int_dtype", "empty", "noncontiguous", "readonly"]


@pytest.mark.mpi
@pytest.mark.parametrize("disagree", ["size", "dtype", "settings"])
@pytest.mark.parametrize("rejected", REJECTED)
def test_rejected_buffer_while_others_disagree(comm, fb, rejected, disagree):
    """Rank 0's buffer is rejected; ranks 1 and 2 disagree (rank 3, if any,
    agrees with rank 1): MismatchError on every rank, no hang, no change."""
    if comm.size < 3:
        pytest.skip("needs 3 ranks: one rejected, two that disagree")
    r = comm.rank
    mpigc.allreduce(grads(r, N), "2bit", key="k", feedback=fb)  # residuals exist
    before = _state_bytes(fb)
    odd = r == 2
    n = N + 1 if (odd and disagree == "size") else N
    dtype = np.float64 if (odd and disagree == "dtype") else np.float32
    threshold = 0.25 if (odd and disagree == "settings") else 0.5
    x = grads(r, n, dtype)
    if r == 0:
        x = _reject(rejected, x)
    keep = np.array(x, copy=True) if r else None
    # a dtype mismatch makes the key's state a StateError on the odd rank
    key = "k" if disagree != "dtype" else "k2"
    name, msg = _outcome(lambda: mpigc.allreduce(x, "2bit", key=key, feedback=fb,
                                                 threshold=threshold))
    assert_all(name == "MismatchError", f"got {name}: {msg}")
    assert_all(_same_everywhere(name, comm), "different errors on different ranks")
    assert_all(f"disagree on the {disagree}" in msg, msg)
    assert_all(keep is None or np.array_equal(x, keep), "buffer changed")
    assert_all(_state_bytes(fb) == before, "residuals changed")
    # the communicator is usable afterwards: the next call works everywhere
    y = np.ones(N, np.float32)
    mpigc.allreduce(y, "none")
    assert_all(np.all(y == comm.size), "the next call failed")


# ----------------------------------------------------------------------------
# finite values that a wire format cannot carry
# ----------------------------------------------------------------------------
OPS = {"none": {"type": "none"}, "2bit": {"type": "2bit", "threshold": 0.5},
       "2bit_rel": {"type": "2bit", "rel_threshold": 1.5},
       "1bit": {"type": "1bit"}, "terngrad": {"type": "terngrad", "error_feedback": True},
       "fp16": {"type": "fp16", "error_feedback": True},
       "bf16": {"type": "bf16", "error_feedback": True}}
# (op, dtype) whose largest finite values do not fit the wire (see
# docs/wire-format.md, "Values a wire format cannot carry")
BEYOND = {("fp16", np.float32), ("fp16", np.float64), ("bf16", np.float32),
          ("bf16", np.float64), ("1bit", np.float64),
          ("terngrad", np.float64), ("2bit_rel", np.float32), ("2bit_rel", np.float64)}


def _big(dtype):
    return 1e39 if dtype == np.float64 else float(np.finfo(dtype).max)


@pytest.mark.mpi
@pytest.mark.parametrize("policy", ["raise", "skip"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("name", sorted(OPS))
def test_values_beyond_the_wire_range(comm, fb, name, dtype, policy):
    """The last rank holds finite values as large as its dtype allows (1e39
    for float64). Where the wire cannot carry them: NonFiniteError naming
    the range on every rank (or a NaN result under "skip"), and no buffer or
    residual changed. Elsewhere the call goes ahead with finite residuals."""
    r = comm.rank
    op = OPS[name]
    mpigc.allreduce(grads(r, N, dtype), op, key="k", feedback=fb)
    before = _state_bytes(fb)
    x = grads(r, N, dtype)
    if r == comm.size - 1:
        x[: N // 2] = _big(dtype)
        x[N // 2:] = -_big(dtype)
    keep = x.copy()
    name_got, msg = _outcome(lambda: mpigc.allreduce(x, op, key="k", feedback=fb,
                                                     nonfinite=policy))
    if (name, dtype) in BEYOND:
        if policy == "raise":
            assert_all(name_got == "NonFiniteError" and "beyond the range" in msg
                       and "non-finite values" not in msg, f"got {name_got}: {msg}")
            assert_all(np.array_equal(x, keep), "buffer changed")
        else:
            assert_all(name_got is None and np.isnan(x).all(), f"got {name_got}: {msg}")
        assert_all(_state_bytes(fb) == before, "residuals changed")
        return
    assert_all(name_got is None, f"got {name_got}: {msg}")
    st = fb.state_dict().get("k")
    finite = st is None or all(st[p] is None or np.isfinite(st[p]).all()
                               for p in ("worker", "owner"))
    assert_all(finite, "a residual is not finite")


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["1bit", "terngrad", "2bit_rel", "fp16", "bf16"])
def test_owner_stage_sum_beyond_the_wire_range(comm, fb, name):
    """Every rank's values fit, their sum does not (float64 beyond float32;
    float32 beyond half for fp16): the owners' recompression cannot carry
    it. The call goes ahead (it is past the agreement); the shard arrives
    non-finite on every rank (never a finite 0) and the owner keeps its
    residual as it was."""
    if comm.size < 2:
        pytest.skip("needs 2 ranks for a sum")
    r = comm.rank
    dtype = np.float32 if name == "fp16" else np.float64
    v = 40000.0 if name == "fp16" else float(np.float32(3e38))  # fits float32 exactly
    op = dict(OPS[name], **({"rel_threshold": 1.0} if name == "2bit_rel" else {}))
    mpigc.allreduce(np.ones(N, dtype), op, key="k", feedback=fb)
    owner_before = fb.state_dict()["k"]["owner"].copy()
    x = np.full(N, v, dtype)
    x[1::2] = -v
    mpigc.allreduce(x, op, key="k", feedback=fb)
    st = fb.state_dict()["k"]
    assert_all(not np.isfinite(x).any(), f"finite results: {x[np.isfinite(x)][:4]}")
    assert_all(st["owner"].tobytes() == owner_before.tobytes(), "owner residual changed")
    assert_all(np.isfinite(st["worker"]).all(), "worker residual not finite")


# ----------------------------------------------------------------------------
# random faults
# ----------------------------------------------------------------------------
FAULTS = ["ok", "reject", "size", "dtype", "settings", "nan", "beyond", "busy"]
P_FAULTS = [0.5] + [0.5 / 7] * 7  # half the ranks healthy: every outcome occurs
TRIALS = 40
RANDOM_OPS = ["2bit", "1bit", "terngrad", "fp16"]


def _expected(faults, rejects, op):
    """The error class name every rank must raise (None: the call succeeds),
    from the agreement rules of docs/wire-format.md ("The agreement row")."""
    full = [f for f in faults if f != "reject"]  # rows with size, dtype, settings
    for kind in ("size", "dtype", "settings"):
        if kind in full and any(f != kind for f in full):
            return "MismatchError"
    for f, how in zip(faults, rejects):
        if f == "reject":
            return "DTypeError" if how in ("not_array", "int_dtype") else "InvalidBufferError"
        if f in ("size", "dtype", "busy"):  # the key's state does not fit, or is in use
            return "StateError"
    if "nan" in faults or ("beyond" in faults and op != "2bit"):
        return "NonFiniteError"
    return None


def _trial(comm, rng):
    """One call with random per-rank faults; returns a failure message or None."""
    r, size = comm.rank, comm.size
    faults = [str(f) for f in rng.choice(FAULTS, size, p=P_FAULTS)]
    rejects = [str(h) for h in rng.choice(REJECTED, size)]
    name = str(rng.choice(RANDOM_OPS))
    nan_at = int(rng.integers(N, size=size)[r])  # every draw on every rank
    want = _expected(faults, rejects, name)
    # "2bit" here is MXNet's absolute mode, which carries any finite value
    op = {"2bit": {"type": "2bit", "threshold": 0.5}}.get(name, name)
    fb, ref = mpigc.ErrorFeedback(), mpigc.ErrorFeedback()
    for store in (fb, ref):  # the key "k" has float64 residuals of N values
        mpigc.allreduce(grads(r, N, np.float64), op, key="k", feedback=store)
    # a pending call that holds "k" in fb on the "busy" ranks (in another
    # store elsewhere, with the same settings); ref sees it without the fault
    pend_x = grads(r, N, np.float64, seed=1)
    busy = faults[r] == "busy"
    pending = mpigc.iallreduce(pend_x.copy(), op, key="k",
                               feedback=fb if busy else mpigc.ErrorFeedback())
    ref_pending = mpigc.iallreduce(pend_x.copy(), op, key="k",
                                   feedback=ref if busy else mpigc.ErrorFeedback())
    f = faults[r]
    x = grads(r, N + (f == "size"), np.float32 if f == "dtype" else np.float64, seed=2)
    kw = {"average": f == "settings"}
    if f == "nan":
        x[nan_at] = np.nan
    if f == "beyond":
        x[:3] = [1e39, -1e39, 1e300]
    if f == "reject":
        x = _reject(rejects[r], x)
    keep = np.array(x, copy=True) if isinstance(x, np.ndarray) else None
    got, msg = _outcome(lambda: mpigc.allreduce(x, op, key="k", feedback=fb, **kw))
    pending.wait()
    ref_pending.wait()
    what = f"faults {faults} op {op}"
    if got != want:
        return f"{what}: expected {want}, got {got}: {msg}"
    if want is not None:
        if keep is not None and not np.array_equal(x, keep, equal_nan=True):
            return f"{what}: buffer changed"
        if _state_bytes(fb) != _state_bytes(ref):
            return f"{what}: residuals changed"
    return None


@pytest.mark.mpi
def test_random_faults(comm):
    """Seeded random per-rank faults (the same draw on every rank): on every
    rank the error class the agreement rules give, no hang, the buffer and
    the residuals as if the failed call had not been made."""
    rng = np.random.default_rng(19)  # the same on every rank; hits every case at 1-4 ranks
    t0 = time.perf_counter()
    failures = []
    for _ in range(TRIALS):
        try:
            msg = _trial(comm, rng)
        except Exception as exc:  # noqa: BLE001 - reported after the agreement
            msg = f"{type(exc).__name__}: {exc}"
        if msg is not None:
            failures.append(msg[:400])
    elapsed = time.perf_counter() - t0
    assert_all(not failures, "; ".join(failures[:3]))
    assert_all(elapsed < 60, f"{TRIALS} trials took {elapsed:.1f} s")
