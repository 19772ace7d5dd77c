"""Train a small CNN on the handwritten digits bundled with scikit-learn, data
parallel over MPI, with compressed gradient averaging (mpigc.torch).

    mpirun -n 8 python examples/train_torch.py --op 2bit
    mpirun -n 8 python examples/train_torch.py --op 2bit --epochs 10 --checkpoint /tmp/ck
    mpirun -n 8 python examples/train_torch.py --op 2bit --epochs 20 --checkpoint /tmp/ck --resume

The data (``sklearn.datasets.load_digits``: 1797 8x8 images, 10 classes) ships
with scikit-learn (``pip install scikit-learn``); nothing is downloaded. Each
rank trains on its own slice of the training set; the test set is the same on
every rank. ``--checkpoint DIR`` saves, after every epoch, the model, the
optimizer and the learning-rate schedule (``DIR/train.pt``, one file written by
rank 0) and the residuals of the error feedback (``mpigc.save_checkpoint`` in
``DIR/residuals-<epoch>``, which can be loaded on another number of ranks); the
residuals first, ``train.pt`` last and atomically, so a job killed while saving
resumes from the previous epoch; ``--resume`` restores all four (the residuals
with ``step=`` the model file's epoch) and continues with the next epoch. The cosine
schedule is a function of the epoch and ``--epochs``: a resumed run with the
same ``--epochs`` continues it exactly, one with more epochs follows the
schedule of the new total from the next epoch on.

``--hierarchy node`` (or ``auto``) sums the gradients exactly inside each node
and compresses only between the nodes (``docs/cluster.md``); checkpoints are
per parameter either way, so a run may resume with another ``--hierarchy``,
number of ranks or ranks per node.

``--sync ddp-hook`` trains with torch's DistributedDataParallel (gloo process
group, started from the MPI ranks) and mpigc's compressed allreduce as its
communication hook (``mpigc.torch.comm_hook``) instead of
``mpigc.torch.DistributedOptimizer``.

Optimizer and threshold: SGD with momentum (default), as 1-bit SGD and MXNet's
2-bit compression were designed for; Adam (``--optimizer adam``) divides each
element by its own running magnitude, which undoes much of what a threshold
quantizer does.

The 2bit threshold, three ways (give at most one):

- ``--rel-threshold c`` (the default, c = 1.5): 2bit's relative mode, one
  threshold per block of ``--block-size`` elements (default 1024), c times
  the RMS of that block's ``gradient + residual`` at every step
  (``mpigc.TwoBit(rel_threshold=c)``).
- ``--threshold t``: one absolute threshold for every element (MXNet's mode).
- ``--threshold-from-first-batch c``: one absolute threshold, c times the RMS
  of the first batch's averaged gradient (one uncompressed allreduce before
  training); what ``--rel-threshold`` meant before the relative mode existed.
"""
import argparse
import math
import os
import shutil
import time

import numpy as np
import torch
from mpi4py import MPI

import mpigc
import mpigc.torch


#: the 2bit relative threshold used when no threshold option is given (chosen
#: from the sweep in docs/torch.md)
DEFAULT_REL_THRESHOLD = 1.5


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--op", default="2bit", help="none, fp16, 2bit, 1bit, terngrad")
    p.add_argument("--threshold", type=float, default=None, help="2bit threshold (absolute)")
    p.add_argument("--rel-threshold", type=float, default=None,
                   help=f"2bit relative mode: per-block threshold c x the block's RMS "
                        f"(the default, c = {DEFAULT_REL_THRESHOLD})")
    p.add_argument("--block-size", type=int, default=1024,
                   help="2bit relative mode: elements per block")
    p.add_argument("--threshold-from-first-batch", type=float, default=None, metavar="C",
                   help="2bit absolute threshold = C x the RMS of the first batch's "
                        "averaged gradient")
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD's momentum")
    p.add_argument("--gather", choices=("compressed", "exact"), default="compressed")
    p.add_argument("--schedule", choices=("cosine", "constant"), default="cosine",
                   help="learning-rate schedule over the epochs")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=None,
                   help="learning rate (default 0.05 for SGD, 1e-3 for Adam)")
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint", metavar="DIR", help="save after every epoch")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    p.add_argument("--hierarchy", choices=("flat", "auto", "node"), default="flat",
                   help="flat (default); node: exact sums inside each node, compressed "
                        "between nodes; auto: node when the job spans several nodes "
                        "with several ranks on a node (docs/cluster.md)")
    p.add_argument("--sync", choices=("optimizer", "ddp-hook"), default="optimizer",
                   help="mpigc.torch.DistributedOptimizer (default), or DDP with "
                        "mpigc.torch.comm_hook")
    args = p.parse_args()
    given = [o for o, v in (("--threshold", args.threshold),
                            ("--rel-threshold", args.rel_threshold),
                            ("--threshold-from-first-batch",
                             args.threshold_from_first_batch)) if v is not None]
    if len(given) > 1:
        p.error(f"give at most one of {', '.join(given)}")
    return args


