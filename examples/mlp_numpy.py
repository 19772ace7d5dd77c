"""The common mpi4py + numpy data-parallel loop, with mpigc's headline line.

    mpirun -n 2 python examples/mlp_numpy.py                     # --op 2bit
    mpirun -n 4 python examples/mlp_numpy.py --op 2bit --op 1bit --op '{"type": "2bit", "threshold": 0.5}'

Written the way a user writes it before mpigc: every parameter's gradient is
summed with ``comm.Allreduce(MPI.IN_PLACE, grad)`` and divided by the number
of ranks, one call per parameter. With mpigc that line becomes
``mpigc.allreduce(grad, op=OP, key=name)`` (README.md's headline), and nothing
else changes. Each run trains the same model from the same initial weights on
the same batches, first with the exact ``comm.Allreduce`` (the reference), then
with each ``--op``, and prints the final loss and its ratio to the exact one.

The model: a 784-128-128-10 ReLU MLP (118,282 parameters), softmax
cross-entropy, SGD with momentum 0.9. The data: synthetic 28x28 "digits" (no
download): ten smooth random stroke images, one per class, each sample a
randomly shifted and scaled copy of its class's image plus strong noise; every rank
draws its own batches from its own seeded stream. The final loss is the mean
cross-entropy over 2000 fixed held-out samples, the same on every rank.

``--op`` (repeatable): an mpigc op, a string (``2bit``, ``1bit``, ``fp16``,
``none``...) or a JSON config (``'{"type": "2bit", "rel_threshold": 1.5}'``,
``'{"type": "2bit", "threshold": 0.5}'``). ``--average`` passes
``average=True`` instead of dividing after the call.
"""
import argparse
import json

import numpy as np
from mpi4py import MPI

import mpigc

SIZES = (784, 128, 128, 10)
#: the standard deviation of the pixel noise
NOISE = 0.45


def make_data(seed=0):
    """Ten class images (28x28, values in [0, 1]) and a sampler of batches."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:28, 0:28] / 27.0
    protos = []
    for _ in range(10):
        img = np.zeros((28, 28))
        for _ in range(3):  # three random strokes: Gaussian ridges along lines
            a, b = rng.uniform(0.2, 0.8, 2), rng.uniform(0.2, 0.8, 2)
            d = b - a
            t = np.clip(((xx - a[0]) * d[0] + (yy - a[1]) * d[1]) / (d @ d), 0, 1)
            dist2 = (xx - a[0] - t * d[0]) ** 2 + (yy - a[1] - t * d[1]) ** 2
            img = np.maximum(img, np.exp(-dist2 / 0.004))
        protos.append(img)
    return np.stack(protos)


def shifted(protos):
    """Every class image shifted by -2..2 pixels each way: (10, 25, 784)."""
    return np.stack([[np.roll(p, (dy, dx), axis=(0, 1)).reshape(-1)
                      for dy in range(-2, 3) for dx in range(-2, 3)] for p in protos])


def sample(images, rng, m):
    """``m`` samples: class labels, and images of ``shifted(protos)`` picked
    at random, scaled by 0.7-1.3, plus noise of standard deviation NOISE."""
    y = rng.integers(0, 10, m)
    shift = rng.integers(0, 25, m)
    scale = rng.uniform(0.7, 1.3, (m, 1))
    X = images[y, shift] * scale + NOISE * rng.standard_normal((m, 784))
    return X.astype(np.float32), y


def init_params(seed=0):
    rng = np.random.default_rng(seed)
    params = {}
    for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:])):
        params[f"W{i}"] = (rng.standard_normal((a, b)) * np.sqrt(2.0 / a)).astype(np.float32)
        params[f"b{i}"] = np.zeros(b, np.float32)
    return params


def loss_and_grads(params, X, y):
    """Mean cross-entropy of the batch and the gradient of every parameter."""
    n = len(SIZES) - 1
    hs = [X]
    for i in range(n):
        z = hs[-1] @ params[f"W{i}"] + params[f"b{i}"]
        hs.append(np.maximum(z, 0) if i < n - 1 else z)
    z = hs[-1] - hs[-1].max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    m = len(y)
    loss = float(-np.log(p[np.arange(m), y] + 1e-12).mean())
    dz = p
    dz[np.arange(m), y] -= 1
    dz /= m
    grads = {}
    for i in reversed(range(n)):
        grads[f"W{i}"] = (hs[i].T @ dz).astype(np.float32)
        grads[f"b{i}"] = dz.sum(0).astype(np.float32)
        if i:
            dz = (dz @ params[f"W{i}"].T) * (hs[i] > 0)
    return loss, grads


def parse_op(text):
    text = text.strip()
    return json.loads(text) if text.startswith("{") else text


def train(op, args, comm, protos, X_eval, y_eval):
    """One run: ``op`` None is the exact reference (comm.Allreduce). Returns
    the final held-out loss."""
    size = comm.Get_size()
    params = init_params(args.seed)
    vel = {k: np.zeros_like(v) for k, v in params.items()}
    rng = np.random.default_rng([args.seed, comm.Get_rank()])
    fb = mpigc.ErrorFeedback()  # each run its own residuals
    for step in range(args.steps):
        X, y = sample(protos, rng, args.batch)
        _, grads = loss_and_grads(params, X, y)
        for name, grad in grads.items():
            if op is None:
                comm.Allreduce(MPI.IN_PLACE, grad)
                grad /= size
            elif args.average:
                mpigc.allreduce(grad, op=op, key=name, average=True, feedback=fb)
            else:
                mpigc.allreduce(grad, op=op, key=name, feedback=fb)
                grad /= size
            vel[name] = 0.9 * vel[name] + grad
            params[name] -= args.lr * vel[name]
    return loss_and_grads(params, X_eval, y_eval)[0]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--op", action="append", help="mpigc op (repeatable; default 2bit)")
    ap.add_argument("--average", action="store_true",
                    help="average=True in the call instead of dividing after it")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    ops = [parse_op(o) for o in (args.op or ["2bit"])]
    comm = MPI.COMM_WORLD
    protos = shifted(make_data(args.seed))
    X_eval, y_eval = sample(protos, np.random.default_rng([args.seed, 12345]), 2000)
    say = print if comm.Get_rank() == 0 else (lambda *a, **k: None)
    say(f"{comm.Get_size()} ranks, {args.steps} steps, batch {args.batch} per rank",
        flush=True)
    exact = train(None, args, comm, protos, X_eval, y_eval)
    rows = [("exact (comm.Allreduce)", exact)]
    say(f"{rows[0][0]:<48} final loss {exact:.4f}  ratio to exact 1.000", flush=True)
    for op in ops:
        label = json.dumps(op) + (" average=True" if args.average else "")
        loss = train(op, args, comm, protos, X_eval, y_eval)
        rows.append((label, loss))
        say(f"{label:<48} final loss {loss:.4f}  ratio to exact {loss / exact:.3f}",
            flush=True)
    return rows


if __name__ == "__main__":
    main()
