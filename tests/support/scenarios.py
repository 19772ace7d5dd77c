"""What the two searches for hangs share (tests/mpi/test_schedules_mpi.py on
real MPI, tests/support/model_check.py on the fake one): drawing the calls of a
scenario, a call's input on a rank, with its fault, and how a call ended."""
import numpy as np

from mpigc import MpigcError

OPS = ["none", "2bit", "1bit", "terngrad", "fp16"]
FAULTS = ["none"] * 6 + ["size", "reject", "nan-raise", "nan-skip"]


def draw_calls(rng, size, sizes, hier_ok=None, comms=None):
    """2 to 6 call specs drawn from ``rng``: kind, op, size (of ``sizes``),
    hierarchical (only when ``hier_ok`` is not None; drawn only when it is
    true), blocking, fault and the rank that has it, and the communicator
    (of ``comms``, when given)."""
    calls = []
    for i in range(int(rng.integers(2, 7))):
        fault = rng.choice(FAULTS)
        c = {"i": i, "kind": str(rng.choice(["allreduce", "reduce_scatter"])),
             "op": str(rng.choice(OPS)), "n": int(rng.choice(sizes))}
        if hier_ok is not None:
            c["hier"] = bool(hier_ok and rng.random() < 0.3)
        c["blocking"] = bool(rng.random() < 0.3)
        c["fault"] = str(fault) if size > 1 else "none"
        c["culprit"] = int(rng.integers(size))
        if comms is not None:
            c["comm"] = str(rng.choice(comms))
        calls.append(c)
    return calls


def call_input(c, rank, step=0):
    """Rank ``rank``'s buffer for call spec ``c`` (its ``i``, ``n``,
    ``fault`` and ``culprit``): another size, a NaN, or a dtype rejected
    before the size is read on the culprit rank; a list of ``c["group"]``
    arrays for a grouped call."""
    rng = np.random.default_rng([c["i"], rank, step])
    n = c["n"]
    if c["fault"] == "size" and rank == c["culprit"]:
        n += 1
    x = rng.standard_normal(n).astype(np.float32)
    if c["fault"].startswith("nan") and rank == c["culprit"]:
        x[n // 2] = np.nan
    if c["fault"] == "reject" and rank == c["culprit"]:
        x = x.astype(np.int32)  # DTypeError before its size is read
    if c.get("group"):
        # a grouped call: the buffer cut into that many members (the fault
        # lands in one of them)
        return np.array_split(x, c["group"])
    return x


def outcome(fn):
    """``("ok", result bytes)`` or ``("error", the MpigcError's class name)``;
    a grouped call's results, one after the other."""
    try:
        res = fn()
        if isinstance(res, (list, tuple)):
            return ("ok", b"".join(np.asarray(a).tobytes() for a in res))
        return ("ok", np.asarray(res).tobytes())
    except MpigcError as e:
        return ("error", type(e).__name__)


def state_bytes(fb):
    """Residual store ``fb`` as comparable values: ``{key: (calls, worker
    bytes, owner bytes)}``."""
    return {key: (st["calls"],) + tuple(None if st[p] is None else st[p].tobytes()
                                        for p in ("worker", "owner"))
            for key, st in fb.state_dict().items()}
