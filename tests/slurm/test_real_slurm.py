"""Every template in slurm/, submitted to a real (local) Slurm with small sizes.

Run by ``tests/slurm/run.sh``, which brings the Slurm up and sets SLURM_CONF.
All jobs are submitted at the start (the node runs two 4-rank jobs at a time)
and each test waits for its own. The job chain is interrupted with
``scancel --signal=USR1 --batch`` (what ``--signal=B:USR1@...`` delivers, without
waiting for Slurm's ~30 s time-limit check), resumed by requeue and by a
dependent job, and its final model, momentum and residuals must equal those of
an uninterrupted run on the same rank count, bit for bit.
"""
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
SLURM = ROOT / "slurm"
TEMPLATES = sorted(p.name for p in SLURM.glob("*.sbatch"))
DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
        "PREEMPTED", "BOOT_FAIL", "DEADLINE"}
WAIT = 300          # seconds a test waits for its job at most
CHAIN_STEPS = 40
CHAIN = f"python examples/train_chain.py --steps {CHAIN_STEPS} --sleep 0.2 --log-every 5"
SMALL = ["--nodes=1", "--ntasks-per-node=4", "--cpus-per-task=1", "--time=10"]


def _run(*cmd, **kw):
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kw).stdout


def job_info(job):
    out = _run("scontrol", "show", "job", "-o", str(job))
    return dict(re.findall(r"(\w+)=(\S*)", out))


