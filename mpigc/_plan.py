"""A call's plan, without MPI: the agreement rows and their verdict, and the
layout of the call's data.

Everything here is a pure function of a call's arguments and of the rows its
ranks exchanged; nothing sends, receives or waits. The engine
(``mpigc._collective``) carries the plan out, and the tests hold these
functions to ``tests/support/reference.py`` without ``mpirun`` (``tests/test_plan.py``).

The agreement row
    Each rank of a call sends every peer one row of ``NCOLS`` int64 before any
    data moves (``ROW_BYTES`` at the head of its agreement message): ``CODE``
    (0, or the wire code of the error this rank raised while preparing:
    ``mpigc._errors.code_of``), ``NBAD`` and ``RANGE`` (its non-finite values
    and the finite values the wire format cannot carry), ``N``, ``DTYPE``,
    ``FP`` (the fingerprint of the settings), ``SCALE`` (terngrad's local
    scale, as float64 bits), ``INLINE`` (1 when its data follows the row in
    the same message) and ``CHUNK`` (the number of chunks of a pipelined
    call, 0 when not pipelined). The rows of all ranks make the table, and
    :func:`verdict` reads it the same way on every rank.
"""
import json
from typing import NamedTuple

import numpy as np

from ._errors import ENGINE_CLASSES, MismatchError, NonFiniteError, class_of, code_of

CODE, NBAD, N, DTYPE, FP, SCALE, RANGE, INLINE, CHUNK, NCOLS = range(10)
ROW_BYTES = NCOLS * 8
# columns whose values must be the same on every rank that got as far as the
# agreement, and the words an error uses for them
SAME_COLUMNS = ((N, "size"), (DTYPE, "dtype"), (FP, "settings"), (CHUNK, "chunking"))
_SAME_COLS = tuple(c for c, _ in SAME_COLUMNS)
_FAST = np.array([CODE, NBAD, RANGE])
_SAME = np.array(_SAME_COLS)
# the bytes of a row's CODE and NBAD columns (then RANGE's), all zero in a
# row that lets the call go ahead (verdict's quick check of identical rows)
assert (CODE, NBAD) == (0, 1)
_ZERO_SPAN = slice(0, 16)
_RANGE_SPAN = slice(RANGE * 8, RANGE * 8 + 8)
_ZEROS = bytes(16)
# the DTYPE column's values
DTYPE_CODE = {np.dtype(np.float16): 1, np.dtype(np.float32): 2, np.dtype(np.float64): 3}
# the error codes of ranks whose rows are complete: none, and StateError (a
# key in use is found after every column has its value)
_COMPLETE = (0, 4)


def complete(row):
    """Whether ``row`` has every column's value (its rank got as far as the
    agreement: no error, or only its key in use)."""
    return int(row[CODE]) in _COMPLETE


def new_row():
    return np.zeros(NCOLS, np.int64)


def new_table(size):
    return np.zeros((size, NCOLS), np.int64)


class Verdict(NamedTuple):
    """What the agreed table says, the same on every rank.

    ``kind``:

    - ``"go"``: every rank goes ahead;
    - ``"skip"``: non-finite values and ``nonfinite="skip"``: no rank changes
      anything, results are NaN;
    - ``"nonfinite"``: non-finite or out-of-range values and
      ``nonfinite="raise"``: every rank raises NonFiniteError;
    - ``"mismatch"``: ranks disagree on the column named ``what``
      (``"size"``, ``"dtype"``, ``"settings"``, ``"chunking"``): every rank
      raises MismatchError;
    - ``"failed"``: the ranks ``ranks`` failed while preparing: every rank
      raises ``error``, the class of the lowest failing rank's error.
    """
    kind: str
    what: str = None
    ranks: tuple = ()
    error: type = None


GO = Verdict("go")


def nonfinite_verdict(table, nonfinite):
    """GO, or the verdict of the table's non-finite and out-of-range counts
    under the policy ``nonfinite`` ("raise", "skip", "ignore")."""
    if nonfinite == "ignore" or not (table[:, NBAD].any() or table[:, RANGE].any()):
        return GO
    return Verdict("nonfinite" if nonfinite == "raise" else "skip")


