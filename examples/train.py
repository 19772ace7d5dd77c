"""Data-parallel training on real data, gradients reduced with mpigc.allreduce.

    mpirun -n 8 python examples/train.py --op 2bit
    mpirun -n 8 python examples/train.py --op none,fp16,2bit,1bit,terngrad --seeds 0,1,2 \\
        --json convergence.json

The data: scikit-learn's bundled handwritten digits (1797 real 8x8 images of
the digits 0-9, shipped inside the scikit-learn package: no download). A fixed
stratified split holds out 25% (450 images) as the test set; rank r trains on
every N-th training image from r on (its own shard). The model: a small MLP
(64-128-10, ReLU, softmax cross-entropy, 9610 parameters) in numpy, SGD with
momentum 0.9 and a cosine learning-rate decay (the same for every op). Every step each rank computes the gradient of its own batch,
flattens all parameters' gradients into one float32 buffer and averages it over
the ranks with ``mpigc.allreduce(grad, op=..., key="grad", average=True)``;
every rank then takes the same step, so the replicas stay identical.

2bit threshold: the gradient's scale depends on model, loss and batch, so by
default the threshold is set relative to it: ``--threshold-from-first-batch c``
(default 2.0) sets one absolute t = c x RMS of the exactly averaged gradient at
the first step (one uncompressed allreduce, made once before training; this
option was called ``--rel-threshold`` before 2bit had a relative mode, and the
results in docs/benchmarks.md were measured with it). ``--threshold`` sets t
directly. ``--rel-threshold c`` uses 2bit's relative mode instead: one
threshold per block of ``--block-size`` elements, c x the block's RMS at every
step. Give at most one of the three. Error feedback delivers what a step did
not send later.

Each epoch rank 0 prints the mean training loss, the test accuracy and the
bytes this rank has sent so far (``mpigc.traffic()``).

``--checkpoint DIR`` saves, after every epoch and per run (``DIR/OP-seedS/``),
the model, the momentum, every rank's random state and the history
(``state-EPOCH.npz``, written by rank 0) and the error-feedback residuals
(``mpigc.save_checkpoint`` in ``residuals/``, step = epoch); ``--resume``
continues each run from there, bit for bit as if it had not stopped, given the
same number of ranks and the same learning-rate schedule (the cosine decay
spans ``--epochs``: resume a killed job with its own command, or use
``--schedule constant`` to extend a run)::

    mpirun -n 4 python examples/train.py --op 2bit --epochs 30 --checkpoint /tmp/ck
    mpirun -n 4 python examples/train.py --op 2bit --epochs 30 --checkpoint /tmp/ck --resume

Needs scikit-learn: ``pip install ".[examples]"`` (or ``pip install scikit-learn``).
"""
import argparse
import glob
import json
import os
import time

import numpy as np
from mpi4py import MPI

import mpigc


def load_digits_split(seed=0):
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError as exc:
        raise SystemExit("examples/train.py needs scikit-learn (its bundled digits "
                         "dataset): pip install scikit-learn") from exc
    X, y = load_digits(return_X_y=True)
    X = (X / 16.0).astype(np.float32)
    return train_test_split(X, y, test_size=0.25, random_state=seed, stratify=y)


class MLP:
    """64-h-10 ReLU network whose parameters live in one flat float32 vector."""

    def __init__(self, d_in, hidden, d_out, rng):
        self.shapes = [(d_in, hidden), (hidden,), (hidden, d_out), (d_out,)]
        sizes = [int(np.prod(s)) for s in self.shapes]
        self.offsets = np.concatenate([[0], np.cumsum(sizes)])
        self.theta = np.zeros(self.offsets[-1], np.float32)
        W1, _, W2, _ = self.views(self.theta)
        W1[...] = rng.standard_normal(W1.shape) * np.sqrt(2.0 / d_in)
        W2[...] = rng.standard_normal(W2.shape) * np.sqrt(1.0 / hidden)

    def views(self, flat):
        return [flat[a:b].reshape(s) for a, b, s in
                zip(self.offsets[:-1], self.offsets[1:], self.shapes)]

    def forward(self, X):
        W1, b1, W2, b2 = self.views(self.theta)
        h = np.maximum(X @ W1 + b1, 0)
        return h, h @ W2 + b2

    def loss_grad(self, X, y, grad):
        """Mean cross-entropy of the batch; its gradient written into ``grad``."""
        W1, b1, W2, b2 = self.views(self.theta)
        h, z = self.forward(X)
        z = z - z.max(axis=1, keepdims=True)
        p = np.exp(z)
        p /= p.sum(axis=1, keepdims=True)
        m = len(y)
        loss = -np.log(p[np.arange(m), y] + 1e-12).mean()
        dz = p
        dz[np.arange(m), y] -= 1
        dz /= m
        gW1, gb1, gW2, gb2 = self.views(grad)
        gW2[...] = h.T @ dz
        gb2[...] = dz.sum(0)
        dh = (dz @ W2.T) * (h > 0)
        gW1[...] = X.T @ dh
        gb1[...] = dh.sum(0)
        return float(loss)

    def accuracy(self, X, y):
        return float((self.forward(X)[1].argmax(1) == y).mean())


