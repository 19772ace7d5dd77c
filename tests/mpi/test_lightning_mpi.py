"""mpigc.torch.lightning under mpirun: the hook registered by MpigcCommHook
trains a Lightning DDP model on CPU (where DDPStrategy's own ddp_comm_hook is
skipped), as DDP with the hook does without Lightning; its residuals travel
in Lightning's checkpoints and a resume continues bit for bit; they reshard
as mpigc.load_checkpoint does; strategies that are not DDP are refused.

Lightning is optional (``pip install 'mpigc[lightning]'``): without it these
tests skip. Lightning runs on the MPI ranks through its ``MPIEnvironment``,
one CPU process per rank, at any rank count."""
import os
import re
import warnings

import numpy as np
import pytest
from mpi4py import MPI

import mpigc

from conftest import assert_all, raises_everywhere

torch = pytest.importorskip("torch")
L = pytest.importorskip("lightning")
from lightning.fabric.plugins.environments import MPIEnvironment  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy  # noqa: E402

import mpigc.torch as mt  # noqa: E402
from mpigc.compressors import get_compressor  # noqa: E402
from mpigc.feedback import shard_bounds  # noqa: E402
from mpigc.torch.lightning import CHECKPOINT_KEY, MpigcCommHook, residuals_for_rank  # noqa: E402

from lightning_toy import Net, loader as toy_loader  # noqa: E402

# ranks: one node, flat: 3 reshards down and up unevenly; 4 adds nothing
pytestmark = pytest.mark.ranks(1, 2, 3)

OP = {"op": "2bit", "threshold": 2.0 ** -6}  # sums of +-t are exact: any bucket layout
BATCHES, BATCH = 2, 8                        # per epoch and rank


def loader(rank):
    """This rank's own shard, the same batches in every epoch."""
    return toy_loader(rank, BATCHES * BATCH, BATCH)


def trainer(root, callbacks=(), strategy=None, **kw):
    comm = MPI.COMM_WORLD
    kw.setdefault("enable_checkpointing", False)
    return L.Trainer(accelerator="cpu", devices=comm.size, num_nodes=1,
                     strategy=strategy or DDPStrategy(cluster_environment=MPIEnvironment()),
                     callbacks=list(callbacks), logger=False, enable_progress_bar=False,
                     enable_model_summary=False, use_distributed_sampler=False,
                     default_root_dir=root, **kw)


def checkpointing(root):
    """A checkpoint at the end of every epoch: ``{root}/ckpt/epoch=K.ckpt``."""
    return ModelCheckpoint(dirpath=f"{root}/ckpt", filename="{epoch}", save_top_k=-1,
                           every_n_epochs=1)


