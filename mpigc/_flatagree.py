"""A flat call's agreement (:class:`mpigc._collective._Op`): what its rows
carry besides the row (the data that travels with them, so that the
agreement costs no round of its own), and what the call does with the
table's verdict: go ahead, skip (NaN results on every rank), raise
``NonFiniteError`` on every rank, or report an error or mismatch to every
rank (:func:`mpigc._agree.failure_report`, the one report of flat, grouped,
short and hierarchical agreements). The messages are :mod:`mpigc._agree`'s,
the verdict :mod:`mpigc._plan`'s; these functions read the call's public
attributes and set its ``rows``, ``table``, ``report``, ``state`` and
``result``."""
import json

import numpy as np

from . import _agree
from . import _plan

__all__ = ["start_rows", "act", "nonfinite_verdict"]

_NBAD, _RANGE = _plan.NBAD, _plan.RANGE


def _inline_kind(op):
    """``"values"``, ``"payloads"`` or None: what this rank's agreement
    messages carry after its row (the call's prepared ``inline``,
    :func:`mpigc._plan.inline_data`). A rank that failed early sends its
    row alone. The row says (``_INLINE``) whether data follows, so the
    decision need not be the same on every rank: the data path is taken
    only when every row says so."""
    if op.local_error is not None or op.prep is None:
        return None
    return op.prep.inline


def _inline_payloads(op, kind):
    """What this rank's agreement message to each peer carries after its
    row (``{peer: uint8 array}``), or None (rows only), for ``kind``
    (:func:`_inline_kind`): the values of ``op="none"`` on 2 ranks, or
    the payload of the peer's shard (phase 1 itself)."""
    if kind is None:
        return None
    if kind == "values":
        return {1 - op.rank: op.none_buf.view(np.uint8)}
    off, psz = op.prep.phases.poff[0], op.prep.phases.psz[0]
    return {j: op.sendbuf[off[j]:off[j] + psz[j]]
            for j in range(op.size) if j != op.rank}


def _expected_inline(op, kind):
    """Bytes of data that a peer that agrees with this rank sends after
    its row (0: rows only), for this rank's ``kind``."""
    return 0 if kind is None else op.prep.inline_bytes


def start_rows(op):
    """Send this rank's row, with its data where it can travel with it,
    to every peer (:class:`mpigc._agree.Rows`)."""
    kind = _inline_kind(op)  # once: it decides what is sent and expected
    op.rows = _agree.Rows(op.cs.comm, op.rank, op.size, op.tags[2], op.row,
                          _inline_payloads(op, kind), _expected_inline(op, kind),
                          op.sendreqs)
    op.table = op.rows.table


def act(op):
    """Act on the table's verdict (:func:`mpigc._plan.verdict`): True (go
    ahead), False (skipped: NaN results), None (failed: the error report
    is under way), or raise NonFiniteError on every rank."""
    v = _plan.verdict(op.table, op.rank, op.nonfinite)
    if v.kind == "go":
        return True
    if v.kind in ("mismatch", "failed"):
        if v.kind == "mismatch":
            op.abandon()
        # the report is a collective started after the agreement (cs.post),
        # reached by every rank whatever this one holds
        op.report = _agree.failure_report(op.cs.post, op.kind, v, op.table, op.rank,
                                          op.local_error, lambda: _describe(op))
        op.state = "report"
        return None
    return nonfinite_verdict(op)


def nonfinite_verdict(op):
    """The table's non-finite and out-of-range counts decide: True (go
    ahead), False (skipped on every rank: NaN results) or raise
    NonFiniteError on every rank; nothing has changed in the last two
    cases."""
    t = op.table
    v = _plan.nonfinite_verdict(t, op.nonfinite)
    if v.kind != "go":
        op.abandon()
        if v.kind == "nonfinite":
            raise _plan.nonfinite_error(op.kind, _plan.nonfinite_causes(
                t[:, _NBAD], t[:, _RANGE], op.comp.codec_id, op.comp.wire_range))
        if op.txn is not None:
            op.txn.skipped()
        _finish_skipped(op)
        op.release_agree()
        return False
    return True


def _describe(op):
    """This rank's size, dtype, settings and chunking, as texts (a mismatch's;
    asked only where its row is complete)."""
    chunking = f"{len(op.chunks)} chunks" if op.chunks is not None else "not pipelined"
    return {"size": str(op.n), "dtype": str(op.dtype),
            "settings": json.dumps(op.settings, sort_keys=True), "chunking": chunking}


def _finish_skipped(op):
    """Every rank skips the call: NaN results, nothing else changed."""
    if op.kind == "allreduce":
        op.be.fill_nan(op.flat)
        op.set_result(None)
    else:
        lo, hi = op.bounds[op.rank]
        res = op.be.empty(hi - lo, op.dtype)
        op.be.fill_nan(res)
        op.set_result(res)
    op.be.sync()
    op.release_buffers()
    op.state = "done"
