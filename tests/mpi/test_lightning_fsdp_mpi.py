"""Lightning's FSDP2 strategy (ModelParallelStrategy) with mpigc's FSDP hooks
(issue 46, item 4): MpigcFsdpHooks registers them after configure_model, on
CPU and gloo under mpirun; op="none" trains as plain Lightning FSDP2 bit for
bit; a resume from Lightning's (distributed) checkpoint continues bit for
bit, residuals included; other strategies are refused."""
import os
import sys
import warnings

import pytest
from mpi4py import MPI

import mpigc

from conftest import assert_all, raises_everywhere

torch = pytest.importorskip("torch")
L = pytest.importorskip("lightning")
from lightning.fabric.plugins.environments import MPIEnvironment  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy  # noqa: E402

from mpigc.torch.lightning import MpigcFsdpHooks  # noqa: E402

from lightning_toy import Net, loader as toy_loader  # noqa: E402
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tests/
from support import torch_dist as td  # noqa: E402
from test_lightning_mpi import isolated  # noqa: E402,F401 - autouse: Lightning's leftovers

# 2: sums of two, bit for bit; 3: uneven shards (16 and 3 rows over 3 ranks)
pytestmark = pytest.mark.ranks(2, 3)

OP = {"op": "2bit", "threshold": 2.0 ** -6}


class ShardedNet(Net):
    """lightning_toy's MLP, each Linear and the Sequential fully_shard'ed
    over Lightning's data-parallel mesh in configure_model."""

    def configure_model(self):
        td.fully_shard_layers(self.net, (self.net[0], self.net[2]),
                              mesh=self.device_mesh["data_parallel"])


@pytest.fixture
def root(comm):
    with td.shared_dir(comm, "mpigc-lfsdp-") as path:
        yield path


def _trainer(root, callbacks=(), epochs=1, strategy=None, **kw):
    comm = MPI.COMM_WORLD
    kw.setdefault("enable_checkpointing", False)
    strategy = strategy or ModelParallelStrategy(data_parallel_size=comm.size,
                                                 tensor_parallel_size=1)
    return L.Trainer(accelerator="cpu", devices=comm.size, num_nodes=1, strategy=strategy,
                     plugins=[MPIEnvironment()], callbacks=list(callbacks), max_epochs=epochs,
                     logger=False, enable_progress_bar=False, enable_model_summary=False,
                     use_distributed_sampler=False, default_root_dir=root, **kw)


def _fit(root, callbacks=(), epochs=1, ckpt_path=None, **kw):
    net = ShardedNet()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _trainer(root, callbacks, epochs, **kw).fit(
            net, toy_loader(MPI.COMM_WORLD.rank, 16, 8), ckpt_path=ckpt_path)
    return td.local_params(net)


@pytest.mark.mpi
def test_none_trains_as_lightning_fsdp2(comm, root):
    """3 epochs of 2 steps: op="none" gives plain Lightning FSDP2's
    parameters bit for bit, one compressed call per FSDP group and step."""
    plain = _fit(root, epochs=3)
    hooks = MpigcFsdpHooks(op="none")
    got = _fit(root, [hooks], epochs=3)
    assert_all(td.same(plain, got) and hooks.state.calls == 6 * len(hooks.state.keys),
               f"differs from Lightning FSDP2 or calls {hooks.state.calls}")


@pytest.mark.mpi
def test_resume_from_lightning_checkpoint_bit_exact(comm, root):
    """Checkpoints after each epoch (Lightning writes them with DCP, the
    residuals gathered into its metadata file); a new trainer resumed from
    epoch 0's ends with the parameters and residuals of the uninterrupted
    run; the residuals are not zero."""
    first = MpigcFsdpHooks(**OP)
    ckpt = ModelCheckpoint(dirpath=f"{root}/ckpt", filename="{epoch}", save_top_k=-1,
                           every_n_epochs=1)
    want = _fit(root, [first, ckpt], epochs=3, enable_checkpointing=True)
    want_rows = {k: v.to_local().clone() for k, v in first.state.state_dict()["rows"].items()}
    second = MpigcFsdpHooks(**OP)
    got = _fit(root, [second], epochs=3, ckpt_path=f"{root}/ckpt/epoch=0.ckpt")
    rows = {k: v.to_local() for k, v in second.state.state_dict()["rows"].items()}
    kept = max(float(v.abs().max()) for v in want_rows.values())
    assert_all(td.same(want, got) and td.same(want_rows, rows) and kept > 0,
               f"resumed run differs (params {td.same(want, got)}, residuals "
               f"{td.same(want_rows, rows)}, largest {kept})")


@pytest.mark.mpi
def test_other_strategy_refused(comm, root):
    raises_everywhere(mpigc.ConfigError, lambda: _fit(
        root, [MpigcFsdpHooks(**OP)], strategy=DDPStrategy()),
        match="ModelParallelStrategy")