def verdict(table, rank, nonfinite):
    """The :class:`Verdict` of an agreement table (``rank``: this rank's row,
    for the common case's quick check). In order: a disagreement between
    ranks (the root cause of any error it provokes), then failed ranks, then
    the non-finite counts."""
    # the common case first: every row the same bytes, this rank's without
    # an error, a non-finite or an out-of-range value (two bytes compares);
    # else, on a small table, in Python on its rows as lists (numpy's fancy
    # indexing costs more than its few values), else in numpy
    raw = table.tobytes()
    if raw[_ZERO_SPAN] == _ZEROS and raw[_RANGE_SPAN] == _ZEROS[:8] \
            and raw == raw[:ROW_BYTES] * len(table):
        return GO
    if len(table) <= 16:
        rows = table.tolist()
        mine = rows[rank]
        same = [mine[c] for c in _SAME_COLS]
        for r in rows:
            if r[CODE] or r[NBAD] or r[RANGE] or [r[c] for c in _SAME_COLS] != same:
                break
        else:
            return GO
    elif (not table[:, _FAST].any()
          and (table[:, _SAME] == table[rank, _SAME]).all()):
        return GO
    full = np.isin(table[:, CODE], _COMPLETE)
    for col, what in SAME_COLUMNS:
        vals = table[full, col]
        if vals.size and np.any(vals != vals[0]):
            return Verdict("mismatch", what=what)
    v = failures(table[:, CODE])
    return nonfinite_verdict(table, nonfinite) if v is GO else v


def failures(codes, classes=ENGINE_CLASSES):
    """GO, or ``Verdict("failed", ...)`` of a column of error codes (one per
    rank, or per part of a call; 0: no error; :func:`mpigc._errors.code_of`
    in the table ``classes``): the parts whose code is not 0, and the class of
    the lowest one's code."""
    bad = np.flatnonzero(np.asarray(codes))
    if not bad.size:
        return GO
    return Verdict("failed", ranks=tuple(int(r) for r in bad),
                   error=class_of(codes[int(bad[0])], classes))


def mismatch_error(kind, what, values):
    """The MismatchError of ``Verdict("mismatch", what)``: ``values`` is every
    rank's value of the column as text (None or "" where its row is not
    complete)."""
    detail = ", ".join(f"rank {r}: {x}" for r, x in enumerate(values) if x)
    hint = ("; pipelining takes host buffers only and $MPIGC_CHUNK_BYTES must be the same "
            "on every rank" if what == "chunking" else "")
    return MismatchError(f"{kind}: ranks disagree on the {what} ({detail}){hint}")


# -- the failure report --------------------------------------------------------------
# Every agreement that fails (a flat, grouped, short or hierarchical call's
# rows, a hierarchical call's slice groups, a blocking agreement outside calls)
# ends the same way: a verdict of the numeric codes in its rows (:func:`verdict`,
# :func:`failures`), each rank's text for it (:func:`report_text`; one slot per
# rank, :func:`report_slot`), and :func:`report_error`, which turns the verdict
# and the gathered texts into the same exception, class and text, on every rank.
class Parts(NamedTuple):
    """What the rows of a report are about: ``noun`` (counted), ``label``
    (one of them, named), ``prep`` (the call failed ``prep`` so many)."""
    noun: str
    label: str
    prep: str


RANKS = Parts("rank(s)", "rank", "on")
SLICE_GROUPS = Parts("slice group(s)", "slice", "in")


def error_text(exc, classes=ENGINE_CLASSES):
    """What a failed rank reports of its error ``exc`` ("": none): its message,
    after its class's name where the code table ``classes`` cannot carry the
    class (an exception raised elsewhere as another class), or the class's
    name alone where the message is empty."""
    if exc is None:
        return ""
    msg = str(exc)
    name = type(exc).__name__
    if class_of(code_of(exc, classes), classes) is type(exc):
        return msg or name
    return f"{name}: {msg}" if msg else name


