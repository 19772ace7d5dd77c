"""examples/train_lm.py at a tiny size under ``mpirun -n 2``, so it cannot rot:
it trains (torch AdamW behind GradientSync, mpigc.torch.CompressedAdamW, DiLoCo
and StreamingDiLoCo),
prints its JSON summary, and a run stopped at a checkpoint and
resumed ends bit for bit where the uninterrupted run ends (model, AdamW state,
scheduler, residuals and the data order all come back). The runs call the
example's ``main(argv)`` one after another in two jobs (support/examples.py),
the resumed runs in the second, so no run resumes in the process that saved."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from support import background
from support import examples

pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None, reason="no mpirun on PATH")

EXAMPLE = examples.example("train_lm.py")
TINY = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--context", "32",
        "--batch-size", "4", "--corpus-mb", "0.5", "--eval-batches", "2", "--warmup", "2",
        "--eval-every", "2"]


# GradientSync's resume through the example once (2bit): 1bit's residuals resume
# bit for bit in mpi/test_torch_mpi.py (test_state_dict_survives_rebucketing_and_
# resumes_bit_exact, test_gathered_state_in_a_rank_0_torch_save_resumes_bit_exact),
# and the example's 1bit path runs in the CompressedAdamW cases (3 runs a case; all
# cases' runs in two jobs of 2 ranks: tests/README.md, where the time goes)
CASES = {
    "2bit": ("2bit", []),
    # CompressedAdamW: the checkpoint at step 2 falls after the exact warm-up
    "cadamw": ("1bit", ["--optimizer", "compressed-adamw", "--freeze-steps", "1"]),
    # with a bf16 warm-up, local steps (synchronised at each evaluation) and a refresh
    "cadamw-local": ("1bit", ["--optimizer", "compressed-adamw", "--freeze-steps", "1",
                              "--warmup-op", "bf16", "--sync-every", "2", "--var-refresh",
                              "1"]),
    # DiLoCo: local AdamW, the outer exchange (2bit, error feedback) every 2 steps;
    # each rank's own AdamW and outer state come back from the checkpoint
    "diloco": ("2bit", ["--diloco", "2"]),
    # Streaming DiLoCo: 2 fragments on a staggered schedule, each exchange overlapped
    # with the next inner step; the evaluations' synchronize() completes them
    "streaming": ("2bit", ["--diloco", "2", "--streaming", "2", "--overlap", "1"]),
}


def _runs(op, extra, ck):
    """A case's three runs: uninterrupted to step 4, stopped at the checkpoint of
    step 2, resumed from it to step 4."""
    return [[*TINY, "--op", op, "--steps", "4", *extra],
            [*TINY, "--op", op, "--steps", "2", "--checkpoint", ck, *extra],
            [*TINY, "--op", op, "--steps", "4", "--checkpoint", ck, "--resume", *extra]]


@pytest.fixture(scope="module")
def jobs(request, tmp_path_factory):
    """The runs of every selected case in two jobs of 2 ranks (support/examples.py:
    a job's start and torch's import once, not once per run; 15 jobs before): the
    uninterrupted and the stopped runs of every case, then in a fresh job the
    resumed runs, so that no run resumes in the process that saved its checkpoint.
    {case: ((job, index) of its uninterrupted, stopped and resumed runs)}."""
    saving, resuming, where = [], [], {}
    for case in background.selected(request, "test_resume_is_bit_identical", "case"):
        whole, first, resumed = _runs(*CASES[case],
                                      str(tmp_path_factory.mktemp(case) / "ck"))
        where[case] = (len(saving), len(saving) + 1, len(resuming))
        saving += [whole, first]
        resuming.append(resumed)
    a = examples.run_in_one_job(EXAMPLE, saving, timeout=300 + 60 * len(saving))
    b = examples.run_in_one_job(EXAMPLE, resuming, timeout=300 + 60 * len(resuming))
    return {case: ((a, i), (a, j), (b, k)) for case, (i, j, k) in where.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_resume_is_bit_identical(case, jobs):
    op, extra = CASES[case]
    whole, first, resumed = (job.result(i) for job, i in jobs[case])
    assert whole["parameters_equal"] and whole["steps"] == 4
    if not extra:  # below a uniform guess over 256 bytes (5.55) + noise
        assert 0 < whole["val_loss"] < 6.0
    else:  # a variance frozen after one step makes a wild start: resume is the point here
        assert 0 < whole["val_loss"] < float("inf")
    assert whole["bytes_sent_per_rank"] > 0
    if "--streaming" in extra:  # fragment 0 starts after steps 1 and 3, fragment 1 after
        # 2 and 4 (completed by the evaluation's synchronize()), which then also
        # synchronises every fragment at once: 2 x 2 fragment syncs + 2 full ones
        assert whole["fragment_syncs"] == [2, 2] and whole["outer_syncs"] == 6
        assert whole["params"]["fragments"] == 2 and whole["params"]["overlap"] == 1
    elif "--diloco" in extra:   # outer steps after steps 2 and 4
        assert whole["outer_syncs"] == 2
    assert first["steps"] == 2 and first["val_loss"] != whole["val_loss"]
    assert resumed["val_loss"] == whole["val_loss"]


def test_bench_lm_label_and_merge(tmp_path):
    """benchmarks/bench_lm.py names a configuration's runs with --label and
    --merge makes one table of several --json files, against the first."""
    bench = os.path.join(os.path.dirname(EXAMPLE), "..", "benchmarks", "bench_lm.py")
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    files = []
    for label, extra in (("none", []), ("1bit h2", ["--sync-every", "2"])):
        files.append(str(tmp_path / f"{len(files)}.json"))
        op = "none" if label == "none" else "1bit:compressed-adamw"
        p = subprocess.run([sys.executable, bench, "--ranks", "2", "--seeds", "0", "--steps",
                            "3", "--ops", op, "--label", label, "--json", files[-1], "--",
                            *TINY, "--freeze-steps", "1", *extra],
                           env=env, capture_output=True, text=True, timeout=360)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
        with open(files[-1]) as f:
            rows = json.load(f)["rows"]
        assert [r["variant"] for r in rows] == [label]
        assert rows[0]["params"].get("sync_every") == (2 if extra else None)
    p = subprocess.run([sys.executable, bench, "--merge", *files], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[1].startswith("none ") and " 1.0000 " in lines[1]
    assert lines[2].startswith("1bit h2 ")
