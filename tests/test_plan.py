"""mpigc._plan without MPI: the verdict of an agreement table, and the layout
of a call (chunks, offsets, what travels with the rows), held to
tests/support/reference.py where bits are concerned."""
import itertools

import numpy as np
import pytest

import mpigc
from mpigc import _plan
from mpigc._errors import (ConfigError, DTypeError, InvalidBufferError, MpigcError,
                           StateError)

from support import reference as ref

P = _plan


def table(*rows):
    """A table from ``{column: value}`` dicts (missing columns 0)."""
    t = P.new_table(len(rows))
    for r, row in enumerate(rows):
        for c, v in row.items():
            t[r, c] = v
    return t


def same(n=100, fp=7):
    return {P.N: n, P.DTYPE: 2, P.FP: fp}


def verdicts(t, nonfinite="raise"):
    """The verdict as every rank reads it: it must be one."""
    vs = {P.verdict(t, r, nonfinite) for r in range(len(t))}
    assert len(vs) == 1, vs
    return vs.pop()


# -- the verdict ------------------------------------------------------------------------
def test_alike_rows_go():
    assert verdicts(table(same(), same(), same())) == P.GO


@pytest.mark.parametrize("col,what", P.SAME_COLUMNS)
def test_a_column_that_differs_is_a_mismatch_named_by_it(col, what):
    rows = [same(), same(), same()]
    rows[1] = dict(rows[1])
    rows[1][col] = rows[1].get(col, 0) + 1
    assert verdicts(table(*rows)) == P.Verdict("mismatch", what=what)


def test_the_first_differing_column_names_the_mismatch():
    t = table(same(n=5, fp=1), same(n=6, fp=2))
    assert verdicts(t).what == "size"


def test_a_mismatch_comes_before_failures():
    # rank 1's key is in use (its row is complete), rank 2 failed early
    t = table(same(n=5), {**same(n=6), P.CODE: 4}, {P.CODE: 1})
    assert verdicts(t) == P.Verdict("mismatch", what="size")


def test_rows_of_ranks_that_failed_early_are_not_compared():
    # rank 1 failed before it knew the size: a failure, not a mismatch
    t = table(same(n=5), {P.CODE: 2}, same(n=5))
    assert verdicts(t) == P.Verdict("failed", ranks=(1,), error=InvalidBufferError)


@pytest.mark.parametrize("codes,ranks,error", [
    ((0, 3, 1), (1, 2), DTypeError),
    ((1, 0, 3), (0, 2), ConfigError),
    ((4, 4), (0, 1), StateError),
    ((0, 6), (1,), MpigcError),
    ((0, 99), (1,), MpigcError),  # a code this version does not know
])
def test_failed_ranks_and_the_lowest_ones_class(codes, ranks, error):
    t = table(*[{**same(), P.CODE: c} for c in codes])
    assert verdicts(t) == P.Verdict("failed", ranks=ranks, error=error)


@pytest.mark.parametrize("col", [P.NBAD, P.RANGE])
@pytest.mark.parametrize("policy,kind", [("raise", "nonfinite"), ("skip", "skip"),
                                         ("ignore", "go")])
def test_nonfinite_counts_under_each_policy(col, policy, kind):
    t = table(same(), {**same(), col: 3}, same())
    assert verdicts(t, policy).kind == kind
    assert P.nonfinite_verdict(t, policy).kind == kind


def test_failures_come_before_nonfinite_counts():
    t = table({**same(), P.NBAD: 1}, {P.CODE: 3})
    assert verdicts(t, "skip").kind == "failed"


def test_every_small_table_reads_the_same_on_every_rank():
    """Exhaustively over small tables: the verdict does not depend on which
    rank reads it, and go means every row alike and clean."""
    vals = [(0, 0, 5, 0), (0, 0, 6, 0), (0, 1, 5, 0), (4, 0, 5, 0), (1, 0, 0, 0),
            (0, 0, 5, 1)]  # (code, nbad, n, range)
    for rows in itertools.product(vals, repeat=3):
        t = table(*[{P.CODE: c, P.NBAD: b, P.N: n, P.RANGE: g, P.DTYPE: 2}
                    for c, b, n, g in rows])
        for policy in ("raise", "skip", "ignore"):
            v = verdicts(t, policy)
            clean = all(c == 0 and n == rows[0][2] for c, _, n, _ in rows) and (
                policy == "ignore" or not any(b or g for _, b, _, g in rows))
            assert (v == P.GO) == clean, (rows, policy, v)


