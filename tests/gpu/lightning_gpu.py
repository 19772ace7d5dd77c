"""Lightning on a GPU with mpigc's callback, under mpirun (one process per
rank; every rank may share one GPU): ``MpigcCommHook`` trains a Lightning
DDP model on CUDA tensors (mpigc's device buckets), as DDP with
``mpigc.torch.comm_hook`` driven by hand does on the same batches; its
residuals stay on the GPU and travel in Lightning's checkpoint record.

    mpirun -n 2 python tests/gpu/lightning_gpu.py [--device cuda|cpu] [--json FILE]

Each MPI rank is a node of one device to Lightning (``devices=1``,
``num_nodes`` = ranks, device 0 of each process), so that several ranks may
share the one GPU of a test machine. Gloo moves DDP's own tensors (its
parameter broadcast); mpigc the gradients. ``--device cpu`` runs the same
checks on the CPU (a test of this script without a GPU). Prints one JSON
line on rank 0; exit status 0 when every check held on every rank.
"""
import argparse
import json
import os
import sys
import tempfile
import warnings

from mpi4py import MPI

import numpy as np
import torch
import lightning as L
from lightning.fabric.plugins.environments import MPIEnvironment
from lightning.pytorch.strategies import DDPStrategy

import mpigc
import mpigc.torch as mt
from mpigc.torch.lightning import CHECKPOINT_KEY, MpigcCommHook

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "mpi"))
from lightning_toy import Net as ToyNet, loader as toy_loader  # noqa: E402

OP = {"op": "2bit", "threshold": 2.0 ** -6}
STEPS, BATCH = 4, 16
SIZES, LR = (64, 256, 8), 0.05


def Net():
    return ToyNet(SIZES, LR)


def loader(rank):
    return toy_loader(rank, STEPS * BATCH, BATCH, SIZES)


class OneDevicePerRank(MPIEnvironment):
    """Every MPI rank a node of its own, on device 0 (ranks share a GPU)."""

    def local_rank(self):
        return 0

    def node_rank(self):
        return self.global_rank()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    cuda = args.device == "cuda"
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    root = comm.bcast(tempfile.mkdtemp() if comm.rank == 0 else None)

    model, hook = Net(), MpigcCommHook(**OP)
    trainer = L.Trainer(accelerator="gpu" if cuda else "cpu", devices=1, num_nodes=comm.size,
                        strategy=DDPStrategy(cluster_environment=OneDevicePerRank(),
                                             process_group_backend="gloo"),
                        callbacks=[hook], max_steps=STEPS, logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, enable_checkpointing=False,
                        default_root_dir=root)
    mpigc.reset_traffic()
    trainer.fit(model, loader(comm.rank))
    calls = mpigc.traffic()["calls"]
    got = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = hook.state.state_dict()
    workers = [s["worker"] for s in state.values() if s["worker"] is not None]
    fb = hook.state.feedback  # the live store: where its residuals are kept
    on_device = len(fb) > 0 and all(bool(fb.entry(k).on_device) == cuda for k in fb.keys())
    trainer.save_checkpoint(f"{root}/last.ckpt")
    record = torch.load(f"{root}/last.ckpt", weights_only=True)[CHECKPOINT_KEY]

    # the same steps by hand: DDP (Lightning's process group) with the hook
    ref = Net().to(dev)
    ddp = torch.nn.parallel.DistributedDataParallel(ref, device_ids=[0] if cuda else None)
    rstate = mt.CommHookState(ddp, **OP)
    ddp.register_comm_hook(rstate, mt.comm_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    mpigc.reset_traffic()
    for x, y in loader(comm.rank):
        x, y = x.to(dev), y.to(dev)
        opt.zero_grad()
        ((ddp(x) - y) ** 2).mean().backward()
        opt.step()
    want_calls = mpigc.traffic()["calls"]
    want = {n: p.detach() for n, p in ref.named_parameters()}
    diff = max(float((got[n].to(dev) - want[n]).abs().max()) for n in want)
    same = all(torch.equal(got[n].to(dev), want[n]) for n in want)

    def host(a):
        return np.asarray(a.cpu() if isinstance(a, torch.Tensor) else a)
    rst = rstate.state_dict()
    same_res = state.keys() == rst.keys() and all(
        host(state[k]["worker"]).tobytes() == host(rst[k]["worker"]).tobytes()
        for k in state if state[k]["worker"] is not None)
    checks = {
        "hook calls": calls >= STEPS and calls == want_calls,
        "parameters as DDP with the hook": same,
        "residuals as DDP with the hook": same_res,
        "residuals on the device": on_device,
        "residuals nonzero": any(bool(host(w).any()) for w in workers),
        "checkpoint record": record["world_size"] == comm.size
        and len(record["residuals"]) == comm.size,
    }
    ok = comm.allreduce(int(all(checks.values())), op=MPI.MIN) == 1
    out = {"ranks": comm.size, "device": str(dev),
           "where": torch.cuda.get_device_name(0) if cuda else "cpu",
           "lightning": L.__version__, "torch": torch.__version__,
           "steps": STEPS, "hook_calls": calls, "max_param_diff": diff,
           "checks": {k: bool(v) for k, v in checks.items()}, "ok": ok}
    all_out = comm.gather(out)
    if comm.rank == 0:
        print(json.dumps(all_out[0]))
        if not ok:
            print(json.dumps(all_out), file=sys.stderr)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(all_out[0], failed_ranks=[r for r, o in enumerate(all_out)
                                                         if not all(o["checks"].values())]), f)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
