"""No residual is silently lost: ALGORITHMS.md's conservation (summed over
ranks and steps, what was put in equals what was delivered plus what the
residuals still hold, worker and owner side) checked after every step of
random sequences (seeded, the same on every rank) of single, nonblocking,
grouped, hierarchical (``MPIGC_NODE_SPLIT=2``: their residuals are the
slices' keys) and reduce_scatter calls mixed with what must change no residual:
calls that fail (a non-finite value planted on one rank, a size one rank
gets wrong, a key already in use) or are skipped (``nonfinite="skip"``), and
what must keep every residual: state and checkpoint round trips into a new
store."""
import os
import tempfile

import numpy as np
import pytest
from mpi4py import MPI

import mpigc
from mpigc import _hierarchy
from conftest import assert_all, grads, on_root, raises_everywhere

# ranks: 1 (no exchange), 2 (one node of 2), 3 (uneven shards: key "b" has one
# element; nodes of 2 + 1)
pytestmark = pytest.mark.ranks(1, 2, 3)

#: key -> (size, average, gather): a grouped call's members share the last two
KEYS = {"a": (300, False, "compressed"), "b": (1, False, "compressed"),
        "c": (777, True, "exact"), "d": (64, True, "exact")}
GROUPS = (["a", "b"], ["b", "a"], ["c", "d"], ["d", "c"])
ACTIONS = ["single", "single", "nonblocking", "group", "rs", "hier", "hier-fail", "fail",
           "skip", "mismatch", "busy", "state", "ckpt"]
#: the keys a hierarchical call uses (not averaged: its slices' calls sum)
HIER_KEYS = ["a", "b"]
OPS = {"2bit": "2bit", "1bit": "1bit",
       "terngrad-ef": {"type": "terngrad", "error_feedback": True}}


class Ledger:
    """Per key: what was put in (the ranks' sum, averaged where the key's
    calls average) and what was delivered, on every rank alike."""

    def __init__(self, comm):
        self.comm = comm
        self.put_in = {k: np.zeros(n) for k, (n, _, _) in KEYS.items()}
        self.delivered = {k: np.zeros(n) for k, (n, _, _) in KEYS.items()}

    def gave(self, key, g):
        total = np.empty_like(g)
        self.comm.Allreduce(g, total, op=MPI.SUM)
        self.put_in[key] += total / self.comm.size if KEYS[key][1] else total

    def got(self, key, result):
        self.delivered[key] += result

    def got_shard(self, key, shard):
        self.delivered[key] += np.concatenate(self.comm.allgather(shard))

    def error(self, fb):
        """The largest conservation error over the keys (the same on every
        rank), and the key. A key's residuals are its own entry's and those
        of its hierarchical calls' slices (``key@hier[s/L:n]``: the slice's
        elements of the worker residual, the slice's shard of this rank in
        its inter-node group of the owner's)."""
        comm, st = self.comm, fb.state_dict()
        mine = {k: (np.zeros(n), np.zeros(n)) for k, (n, _, _) in KEYS.items()}
        for name, e in st.items():
            sliced = _hierarchy.parse_slice_key(name)
            k, lo = (name, 0) if sliced is None else (sliced[0], mpigc.shard_bounds(
                sliced[3], sliced[2])[sliced[1]][0])
            worker, owner = mine[k]
            if e["worker"] is not None:
                worker[lo:lo + e["worker"].size] += e["worker"]
            if e["owner"] is not None:
                n = e["n"]
                a, b = mpigc.shard_bounds(n, e["world_size"])[e["rank"]]
                owner[lo + a:lo + b] += e["owner"]
        worst = (0.0, None)
        for k, (n, average, _) in KEYS.items():
            worker, owner = np.empty(n), np.empty(n)
            comm.Allreduce(mine[k][0], worker, op=MPI.SUM)
            comm.Allreduce(mine[k][1], owner, op=MPI.SUM)
            if average:
                worker /= comm.size
            err = float(np.max(np.abs(self.put_in[k] - (self.delivered[k] + worker + owner)),
                               initial=0.0))
            worst = max(worst, (err, k), key=lambda t: t[0])
        return worst