def test_the_verdicts_errors_name_every_rank_and_cause():
    """The errors raised on every rank, as flat and hierarchical calls build
    them from the verdict and the gathered texts."""
    e = P.mismatch_error("allreduce", "size", ["10", None, "12"])
    assert isinstance(e, mpigc.MismatchError)
    assert str(e) == "allreduce: ranks disagree on the size (rank 0: 10, rank 2: 12)"
    assert "$MPIGC_CHUNK_BYTES must be the same" in str(
        P.mismatch_error("allreduce", "chunking", ["2 chunks", "not pipelined"]))

    cause = ValueError("boom")
    assert P.error_text(cause) == "ValueError: boom"
    assert P.error_text(StateError("key 'k' busy")) == "key 'k' busy"
    assert P.error_text(None) == ""
    v = P.Verdict("failed", ranks=(1, 3), error=StateError)
    e = P.report_error("reduce_scatter", v, ["", "a", "", "b"], 4, cause)
    assert type(e) is StateError and e.__cause__ is cause and e.__suppress_context__
    assert str(e) == "reduce_scatter failed on 2 of 4 rank(s): rank 1: a; rank 3: b"

    what = P.nonfinite_causes(np.array([0, 3, 1]), np.array([2, 0, 0]), "fp16", "|x| <= 65504")
    assert what == ("non-finite values in the input on rank 1 (3), rank 2 (1); finite values "
                    "beyond the range of the fp16 wire format (|x| <= 65504) on rank 0 (2)")
    assert P.nonfinite_causes(np.zeros(2, np.int64)) == ""
    e = P.nonfinite_error("allreduce", what)
    assert isinstance(e, mpigc.NonFiniteError) and str(e).startswith("allreduce: " + what)
    assert "no buffer or residual changed" in str(e)


# -- the layout --------------------------------------------------------------------------
def test_offsets():
    assert P.offsets([3, 0, 5]) == [0, 3, 3, 8]
    offs, total = P.piece_offsets([[1, 2], [3, 4]])
    assert offs == [[0, 1], [3, 6]] and total == 10


def test_shard_starts():
    assert P.shard_starts([(0, 3), (3, 5), (5, 9)], 9) == (0, 3, 5, 9)


@pytest.mark.parametrize("align,cb,nbytes", [(None, 8, 100), (4, 0, 100), (4, 64, 127)])
def test_calls_that_are_not_pipelined(align, cb, nbytes):
    assert P.chunk_cuts([(0, 10), (10, 20)], nbytes, align, cb) is None


@pytest.mark.parametrize("n,size,itemsize,align,cb", [
    (3001, 2, 4, 4, 2048), (3001, 3, 4, 1024, 1000), (4096, 4, 8, 4, 4096),
    (257, 3, 2, 1, 64), (10, 4, 4, 4, 8), (5000, 3, 4, 1024, 128)])
