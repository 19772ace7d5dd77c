"""examples/train_gpt_ddp.py (a GPT script written for DDP and torchrun) at a
tiny size under ``mpirun -n 2 python -m mpigc.launch``, so it cannot rot: it
runs unchanged as plain DDP, and with ``--mpigc 1bit`` (CompressedAdamW under
DDP with the local-gradients hook) a run stopped at rank 0's checkpoint and
resumed with ``--init-from resume`` ends bit for bit where the uninterrupted
run ends."""
import shutil

import pytest

from support import examples

pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None, reason="no mpirun on PATH")

EXAMPLE = examples.example("train_gpt_ddp.py")
TINY = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--context", "32",
        "--batch-size", "4", "--corpus-mb", "0.5", "--eval-iters", "2", "--warmup-iters", "2",
        "--eval-interval", "2", "--freeze-steps", "2"]


def run(*args):
    """One run of the example under ``mpirun -n 2 python -m mpigc.launch``: its
    JSON summary."""
    return examples.run(EXAMPLE, *TINY, *args, launch=True)


def test_plain_ddp_and_mpigc_resume_bit_identical(tmp_path):
    plain = run("--max-iters", "2")
    assert plain["mpigc"] is None and 0 < plain["val_loss"] < 6.0
    whole = run("--mpigc", "1bit", "--max-iters", "4")
    assert whole["bytes_sent_per_rank"] > 0 and whole["iters"] == 4
    out = str(tmp_path / "out")
    first = run("--mpigc", "1bit", "--max-iters", "2", "--out-dir", out)
    assert first["val_loss"] != whole["val_loss"]
    resumed = run("--mpigc", "1bit", "--max-iters", "4", "--out-dir", out,
                  "--init-from", "resume")
    assert resumed["val_loss"] == whole["val_loss"]
