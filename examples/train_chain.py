"""A small, deterministic data-parallel training that survives time limits.

The job chain of ``slurm/chain.sbatch`` runs it (``TRAIN_CMD``); it shows the
pattern of :mod:`mpigc.slurm` in a training loop, and the tests use it to
check that an interrupted and resumed chain ends bit for bit where an
uninterrupted run ends::

    mpirun -n 4 python examples/train_chain.py --steps 200 --ckpt /tmp/ckpt

A two-layer MLP (numpy, float32) fits a fixed random teacher on synthetic
batches; batch ``s`` of rank ``r`` depends only on ``(seed, s, r)``, so any
step can be replayed. Gradients are averaged with ``mpigc.allreduce`` (one key
per parameter, error feedback in ``fb``); SGD with momentum.

On SIGUSR1 or SIGTERM (any rank), all ranks agree at the next step boundary,
save model, momentum and residuals (``mpigc.slurm.save_training_state``) and
exit with ``mpigc.slurm.RESUME_EXIT_CODE`` (85); started again with the same
``--ckpt``, it resumes from there. At the end every rank writes
``OUT/final-rank00000.npz`` (parameters, momentum, and each key's residuals and
call count) for comparisons.
"""
import os

# one BLAS thread per rank: with several ranks per node more only oversubscribe
for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mpigc  # noqa: E402
from mpigc import slurm  # noqa: E402

NAMES = ("w1", "b1", "w2", "b2")


def init_params(d_in, hidden, d_out, seed):
    rng = np.random.default_rng([seed, 0xC0FFEE])
    return {
        "w1": (rng.standard_normal((d_in, hidden)) / np.sqrt(d_in)).astype(np.float32),
        "b1": np.zeros(hidden, np.float32),
        "w2": (rng.standard_normal((hidden, d_out)) / np.sqrt(hidden)).astype(np.float32),
        "b2": np.zeros(d_out, np.float32),
    }


def batch(seed, step, rank, n, d_in, teacher):
    rng = np.random.default_rng([seed, step, rank])
    x = rng.standard_normal((n, d_in)).astype(np.float32)
    y = np.tanh(x @ teacher).astype(np.float32)
    return x, y


def loss_and_grads(p, x, y):
    h_pre = x @ p["w1"] + p["b1"]
    h = np.maximum(h_pre, 0)
    out = h @ p["w2"] + p["b2"]
    diff = out - y
    loss = float(np.mean(diff * diff))
    g_out = (2.0 / diff.size) * diff
    g = {"w2": h.T @ g_out, "b2": g_out.sum(0)}
    g_h = (g_out @ p["w2"].T) * (h_pre > 0)
    g["w1"] = x.T @ g_h
    g["b1"] = g_h.sum(0)
    return loss, {k: np.ascontiguousarray(v, np.float32) for k, v in g.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--op", default="2bit", help="mpigc op (none, fp16, 2bit, 1bit, terngrad)")
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--batch", type=int, default=32, help="samples per rank and step")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ckpt", default=os.environ.get("MPIGC_CHECKPOINT_DIR", "mpigc-ckpt"),
                    help="checkpoint directory (default $MPIGC_CHECKPOINT_DIR or ./mpigc-ckpt)")
    ap.add_argument("--out", help="where the final per-rank states go (default CKPT/final)")
    ap.add_argument("--save-every", type=int, default=0, help="also save every N steps")
    ap.add_argument("--sleep", type=float, default=0.0, help="seconds per step (tests)")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--fake-signal", metavar="STEP:RANK",
                    help="raise the stop flag on RANK after STEP (tests, no signal)")
    args = ap.parse_args(argv)

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    slurm.expect_world_size(comm)        # fail loudly on singletons
    flag = slurm.install_signal_handler()
    env = slurm.slurm_env()
    say = print if rank == 0 else (lambda *a, **k: None)

    d_in, d_out = 16, 8
    teacher = np.random.default_rng([args.seed, 1]).standard_normal((d_in, d_out)) \
        .astype(np.float32)
    fb = mpigc.ErrorFeedback()
    state = slurm.load_training_state(args.ckpt, feedback=fb, comm=comm)
    if state is None:
        start = 0
        params = init_params(d_in, args.hidden, d_out, args.seed)
        mom = {k: np.zeros_like(v) for k, v in params.items()}
        say(f"train_chain: fresh start, {size} rank(s), op {args.op}, job "
            f"{env.job_id}, restart {env.restart_count}", flush=True)
    else:
        start = state.step
        params = {k: state.arrays[k] for k in NAMES}
        mom = {k: state.arrays["mom_" + k] for k in NAMES}
        say(f"train_chain: resumed from step {start} ({state.path}), {size} rank(s), "
            f"job {env.job_id}, restart {env.restart_count}", flush=True)
    fake_step, fake_rank = (None, None)
    if args.fake_signal:
        fake_step, fake_rank = (int(v) for v in args.fake_signal.split(":"))

    def save(step):
        arrays = dict(params)
        arrays.update({"mom_" + k: v for k, v in mom.items()})
        return slurm.save_training_state(args.ckpt, arrays, step=step, feedback=fb,
                                         comm=comm)

    t0 = time.perf_counter()
    for step in range(start, args.steps):
        x, y = batch(args.seed, step, rank, args.batch, d_in, teacher)
        loss, grads = loss_and_grads(params, x, y)
        for k in NAMES:
            mpigc.allreduce(grads[k].reshape(-1), op=args.op, key=k, feedback=fb,
                            average=True, comm=comm)
            mom[k] = (args.momentum * mom[k] + grads[k]).astype(np.float32)
            params[k] = (params[k] - args.lr * mom[k]).astype(np.float32)
        done = step + 1
        if done % args.log_every == 0 or done == args.steps:
            say(f"step {done} loss {comm.allreduce(loss) / size:.6f}", flush=True)
        if args.sleep:
            time.sleep(args.sleep)
        if fake_step is not None and done == fake_step and rank == fake_rank:
            flag.set()
        sig = slurm.checkpoint_due(flag, comm=comm)   # same answer on every rank
        if sig and done < args.steps:
            where = save(done)
            flag.ignore()   # a second signal must not kill us while exiting
            say(f"train_chain: signal {sig}: saved step {done} to {where}; exit "
                f"{slurm.RESUME_EXIT_CODE} to be resumed", flush=True)
            return slurm.RESUME_EXIT_CODE
        if args.save_every and done % args.save_every == 0 and done < args.steps:
            save(done)

    flag.ignore()   # done: a late warning must not turn success into a kill
    out = args.out or os.path.join(args.ckpt, "final")
    if rank == 0:
        os.makedirs(out, exist_ok=True)
    comm.Barrier()
    final = {k: params[k] for k in NAMES}
    final.update({"mom_" + k: mom[k] for k in NAMES})
    for k, s in sorted(fb.state_dict().items()):
        for part in ("worker", "owner"):
            if s[part] is not None:
                final[f"{part}_{k}"] = s[part]
        final[f"calls_{k}"] = np.array(s["calls"])
    np.savez(os.path.join(out, f"final-rank{rank:05d}.npz"), **final)
    comm.Barrier()
    say(f"train_chain: done, {args.steps} steps ({args.steps - start} in this run, "
        f"{time.perf_counter() - t0:.1f} s), final state in {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
