"""examples/train.py's --checkpoint/--resume at any rank count, on synthetic
data (no scikit-learn needed): a resumed run is bit-identical to one that did
not stop. Above one rank the residuals matter, so a resume that lost them fails."""
import importlib.util
import os
import shutil
import tempfile

import numpy as np
import pytest
from mpi4py import MPI

from conftest import assert_all, on_root

# ranks: flat training: 1 no residual exchange, 2 pairs, 3 uneven shards; 4 adds nothing
pytestmark = [pytest.mark.mpi, pytest.mark.ranks(1, 2, 3)]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _train_module():
    spec = importlib.util.spec_from_file_location(
        "mpigc_example_train", os.path.join(ROOT, "examples", "train.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _data():
    rng = np.random.default_rng(0)
    centers = rng.standard_normal((10, 64)).astype(np.float32)
    y = rng.integers(0, 10, 400)
    X = (centers[y] + 0.8 * rng.standard_normal((400, 64))).astype(np.float32)
    return X[:300], X[300:], y[:300], y[300:]


@pytest.mark.parametrize("op", ["2bit", "1bit"])
def test_resume_is_bit_identical(comm, op):
    train, data = _train_module(), _data()
    # constant learning rate: the cosine decay spans --epochs, so a 2-epoch run
    # is not the first half of a 4-epoch one
    base = ["--op", op, "--hidden", "16", "--batch", "8", "--quiet", "--schedule", "constant"]
    p = train.build_parser()
    ck = on_root(lambda: tempfile.mkdtemp(prefix="mpigc-train-ck-"), comm)
    try:
        straight = train.train(op, 0, p.parse_args(base + ["--epochs", "4"]), data, comm)
        first = train.train(op, 0, p.parse_args(base + ["--epochs", "2", "--checkpoint", ck]),
                            data, comm)
        files = on_root(lambda: sorted(os.listdir(os.path.join(ck, f"{op}-seed0"))), comm)
        resumed = train.train(op, 0, p.parse_args(base + ["--epochs", "4", "--checkpoint", ck,
                                                          "--resume"]), data, comm)
    finally:
        comm.Barrier()
        if comm.rank == 0:
            shutil.rmtree(ck, ignore_errors=True)
    assert_all(files == ["residuals", "state-2.npz"], f"files {files}", comm)
    assert_all(first["history"] == straight["history"][:2], "first two epochs", comm)
    assert_all(resumed["theta"].tobytes() == straight["theta"].tobytes()
               and resumed["history"] == straight["history"], "resumed run differs", comm)