def _run(comm, op, seed, steps, path):
    rng = np.random.default_rng(seed)  # the same on every rank
    fb, book, taken = mpigc.ErrorFeedback(), Ledger(comm), []

    def g(key, step):
        return grads(comm.rank, KEYS[key][0], np.float64, seed=1000 * seed + 10 * step
                     + sorted(KEYS).index(key), scale=0.3)

    def kw(key):
        _, average, gather = KEYS[key]
        return dict(op=op, average=average, gather=gather, feedback=fb)
    for step in range(steps):
        what = ACTIONS[rng.integers(len(ACTIONS))]
        key = sorted(KEYS)[rng.integers(len(KEYS))]
        taken.append(what)
        if what == "single":
            x = g(key, step)
            book.gave(key, x)
            book.got(key, mpigc.allreduce(x, key=key, **kw(key)))
        elif what == "nonblocking":  # two keys in flight together
            other = sorted(set(KEYS) - {key})[rng.integers(len(KEYS) - 1)]
            xs = {k: g(k, step) for k in (key, other)}
            for k in (key, other):  # before the calls: results may be written in place
                book.gave(k, xs[k])
            reqs = {k: mpigc.iallreduce(xs[k], key=k, **kw(k)) for k in (key, other)}
            for k in (other, key):
                book.got(k, reqs[k].wait())
        elif what == "group":
            keys = GROUPS[rng.integers(len(GROUPS))]
            xs = [g(k, step) for k in keys]
            for k, x in zip(keys, xs):
                book.gave(k, x)
            out = mpigc.allreduce(xs, key=keys, **kw(keys[0]))
            for k, r in zip(keys, out):
                book.got(k, r)
        elif what in ("hier", "hier-fail"):
            key = HIER_KEYS[rng.integers(len(HIER_KEYS))]
            x = g(key, step)
            if what == "hier":
                book.gave(key, x)
                book.got(key, mpigc.allreduce(x, key=key, hierarchy="node", **kw(key)))
            else:  # a NaN on the last rank: its slice's group fails, every slice put back
                if comm.rank == comm.size - 1:
                    x[-1] = np.nan
                raises_everywhere(mpigc.NonFiniteError, lambda: mpigc.allreduce(
                    x, key=key, hierarchy="node", **kw(key)))
        elif what == "rs":
            x = g(key, step)
            book.gave(key, x)
            book.got_shard(key, mpigc.reduce_scatter(x, key=key, op=op, feedback=fb,
                                                     average=KEYS[key][1]))
        elif what in ("fail", "skip"):
            x = g(key, step)
            if comm.rank == int(rng.integers(comm.size)):
                x[int(rng.integers(x.size))] = np.nan
            else:
                rng.integers(x.size)  # the same draws on every rank
            if what == "fail":
                raises_everywhere(mpigc.NonFiniteError,
                                  lambda: mpigc.allreduce(x, key=key, **kw(key)))
            else:
                r = mpigc.allreduce(x, key=key, nonfinite="skip", **kw(key))
                assert_all(bool(np.isnan(r).all()), f"step {step}: a skipped call's result")
        elif what == "mismatch" and comm.size > 1:  # one rank's buffer one longer
            x = g(key, step)
            if comm.rank == comm.size - 1:
                x = np.append(x, 1.0)
            raises_everywhere(mpigc.MismatchError,
                              lambda: mpigc.allreduce(x, key=key, **kw(key)))
        elif what == "busy":  # a key in use by a pending call, used again
            x = g(key, step)
            book.gave(key, x)
            req = mpigc.iallreduce(x.copy(), key=key, **kw(key))
            raises_everywhere(mpigc.StateError,
                              lambda: mpigc.allreduce(x.copy(), key=key, **kw(key)))
            book.got(key, req.wait())
        elif what == "state":  # into a new store
            fresh = mpigc.ErrorFeedback()
            fresh.load_state_dict(fb.state_dict())
            fb = fresh
        else:  # "ckpt", into a new store
            mpigc.save_checkpoint(path, feedback=fb, step=step)
            fresh = mpigc.ErrorFeedback()
            mpigc.load_checkpoint(path, feedback=fresh)
            fb = fresh
        err, k = book.error(fb)
        assert_all(err < 1e-9 * (step + 1) * comm.size,
                   f"seed {seed} step {step} ({what} on {key}) after {taken}: key {k}'s "
                   f"residuals and deliveries miss {err} of what was put in")
    return taken


@pytest.mark.mpi
@pytest.mark.parametrize("op", list(OPS))
def test_random_sequences_conserve_every_input(comm, op, monkeypatch):
    monkeypatch.setenv("MPIGC_NODE_SPLIT", "2")  # emulated nodes of two ranks
    d = on_root(lambda: tempfile.mkdtemp(prefix="mpigc-conservation-"), comm)
    path = os.path.join(d, "ckpt")
    seen = set()
    for seed in range(4):
        seen.update(_run(comm, OPS[op], 17 * seed + len(op), 20, path))
    assert_all(seen == set(ACTIONS), f"not every action ran: {set(ACTIONS) - seen}")
