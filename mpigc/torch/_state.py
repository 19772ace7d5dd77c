"""Residual state of bucketed gradients, per parameter: the per-parameter
state of a set of bucket layouts and its conversions (across bucketings, world
sizes and hierarchical slices), for :class:`mpigc.torch._residuals.Residuals`."""
import numpy as np

from .. import _hierarchy
from .._errors import ConfigError, MismatchError, MpigcError, StateError
from ..compressors import get_compressor
from ..feedback import ErrorFeedback, shard_bounds

from ._common import raise_everywhere
from ._record import is_record, state_for_rank


def _uses_owner(gather, config):
    return gather == "compressed" and get_compressor(dict(config)).uses_feedback


def state_from_layouts(layouts, fbs, comm, gather):
    """Per-parameter residual state (see :meth:`GradientSync.state_dict`)
    from the per-bucket ``fbs`` (an ``ErrorFeedback.state_dict()``) of
    ``layouts`` (collective: one alltoall moves owner shards)."""
    N, r = comm.size, comm.rank
    out, sends = {}, [[] for _ in range(N)]
    for b in layouts:
        s = fbs.get(b.key)
        if s is None:
            continue
        has_owner = _uses_owner(gather, s["config"])
        lo, hi = shard_bounds(b.n, N)[r]
        for name, off, m in zip(b.names, b.offsets, b.numels):
            qlo, qhi = shard_bounds(m, N)[r]
            out[name] = {
                "worker": None if s["worker"] is None else s["worker"][off:off + m].copy(),
                "owner": np.zeros(qhi - qlo, s["dtype"]) if has_owner else None,
                "config": dict(s["config"]), "calls": s["calls"], "world_size": N,
                "rank": r, "n": m, "dtype": s["dtype"]}
            if s["owner"] is None:
                continue
            plo, phi = max(lo - off, 0), min(hi - off, m)  # my owned elements of it
            for j, (jlo, jhi) in enumerate(shard_bounds(m, N)):
                a, z = max(plo, jlo), min(phi, jhi)
                if a < z:
                    sends[j].append((name, a - jlo, s["owner"][off + a - lo:off + z - lo]))
    for pieces in comm.alltoall(sends):
        for name, start, vals in pieces:
            out[name]["owner"][start:start + vals.size] = vals
    return out


def check_state(state, numel_of, N, r):
    """Validate a per-parameter state against ``{name: numel}`` (local)."""
    for name, s in state.items():
        if name not in numel_of:
            continue
        m = numel_of[name]
        if (int(s["world_size"]), int(s["rank"])) != (N, r):
            raise StateError(
                f"{name!r}: residuals of rank {s['rank']} of {s['world_size']}, this "
                f"is rank {r} of {N}; reshard with mpigc.load_checkpoint first")
        if int(s["n"]) != m:
            raise StateError(f"{name!r}: residuals of {s['n']} values, the "
                             f"parameter has {m}")
        qlo, qhi = shard_bounds(m, N)[r]
        if s.get("owner") is not None and np.asarray(s["owner"]).size != qhi - qlo:
            raise StateError(f"{name!r}: owner residual of {np.asarray(s['owner']).size}"
                             f" values, expected {qhi - qlo}")


def store_state(c, feedback, idle, what, lay=None, hier=False):
    """``feedback.state_dict()`` agreed on over ``c`` (collective: a step in
    progress, ``idle()`` raising, or a pending call raises on every rank),
    hierarchical slice keys in the flat form of each bucket."""
    exc = None
    try:
        idle()
        fbs = feedback.state_dict()
    except MpigcError as e:
        exc, fbs = e, {}
    raise_everywhere(c, exc, what)
    if hier:
        fbs = hier_to_flat(c, lay, fbs, c.Get_size(), c.Get_rank())
    return fbs


def incoming_state(c, state, numel_of, strict, idle, what):
    """This rank's per-parameter state from what a ``load_state_dict`` got
    (a per-rank state, or a gathered record of any world size), checked
    against ``{name: numel}`` of the trainable parameters (collective: an
    error on any rank raises on every rank). ``strict``: names that are not
    parameters here, or parameters missing from a non-empty state, raise."""
    exc = None
    try:
        idle()
        if is_record(state):
            state = state_for_rank(state, c.Get_size(), c.Get_rank())
        state = dict(state)
        extra = sorted(set(state) - set(numel_of))
        missing = [n for n in numel_of if n not in state] if state else []
        if strict and (extra or missing):
            raise StateError(f"state names do not match the parameters: unexpected "
                             f"{extra[:5]}, missing {missing[:5]} (strict=False "
                             "ignores them)")
        check_state(state, numel_of, c.Get_size(), c.Get_rank())
    except MpigcError as e:
        exc = e
    raise_everywhere(c, exc, what)
    return state