def report_text(v, table, rank, exc, describe, classes=ENGINE_CLASSES):
    """This rank's text in the report of verdict ``v`` of agreement ``table``:
    for a mismatch, its own value of the disagreeing column
    (``describe()[v.what]``, asked only where its row is complete: a rank that
    failed early has none), else its error's :func:`error_text` (``exc``)."""
    if v.kind == "mismatch":
        return str(describe()[v.what]) if complete(table[rank]) else ""
    return error_text(exc, classes)


def report_error(what, v, texts, total, cause=None, parts=RANKS, tail=""):
    """The one exception of a failed agreement, the same class and text on every
    rank: ``v``, its verdict (``"mismatch"`` or ``"failed"``); ``texts``, every
    rank's (or part's) :func:`report_text`, gathered (None or "" where it has
    none); ``total``: how many ranks (parts) there are; ``what``: the call.
    ``cause``, this rank's own error, is chained to it (None: nothing)."""
    if v.kind == "mismatch":
        return mismatch_error(what, v.what, texts)
    exc = v.error(f"{what} failed {parts.prep} {len(v.ranks)} of {total} {parts.noun}: "
                  f"{report_detail(v.ranks, texts, parts)}{tail}")
    exc.__cause__ = cause
    return exc


def report_detail(ranks, texts, parts=RANKS):
    """``"rank 1: a; ranks 0,2-3: b"``: the texts of ``ranks`` (or parts), each
    text once with the ranks that reported it, in the order of the lowest."""
    by_text = {}
    for r in ranks:
        by_text.setdefault(texts[r] or "", []).append(r)
    return "; ".join(f"{parts.label}{'s' if len(rs) > 1 else ''} {_ranges(rs)}: {t}"
                     for t, rs in by_text.items())


def slice_verdict(table, nonfinite_code=code_of(NonFiniteError())):
    """The verdict of a hierarchical call's slice groups from ``table`` (one
    row per rank of a node, a column per slice group: 0, or the code of the
    error of the inter-node call that this rank ran for that group; every
    node has a handler of every group): GO, ``"nonfinite"`` when every failed
    group's sum was not finite, else ``"failed"``: ``ranks``, every failed
    group, ``error``, the class of the lowest one whose failure is not a
    non-finite sum."""
    codes = np.asarray(table).max(axis=0)
    v = failures(codes)
    if v is GO:
        return GO
    other = failures(np.where(codes == nonfinite_code, 0, codes))
    if other is GO:
        return Verdict("nonfinite", ranks=v.ranks)
    return other._replace(ranks=v.ranks)


def _ranges(ranks):
    """``"0-2,5"``: sorted ``ranks`` as runs."""
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ",".join(out)


def per_rank(counts):
    """``"rank r (count), ..."`` for the ranks whose count is not 0."""
    return ", ".join(f"rank {r} ({int(c)})" for r, c in enumerate(counts) if c)


def nonfinite_error(kind, what):
    """The NonFiniteError of ``Verdict("nonfinite")``; ``what``: the causes,
    as text (:func:`nonfinite_causes`)."""
    return NonFiniteError(
        f"{kind}: {what}; no buffer or residual changed (nonfinite='skip' fills the "
        "result with NaN instead of raising)")


def nonfinite_causes(nbad, nrange=(), codec_id=None, wire_range=None):
    """The causes of a non-finite verdict as text: the ranks with non-finite
    input values (``nbad``, per rank), and those with finite values beyond
    the range of the ``codec_id`` wire format (``nrange``)."""
    what = []
    if np.any(nbad):
        what.append("non-finite values in the input on " + per_rank(nbad))
    if np.any(nrange):
        what.append(f"finite values beyond the range of the {codec_id} wire format "
                    f"({wire_range}) on " + per_rank(nrange))
    return "; ".join(what)


def inline_data(kind, size, plain, nbytes, payload_sizes, needs_scale, *, device,
                pipelined, plain_max, payload_max):
    """What a rank's agreement message carries after its row: ``"values"``
    (``op="none"`` and the small-buffer fallback of an allreduce on 2 ranks,
    up to ``plain_max`` bytes: the peer adds them), ``"payloads"``
    (compressed ops but terngrad, which quantizes only once the scale is
    agreed, when no shard's payload is over ``payload_max`` bytes: phase 1
    itself) or None (the row alone). Host buffers of calls that are not
    pipelined only: a device payload would need staging first."""
    if device or pipelined:
        return None
    if plain:
        return "values" if kind == "allreduce" and size == 2 and nbytes <= plain_max else None
    if needs_scale or max(payload_sizes) > payload_max:
        return None
    return "payloads"


