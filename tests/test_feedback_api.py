"""The residual store owns its entries (issue 51 item 3): no module of
mpigc but the store's (``feedback.py`` and its private ``_residual_entry.py``
and ``_residual_txn.py``) writes an entry's fields or the store's count of
skipped steps, or makes an entry itself; they go through the store's API,
checked here too. Every rollback is one of the store's transactions
(:class:`mpigc._residual_txn.Txn`), checked here for each of its records: by
reference, by copy, and of the whole store."""
import ast
import os

import numpy as np
import pytest

import mpigc
from mpigc import feedback

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "mpigc")
FIELDS = {"worker", "owner", "calls", "skipped_steps", "on_device", "config", "_worker",
          "_owner", "fused"}
# the residual arrays: ``x.worker[lo:hi] = ...`` writes an entry's residual too
ARRAYS = {"worker", "owner", "_worker", "_owner"}
# writes still to move onto the API: (file, field); none left
PENDING = set()
# not an entry: a Numba memory object's owner (mpigc/_cuda.py)
OTHERS = {("_cuda.py", "owner")}
# the store's modules (mpigc/)
STORE = {"feedback.py", "_residual_entry.py", "_residual_txn.py"}


def _writes(path):
    """``(line, field)`` of every assignment to ``<something>.FIELD`` where
    the something is not ``self``, and every use of the entry class."""
    tree = ast.parse(open(path).read())
    out = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for t in targets:
            for sub in ast.walk(t):
                if (isinstance(sub, ast.Attribute) and sub.attr in FIELDS
                        and isinstance(sub.ctx, ast.Store)
                        and not (isinstance(sub.value, ast.Name) and sub.value.id == "self")):
                    out.append((sub.lineno, sub.attr))
                if (isinstance(sub, ast.Subscript) and isinstance(sub.ctx, ast.Store)
                        and isinstance(sub.value, ast.Attribute) and sub.value.attr in ARRAYS
                        and not (isinstance(sub.value.value, ast.Name)
                                 and sub.value.value.id == "self")):
                    out.append((sub.lineno, sub.value.attr + "[]"))
        if isinstance(node, (ast.Name, ast.Attribute, ast.alias)):
            name = getattr(node, "id", None) or getattr(node, "attr", None) or node.name
            if name in ("_Entry", "Entry"):
                out.append((node.lineno, name))
    return out


def test_no_module_but_feedback_writes_an_entry():
    bad = []
    for d, _, files in os.walk(ROOT):
        for f in files:
            if not f.endswith(".py") or f in STORE and os.path.samefile(d, ROOT):
                continue
            for line, field in _writes(os.path.join(d, f)):
                if (f, field) not in PENDING | OTHERS:
                    bad.append(f"{os.path.relpath(os.path.join(d, f), ROOT)}:{line} {field}")
    assert not bad, "written outside the store's modules: " + ", ".join(bad)


def _rebuilds(path):
    """``(line, function)`` of every function that makes an entry
    (``new_entry``) and reads a live one of a store (``.entry(...)``,
    ``.entries()``): an entry rebuilt from a live one's fields is a write of
    them by another name (``worker_for_fold_back`` in mpigc/torch/_common.py
    gave a plain-summed key a worker residual so). ``new_entry`` is for
    entries made from records (states, checkpoints)."""
    out = []
    for fn in ast.walk(ast.parse(open(path).read())):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        called = {getattr(c.func, "attr", None) or getattr(c.func, "id", None)
                  for c in ast.walk(fn) if isinstance(c, ast.Call)}
        if "new_entry" in called and called & {"entry", "entries"}:
            out.append((fn.lineno, fn.name))
    return out


def test_no_module_but_feedback_rebuilds_a_live_entry():
    bad = []
    for d, _, files in os.walk(ROOT):
        for f in files:
            if not f.endswith(".py") or f in STORE and os.path.samefile(d, ROOT):
                continue
            bad += [f"{os.path.relpath(os.path.join(d, f), ROOT)}:{line} {name}()"
                    for line, name in _rebuilds(os.path.join(d, f))]
    assert not bad, "a live entry rebuilt outside the store's modules: " + ", ".join(bad)