def params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def same_params(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def same_state(a, b):
    """Per-parameter residual states ``a`` and ``b`` are equal, bit for bit."""
    def eq(x, y):
        if x is None or y is None:
            return x is None and y is None
        return np.asarray(x).tobytes() == np.asarray(y).tobytes()
    return a.keys() == b.keys() and all(
        eq(a[n]["worker"], b[n]["worker"]) and eq(a[n]["owner"], b[n]["owner"])
        and int(a[n]["calls"]) == int(b[n]["calls"]) for n in a)


@pytest.fixture
def root(comm, tmp_path_factory):
    return comm.bcast(str(tmp_path_factory.mktemp("lightning")) if comm.rank == 0 else None)


@pytest.fixture(autouse=True)
def isolated():
    """Lightning leaves its process group, environment variables (MASTER_PORT,
    ...) and warnings behind: the other tests of the session must not see them."""
    env, threads = dict(os.environ), torch.get_num_threads()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        warnings.filterwarnings("ignore", message=".*LeafSpec.*")
        warnings.filterwarnings("ignore", message="Checkpoint directory .* not empty")
        yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(threads)


@pytest.mark.mpi
def test_lightning_skips_its_own_ddp_comm_hook_on_cpu(comm, root):
    """Why MpigcCommHook exists (Lightning 2.x): DDPStrategy registers its
    ddp_comm_hook only on CUDA; on CPU training runs without it, silently."""
    model = Net()
    state = mt.CommHookState(model, **OP)
    mpigc.reset_traffic()
    strategy = DDPStrategy(cluster_environment=MPIEnvironment(), ddp_comm_state=state,
                           ddp_comm_hook=mt.comm_hook)
    trainer(root, strategy=strategy, max_steps=2).fit(model, loader(comm.rank))
    assert_all(mpigc.traffic()["calls"] == 0, f"traffic {mpigc.traffic()}: Lightning now "
               "registers ddp_comm_hook on CPU; docs/torch.md says it does not")


@pytest.mark.mpi
def test_hook_trains_on_cpu_as_ddp_with_the_hook_does(comm, root):
    """Every step goes through the hook (traffic), and the parameters and
    residuals are those of DDP with the hook, driven by hand on the same
    batches."""
    steps = 3
    model, hook = Net(), MpigcCommHook(**OP)
    mpigc.reset_traffic()
    trainer(root, [hook], max_steps=steps).fit(model, loader(comm.rank))
    calls = mpigc.traffic()["calls"]
    got, got_state = params(model), hook.state.state_dict()

    ref = Net()
    ddp = torch.nn.parallel.DistributedDataParallel(ref)  # Lightning's process group
    state = mt.CommHookState(ddp, **OP)
    ddp.register_comm_hook(state, mt.comm_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    mpigc.reset_traffic()
    batches = [b for _ in range(2) for b in loader(comm.rank)][:steps]
    for x, y in batches:
        opt.zero_grad()
        ((ddp(x) - y) ** 2).mean().backward()
        opt.step()
    want_calls = mpigc.traffic()["calls"]
    assert_all(calls >= steps and calls == want_calls,
               f"{calls} hook calls under Lightning, {want_calls} without, {steps} steps")
    assert_all(same_params(got, params(ref)), "parameters differ from DDP with the hook")
    assert_all(same_state(got_state, state.state_dict()), "residuals differ")
    assert_all(any(np.any(s["worker"]) for s in got_state.values() if s["worker"] is not None),
               "no residual: the test would not see them lost")


@pytest.mark.mpi
@pytest.mark.parametrize("op", ["2bit", "none"])
def test_checkpoint_resume_continues_bit_for_bit(comm, root, op):
    """ModelCheckpoint after epoch 0; trainer.fit(ckpt_path=...) in a new
    trainer with a new callback ends where the uninterrupted run ends:
    parameters and residuals bit for bit."""
    kw = OP if op == "2bit" else {"op": "none"}
    model, hook = Net(), MpigcCommHook(**kw)
    trainer(root, [hook, checkpointing(root)], max_epochs=2,
            enable_checkpointing=True).fit(model, loader(comm.rank))
    want, want_state = params(model), hook.state.state_dict()

    path = f"{root}/ckpt/epoch=0.ckpt"
    record = torch.load(path, weights_only=True)[CHECKPOINT_KEY]  # as Lightning loads it
    ok = record["world_size"] == comm.size and len(record["residuals"]) == comm.size
    if op == "2bit":
        ok &= any(bool(s["worker"].any()) for s in record["residuals"][comm.rank].values())
    assert_all(ok, f"checkpoint record: world_size {record['world_size']}")

    model2, hook2 = Net(), MpigcCommHook(**kw)  # a new trainer, as in a new job
    trainer(root, [hook2, checkpointing(root)], max_epochs=2,
            enable_checkpointing=True).fit(model2, loader(comm.rank), ckpt_path=path)
    assert_all(same_params(want, params(model2)), "resumed parameters differ")
    assert_all(same_state(want_state, hook2.state.state_dict()), "resumed residuals differ")
    if op != "2bit":
        return
    # residuals of another compressor config are refused
    other = MpigcCommHook(op="2bit", threshold=2.0 ** -5)
    t = trainer(root, [other, checkpointing(root)], max_epochs=2, enable_checkpointing=True)
    raises_everywhere(mpigc.MismatchError,
                      lambda: t.fit(Net(), loader(comm.rank), ckpt_path=path),
                      match="another compressor config")

    # a second fit with the same callback goes on with the first one's residuals
    model3, hook3 = Net(), MpigcCommHook(**kw)
    for _ in range(2):
        trainer(root, [hook3], max_epochs=1).fit(model3, loader(comm.rank))
    assert_all(same_params(want, params(model3)), "second fit: parameters differ")
    assert_all(same_state(want_state, hook3.state.state_dict()), "second fit: residuals")

    # a checkpoint without residuals: a warning, and they start from zero
    bare = f"{root}/bare.ckpt"
    if comm.rank == 0:
        c = torch.load(path, weights_only=True)
        del c[CHECKPOINT_KEY]
        torch.save(c, bare)
    comm.Barrier()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer(root, [MpigcCommHook(**kw)], max_epochs=2).fit(Net(), loader(comm.rank),
                                                                ckpt_path=bare)
    warned = any("holds no mpigc residuals" in str(w.message) for w in seen)
    assert_all(warned == (comm.rank == 0), f"warned: {warned}")


def _synthetic_record(names_numel, size, config):
    """A checkpoint record of ``size`` ranks with random residuals (every
    rank builds the same one)."""
    ranks = []
    for r in range(size):
        rng = np.random.default_rng([7, r])
        state = {}
        for name, n in names_numel.items():
            lo, hi = shard_bounds(n, size)[r]
            state[name] = {
                "worker": torch.from_numpy(rng.standard_normal(n).astype(np.float32)),
                "owner": torch.from_numpy(rng.standard_normal(hi - lo).astype(np.float32)),
                "config": config, "calls": 3, "n": n, "dtype": "float32"}
        ranks.append(state)
    return {"format": "mpigc.torch.residuals", "version": 1, "world_size": size,
            "mpigc_version": mpigc.__version__, "residuals": ranks}


@pytest.mark.mpi
def test_residuals_reshard_as_load_checkpoint_does(comm, root):
    """On its own world size a record gives each rank its state exactly; on a
    smaller one (a sub-communicator), exactly what mpigc.load_checkpoint of
    the same residuals gives; on a larger one the totals are kept."""
    model = Net()
    numel = {n: p.numel() for n, p in model.named_parameters()}
    config = get_compressor(OP["op"], threshold=OP["threshold"]).get_config()
    record = _synthetic_record(numel, comm.size, config)
    mine = residuals_for_rank(record, comm.size, comm.rank)
    ok = all(np.array_equal(mine[n]["worker"], record["residuals"][comm.rank][n]["worker"])
             and np.array_equal(mine[n]["owner"], record["residuals"][comm.rank][n]["owner"])
             for n in numel)
    state = mt.CommHookState(model, **OP)
    state.load_state_dict(mine)
    state.save_checkpoint(f"{root}/res")
    for m in range(1, comm.size):
        sub = comm.Split(0 if comm.rank < m else MPI.UNDEFINED, comm.rank)
        if sub != MPI.COMM_NULL:
            st = mt.CommHookState(model, comm=sub, **OP)
            st.load_checkpoint(f"{root}/res")
            ok &= same_state(st.state_dict(), residuals_for_rank(record, m, sub.rank))
            sub.Free()
    for m in (comm.size + 1, 2 * comm.size + 1):  # more ranks: totals kept
        new = [residuals_for_rank(record, m, j) for j in range(m)]
        for n in numel:
            worker = sum(s[n]["worker"].astype(np.float64) for s in new if
                         s[n]["worker"] is not None)
            old = sum(s[n]["worker"].numpy().astype(np.float64) for s in record["residuals"])
            ok &= np.array_equal(worker, old)
            ok &= np.array_equal(np.concatenate([s[n]["owner"] for s in new]),
                                 np.concatenate([s[n]["owner"].numpy()
                                                 for s in record["residuals"]]))
    assert_all(ok)


@pytest.mark.mpi
def test_refuses_a_strategy_that_is_not_ddp(comm, root):
    hook = MpigcCommHook(**OP)
    t = L.Trainer(accelerator="cpu", devices=1, strategy=SingleDeviceStrategy("cpu"),
                  callbacks=[hook], logger=False, enable_progress_bar=False,
                  enable_model_summary=False, enable_checkpointing=False,
                  default_root_dir=root, max_steps=1)
    raises_everywhere(mpigc.ConfigError, lambda: t.fit(Net(), loader(comm.rank)),
                      match="expected a DDPStrategy.*SingleDeviceStrategy")
    assert_all(hook.state is None)


@pytest.mark.mpi
def test_refuses_a_ddp_strategy_with_its_own_hook(comm, root):
    strategy = DDPStrategy(cluster_environment=MPIEnvironment(), ddp_comm_hook=mt.comm_hook)
    t = trainer(root, [MpigcCommHook(**OP)], strategy=strategy, max_steps=1)
    raises_everywhere(mpigc.ConfigError, lambda: t.fit(Net(), loader(comm.rank)),
                      match="ddp_comm_hook of its own")


def _doc_recipe():
    """The python block of docs/torch.md's "## PyTorch Lightning" section (not
    run by tests/test_docs.py, whose environment may have no Lightning)."""
    doc = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "torch.md")
    with open(doc) as f:
        text = f.read()
    section = text[text.index("\n## PyTorch Lightning\n"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.mpi
def test_doc_recipe_runs(comm, root, monkeypatch, capsys):
    """The doc's program, as written: trains, checkpoints, resumes."""
    monkeypatch.chdir(root)
    mpigc.reset_traffic()
    exec(compile(_doc_recipe(), "docs/torch.md", "exec"), {"__name__": "__main__"})
    out = capsys.readouterr().out
    assert_all(re.search(rf"rank {comm.rank}: [1-9][0-9]* compressed allreduces, "
                         r"resumed from .*epoch=1", out), out[-500:])


# -- CompressedAdamW: MpigcCompressedAdamW --------------------------------------------
from mpigc.checkpoint import CheckpointError  # noqa: E402
from mpigc.torch.lightning import ADAMW_CHECKPOINT_KEY, MpigcCompressedAdamW  # noqa: E402

ADAM = {"lr": 0.01, "op": "2bit", "threshold": 2.0 ** -6, "freeze_steps": 2}


class AdamNet(Net):
    """The toy model with CompressedAdamW (a window of ``sync_every`` local steps)."""

    def __init__(self, sync_every=1, **kw):
        super().__init__()
        self.sync_every, self.kw = sync_every, {**ADAM, **kw}

    def configure_optimizers(self):
        return mt.CompressedAdamW(self.parameters(), sync_every=self.sync_every, **self.kw)


class Grads(L.Callback):
    """The gradients each optimizer step is given."""

    def __init__(self):
        self.seen = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.seen.append(torch.cat([p.grad.reshape(-1) for p in pl_module.parameters()]))


def adam_state(opt):
    """A CompressedAdamW's moments, window and residuals, as comparable bytes."""
    own = opt.state_dict()["mpigc"]
    out = {k: own[k].numpy().tobytes() for k in ("exp_avg", "exp_avg_sq")}
    out["steps"] = (own["steps"], own["frozen_at"], own["skipped_steps"])
    win = own["window"] or {}
    out["window"] = {k: (v.numpy().tobytes() if torch.is_tensor(v) else v)
                     for k, v in win.items()}
    out["residuals"] = {k: (None if s["worker"] is None else s["worker"].tobytes(),
                            None if s["owner"] is None else s["owner"].tobytes(), s["calls"])
                        for k, s in opt.feedback.state_dict().items()}
    return out


def adam_by_hand(comm, steps, sync_every, accumulate=1, clip=None):
    """CompressedAdamW under DDP with local_gradients_hook, driven by hand on
    the batches Lightning gives (``accumulate`` batches a step, the loss
    divided by it, and ``clip_grad_norm_(clip)`` as Lightning's
    gradient_clip_val): (parameters, optimizer, gradients, calls)."""
    ref = Net()
    ddp = torch.nn.parallel.DistributedDataParallel(ref)  # Lightning's process group
    ddp.register_comm_hook(None, mt.local_gradients_hook)
    opt = mt.CompressedAdamW(ddp.parameters(), sync_every=sync_every, **ADAM)
    mpigc.reset_traffic()
    grads = []
    n = steps * accumulate
    batches = [b for _ in range(n) for b in loader(comm.rank)][:n]
    for i in range(steps):
        opt.zero_grad()
        for x, y in batches[i * accumulate:(i + 1) * accumulate]:
            (((ddp(x) - y) ** 2).mean() / accumulate).backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in ref.parameters()]))
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        opt.step()
    return params(ref), opt, grads, mpigc.traffic()["calls"]