def test_chunks_cover_each_shard_at_aligned_cuts(n, size, itemsize, align, cb):
    bounds = ref._bounds(n, size)
    cuts = P.chunk_cuts(bounds, n * itemsize, align, cb)
    nc = -(-n * itemsize // cb)
    assert len(cuts) == nc and all(len(c) == size for c in cuts)
    for j, (lo, hi) in enumerate(bounds):
        pieces = [cuts[c][j] for c in range(nc)]
        assert pieces[0][0] == lo and pieces[-1][1] == hi
        for (a, b), (a2, _) in zip(pieces, pieces[1:]):
            assert a <= b == a2
        for a, b in pieces[:-1]:
            assert (b - lo) % align == 0 or b == hi


@pytest.mark.parametrize("config,itemsize", [
    ({"id": "2bit", "threshold": 0.5}, 4), ({"id": "1bit", "block_size": 64}, 4),
    ({"id": "fp16"}, 8), ({"id": "bf16"}, 4),
    ({"id": "2bit", "rel_threshold": 0.3, "block_size": 64}, 4)])
def test_pieces_encode_to_the_bits_of_their_shard(config, itemsize):
    """The point of the alignment: the pieces of a shard, each encoded alone
    with its slice of the residual (reference encoders), decode to the
    shard's decoded values and leave its residual, bit for bit (block
    formats lay a piece's payload out as a shard of its own)."""
    comp = mpigc.get_compressor(config["id"], **{k: v for k, v in config.items()
                                                if k != "id"})
    dtype = np.float32 if itemsize == 4 else np.float64
    n, size = 2999, 3
    rng = np.random.default_rng(1)
    x = rng.standard_normal(n).astype(dtype)
    e = (0.1 * rng.standard_normal(n)).astype(dtype)
    bounds = ref._bounds(n, size)
    cuts = P.chunk_cuts(bounds, n * itemsize, comp.chunk_align(), 1200)
    assert cuts is not None and len(cuts) > 2
    for j, (lo, hi) in enumerate(bounds):
        whole, res = ref.encode(config, x[lo:hi], e[lo:hi])
        pieces = [(a, b) for a, b in (c[j] for c in cuts) if b > a]
        parts = [ref.encode(config, x[a:b], e[a:b]) for a, b in pieces]
        got = np.concatenate([ref.decode(config, p, b - a, dtype)
                              for (p, _), (a, b) in zip(parts, pieces)])
        assert got.tobytes() == ref.decode(config, whole, hi - lo, dtype).tobytes()
        assert np.concatenate([r for _, r in parts]).tobytes() == res.tobytes()


def test_what_travels_with_the_rows():
    f = P.inline_data
    kw = dict(device=False, pipelined=False, plain_max=100, payload_max=50)
    assert f("allreduce", 2, True, 100, None, False, **kw) == "values"
    assert f("allreduce", 2, True, 101, None, False, **kw) is None
    assert f("allreduce", 3, True, 8, None, False, **kw) is None
    assert f("reduce_scatter", 2, True, 8, None, False, **kw) is None
    assert f("allreduce", 3, False, 0, [50, 50, 49], False, **kw) == "payloads"
    assert f("allreduce", 3, False, 0, [50, 51, 49], False, **kw) is None
    assert f("reduce_scatter", 4, False, 0, None, True, **kw) is None  # terngrad
    assert f("allreduce", 2, True, 8, None, False, **{**kw, "device": True}) is None
    assert f("allreduce", 3, False, 0, [1, 1, 1], False, **{**kw, "pipelined": True}) is None


@pytest.mark.parametrize("n,m,k", [(1, 1, 1), (10, 3, 4), (9, 3, 3), (2**31, 2**31 - 1, 2)])
def test_sum_pieces(n, m, k):
    assert P.sum_pieces(n, m) == k


# -- error reports ----------------------------------------------------------------------
def test_report_slots_round_trip():
    texts = ["rank 0: bad", None, "", "é" * 5000]
    slots = np.concatenate([P.report_slot(t) for t in texts])
    assert slots.size == len(texts) * P.REPORT_SLOT
    got = P.read_report(slots)
    assert got[:3] == ["rank 0: bad", None, ""]
    # cut to the slot, the last character maybe replaced where the cut split it
    assert got[3].rstrip("\ufffd") == "é" * len(got[3].rstrip("\ufffd"))
    assert len(got[3].encode()) <= P.REPORT_SLOT


@pytest.mark.parametrize("n,length", [(1, 10), (3, 5000), (40, 300), (2000, 10)])
def test_fit_json_always_parses(n, length):
    import json
    texts = {str(s): f"slice {s} failed: " + "x\u00e9\"" * length for s in range(n)}
    s = P.fit_json(texts)
    assert len(s.encode()) <= P.REPORT_SLOT - 8
    got = json.loads(s)
    assert all(texts[k].startswith(v) for k, v in got.items())
    got2 = json.loads(P.read_report(P.report_slot(s))[0])
    assert got2 == got


@pytest.mark.parametrize("fmt,kw", [("2bit", {}), ("1bit", {"block_size": 64}),
                                    ("fp16", {}), ("terngrad", {}), ("none", {})])
def test_payload_and_piece_layouts_follow_the_reference_sizes(fmt, kw):
    n, size = 10_007, 3
    bounds = ref._bounds(n, size)

    def nbytes(k):
        return ref.payload_nbytes(fmt, k, np.float32, **kw)
    sizes, offs = P.payload_layout(bounds, nbytes)
    assert sizes == [nbytes(hi - lo) for lo, hi in bounds]
    assert offs == [0, sizes[0], sizes[0] + sizes[1], sum(sizes)]
    cuts = P.chunk_cuts(bounds, n * 4, 64, 4096)
    psz, poff, total, per_shard = P.piece_layout(cuts, nbytes)
    flat = [(c, j) for c in range(len(cuts)) for j in range(size)]
    assert [poff[c][j] for c, j in flat] == np.cumsum(
        [0] + [psz[c][j] for c, j in flat])[:-1].tolist()
    assert total == sum(map(sum, psz))
    assert per_shard == [sum(nbytes(b - a) for a, b in (ch[j] for ch in cuts))
                         for j in range(size)]


@pytest.mark.parametrize("kind,gather", [("allreduce", "compressed"), ("allreduce", "exact"),
                                         ("reduce_scatter", "compressed")])
@pytest.mark.parametrize("fmt,kw", [("2bit", {}), ("1bit", {"block_size": 64}),
                                    ("fp16", {})])
@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_the_two_phases_plan(kind, gather, fmt, kw, size):
    """The plan of a compressed call's two phases: one chunk of whole shards
    laid out as the payloads packed before the agreement, counts in the rows;
    pipelined, the chunks' pieces tile every shard, counts in a trailer; the
    bytes each rank sends are the wire format's table (phase 1: the other
    owners' payloads; phase 2: its own shard, recompressed or exact, to every
    peer), pipelined or not up to the pieces' own rounding."""
    n = 10_007

    def nbytes(k):
        return ref.payload_nbytes(fmt, k, np.float32, **kw)
    bounds = ref._bounds(n, size)
    one = P.phases(kind, gather, 4, bounds, None, nbytes, nbytes)
    sizes, offs = P.payload_layout(bounds, nbytes)
    assert one.counts == "rows" and one.cuts == (tuple(bounds),)
    assert one.psz == (tuple(sizes),) and one.poff == (tuple(offs[:-1]),)
    assert one.total == offs[-1] and one.sizes == tuple(sizes)
    assert (one.psz2 is None) == (kind != "allreduce" or gather == "exact")
    for r, (lo, hi) in enumerate(bounds):
        want = sum(sizes) - sizes[r]
        if kind == "allreduce":
            want += (size - 1) * (nbytes(hi - lo) if gather == "compressed" else (hi - lo) * 4)
        assert one.bytes_sent(r) == want
        assert one.recv_slots(r) == ([0], size * sizes[r])
    with pytest.raises(AttributeError):
        one.total = 0
    cuts = P.chunk_cuts(bounds, n * 4, 64, 4096)
    if size == 1 or cuts is None:
        return
    pip = P.phases(kind, gather, 4, bounds, cuts, nbytes, nbytes)
    assert pip.counts == "trailer" and len(pip.cuts) == len(cuts) > 1
    for j, (lo, hi) in enumerate(bounds):
        edges = [lo] + [b for ch in pip.cuts for a, b in [ch[j]]]
        assert edges[-1] == hi and all(x <= y for x, y in zip(edges, edges[1:]))
        assert all(pip.cuts[c][j][0] == edges[c] for c in range(len(cuts)))
    for r in range(size):
        base, total = pip.recv_slots(r)
        assert total == size * pip.sizes[r]
        assert base == np.cumsum([0] + [size * row[r] for row in pip.psz])[:-1].tolist()
        # the pieces' payloads round per piece: a few bytes more than unpipelined
        assert 0 <= pip.bytes_sent(r) - one.bytes_sent(r) <= 16 * len(cuts) * size


def test_verdict_is_the_same_for_small_and_large_tables():
    """The verdict's quick check runs in Python up to 16 rows and in numpy
    beyond: random tables of 1 to 40 rows (one column of one row changed, or
    none) get the verdict of the rule written out here, on every rank."""
    rng = np.random.default_rng(3)
    cols = [P.CODE, P.NBAD, P.RANGE, P.N, P.DTYPE, P.FP, P.CHUNK, P.SCALE, P.INLINE]
    for _ in range(400):
        size = int(rng.integers(1, 41))
        t = table(*[same() for _ in range(size)])
        if rng.random() < 0.8:
            t[int(rng.integers(size)), cols[int(rng.integers(len(cols)))]] = \
                int(rng.choice([1, 4, 9]))
        for nonfinite in ("raise", "skip", "ignore"):
            for rank in range(size):
                got = P.verdict(t, rank, nonfinite)
                complete = [r for r in range(size) if t[r, P.CODE] in (0, 4)]
                if any(len({int(t[r, c]) for r in complete}) > 1
                       for c in (P.N, P.DTYPE, P.FP, P.CHUNK)):
                    assert got.kind == "mismatch", (t, got)
                elif t[:, P.CODE].any():
                    assert got.kind == "failed", (t, got)
                elif (t[:, P.NBAD].any() or t[:, P.RANGE].any()) and nonfinite != "ignore":
                    assert got.kind == ("nonfinite" if nonfinite == "raise" else "skip")
                else:
                    assert got is P.GO, (t, got)


# -- the one failure report ------------------------------------------------------------
def test_error_codes_and_classes_round_trip_in_any_table():
    """Codes 1..6 of the engine's table are the wire format's (docs/wire-format.md);
    a caller's table (a blocking agreement's classes, then its default) gives
    anything else the last code, and a code out of the table the last class."""
    from mpigc._errors import ENGINE_CLASSES, class_of, code_of
    assert [code_of(c("x")) for c in (ConfigError, InvalidBufferError, DTypeError,
                                      StateError, mpigc.NonFiniteError, MpigcError)] == [
        1, 2, 3, 4, 5, 6]
    assert code_of(ValueError("x")) == code_of(mpigc.MismatchError("x")) == 6
    assert code_of(None) == 0 and class_of(99) is MpigcError and class_of(6) is MpigcError
    table = (StateError, TypeError, mpigc.MismatchError)
    for cls, code in ((StateError, 1), (TypeError, 2), (OSError, 3), (MpigcError, 3)):
        assert code_of(cls("x"), table) == code
    assert class_of(2, table) is TypeError and class_of(7, table) is mpigc.MismatchError
    assert ENGINE_CLASSES[-1] is MpigcError


def test_a_ranks_text_names_a_class_that_its_code_cannot_carry():
    table = (StateError, MpigcError)
    assert P.error_text(StateError("busy"), table) == "busy"
    assert P.error_text(OSError("disk full"), table) == "OSError: disk full"
    assert P.error_text(ConfigError("bad"), table) == "ConfigError: bad"
    assert P.error_text(TypeError(""), table) == "TypeError"
    assert P.error_text(StateError(""), table) == "StateError"
    assert P.error_text(mpigc.MismatchError("n")) == "MismatchError: n"  # not a wire code


def test_report_error_names_each_text_once_with_its_ranks():
    v = P.failures(np.array([3, 0, 1, 3, 3, 0, 3]))
    assert v == P.Verdict("failed", ranks=(0, 2, 3, 4, 6), error=DTypeError)
    texts = ["t", None, "c", "t", "t", None, "t"]
    e = P.report_error("allreduce", v, texts, 7)
    assert type(e) is DTypeError and e.__cause__ is None and e.__suppress_context__
    assert str(e) == "allreduce failed on 5 of 7 rank(s): ranks 0,3-4,6: t; rank 2: c"
    s = P.report_error("allreduce (hierarchical)", P.Verdict("failed", ranks=(0, 1), error=StateError),
                       ["a", "a"], 3, None, P.SLICE_GROUPS, "; no residual changed")
    assert str(s) == ("allreduce (hierarchical) failed in 2 of 3 slice group(s): "
                      "slices 0-1: a; no residual changed")


def test_report_text_is_the_mismatching_value_or_the_error():
    t = table(same(n=4), {P.CODE: 3}, same(n=5))
    v = P.verdict(t, 0, "raise")
    assert v.kind == "mismatch"
    describe = {"size": 4}.copy
    assert P.report_text(v, t, 0, None, describe) == "4"
    assert P.report_text(v, t, 1, DTypeError("x"), describe) == ""  # never asked
    f = P.Verdict("failed", ranks=(1,), error=DTypeError)
    assert P.report_text(f, t, 1, DTypeError("x"), None) == "x"


@pytest.mark.parametrize("rows,want", [
    ([[0, 0], [0, 0]], P.GO),
    ([[5, 0], [0, 0]], P.Verdict("nonfinite", ranks=(0,))),
    ([[5, 0], [0, 5]], P.Verdict("nonfinite", ranks=(0, 1))),
    ([[5, 0, 0], [0, 4, 1]], P.Verdict("failed", ranks=(0, 1, 2), error=StateError)),
    ([[0, 0, 2], [6, 0, 0]], P.Verdict("failed", ranks=(0, 2), error=MpigcError)),
])
def test_slice_verdict_reads_every_group_on_every_node_rank(rows, want):
    """A hierarchical call's groups: failed wherever any node rank saw a
    failure; the class of the lowest failure that is not a non-finite sum."""
    t = np.array(rows, np.int64)
    assert P.slice_verdict(t) == want
    assert P.slice_verdict(t[::-1]) == want  # whichever rank ran a group


class _NoLists(np.ndarray):
    """A table whose rows cannot be read as lists."""

    def tolist(self):
        raise AssertionError("read as lists")


def test_identical_rows_go_by_their_bytes():
    """The common table (every row the same bytes, none with an error, a
    non-finite or an out-of-range count) goes ahead on two bytes compares,
    before its rows are read as lists; the other tables as before."""
    for size in (1, 2, 5, 16):
        t = table(*[same() for _ in range(size)]).view(_NoLists)
        for rank in range(size):
            assert P.verdict(t, rank, "raise") is P.GO
    for col in (P.NBAD, P.RANGE):
        t = table(*[{**same(), col: 3} for _ in range(2)])
        assert verdicts(t, "skip").kind == "skip"
        assert verdicts(t, "ignore") is P.GO
    t = table(*[{**same(), P.CODE: 2} for _ in range(2)])
    assert verdicts(t).kind == "failed"