def entries_for_layouts(layouts, state, comm):
    """The per-bucket ``ErrorFeedback`` state of ``layouts`` built from a
    per-parameter ``state`` (collective: one alltoall moves owner shards)."""
    N, r = comm.size, comm.rank
    new, sends = {}, [[] for _ in range(N)]
    by_index = {b.index: b for b in layouts}
    for b in layouts:
        saved = [(name, off, m, state[name]) for name, off, m
                 in zip(b.names, b.offsets, b.numels) if name in state]
        if not saved:
            continue
        dtype = b.dtype
        worker = None
        if any(s.get("worker") is not None for *_, s in saved):
            worker = np.zeros(b.n, dtype)
            for name, off, m, s in saved:
                if s.get("worker") is not None:
                    worker[off:off + m] = np.asarray(s["worker"]).reshape(-1)
        has_owner = any(s.get("owner") is not None for *_, s in saved)
        bounds = shard_bounds(b.n, N)
        lo, hi = bounds[r]
        new[b.key] = {"worker": worker,
                      "owner": np.zeros(hi - lo, dtype) if has_owner else None,
                      "config": dict(saved[0][3]["config"]),
                      "calls": max(int(s.get("calls", 0)) for *_, s in saved),
                      "world_size": N, "rank": r, "n": b.n, "dtype": dtype.name}
        for name, off, m, s in saved:
            if s.get("owner") is None:
                continue
            vals = np.asarray(s["owner"]).reshape(-1)
            qlo, qhi = shard_bounds(m, N)[r]  # bucket positions off+qlo .. off+qhi
            for j, (jlo, jhi) in enumerate(bounds):
                a, z = max(off + qlo, jlo), min(off + qhi, jhi)
                if a < z:
                    sends[j].append((b.index, a - jlo, vals[a - off - qlo:z - off - qlo]))
    for pieces in comm.alltoall(sends):
        for index, start, vals in pieces:
            owner = new[by_index[index].key]["owner"]
            owner[start:start + vals.size] = vals
    return new


# -- hierarchical buckets (hierarchy="node"/"auto") ------------------------------
def agree_hierarchy(c, comm, hierarchy, who):
    """Check ``hierarchy`` and that every rank passed the same (collective
    over ``c``): ``(layout, hierarchical)``, the node layout of ``comm``
    (None for ``"flat"``) and whether the buckets' calls are hierarchical."""
    exc = None
    if hierarchy not in _hierarchy.HIERARCHY_MODES:
        exc = ConfigError(f"hierarchy must be one of {_hierarchy.HIERARCHY_MODES}, got "
                          f"{hierarchy!r}")
    raise_everywhere(c, exc, who)
    modes = c.allgather(hierarchy)
    if any(m != modes[0] for m in modes):
        exc = MismatchError(f"{who}: ranks disagree on hierarchy (" + ", ".join(
            f"rank {r}: {m!r}" for r, m in enumerate(modes)) + ")")
    raise_everywhere(c, exc, who)
    lay = None if hierarchy == "flat" else _hierarchy.layout(comm)
    return lay, lay is not None and lay.hierarchical(hierarchy)


def residual_keys(lay, hier, key, n):
    """``[(slice, key)]``: the residual keys of a bucket's calls on this rank:
    its own (slice None), or, when the calls are hierarchical, those of the
    slices this rank handles (``mpigc._hierarchy``)."""
    if not hier:
        return [(None, key)]
    return [(sl, _hierarchy.slice_key(key, sl, lay.L, n)) for sl in lay.slices_of(lay.rank)]


def hier_to_flat(c, lay, fbs, size, rank):
    """``fbs`` (an ``ErrorFeedback.state_dict()``) with each bucket's
    hierarchical residuals (slice keys) also in the flat layout under the
    bucket's key (collective), as :func:`mpigc.save_checkpoint` converts them."""
    from .. import checkpoint
    tmp = ErrorFeedback()
    tmp.load_state_dict(fbs)
    hier = checkpoint.hier_groups(tmp.entries())
    rows = checkpoint.hier_rows(c, hier)
    out = dict(fbs)
    for k, e in checkpoint.hier_to_flat(c, lay, hier, rows, size, rank).items():
        out[k[:-len(checkpoint.HIER_SUFFIX)]] = {
            "worker": e.worker, "owner": e.owner, "config": e.config, "calls": e.calls,
            "world_size": size, "rank": rank, "n": e.n, "dtype": e.dtype.name}
    return out


def flat_to_hier(c, comm, new, hierarchy, who):
    """The per-bucket flat-layout state ``new`` (of
    :func:`entries_for_layouts`) as residual entries of hierarchical calls
    on ``comm`` (collective): each bucket's worker residuals summed per node
    to its slices' handlers, owner shards moved to the group owners, as
    ``load_checkpoint(..., hierarchy=)`` does. ``{key: entry}``."""
    from .. import checkpoint
    exc, tmp = None, ErrorFeedback()
    try:
        tmp.load_state_dict(new)
    except MpigcError as e:
        exc = e
    raise_everywhere(c, exc, who)
    keys = c.allgather(sorted(tmp.entries()))
    if any(k != keys[0] for k in keys):
        exc = StateError(f"{who}: ranks' states cover different buckets (" + "; ".join(
            f"rank {r}: {len(k)} bucket(s)" for r, k in enumerate(keys)) + ")")
    raise_everywhere(c, exc, who)
    return checkpoint.to_layout(c, comm, tmp.entries(), hierarchy)
