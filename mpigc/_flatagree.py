"""A flat call's agreement (:class:`mpigc._collective._Op`): what its rows
carry besides the row (the data that travels with them, so that the
agreement costs no round of its own), the verdict of the rows, and what a
verdict other than "go" produces: the error report or mismatch report to
every rank (:func:`mpigc._agree.failure_report`, the one report of flat,
grouped, short and hierarchical agreements), ``NonFiniteError``, or a
skipped call's NaN result. The messages are :mod:`mpigc._agree`'s, the
verdict :mod:`mpigc._plan`'s. These functions read the call's prepared
record (:class:`mpigc._prepared.Prepared`) and what they are given, and
return what they produced; the call acts on it (raise, skip, report, go)."""
import json

import numpy as np

from . import _agree
from . import _plan

__all__ = ["start_rows", "verdict", "report", "nonfinite_error", "nan_result"]

_NBAD, _RANGE = _plan.NBAD, _plan.RANGE


def _inline_payloads(rec, kind, rank, size, values, sendbuf):
    """What this rank's agreement message to each peer carries after its
    row (``{peer: uint8 array}``), or None (rows only), for ``kind``: the
    values of ``op="none"`` on 2 ranks, or the payload of the peer's shard
    (phase 1 itself)."""
    if kind is None:
        return None
    if kind == "values":
        return {1 - rank: values.view(np.uint8)}
    off, psz = rec.phases.poff[0], rec.phases.psz[0]
    return {j: sendbuf[off[j]:off[j] + psz[j]] for j in range(size) if j != rank}


def start_rows(cs, tags, row, rec, failed, values, sendbuf, sendreqs):
    """Send this rank's ``row``, with its data where it can travel with it,
    to every peer; returns the exchange (:class:`mpigc._agree.Rows`). What
    travels is the record's ``inline`` (:func:`mpigc._plan.inline_data`):
    ``values`` (a plain sum's) or phase 1's payloads (in ``sendbuf``). A
    rank that ``failed`` early (or has no record) sends its row alone. The
    row says (``_INLINE``) whether data follows, so the decision need not
    be the same on every rank: the data path is taken only when every row
    says so. The sends join ``sendreqs``."""
    kind = None if failed or rec is None else rec.inline
    return _agree.Rows(cs.comm, cs.rank, cs.size, tags[2], row,
                       _inline_payloads(rec, kind, cs.rank, cs.size, values, sendbuf),
                       0 if kind is None else rec.inline_bytes, sendreqs)


def verdict(table, rank, nonfinite):
    """The verdict of the agreement's rows (:func:`mpigc._plan.verdict`):
    ``go``, ``skip``, ``nonfinite``, ``mismatch`` or ``failed``."""
    return _plan.verdict(table, rank, nonfinite)


def report(cs, kind, v, table, local_error, rec, n, dtype):
    """The error report of verdict ``v`` (``mismatch`` or ``failed``), a
    collective started after the agreement (``cs.post``), reached by every
    rank whatever this one holds; ``rec``, ``n``, ``dtype``: what this
    rank's texts say (where its row is complete)."""
    return _agree.failure_report(cs.post, kind, v, table, cs.rank, local_error,
                                 lambda: _describe(rec, n, dtype))


def nonfinite_error(kind, table, comp):
    """The ``NonFiniteError`` of a table whose verdict is ``nonfinite``,
    the same on every rank."""
    return _plan.nonfinite_error(kind, _plan.nonfinite_causes(
        table[:, _NBAD], table[:, _RANGE], comp.codec_id, comp.wire_range))


def _describe(rec, n, dtype):
    """This rank's size, dtype, settings and chunking, as texts (a mismatch's;
    asked only where its row is complete)."""
    chunks = rec.chunks
    chunking = f"{len(chunks)} chunks" if chunks is not None else "not pipelined"
    return {"size": str(n), "dtype": str(dtype),
            "settings": json.dumps(rec.settings.config, sort_keys=True),
            "chunking": chunking}


def nan_result(rec, be, flat, rank):
    """A skipped call's values (every rank skips it: NaN results, nothing
    else changed): allreduce, ``flat`` filled with NaN (returns None);
    reduce_scatter, a new array of this rank's shard, NaN."""
    if rec.kind == "allreduce":
        be.fill_nan(flat)
        return None
    lo, hi = rec.bounds[rank]
    res = be.empty(hi - lo, rec.dtype)
    be.fill_nan(res)
    return res