def test_the_api_writes_what_callers_wrote():
    fb = mpigc.ErrorFeedback()
    w = np.arange(6, dtype=np.float32)
    fb.replace_entries({"k": feedback.new_entry(6, np.float32, 1, 0, {"type": "2bit"}, 3,
                                                w, None)}, skipped_steps=4)
    assert fb.skipped_steps == 4 and fb.state_dict()["k"]["calls"] == 3
    fb.count_skipped_step()
    assert fb.skipped_steps == 5

    def add(view):
        view += 1
    assert fb.add_to_worker("k", 2, 4, add)
    assert fb.state_dict()["k"]["worker"].tolist() == [0, 1, 3, 4, 4, 5]
    assert not fb.add_to_worker("k", 4, 4, add) and not fb.add_to_worker("x", 0, 1, add)
    # op="auto"'s plain sum cleared the residuals: the fold-back ensures a worker
    e, _ = fb.acquire("k", 6, np.float32, 1, 0)
    feedback.plain_done(fb, "k", e, True)
    assert fb.state_dict()["k"]["worker"] is None and not fb.add_to_worker("k", 0, 1, add)
    assert fb.ensure_worker("k") and not fb.ensure_worker("x") and "x" not in fb
    s = fb.state_dict()["k"]
    assert s["worker"].tolist() == [0] * 6 and s["worker"].dtype == np.float32
    assert s["calls"] == 3 and s["config"] == {"type": "2bit"}
    assert fb.add_to_worker("k", 1, 2, add) and fb.ensure_worker("k")  # kept, not zeroed
    assert fb.state_dict()["k"]["worker"].tolist() == [0, 1, 0, 0, 0, 0]
    fb.replace_entries({})
    assert fb.skipped_steps == 5 and len(fb) == 0

    txn = fb.begin("t", 4, np.float32, 1, 0)
    assert txn.calls() is None
    txn.take_scratch()[:] = 1
    txn.commit({"type": "2bit"})
    txn.ensure_owner(lambda: np.zeros(4, np.float32))
    txn.set_owner(np.full(4, 2, np.float32))
    txn.count_call()
    assert txn.calls() == 1
    txn.end()
    s = fb.state_dict()["t"]
    assert s["calls"] == 1
    assert s["worker"].tolist() == [1] * 4 and s["owner"].tolist() == [2] * 4


@pytest.mark.parametrize("field", ["worker", "owner"])
def test_a_fused_member_is_its_own_once_read(field):
    """A member of fused residuals: reading or writing either residual moves
    every member's out of the fused arrays, once."""
    fb = mpigc.ErrorFeedback()
    place = ([(0, 0, 2, 0), (1, 0, 1, 2)], (0, 2), 1)
    own = ([(0, 0, 2, 0), (1, 0, 1, 2)], (0, 2), 1)
    txn = fb.begin_group(["p", "q"], [2, 1], place, own, 3, np.float32, 1, 0)
    txn.take_scratch()[:] = [1, 2, 3]
    txn.commit({"type": "2bit"})
    txn.set_owner(np.array([4, 5, 6], np.float32))
    txn.end()
    p, q = fb.entry("p"), fb.entry("q")
    assert p.fused is not None and p.fused is q.fused
    assert p._worker is None and q._owner is None  # only the fused arrays hold them
    got = getattr(q, field)
    assert got.tolist() == ([3] if field == "worker" else [6])
    assert p.fused is None and q.fused is None
    assert p.worker.tolist() == [1, 2] and p.owner.tolist() == [4, 5]
    again = fb.begin_group(["p", "q"], [2, 1], place, own, 3, np.float32, 1, 0)
    assert again.entry.worker.tolist() == [1, 2, 3]  # gathered anew
    again.end()
    assert p.worker.tolist() == [1, 2]  # a call that did not commit changed nothing