@pytest.mark.mpi
@pytest.mark.parametrize("sync_every, accumulate", [(1, 1), (3, 1), (1, 2)])
def test_compressed_adamw_trains_as_by_hand_with_local_gradients(comm, root, sync_every,
                                                                  accumulate):
    """The callback makes DDP leave the gradients local (each optimizer step
    sees this rank's own gradient, not DDP's average), so mpigc's exchange
    of the momentum is the only one; parameters, moments, window and
    residuals are those of CompressedAdamW under DDP with
    local_gradients_hook driven by hand on the same batches (also with
    accumulate_grad_batches=2 and gradient_clip_val, as user scripts do)."""
    steps = 7
    clip = 0.05 if accumulate > 1 else None
    model, grads = AdamNet(sync_every), Grads()
    mpigc.reset_traffic()
    trainer(root, [MpigcCompressedAdamW(), grads], max_steps=steps,
            accumulate_grad_batches=accumulate, gradient_clip_val=clip).fit(
                model, loader(comm.rank))
    calls = mpigc.traffic()["calls"]
    opt = model.trainer.optimizers[0]
    want, ref_opt, ref_grads, want_calls = adam_by_hand(comm, steps, sync_every,
                                                        accumulate, clip)
    # the by-hand run's gradients are local: without the hook DDP's average
    # would reach the optimizer (and at 2+ ranks differ from them)
    same_grads = len(grads.seen) == steps and all(
        torch.equal(a, b) for a, b in zip(grads.seen, ref_grads))
    assert_all(same_grads, "the optimizer's gradients are not this rank's own")
    if comm.size > 1:
        every = comm.allgather(grads.seen[0])
        assert_all(not all(torch.equal(every[0], g) for g in every[1:]),
                   "every rank saw the same gradient: DDP averaged them")
    assert_all(calls == want_calls and calls >= 1,
               f"{calls} mpigc calls under Lightning, {want_calls} by hand")
    assert_all(same_params(params(model), want), "parameters differ from the run by hand")
    assert_all(adam_state(opt) == adam_state(ref_opt), "optimizer state differs")
    assert_all(any(np.any(s["worker"]) for s in opt.feedback.state_dict().values()),
               "no residual: the test would not see them lost")