def _run_dir(args, op, seed):
    return os.path.join(args.checkpoint, f"{op}-seed{seed}")


def save_state(args, op, seed, comm, epoch, model, vel, rng, fb, params, history):
    """State of one run after ``epoch``: rank 0 writes the model, the momentum,
    every rank's random state and the history; then the residuals (collective).
    The residual checkpoint's step names the state file that goes with it, so
    a job killed in between resumes from the previous, complete pair."""
    d = _run_dir(args, op, seed)
    states = comm.gather(json.dumps(rng.bit_generator.state))
    if comm.rank == 0:
        os.makedirs(d, exist_ok=True)
        tmp = os.path.join(d, f"state-{epoch}.tmp.npz")
        np.savez(tmp, theta=model.theta, vel=vel, epoch=epoch, world_size=comm.size,
                 rng_states=json.dumps(states), params=json.dumps(params),
                 history=json.dumps(history))
        os.replace(tmp, os.path.join(d, f"state-{epoch}.npz"))
    comm.Barrier()
    mpigc.save_checkpoint(os.path.join(d, "residuals"), feedback=fb, step=epoch)
    if comm.rank == 0:
        for f in glob.glob(os.path.join(d, "state-*.npz")):
            if os.path.basename(f) != f"state-{epoch}.npz":
                os.remove(f)
    comm.Barrier()


def load_state(args, op, seed, comm, model, vel, rng, fb):
    """Restore a run saved by :func:`save_state`; returns (epoch, params,
    history), or None when this run has no checkpoint yet."""
    d = _run_dir(args, op, seed)
    if not comm.bcast(os.path.isdir(os.path.join(d, "residuals")) if comm.rank == 0 else None):
        return None
    epoch = mpigc.load_checkpoint(os.path.join(d, "residuals"), feedback=fb)["step"]
    with np.load(os.path.join(d, f"state-{epoch}.npz")) as z:
        if int(z["world_size"]) != comm.size:
            raise SystemExit(f"{d}: saved with {int(z['world_size'])} ranks, resumed with "
                             f"{comm.size}: this example resumes on the same number")
        model.theta[...] = z["theta"]
        vel[...] = z["vel"]
        rng.bit_generator.state = json.loads(json.loads(str(z["rng_states"]))[comm.rank])
        return epoch, json.loads(str(z["params"])), json.loads(str(z["history"]))


def train(op, seed, args, data, comm):
    Xtr, Xte, ytr, yte = data
    N, rank = comm.size, comm.rank
    Xs, ys = Xtr[rank::N], ytr[rank::N]  # this rank's shard
    model = MLP(Xtr.shape[1], args.hidden, 10, np.random.default_rng(seed))  # same init
    rng = np.random.default_rng([seed, rank])
    grad = np.zeros_like(model.theta)
    vel = np.zeros_like(model.theta)
    fb = mpigc.ErrorFeedback()
    params = {}
    # steps per epoch: the same on every rank (the smallest shard decides)
    steps = comm.allreduce(len(ys), op=MPI.MIN) // args.batch
    start, history, sent0 = 1, [], 0
    restored = (load_state(args, op, seed, comm, model, vel, rng, fb)
                if args.checkpoint and args.resume else None)
    if restored is not None:
        done, params, history = restored
        start = done + 1
        sent0 = history[-1]["bytes_sent"] if history else 0
        if rank == 0 and not args.quiet:
            print(f"op={op:8s} seed={seed} resumed after epoch {done}", flush=True)
    elif op == "2bit":
        if args.threshold is not None:
            params["threshold"] = args.threshold
        elif args.rel_threshold is not None:
            params["rel_threshold"] = args.rel_threshold
            params["block_size"] = args.block_size
        else:
            idx = rng.choice(len(ys), args.batch, replace=False)
            model.loss_grad(Xs[idx], ys[idx], grad)
            comm.Allreduce(MPI.IN_PLACE, grad)
            rms = float(np.sqrt(np.mean((grad / N) ** 2)))
            c = 2.0 if args.threshold_from_first_batch is None else \
                args.threshold_from_first_batch
            params["threshold"] = c * rms
    mpigc.reset_traffic()
    t0 = time.perf_counter()
    loss = history[-1]["loss"] if history else float("nan")
    acc = history[-1]["test_acc"] if history else model.accuracy(Xte, yte)
    sent = sent0
    for epoch in range(start, args.epochs + 1):
        perm = rng.permutation(len(ys))
        losses = []
        for s in range(steps):
            idx = perm[s * args.batch:(s + 1) * args.batch]
            losses.append(model.loss_grad(Xs[idx], ys[idx], grad))
            mpigc.allreduce(grad, op=op, key="grad", average=True, feedback=fb, **params)
            vel *= args.momentum
            vel += grad
            lr = args.lr
            if args.schedule == "cosine":  # per step, from lr down to 0
                k = (epoch - 1) * steps + s
                lr = args.lr * 0.5 * (1 + np.cos(np.pi * k / (args.epochs * steps)))
            model.theta -= lr * vel
        loss = comm.allreduce(float(np.mean(losses)), op=MPI.SUM) / N
        acc = model.accuracy(Xte, yte)
        sent = sent0 + mpigc.traffic()["bytes_sent"]
        history.append({"epoch": epoch, "loss": loss, "test_acc": acc, "bytes_sent": sent})
        if rank == 0 and not args.quiet:
            print(f"op={op:8s} seed={seed} epoch {epoch:3d}  loss {loss:.4f}  "
                  f"test acc {acc * 100:6.2f}%  sent {sent / 1e6:8.3f} MB", flush=True)
        if args.checkpoint:
            save_state(args, op, seed, comm, epoch, model, vel, rng, fb, params, history)
    # the replicas must be identical (every rank applied the same reduced gradient)
    same = comm.allreduce(float(np.abs(model.theta - comm.bcast(model.theta)).max()),
                          op=MPI.MAX)
    return {"op": op, "seed": seed, "params": params, "final_test_acc": acc,
            "theta": model.theta, "final_loss": loss, "bytes_sent": sent, "steps_per_epoch": steps,
            "seconds": time.perf_counter() - t0, "replica_max_diff": same,
            "n_params": int(model.theta.size), "history": history}