def wait_job(job, timeout=WAIT):
    """Wait until ``job`` ended for good; returns its scontrol fields."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        info = job_info(job)
        if info.get("JobState") in DONE:
            return info
        time.sleep(1)
    subprocess.run(["scancel", str(job)])
    pytest.fail(f"job {job} not done after {timeout} s: {job_info(job)}")


def wait_output(path, pattern, job, timeout=WAIT):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if path.exists() and re.search(pattern, path.read_text(), re.M):
            return
        if job_info(job).get("JobState") in DONE:
            break
        time.sleep(0.3)
    pytest.fail(f"job {job}: {pattern!r} not in {path} "
                f"({path.read_text() if path.exists() else 'no output'})")


class Jobs:
    """Submits templates with small sizes; remembers job ids and outputs."""

    def __init__(self, tmp):
        self.tmp = tmp
        # MPIGC_MIN_COMPRESS_BYTES=0: the small test models stay on the
        # compressed path, so every key has residuals to save and resume
        self.env = dict(os.environ, MPIGC_VENV=sys.prefix, MPIGC_WORKDIR=str(ROOT),
                        NUMBA_CACHE_DIR=str(tmp / "numba-cache"),
                        MPIGC_MIN_COMPRESS_BYTES="0")
        self.jobs = {}

    def submit(self, name, template, flags=(), **env):
        out = self.tmp / f"{name}.out"
        job = _run("sbatch", "--parsable", f"--job-name={name}", f"--output={out}",
                   *SMALL, *flags, str(SLURM / template),
                   env={**self.env, **{k: str(v) for k, v in env.items()}}).strip()
        self.jobs[name] = (int(job.split(";")[0]), out)
        return self.jobs[name]

    def result(self, name, ok=True):
        job, out = self.jobs[name]
        info = wait_job(job)
        text = out.read_text() if out.exists() else ""
        if ok:
            assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", \
                f"job {name} ({job}): {info['JobState']} exit {info['ExitCode']}\n{text}"
        return info, text


@pytest.fixture(scope="session")
def jobs(tmp_path_factory):
    try:
        _run("sinfo", "-h")
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.fail(f"no Slurm reachable (run tests/slurm/run.sh): {exc}")
    tmp = tmp_path_factory.mktemp("slurm")
    j = Jobs(tmp)
    # the chain first: the interrupted ones wait for a signal, the others queue meanwhile
    j.submit("chain-requeue", "chain.sbatch", TRAIN_CMD=CHAIN,
             MPIGC_CHECKPOINT_DIR=tmp / "ckpt-requeue")
    j.submit("chain-resubmit", "chain.sbatch", TRAIN_CMD=CHAIN, MPIGC_CHAIN="resubmit",
             MPIGC_CHECKPOINT_DIR=tmp / "ckpt-resubmit")
    j.submit("chain-ref", "chain.sbatch", TRAIN_CMD=CHAIN.replace("--sleep 0.2", ""),
             MPIGC_CHECKPOINT_DIR=tmp / "ckpt-ref")
    train = "python examples/train_chain.py --steps 12 --ckpt {}"
    j.submit("cpu-srun", "cpu_srun.sbatch", TRAIN_CMD=train.format(tmp / "ckpt-srun"))
    j.submit("cpu-mpirun", "cpu_mpirun.sbatch", TRAIN_CMD=train.format(tmp / "ckpt-mpirun"),
             MPIGC_MPIRUN_FLAGS="--bind-to none")  # 4 ranks on 2 real cores
    gpu = ["--ntasks-per-node=2", "--gpus-per-node=2"]  # the local node's 2 fake GPUs
    j.submit("gpu-dry", "gpu_srun.sbatch", gpu, MPIGC_DRY_RUN=1)
    # no CUDA here: the launch itself (ranks, binding) with the launch check as training
    j.submit("gpu-check", "gpu_srun.sbatch", gpu, TRAIN_CMD="python -m mpigc.slurm")
    j.submit("bench", "bench_sweep.sbatch", MPIGC_BENCH_DIR=tmp / "bench",
             SWEEP_RANKS="2 4", BENCH_ARGS="--sizes 4K,64K --ops none,2bit "
             "--collectives allreduce --iters 3 --min-iters 1 --warmup 1 "
             "--time-per-point 0.2")
    # interrupt both chains once they are under way (before the tests wait on other jobs)
    for name in ("chain-requeue", "chain-resubmit"):
        job, out = j.jobs[name]
        wait_output(out, r"^step 10 ", job)
        _run("scancel", "--signal=USR1", "--batch", str(job))
    yield j
    running = [str(job) for job, _ in j.jobs.values()]
    subprocess.run(["scancel", *running], capture_output=True)


def test_every_template_is_tested(jobs):
    used = {"chain.sbatch", "cpu_srun.sbatch", "cpu_mpirun.sbatch", "gpu_srun.sbatch",
            "bench_sweep.sbatch"}
    assert set(TEMPLATES) == used, f"templates without a test: {set(TEMPLATES) - used}"


def _finals(ckpt):
    files = sorted(glob.glob(str(ckpt / "final" / "final-rank*.npz")))
    return [dict(np.load(f)) for f in files]


@pytest.mark.parametrize("name", ["cpu-srun", "cpu-mpirun"])
def test_cpu_templates(jobs, name):
    _, text = jobs.result(name)
    assert "train_chain: fresh start, 4 rank(s)" in text, text
    assert "train_chain: done, 12 steps" in text, text
    ckpt = jobs.tmp / f"ckpt-{name.split('-')[1]}"
    finals = _finals(ckpt)
    assert len(finals) == 4
    for f in finals[1:]:   # data parallel: every rank holds the same model
        assert np.array_equal(f["w1"], finals[0]["w1"])


def test_gpu_template_dry_run(jobs):
    _, text = jobs.result("gpu-dry")
    assert "mpigc: dry run, nothing launched" in text, text
    assert "--gpus-per-task=1" in text and "examples/train_torch.py" in text, text
    # one GPU per rank, a different one each
    seen = re.findall(r"rank (\d) on \S+: CUDA_VISIBLE_DEVICES=(\S+)", text)
    assert sorted(seen) == [("0", "0"), ("1", "1")], text


def test_gpu_template_launch(jobs):
    _, text = jobs.result("gpu-check")
    assert "mpigc.slurm: world size 2" in text, text
    gpus = re.findall(r"rank \d host \S+ SLURM_PROCID \d SLURM_LOCALID \d "
                      r"CUDA_VISIBLE_DEVICES (\S+)", text)
    assert sorted(gpus) == ["0", "1"], text


def test_bench_sweep(jobs):
    _, text = jobs.result("bench")
    out = jobs.tmp / "bench"
    if shutil.which("mpigc-bench") is None:
        assert "mpigc-bench not found; running the stand-in" in text, text
        warnings.warn("mpigc-bench is not installed: bench_sweep.sbatch ran its stand-in "
                      "(benchmarks/bench_allreduce.py); JSON and plots were not checked")
        for n in (2, 4):
            log = (out / f"ranks{n:04d}.log").read_text()
            assert "2bit" in log, log
        return
    for n in (2, 4):
        data = json.loads((out / f"ranks{n:04d}.json").read_text())
        rows = data["rows"]
        assert {r["ranks"] for r in rows} == {n}
        assert {r["op"] for r in rows} == {"none", "2bit"}
        assert {r["size_bytes"] for r in rows} == {4096, 65536}
        try:
            import matplotlib  # noqa: F401
            assert (out / f"ranks{n:04d}.png").stat().st_size > 0
        except ImportError:
            pass
    assert "allreduce busbw in GB/s" in text, text


def _assert_same_final(a, b):
    fa, fb = _finals(a), _finals(b)
    assert len(fa) == len(fb) == 4
    for r, (x, y) in enumerate(zip(fa, fb)):
        assert sorted(x) == sorted(y), (sorted(x), sorted(y))
        diff = [k for k in x if not np.array_equal(x[k], y[k])]
        assert not diff, f"rank {r}: differ from the uninterrupted run: {diff}"
        assert int(x["calls_w1"]) == CHAIN_STEPS


def test_chain_interrupted_requeued_resumes_bit_identical(jobs):
    info, text = jobs.result("chain-requeue")
    assert info["Restarts"] == "1", text
    m = re.search(r"signal 10: saved step (\d+)", text)
    assert m, text
    saved = int(m.group(1))
    assert 10 <= saved < CHAIN_STEPS
    assert f"train_chain: resumed from step {saved}" in text, text
    assert f"train_chain: done, {CHAIN_STEPS} steps ({CHAIN_STEPS - saved} in this run" in text
    jobs.result("chain-ref")
    _assert_same_final(jobs.tmp / "ckpt-requeue", jobs.tmp / "ckpt-ref")


def test_chain_interrupted_resubmitted_resumes_bit_identical(jobs):
    job, out = jobs.jobs["chain-resubmit"]
    info, text = jobs.result("chain-resubmit")
    m = re.search(r"submitted job (\d+) \(link 1\) after", text)
    assert m, text
    nxt = int(m.group(1))
    info = wait_job(nxt)
    text = out.read_text()   # the next job appends to the same output
    assert info["JobState"] == "COMPLETED", f"{info}\n{text}"
    assert re.search(r"train_chain: resumed from step \d+", text), text
    assert f"job {nxt} link 1 (resubmit)" in text, text
    jobs.result("chain-ref")
    _assert_same_final(jobs.tmp / "ckpt-resubmit", jobs.tmp / "ckpt-ref")