@pytest.mark.mpi
@pytest.mark.parametrize("sync_every", [1, 3])
def test_compressed_adamw_resume_continues_bit_for_bit(comm, root, sync_every):
    """ModelCheckpoint after epoch 2 (step 6: with sync_every=3 inside the
    window after the first exchange, each rank's parameters its own); a new trainer resumed from it
    ends where the uninterrupted run ends: parameters, moments, window and
    residuals bit for bit on every rank."""
    model = AdamNet(sync_every)
    trainer(root, [MpigcCompressedAdamW(), checkpointing(root)], max_epochs=4,
            enable_checkpointing=True).fit(model, loader(comm.rank))
    want, want_state = params(model), adam_state(model.trainer.optimizers[0])

    path = f"{root}/ckpt/epoch=2.ckpt"
    record = torch.load(path, weights_only=True)[ADAMW_CHECKPOINT_KEY]  # as Lightning
    part = record["optimizers"][0]
    ok = record["world_size"] == comm.size and len(part["residuals"]["residuals"]) == comm.size
    ok &= any(bool(s["worker"].any()) for s in part["residuals"]["residuals"][comm.rank].values())
    ok &= all((w is not None) == (sync_every > 1) for w in part["windows"])
    assert_all(ok, f"checkpoint record: {record['world_size']}, windows "
               f"{[w is not None for w in part['windows']]}")

    model2 = AdamNet(sync_every)  # a new trainer, as in a new job
    trainer(root, [MpigcCompressedAdamW(), checkpointing(root)], max_epochs=4,
            enable_checkpointing=True).fit(model2, loader(comm.rank), ckpt_path=path)
    got = adam_state(model2.trainer.optimizers[0])
    assert_all(same_params(want, params(model2)), "resumed parameters differ")
    assert_all(got == want_state, "resumed moments, window or residuals differ: "
               f"{[k for k in got if got[k] != want_state[k]]}")

    # residuals of another compressor config are refused
    t = trainer(root, [MpigcCompressedAdamW()], max_epochs=4)
    raises_everywhere(mpigc.MismatchError,
                      lambda: t.fit(AdamNet(sync_every, threshold=2.0 ** -5),
                                    loader(comm.rank), ckpt_path=path),
                      match="another compressor config")

    # a checkpoint without them: a warning, and they start from zero
    bare = f"{root}/bare.ckpt"
    if comm.rank == 0:
        c = torch.load(path, weights_only=True)
        del c[ADAMW_CHECKPOINT_KEY]
        torch.save(c, bare)
    comm.Barrier()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer(root, [MpigcCompressedAdamW()], max_epochs=4).fit(
            AdamNet(sync_every), loader(comm.rank), ckpt_path=bare)
    warned = any("holds no CompressedAdamW residuals" in str(w.message) for w in seen)
    assert_all(warned == (comm.rank == 0), f"warned: {warned}")