def offsets(sizes):
    """``[0, s0, s0 + s1, ...]``: where each of ``sizes`` starts in one
    buffer, and the total."""
    return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64).tolist()


def shard_starts(bounds, n):
    """The shard bounds as one tuple: shard j is ``[starts[j], starts[j + 1])``."""
    return tuple(lo for lo, _ in bounds) + (n,)


def chunk_cuts(bounds, nbytes, align, chunk_bytes):
    """A pipelined call's chunks: ``cuts[c][j] = (a, b)``, the elements of
    shard j in chunk c, or None when the call is not pipelined (a codec
    without an alignment, ``chunk_bytes`` 0, or fewer than ``2 * chunk_bytes``
    bytes). As many chunks as ``chunk_bytes`` fit in ``nbytes``, rounded up;
    each shard is cut into that many pieces at multiples of ``align`` from
    the shard's start, so a piece encodes as its part of the whole shard
    would (the same bits as the call unpipelined)."""
    if align is None or chunk_bytes == 0 or nbytes < 2 * chunk_bytes:
        return None
    nc = -(-nbytes // chunk_bytes)
    cuts = [[None] * len(bounds) for _ in range(nc)]
    for j, (lo, hi) in enumerate(bounds):
        ln = hi - lo
        at = [min(ln, -(-(c * ln // nc) // align) * align) for c in range(nc)] + [ln]
        for c in range(nc):
            cuts[c][j] = (lo + at[c], lo + at[c + 1])
    return cuts


def piece_offsets(psz):
    """Byte offsets of a pipelined call's pieces, chunk by chunk and shard by
    shard in one buffer (``psz[c][j]``: piece sizes), and the total."""
    offs, o = [], 0
    for row in psz:
        offs.append([o + sum(row[:j]) for j in range(len(row))])
        o += sum(row)
    return offs, o


def payload_layout(bounds, nbytes_of):
    """``(sizes, offs)``: the payload bytes of each shard (``nbytes_of(k)``:
    the bytes of the payload of k elements) and where each starts in one
    buffer, shard after shard (``offs[-1]``: the total)."""
    sizes = [nbytes_of(hi - lo) for lo, hi in bounds]
    return sizes, offsets(sizes)


def piece_layout(cuts, nbytes_of):
    """A pipelined call's payloads: ``(psz, poff, total, sizes)``: the bytes
    of piece ``(c, j)`` (chunk c of shard j, :func:`chunk_cuts`), where each
    starts in one buffer (chunk after chunk, shard after shard), the total,
    and the bytes of each shard over all chunks."""
    psz = [[nbytes_of(b - a) for a, b in ch] for ch in cuts]
    poff, total = piece_offsets(psz)
    sizes = [sum(row[j] for row in psz) for j in range(len(psz[0]))]
    return psz, poff, total, sizes


class Phases(NamedTuple):
    """The layout of a compressed call's two phases, the same on every rank
    (:func:`phases`; carried out by :mod:`mpigc._twophase`). A call that is
    not pipelined is one chunk of whole shards.

    ``cuts[c][j]``: the elements ``(a, b)`` of shard j in chunk c; ``psz``,
    ``poff``, ``total``, ``sizes``: phase 1's piece bytes, their offsets in
    one send buffer (chunk after chunk, shard after shard), its size, and
    each shard's bytes over all chunks (:func:`piece_layout`); ``psz2`` ...
    ``sizes2``: the same for phase 2's compressed gather (None without
    one: ``reduce_scatter``, ``gather="exact"``); ``counts``: where the
    counts of non-finite and out-of-range values travel, ``"rows"`` (the
    call was compressed before the agreement) or ``"trailer"`` (pipelined:
    after the last chunk)."""
    kind: str
    gather: str
    itemsize: int
    bounds: tuple
    cuts: tuple
    psz: tuple
    poff: tuple
    total: int
    sizes: tuple
    psz2: tuple
    poff2: tuple
    total2: int
    sizes2: tuple
    counts: str

    def recv_slots(self, r):
        """Where owner ``r`` receives phase 1: a slot of ``psz[c][r]`` bytes
        per sender in each chunk; ``(base of each chunk, total bytes)``."""
        base, o = [], 0
        for row in self.psz:
            base.append(o)
            o += len(self.bounds) * row[r]
        return base, o

    def bytes_sent(self, r):
        """The data bytes rank ``r`` sends: phase 1's pieces to the other
        owners, then (allreduce) its own shard to every peer."""
        size = len(self.bounds)
        sent = sum(self.sizes) - self.sizes[r]
        if self.kind == "allreduce":
            lo, hi = self.bounds[r]
            own = self.sizes2[r] if self.psz2 is not None else (hi - lo) * self.itemsize
            sent += own * (size - 1)
        return sent


def _frozen(rows):
    return tuple(tuple(row) for row in rows)


def phases(kind, gather, itemsize, bounds, cuts, nbytes_of, nbytes2_of):
    """The :class:`Phases` of a compressed call: shards ``bounds``, chunk
    ``cuts`` (:func:`chunk_cuts`; None: not pipelined), ``nbytes_of(k)`` /
    ``nbytes2_of(k)``: the payload bytes of k elements in phase 1 / in the
    compressed gather; ``itemsize``: of the buffer's dtype (the exact
    gather)."""
    counts = "rows" if cuts is None else "trailer"
    cuts = _frozen([bounds] if cuts is None else cuts)
    psz, poff, total, sizes = piece_layout(cuts, nbytes_of)
    psz2 = poff2 = total2 = sizes2 = None
    if kind == "allreduce" and gather == "compressed":
        psz2, poff2, total2, sizes2 = piece_layout(cuts, nbytes2_of)
        psz2, poff2, sizes2 = _frozen(psz2), _frozen(poff2), tuple(sizes2)
    return Phases(kind, gather, itemsize, tuple(tuple(b) for b in bounds), cuts,
                  _frozen(psz), _frozen(poff), total, tuple(sizes), psz2, poff2, total2,
                  sizes2, counts)


def sum_pieces(n, max_count):
    """How many MPI sums an ``op="none"`` call of ``n`` elements takes when
    no count handed to MPI may exceed ``max_count``."""
    return -(-n // max_count)


# -- error reports ---------------------------------------------------------------------
# A failed agreement is reported by one allgather of a fixed slot per rank: an
# int64 length (-1: this rank has nothing to say), then that many bytes of
# UTF-8 text (longer texts are cut).
REPORT_SLOT = 2048


def report_slot(text):
    """This rank's slot (uint8) of an error report: ``text`` (a str) or None."""
    slot = np.zeros(REPORT_SLOT, np.uint8)
    if text is None:
        slot[:8] = np.frombuffer(np.int64(-1).tobytes(), np.uint8)
        return slot
    b = text.encode("utf-8")[:REPORT_SLOT - 8]
    slot[:8] = np.frombuffer(np.int64(len(b)).tobytes(), np.uint8)
    slot[8:8 + len(b)] = np.frombuffer(b, np.uint8)
    return slot


def read_report(slots):
    """Every rank's text (None where it had none) from the gathered slots
    (``size * REPORT_SLOT`` uint8, in rank order)."""
    out = []
    for row in np.asarray(slots, np.uint8).reshape(-1, REPORT_SLOT):
        k = int(row[:8].view(np.int64)[0])
        out.append(None if k < 0 else bytes(row[8:8 + k]).decode("utf-8", "replace"))
    return out


def fit_json(texts):
    """``{key: text}`` as JSON that fits in one report slot: the texts cut as
    far as needed (cutting the JSON itself would leave text that does not
    parse); ``"{}"`` if even empty texts do not fit."""
    limit, cut = REPORT_SLOT - 8, REPORT_SLOT
    while True:
        s = json.dumps({k: v[:cut] for k, v in texts.items()})
        if len(s.encode()) <= limit:
            return s
        if cut == 0:
            return "{}"
        cut //= 2