def test_a_group_takes_its_keys_at_once_and_refuses_as_one_by_one():
    """A grouped call takes its members' keys in one hold of the store's
    lock (ErrorFeedback.acquire_group) and, where their fused residuals
    serve it, checks their fit on the first member only; a key in use or a
    call that does not fit raises what the first failing member's acquire()
    raises, and holds no key."""
    fb = mpigc.ErrorFeedback()
    place = ([(0, 0, 2, 0), (1, 0, 1, 2)], (0, 2), 1)

    def group(world=1, where=place):
        return fb.begin_group(["p", "q"], [2, 1], where, None, 3, np.float32, world, 0)
    g = group()
    assert g.fused is None and g.entry is None  # first call: new keys
    g.take_scratch()[:] = [1, 2, 3]
    g.commit({"type": "2bit"})
    g.count_call()
    g.end()
    g = group()
    assert g.fused is not None and g.entry.worker.tolist() == [1, 2, 3]  # resident
    assert g.calls() == 1
    with pytest.raises(mpigc.StateError, match="key 'p' is already used"):
        group()
    g.end()
    fb.acquire("q", 1, np.float32, 1, 0)  # held, its residuals still fused
    with pytest.raises(mpigc.StateError, match="key 'q' is already used"):
        group()
    fb.release("q")
    with pytest.raises(mpigc.StateError, match=r"key 'p' holds residuals of 2 values"):
        group(world=2)
    assert sorted(fb.state_dict()) == ["p", "q"]  # no key held, not even 'p'
    other = ([(1, 0, 1, 0), (0, 0, 2, 1)], (1, 0), 1)  # another placement: gathered
    g = group(where=other)
    assert g.fused is None and g.entry.worker.tolist() == [3, 1, 2]
    g.end()


def _one(fb, key, values, calls=2):
    """``key`` in ``fb`` with worker residual ``values`` (float32, one rank)."""
    w = np.array(values, np.float32)
    fb.update_entries({key: feedback.new_entry(w.size, np.float32, 1, 0, {"type": "2bit"},
                                               calls, w, None)})
    return w


def _call(fb, key, values, keep_replaced=False):
    """One call's transaction on ``key``: a new worker residual ``values``."""
    txn = fb.begin(key, len(values), np.float32, 1, 0)
    txn.take_scratch()[:] = values
    txn.commit({"type": "1bit"}, keep_replaced)
    txn.count_call()
    txn.end()


def test_a_transaction_by_reference_puts_back_the_arrays_themselves():
    """A hierarchical call's record: its sub-calls keep what they replace;
    restore puts back the very arrays, counts and configs, and forgets a key
    that had no entry; accept makes the replaced worker a spare."""
    fb = mpigc.ErrorFeedback()
    w = _one(fb, "s0", [1, 2, 3])
    txn = fb.transaction()
    txn.keep("s0")
    txn.keep("s1")
    _call(fb, "s0", [9, 9, 9], keep_replaced=True)
    _call(fb, "s1", [5, 5], keep_replaced=True)
    assert fb.state_dict()["s0"]["worker"].tolist() == [9, 9, 9]
    txn.restore()
    e = fb.entry("s0")
    assert e.worker is w and e.calls == 2 and e.config == {"type": "2bit"}
    assert "s1" not in fb and fb.keys() == ["s0"]
    txn = fb.transaction()
    txn.keep("s0")
    _call(fb, "s0", [7, 7, 7], keep_replaced=True)
    txn.accept()
    assert fb.entry("s0").worker.tolist() == [7, 7, 7]
    assert fb.spares.take(3, np.float32) is w  # the replaced array, spare


def test_a_transaction_by_copy_puts_back_the_values_in_the_entrys_arrays():
    """A torch step's record: calls may reuse what they replace and change
    residuals in place; restore copies the values back into the entry's own
    arrays (the record keeps its copies, reused by the next record)."""
    fb = mpigc.ErrorFeedback()
    _one(fb, "b", [1, 2, 3])
    txn = fb.transaction()
    txn.copy("b")
    txn.copy("c")
    assert txn.saved["c"] is None
    _call(fb, "b", [4, 4, 4])
    _call(fb, "b", [6, 6, 6])  # writes over the first call's spare
    fb.add_to_worker("b", 0, 1, lambda v: v.__iadd__(10))
    _call(fb, "c", [1, 1])
    live = fb.entry("b").worker
    fb.transaction(txn.saved).restore()  # its records, kept by the caller
    e = fb.entry("b")
    assert e.worker is live and live.tolist() == [1, 2, 3]
    assert e.worker is not txn.saved["b"].worker
    assert (e.calls, e.config) == (2, {"type": "2bit"}) and "c" not in fb
    again = fb.transaction()
    again.copy("b", txn.saved["b"])
    assert again.saved["b"].worker is txn.saved["b"].worker  # written over