class DigitsCNN(torch.nn.Module):
    """Two convolutions and two dense layers for 1x8x8 images (about 70k parameters)."""

    def __init__(self):
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(1, 32, 3, padding=1), torch.nn.ReLU(),
            torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(),
            torch.nn.MaxPool2d(2))
        self.classifier = torch.nn.Sequential(
            torch.nn.Flatten(), torch.nn.Linear(64 * 4 * 4, 64), torch.nn.ReLU(),
            torch.nn.Linear(64, 10))

    def forward(self, x):
        return self.classifier(self.features(x))


def load_data(seed):
    from sklearn.datasets import load_digits
    d = load_digits()
    x = torch.tensor(d.images / 16.0, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(d.target, dtype=torch.int64)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_test = len(y) // 5
    return (x[perm[n_test:]], y[perm[n_test:]]), (x[perm[:n_test]], y[perm[:n_test]])


def accuracy(model, x, y):
    model.eval()
    with torch.no_grad():
        acc = (model(x).argmax(1) == y).float().mean().item()
    model.train()
    return acc


def make_scheduler(opt, args):
    """The learning-rate schedule over ``args.epochs`` (None: constant). A
    closed form of the epoch (``LambdaLR``), not CosineAnnealingLR's recursive
    one, so that a resumed run may change ``--epochs``."""
    if args.schedule == "constant":
        return None
    epochs = args.epochs
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda e: 0.5 * (1 + math.cos(math.pi * min(e, epochs) / epochs)))


def save(args, comm, epoch, model, opt, sched, residuals):
    """The residuals (``residuals.save_checkpoint``: a GradientSync or a
    CommHookState; every rank) in ``DIR/residuals-<epoch>``, then model,
    optimizer and schedule (rank 0, one file, ``DIR/train.pt``) naming them.
    Crash-consistent: ``train.pt`` is replaced last and atomically, so a job
    killed anywhere in here resumes from the previous epoch's pair; the older
    residuals are removed only after that."""
    os.makedirs(args.checkpoint, exist_ok=True)
    comm.Barrier()
    name = f"residuals-{epoch}"
    residuals.save_checkpoint(os.path.join(args.checkpoint, name), step=epoch)
    comm.Barrier()  # every rank's residuals are written before the model file names them
    if comm.rank == 0:
        tmp = os.path.join(args.checkpoint, "train.pt.tmp")
        torch.save({"epoch": epoch, "model": model.state_dict(), "optimizer": opt.state_dict(),
                    "scheduler": None if sched is None else sched.state_dict(),
                    "op": args.op, "world_size": comm.size, "residuals": name}, tmp)
        os.replace(tmp, os.path.join(args.checkpoint, "train.pt"))
        for old in os.listdir(args.checkpoint):
            if old.startswith("residuals") and old != name:
                shutil.rmtree(os.path.join(args.checkpoint, old), ignore_errors=True)
    comm.Barrier()


def resume(args, comm, model, opt, sched, residuals):
    """Restore what :func:`save` saved; returns the next epoch. The residuals
    must be the model file's epoch's (``step=``: MismatchError otherwise)."""
    ck = torch.load(os.path.join(args.checkpoint, "train.pt"), weights_only=True)
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["optimizer"])
    if sched is not None and ck.get("scheduler") is not None:
        sched.load_state_dict(ck["scheduler"])
        # the lr of the next epoch by this run's schedule (the same value when
        # --epochs did not change; the new total's when it did)
        for group, base, lam in zip(opt.param_groups, sched.base_lrs, sched.lr_lambdas):
            group["lr"] = base * lam(sched.last_epoch)
    residuals.load_checkpoint(os.path.join(args.checkpoint, ck.get("residuals", "residuals")),
                              step=ck["epoch"])
    return ck["epoch"] + 1