def _rewrite(comm, src, dst, edit):
    """``src``'s checkpoint with ``edit(record)`` applied, saved to ``dst``."""
    if comm.rank == 0:
        c = torch.load(src, weights_only=True)
        edit(c[ADAMW_CHECKPOINT_KEY])
        torch.save(c, dst)
    comm.Barrier()


@pytest.mark.mpi
def test_compressed_adamw_on_another_world_size(comm, root):
    """Residuals saved on another world size are resharded as
    mpigc.load_checkpoint does (state_for_rank); a window of local steps
    saved on another world size is a CheckpointError on every rank."""
    trainer(root, [MpigcCompressedAdamW(), checkpointing(root)], max_epochs=3,
            enable_checkpointing=True).fit(AdamNet(3), loader(comm.rank))
    path = f"{root}/ckpt/epoch=2.ckpt"
    big = comm.size + 1

    def more_ranks(record, windows):
        part = record["optimizers"][0]
        res = part["residuals"]
        res["residuals"] = [res["residuals"][r % comm.size] for r in range(big)]
        res["world_size"] = record["world_size"] = big
        part["windows"] = [part["windows"][r % comm.size] if windows else None
                           for r in range(big)]
        part["params"] = [part["params"][r % comm.size] if windows else None
                          for r in range(big)]

    _rewrite(comm, path, f"{root}/nowin.ckpt", lambda r: more_ranks(r, False))
    record = torch.load(f"{root}/nowin.ckpt", weights_only=True)[ADAMW_CHECKPOINT_KEY]
    want = residuals_for_rank(record["optimizers"][0]["residuals"], comm.size, comm.rank)

    class Peek(L.Callback):
        def on_train_start(self, trainer, pl_module):  # after the callback's load
            self.state = trainer.optimizers[0].feedback.state_dict()

    peek = Peek()
    trainer(root, [MpigcCompressedAdamW(), peek], max_epochs=4).fit(
        AdamNet(3), loader(comm.rank), ckpt_path=f"{root}/nowin.ckpt")
    assert_all(same_state(peek.state, want) and any(np.any(s["worker"]) for s in want.values()),
               "residuals not resharded as load_checkpoint")

    _rewrite(comm, path, f"{root}/win.ckpt", lambda r: more_ranks(r, True))
    t = trainer(root, [MpigcCompressedAdamW()], max_epochs=4)
    raises_everywhere(CheckpointError,
                      lambda: t.fit(AdamNet(3), loader(comm.rank), ckpt_path=f"{root}/win.ckpt"),
                      match=f"window of local steps.*on {big} rank")