def test_a_transaction_of_the_whole_store_holds_its_keys_and_puts_back():
    """A checkpoint's install: every entry replaced, the keys held until the
    end; restore puts back the old entries and count of skipped steps."""
    fb = mpigc.ErrorFeedback()
    fb.replace_entries({}, skipped_steps=3)
    w = _one(fb, "old", [1, 2])
    new = {"new": feedback.new_entry(2, np.float32, 1, 0, {"type": "2bit"}, 5,
                                     np.zeros(2, np.float32), None)}
    busy = fb.transaction()
    busy.hold_all()
    with pytest.raises(mpigc.StateError):  # a key held: nothing installed
        fb.transaction().install(new, 9)
    busy.end()
    txn = fb.transaction()
    txn.install(new, 9)
    assert fb.keys() == ["new"] and fb.skipped_steps == 9
    for key in ("old", "new"):  # held until the end
        with pytest.raises(mpigc.StateError):
            fb.begin(key, 2, np.float32, 1, 0)
    txn.restore()
    txn.end()
    assert fb.keys() == ["old"] and fb.entry("old").worker is w and fb.skipped_steps == 3
    _call(fb, "new", [1, 1])  # free again


def test_a_save_whose_copy_fails_holds_no_key(monkeypatch):
    """A checkpoint's save holds every key while it reads them (Txn.hold_all);
    where a host copy of a device residual fails (no memory; 9fa6c9b's
    copy_tohost typo did so for every GPU residual), it raises and holds
    nothing: before, every key stayed in use for good (each later call,
    state, load or reset raised StateError)."""
    from mpigc import _residual_entry
    fb = mpigc.ErrorFeedback()
    _one(fb, "a", [1, 2])
    _one(fb, "b", [3, 4])

    def fails(entry):
        raise MemoryError("no memory for the host copy")
    monkeypatch.setattr(_residual_entry.Entry, "host_copy", fails)
    txn = fb.transaction()
    with pytest.raises(MemoryError):
        txn.hold_all()
    assert not txn.held
    monkeypatch.undo()
    assert sorted(fb.state_dict()) == ["a", "b"]  # no key in use
    _call(fb, "a", [5, 5])
    txn = fb.transaction()
    assert sorted(txn.hold_all()) == ["a", "b"]
    txn.end()
    fb.reset()


def test_a_restore_refuses_a_key_a_pending_call_uses():
    """A record put back under a pending call would overwrite that call's
    residuals (or forget the entry its commit writes to): restore raises
    StateError and puts nothing back, for every kind of record; its own keys
    (a checkpoint's install holds them) do not count. 9fa6c9b's put_back
    wrote them silently (the old module function restored through reset(),
    which refused a busy key)."""
    fb = mpigc.ErrorFeedback()
    _one(fb, "b", [1, 2, 3])
    by_copy, by_ref = fb.transaction(), fb.transaction()
    by_copy.copy("b")
    by_copy.copy("new")  # no entry then: restore would forget it
    by_ref.keep("b")
    _call(fb, "b", [4, 4, 4])
    pending = fb.begin("b", 3, np.float32, 1, 0)  # a call on "b" in progress
    first = fb.begin("new", 2, np.float32, 1, 0)  # a first call in progress
    live = fb.entry("b").worker
    for txn in (by_copy, by_ref, fb.transaction(by_copy.saved)):
        with pytest.raises(mpigc.StateError, match="in use by a pending collective"):
            txn.restore()
        assert fb.entry("b").worker is live and live.tolist() == [4, 4, 4]
        assert fb.entry("b").calls == 3
    pending.end()
    with pytest.raises(mpigc.StateError, match=r"\['new'\]"):
        by_copy.restore()
    first.take_scratch()[:] = 1
    first.commit({"type": "2bit"})
    first.end()
    assert "new" in fb
    # the whole store: any key in use but its own
    whole = fb.transaction()
    whole.install({})
    other = fb.begin("x", 2, np.float32, 1, 0)
    with pytest.raises(mpigc.StateError, match=r"\['x'\]"):
        whole.restore()
    assert fb.keys() == []
    other.end()
    whole.restore()  # its own keys held: allowed
    whole.end()
    assert sorted(fb.keys()) == ["b", "new"]
    by_copy.restore()  # nothing in use now
    assert fb.entry("b").worker.tolist() == [1, 2, 3] and "new" not in fb
