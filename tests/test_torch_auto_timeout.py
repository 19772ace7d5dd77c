"""The torch layer's timeout holds at ``op="auto"``'s model steps: a
communicator's first ``op="auto"`` call and its agreement steps complete
inside the engine's call, where ``GradientSync`` and the DDP hook waited
with no timeout: rank 0 making a step alone (uneven inputs without
``join()``) hung there for ever, without the lines on stderr (found in
review, session 60; the hang reproduced with ``waiting_with`` taken out).
Now the call waits by the layer's own wait (``mpigc._auto.waiting_with``):
StateError after ``timeout``. Runs ``tests/mpi/auto_step_timeout_job.py``
under ``mpirun`` (its rank 0 leaves a call in flight on purpose)."""
import os
import re
import subprocess

import pytest

from test_internal_error import _command

pytest.importorskip("torch")

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "mpi", "auto_step_timeout_job.py")


@pytest.mark.parametrize("when", ["first", "step"])
@pytest.mark.parametrize("kind", ["sync", "hook"])
def test_a_step_on_one_rank_at_a_model_step_raises_at_the_timeout(tmp_path, kind, when):
    cmd, env = _command(2, None, {"JOB_OUT_DIR": str(tmp_path), "MPIGC_TORCH_WARN_S": "1"},
                        script=SCRIPT)
    r = subprocess.run(cmd + [kind, when], env=env, capture_output=True, text=True,
                       timeout=240)
    lines = "".join((tmp_path / f"rank{k}.out").read_text()
                    for k in range(2) if (tmp_path / f"rank{k}.out").exists())
    out = r.stdout + r.stderr + lines  # (the job leaves without MPI finalize: any status)
    got = re.search(r"rank 0: call (\d+) err (\w+) after (\d+) s: (.*)", lines)
    assert got is not None, out[-4000:]
    call, err, _, msg = got.groups()
    assert (int(call) == 0) == (when == "first"), out[-4000:]
    assert err == "StateError" and "did not reach this step" in msg, out[-4000:]
    assert "rank 1: call" in lines and "err NoneType" in lines, out[-4000:]
    # the rank said why before its timeout
    assert "still waiting after" in r.stderr, out[-4000:]