@pytest.mark.mpi
def test_compressed_adamw_refusals(comm, root):
    """What cannot work is a ConfigError from fit on every rank."""
    raises_everywhere(mpigc.ConfigError, lambda: trainer(
        root, [MpigcCompressedAdamW()], max_steps=1).fit(Net(), loader(comm.rank)),
        match="CompressedAdamW optimizer.s. only, got SGD")
    raises_everywhere(mpigc.ConfigError, lambda: trainer(
        root, [MpigcCompressedAdamW(), MpigcCommHook(**OP)], max_steps=1).fit(
            AdamNet(), loader(comm.rank)), match="MpigcCommHook is among the callbacks")
    strategy = DDPStrategy(cluster_environment=MPIEnvironment(), ddp_comm_hook=mt.comm_hook)
    raises_everywhere(mpigc.ConfigError, lambda: trainer(
        root, [MpigcCompressedAdamW()], strategy=strategy, max_steps=1).fit(
            AdamNet(), loader(comm.rank)), match="ddp_comm_hook of its own")
    t = L.Trainer(accelerator="cpu", devices=1, strategy=SingleDeviceStrategy("cpu"),
                  callbacks=[MpigcCompressedAdamW()], logger=False, enable_progress_bar=False,
                  enable_model_summary=False, enable_checkpointing=False,
                  default_root_dir=root, max_steps=1)
    raises_everywhere(mpigc.ConfigError, lambda: t.fit(AdamNet(), loader(comm.rank)),
                      match="expected a DDPStrategy.*SingleDeviceStrategy")
    # a GradScaler ("16-mixed" on a GPU; on CPU Lightning makes none unless given)
    from lightning.pytorch.plugins.precision import MixedPrecision
    scaled = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    raises_everywhere(mpigc.ConfigError, lambda: trainer(
        root, [MpigcCompressedAdamW()], max_steps=1, plugins=[scaled]).fit(
            AdamNet(), loader(comm.rank)), match="GradScaler")