def summary_rows(runs):
    """One line per op: accuracy over seeds, MB sent per rank and "vs none"
    (none's bytes / the op's bytes, whatever the order of --op)."""
    nones = [r["bytes_sent"] for r in runs if r["op"] == "none"]
    base = np.mean(nones) / 1e6 if nones else None
    lines = []
    for op in dict.fromkeys(r["op"] for r in runs):
        rs = [r for r in runs if r["op"] == op]
        a = np.array([r["final_test_acc"] for r in rs]) * 100
        mb = np.mean([r["bytes_sent"] for r in rs]) / 1e6
        rel = f"{base / mb:7.1f}x" if base and mb else f"{'':>8}"
        lines.append(f"  {op:>8} {a.mean():29.2f} +- {a.std():4.2f} {a.min():6.2f} "
                     f"{a.max():6.2f} {mb:12.3f} {rel}")
    return lines


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--op", default="2bit",
                   help="none, fp16, 2bit, 1bit, terngrad, or a comma-separated list")
    p.add_argument("--seeds", default="0", help="comma-separated, e.g. 0,1,2")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch", type=int, default=16, help="per rank")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--schedule", choices=("cosine", "constant"), default="cosine",
                   help="learning rate schedule (default cosine decay to 0)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--threshold", type=float, help="2bit threshold (absolute)")
    p.add_argument("--threshold-from-first-batch", type=float, default=None, metavar="C",
                   help="2bit absolute threshold = C x the first step's gradient RMS "
                        "(the default, C = 2)")
    p.add_argument("--rel-threshold", type=float, default=None,
                   help="2bit relative mode: per-block threshold c x the block's RMS")
    p.add_argument("--block-size", type=int, default=1024,
                   help="2bit relative mode: elements per block")
    p.add_argument("--json", metavar="PATH", help="write every run's history here")
    p.add_argument("--quiet", action="store_true", help="only the summary")
    p.add_argument("--checkpoint", metavar="DIR",
                   help="save every run (model, momentum, random state, residuals) after "
                        "every epoch, in DIR/OP-seedS/")
    p.add_argument("--resume", action="store_true",
                   help="continue every run from its --checkpoint (runs without one start)")
    return p


def main(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    if args.resume and not args.checkpoint:
        p.error("--resume needs --checkpoint DIR")
    given = [o for o, v in (("--threshold", args.threshold),
                            ("--rel-threshold", args.rel_threshold),
                            ("--threshold-from-first-batch",
                             args.threshold_from_first_batch)) if v is not None]
    if len(given) > 1:
        p.error(f"give at most one of {', '.join(given)}")
    comm = MPI.COMM_WORLD
    data = load_digits_split()
    runs = []
    for op in [o.strip() for o in args.op.split(",") if o.strip()]:
        for seed in [int(s) for s in args.seeds.split(",")]:
            runs.append(train(op, seed, args, data, comm))
    if comm.rank == 0:
        Xtr, Xte = data[0], data[1]
        print(f"# digits: {len(Xtr)} train / {len(Xte)} test images, {comm.size} ranks, "
              f"{args.epochs} epochs, batch {args.batch}/rank, "
              f"{runs[0]['steps_per_epoch']} steps/epoch, {runs[0]['n_params']} parameters")
        print(f"# {'op':>8} {'test acc % (mean +- std over seeds)':>36} {'min':>6} {'max':>6} "
              f"{'MB sent/rank':>12} {'vs none':>8}")
        for line in summary_rows(runs):
            print(line)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "ranks": comm.size,
                           "runs": [{k: v for k, v in r.items() if k != "theta"}
                                    for r in runs]}, f, indent=1)


if __name__ == "__main__":
    main()
