"""The residual store owns its entries (issue 51 item 3): no module of
mpigc but ``feedback.py`` writes an entry's fields or the store's count of
skipped steps, or makes an entry itself; they go through the store's API,
checked here too."""
import ast
import os

import numpy as np
import pytest

import mpigc
from mpigc import feedback

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "mpigc")
FIELDS = {"worker", "owner", "calls", "skipped_steps", "on_device", "config"}
# writes still to move onto the API: (file, field); none left
PENDING = set()
# not an entry: a Numba memory object's owner (mpigc/_cuda.py)
OTHERS = {("_cuda.py", "owner")}


def _writes(path):
    """``(line, field)`` of every assignment to ``<something>.FIELD`` where
    the something is not ``self``, and every use of ``_Entry``."""
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
        if isinstance(node, (ast.Name, ast.Attribute, ast.alias)):
            name = getattr(node, "id", None) or getattr(node, "attr", None) or node.name
            if name == "_Entry":
                out.append((node.lineno, "_Entry"))
    return out


def test_no_module_but_feedback_writes_an_entry():
    bad = []
    for d, _, files in os.walk(ROOT):
        for f in files:
            if not f.endswith(".py") or f == "feedback.py" and d == ROOT:
                continue
            for line, field in _writes(os.path.join(d, f)):
                if (f, field) not in PENDING | OTHERS:
                    bad.append(f"{os.path.relpath(os.path.join(d, f), ROOT)}:{line} {field}")
    assert not bad, "written outside mpigc/feedback.py: " + ", ".join(bad)


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