def first_gradient_rms(model, x, y, comm):
    """RMS of the first batch's gradient averaged over the ranks (plain MPI)."""
    loss = torch.nn.functional.cross_entropy(model(x), y)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    flat = torch.cat([g.reshape(-1) for g in grads]).double().numpy()
    comm.Allreduce(MPI.IN_PLACE, flat, op=MPI.SUM)
    return float(np.sqrt(np.mean((flat / comm.size) ** 2)))


def main():
    args = parse_args()
    comm = MPI.COMM_WORLD
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // comm.size))
    torch.manual_seed(args.seed + comm.rank)  # different on purpose: broadcast fixes it
    (xtr, ytr), (xte, yte) = load_data(args.seed)
    xtr, ytr = xtr[comm.rank::comm.size], ytr[comm.rank::comm.size]

    model = DigitsCNN()
    mpigc.torch.broadcast_parameters(model, root=0)
    params = {}
    if args.op == "2bit":
        if args.threshold is not None:
            params["threshold"] = args.threshold
        elif args.threshold_from_first_batch is not None:
            params["threshold"] = args.threshold_from_first_batch * first_gradient_rms(
                model, xtr[:args.batch_size], ytr[:args.batch_size], comm)
        else:
            params["rel_threshold"] = (DEFAULT_REL_THRESHOLD if args.rel_threshold is None
                                       else args.rel_threshold)
            params["block_size"] = args.block_size
    if args.optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=args.lr or 0.05, momentum=args.momentum)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=args.lr or 1e-3)
    net = model
    if args.sync == "ddp-hook":
        mpigc.torch.init_process_group("gloo")  # DDP's process group, from the MPI job
        net = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb)
        residuals = mpigc.torch.CommHookState(net, op=args.op, gather=args.gather,
                                              hierarchy=args.hierarchy, **params)
        net.register_comm_hook(residuals, mpigc.torch.comm_hook)
        layout = ("DDP's buckets" if residuals.groups is None
                  else f"{len(residuals.groups)} group(s) of parameters")
    else:
        # an optimizer whose step() applies the averaged gradients; they are
        # averaged by the end of backward(), as with DDP
        opt = mpigc.torch.DistributedOptimizer(opt, model, op=args.op,
                                               bucket_mb=args.bucket_mb, gather=args.gather,
                                               hierarchy=args.hierarchy, **params)
        residuals = opt.sync
        layout = f"{len(opt.sync.buckets)} bucket(s)"

    sched = make_scheduler(opt, args)
    start = 0
    if args.resume:
        if not args.checkpoint:
            raise SystemExit("--resume needs --checkpoint DIR")
        start = resume(args, comm, model, opt, sched, residuals)
        if comm.rank == 0:
            print(f"resumed from {args.checkpoint} at epoch {start}, "
                  f"lr {opt.param_groups[0]['lr']:.5f}")
    if comm.rank == 0:
        print(f"{comm.size} rank(s), op={args.op} {params}, "
              f"{sum(p.numel() for p in model.parameters())} parameters in "
              f"{layout}, {len(ytr)} training samples per rank, "
              f"{args.optimizer}, sync {args.sync}, hierarchy {args.hierarchy}")

    # every rank runs the same number of steps per epoch
    steps = comm.allreduce(-(-len(ytr) // args.batch_size), op=MPI.MIN)
    for epoch in range(start, args.epochs):
        g = torch.Generator().manual_seed(args.seed * 1000 + epoch * 100 + comm.rank)
        perm = torch.randperm(len(ytr), generator=g)
        t0, total = time.perf_counter(), 0.0
        mpigc.reset_traffic()
        for s in range(steps):
            idx = perm[s * args.batch_size:(s + 1) * args.batch_size]
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(net(xtr[idx]), ytr[idx])
            loss.backward()   # buckets start their compressed allreduce as they fill
            opt.step()        # with the gradients averaged over the ranks
            total += loss.item()
        loss = comm.allreduce(total / steps) / comm.size
        acc = accuracy(model, xte, yte)
        sent = comm.allreduce(mpigc.traffic()["bytes_sent"])
        if comm.rank == 0:
            print(f"epoch {epoch:3d}  loss {loss:.4f}  test accuracy {acc:.4f}  "
                  f"{time.perf_counter() - t0:6.2f} s  sent {sent / 2**20:7.2f} MiB (all ranks)",
                  flush=True)
        if sched is not None:
            sched.step()
        if args.checkpoint:
            save(args, comm, epoch, model, opt, sched, residuals)
    same = comm.allgather(float(sum(p.detach().double().sum() for p in model.parameters())))
    if comm.rank == 0:
        print("parameters equal on every rank:", all(v == same[0] for v in same))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
