"""examples/train_gpt_fsdp.py (a GPT script written for FSDP2) at a tiny size
under ``mpirun -n 2 python -m mpigc.launch``, so it cannot rot: with
``--mpigc none`` the hooks give plain FSDP2's parameters bit for bit (fp32 at 2
ranks, as the hooks promise), and under ``--hsdp 2`` (2 replicas x 1 shard)
with ``--mpigc 2bit`` (the compressed replica all-reduce) a run stopped at its
``torch.distributed.checkpoint`` and resumed with ``--init-from resume`` ends
bit for bit where the uninterrupted run ends."""
import shutil

import pytest

from support import examples

pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None, reason="no mpirun on PATH")

EXAMPLE = examples.example("train_gpt_fsdp.py")
TINY = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--context", "32",
        "--batch-size", "4", "--corpus-mb", "0.5", "--eval-iters", "2", "--warmup-iters", "2",
        "--eval-interval", "2"]


def run(*args):
    """One run of the example under ``mpirun -n 2 python -m mpigc.launch``: its
    JSON summary."""
    return examples.run(EXAMPLE, *TINY, *args, launch=True)


def test_mpigc_none_is_plain_fsdp_bit_for_bit():
    plain = run("--max-iters", "3")
    none = run("--max-iters", "3", "--mpigc", "none")
    assert plain["mpigc"] is None and none["mpigc"] == "none" and 0 < plain["val_loss"] < 6.0
    assert none["params_sha256"] == plain["params_sha256"]
    assert none["val_loss"] == plain["val_loss"]
    # mpigc's counted bytes of op='none' are the ring's the script computes for FSDP
    assert none["reduce_scatter_bytes_per_rank"] == plain["reduce_scatter_bytes_per_rank"] > 0


def test_hsdp_compressed_resumes_bit_for_bit(tmp_path):
    hsdp = ["--hsdp", "2", "--mpigc", "2bit"]
    whole = run(*hsdp, "--max-iters", "4")
    assert whole["replica_allreduce_bytes_per_rank"] > 0 and whole["iters"] == 4
    assert whole["reduce_scatter_bytes_per_rank"] == 0  # one shard per replica
    out = str(tmp_path / "out")
    first = run(*hsdp, "--max-iters", "2", "--out-dir", out)
    assert first["params_sha256"] != whole["params_sha256"]
    resumed = run(*hsdp, "--max-iters", "4", "--out-dir", out, "--init-from", "resume")
    assert resumed["params_sha256"] == whole["params_sha256"]
    assert resumed["val_loss"] == whole["val_loss"]
