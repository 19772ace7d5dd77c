"""examples/train.py: the "vs none" column does not depend on the order of
--op. (--checkpoint/--resume: tests/mpi/test_examples_mpi.py, where residuals
matter.)"""
import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def train():
    spec = importlib.util.spec_from_file_location(
        "mpigc_example_train", os.path.join(ROOT, "examples", "train.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_vs_none_column_whatever_the_order(train):
    runs = [{"op": op, "final_test_acc": 0.9, "bytes_sent": b}
            for op, b in (("2bit", 1e6), ("1bit", 5e5), ("none", 16e6))]
    rows = {ln.split()[0]: ln.rstrip() for ln in train.summary_rows(runs)}
    assert rows["2bit"].endswith(" 16.0x") and rows["1bit"].endswith(" 32.0x"), rows
    assert rows["none"].endswith(" 1.0x"), rows
    rows = {ln.split()[0]: ln.rstrip() for ln in train.summary_rows(runs[:2])}
    assert not rows["2bit"].endswith("x")  # no none run: the column stays empty
