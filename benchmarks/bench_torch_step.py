"""Time per training step: mpigc.torch against DDP (gloo), in one run.

    mpirun -n 4 python benchmarks/bench_torch_step.py
    mpirun -n 4 python benchmarks/bench_torch_step.py --modes ddp,mpigc-2bit --steps 20

Every mode trains the same model (an MLP of about 25.2M parameters by default,
``--width``), from the same initial weights, on the same synthetic batches, with
plain SGD; it runs ``--warmup`` steps, then ``--steps`` timed steps. A step is
forward, backward, gradient averaging and ``optimizer.step()``; its time is the
slowest rank's. DDP and mpigc both keep the gradients in their buckets
(``gradient_as_bucket_view=True``, ``zero_grad(set_to_none=False)``);
``--copy-grads`` copies them in and out instead. Modes:

``ddp``             DistributedDataParallel over gloo, plain allreduce (25 MB buckets)
``ddp-fp16``        DDP with ``default_hooks.fp16_compress_hook``
``ddp-powersgd``    DDP with ``powerSGD_hook`` (rank 1, warm start, error feedback;
                    it starts compressing after ``--warmup`` steps; one bucket, as
                    several buckets make gloo fail with a collective mismatch)
``mpigc-OP``        ``mpigc.torch.GradientSync(model, op=OP)`` for OP in none, fp16,
                    2bit, 1bit, terngrad, auto (25 MiB buckets); 2bit in its relative
                    mode (``rel_threshold=1.5``) unless ``--threshold`` is given;
                    ``auto``: per bucket and step ``none`` or that 2bit (``auto_op``)
``ddp-mpigc-OP``    DDP (gloo process group, ``--bucket-mb`` buckets) with mpigc's
                    compressed allreduce over MPI as its communication hook
                    (``mpigc.torch.comm_hook``), OP and its parameters as for
                    ``mpigc-OP``
``mpigc-staged-OP`` with ``--device cuda``: ``GradientSync(..., device_buckets=False)``,
                    the host-staged path (gradients copied to pinned host buckets,
                    CPU kernels); ``mpigc-OP`` is then the device-bucket path

``--device cuda`` puts the model and the batches on the GPU (rank modulo the visible
GPUs: ranks share one GPU when there is one) and synchronises the GPU before and
after each timed step. ``--device sim`` (Numba's CUDA simulator,
``NUMBA_ENABLE_CUDASIM=1``, tiny ``--width``): CPU tensors, and ``mpigc-OP`` uses the
simulator seam of device buckets; a smoke test of this script, its times mean
nothing. ``--json PATH`` writes the rows (and the ratios ``vs_ddp``, ``vs_staged``).

``--interleave``: every mode's model is built first, each runs its warm-up
(``--warmup``; modes with ``auto`` ``--warmup-auto`` steps), then the
``--steps`` timed steps go round the modes, one step of each in turn (the order
rotates every round), so load that comes and goes hits every mode alike. For
every ``auto`` mode (``mpigc-auto``, ``ddp-mpigc-auto``) it prints what ran per
step and bucket from its first step (``Bucket.decision``,
``CommHookState.decisions``: ``c``/``n`` measuring 2bit/none, ``C``/``N`` the
model's choice, ``p``/``q`` a probe of none/2bit, ``s`` small), the step from
which every bucket stays on the model's choice, the ratio of its median (and
minimum) step to the faster of the matching ``none`` and ``2bit`` modes
(``mpigc-none``/``mpigc-2bit``; for the hook ``ddp``/``ddp-mpigc-2bit``), and the
machine's load average.

torch.distributed is initialised from the MPI rank and size with a TCP store at
rank 0's address (``--master-addr``, default: rank 0's host name resolved by
rank 0, or 127.0.0.1 when every rank is on one host); ``GLOO_SOCKET_IFNAME``
picks gloo's interface. This is a benchmark, not a test: run it on the fabric
you care about (e.g. the emulated 1 Gbit/s one) and compare the ``step ms``
column; ``vs ddp`` is the speed-up over plain DDP.
"""
import argparse
import os
import socket
import statistics
import time

import torch
from mpi4py import MPI

import mpigc
import mpigc.torch

ALL_MODES = ("ddp", "ddp-fp16", "ddp-powersgd", "mpigc-none", "mpigc-fp16", "mpigc-2bit",
             "mpigc-1bit")
# also accepted: ddp-mpigc-OP (DDP with mpigc.torch.comm_hook), mpigc-terngrad


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default=",".join(ALL_MODES))
    p.add_argument("--width", type=int, default=4096, help="hidden width (4096: 25.2M params)")
    p.add_argument("--inputs", type=int, default=1024)
    p.add_argument("--batch", type=int, default=32, help="per rank")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--warmup-auto", type=int, default=None,
                   help="--interleave: warm-up steps of the auto modes (default --warmup)")
    p.add_argument("--interleave", action="store_true",
                   help="build every mode first, then one timed step of each in turn")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--threshold", type=float, default=None,
                   help="2bit: absolute threshold (MXNet's mode) instead of --rel-threshold")
    p.add_argument("--rel-threshold", type=float, default=1.5,
                   help="2bit: per-block relative threshold (default 1.5, as examples/train_torch.py)")
    p.add_argument("--master-addr", default=None)
    p.add_argument("--threads", type=int, default=None, help="torch threads per rank")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda", "sim"))
    p.add_argument("--json", default=None, help="write the rows to this JSON file")
    p.add_argument("--copy-grads", action="store_true",
                   help="gradients copied into and out of the buckets (default: DDP's and "
                        "mpigc's gradient_as_bucket_view=True and zero_grad(set_to_none=False))")
    return p.parse_args()


def device_of(args, comm=None):
    if args.device != "cuda":
        return torch.device("cpu")
    comm = comm or MPI.COMM_WORLD
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    dev = torch.device("cuda", local.rank % torch.cuda.device_count())
    local.Free()
    return dev


def make_model(args, device=None):
    torch.manual_seed(0)
    w = args.width
    return torch.nn.Sequential(torch.nn.Linear(args.inputs, w), torch.nn.ReLU(),
                               torch.nn.Linear(w, w), torch.nn.ReLU(),
                               torch.nn.Linear(w, args.inputs)).to(device or "cpu")


def init_gloo(args, comm):
    if torch.distributed.is_initialized():
        return
    hosts = comm.allgather(socket.gethostname())
    addr = args.master_addr
    if addr is None:
        if len(set(hosts)) == 1:
            addr = "127.0.0.1"
        else:
            addr = comm.bcast(socket.gethostbyname(hosts[0]) if comm.rank == 0 else None)
    port = None
    if comm.rank == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
    port = comm.bcast(port)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://{addr}:{port}",
                                         rank=comm.rank, world_size=comm.size)


def op_params(op, args):
    if op in ("2bit", "auto"):  # auto: auto_op's, the default auto_op 2bit
        return ({"threshold": args.threshold} if args.threshold
                else {"rel_threshold": args.rel_threshold})
    return {}


def wrap(mode, model, args, comm):
    """Returns ``(module_to_call, after_backward)``."""
    return wrap3(mode, model, args, comm)[:2]


def wrap3(mode, model, args, comm, sync_comm=None):
    """Returns ``(module_to_call, after_backward, decisions)``: ``decisions()``
    the last step's per-bucket :class:`Decision` list with ``op="auto"``, else
    an empty list."""
    if mode.startswith("ddp-mpigc-"):
        init_gloo(args, comm)
        op = mode[len("ddp-mpigc-"):]
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, bucket_cap_mb=args.bucket_mb, gradient_as_bucket_view=not args.copy_grads)
        state = mpigc.torch.CommHookState(ddp, op=op, comm=sync_comm, **op_params(op, args))
        ddp.register_comm_hook(state, mpigc.torch.comm_hook)
        return ddp, lambda: None, lambda: [state.decisions[k]
                                           for k in sorted(state.decisions, key=str)]
    if mode.startswith("ddp"):
        init_gloo(args, comm)
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
        # PowerSGD chains several collectives per bucket in future callbacks; with
        # gloo, ranks can then issue them in different orders across buckets (a
        # "collective mismatch"), so it gets a single bucket
        cap = 1 << 14 if mode == "ddp-powersgd" else args.bucket_mb
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, bucket_cap_mb=cap, gradient_as_bucket_view=not args.copy_grads)
        if mode == "ddp-fp16":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif mode == "ddp-powersgd":
            state = powerSGD_hook.PowerSGDState(
                process_group=None, matrix_approximation_rank=1,
                start_powerSGD_iter=max(2, args.warmup), warm_start=True,
                use_error_feedback=True)
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return ddp, lambda: None, list
    op = mode.split("-", 1)[1]
    staged = op.startswith("staged-")
    op = op[len("staged-"):] if staged else op
    mpigc.torch._sim_device_buckets = args.device == "sim" and not staged
    try:
        sync = mpigc.torch.GradientSync(model, op=op, bucket_mb=args.bucket_mb, comm=sync_comm,
                                        gradient_as_bucket_view=not args.copy_grads,
                                        device_buckets=not staged, **op_params(op, args))
    finally:
        mpigc.torch._sim_device_buckets = False
    return model, sync.wait, lambda: [b.decision for b in sync.buckets if b.decision is not None]


def run(mode, args, comm):
    dev = device_of(args, comm)
    model = make_model(args, dev)
    net, after_backward = wrap(mode, model, args, comm)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(comm.rank)
    x = torch.randn(args.batch, args.inputs, generator=g).to(dev)
    y = torch.randn(args.batch, args.inputs, generator=g).to(dev)
    gpu = dev.type == "cuda"
    times, losses = [], []
    mpigc.reset_traffic()
    for step in range(args.warmup + args.steps):
        if gpu:
            torch.cuda.synchronize(dev)
        comm.Barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=args.copy_grads)
        loss = torch.nn.functional.mse_loss(net(x), y)
        loss.backward()
        after_backward()
        opt.step()
        if gpu:
            torch.cuda.synchronize(dev)
        dt = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        if step == args.warmup - 1:
            mpigc.reset_traffic()
        if step >= args.warmup:
            times.append(dt)
            losses.append(loss.item())
    # mpigc.traffic() counts the compressed paths (op="none" is a plain MPI_Iallreduce)
    counted = "mpigc-" in mode and not mode.endswith("-none")
    sent = mpigc.traffic()["bytes_sent"] / args.steps if counted else None
    return times, sent, comm.allreduce(losses[-1]) / comm.size


_CODE = {("measuring", False): "c", ("measuring", True): "n", ("model", False): "C",
         ("model", True): "N", ("probe", True): "p", ("probe", False): "q",
         ("small", True): "s", ("pinned", True): "P", ("pinned", False): "Q"}


def _code(decisions):
    """One step's decisions, a letter per bucket (see the module docstring)."""
    return "".join(_CODE.get((d.reason, d.op == "none"), "?") for d in decisions) or "-"


def settled_at(codes):
    """The first step from which every bucket runs the model's choice (``C``,
    ``N``, or a probe ``p``/``q``), or None."""
    at = None
    for i, c in enumerate(codes):
        if c and all(ch in "CNpq" for ch in c):
            at = i if at is None else at
        else:
            at = None
    return at


class Runner:
    """One mode's model, optimizer and batches, stepped one step at a time."""

    def __init__(self, mode, args, comm):
        self.mode, self.args, self.comm = mode, args, comm
        self.dev = device_of(args, comm)
        self.model = make_model(args, self.dev)
        self.auto = mode.endswith("-auto")
        # an auto mode's own communicator: its own cost model (one per communicator)
        self.net, self.after_backward, self.decisions = wrap3(
            mode, self.model, args, comm, comm.Dup() if self.auto else None)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(comm.rank)
        self.x = torch.randn(args.batch, args.inputs, generator=g).to(self.dev)
        self.y = torch.randn(args.batch, args.inputs, generator=g).to(self.dev)
        self.times, self.codes, self.loss = [], [], None

    def step(self, timed):
        gpu = self.dev.type == "cuda"
        if gpu:
            torch.cuda.synchronize(self.dev)
        self.comm.Barrier()
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=self.args.copy_grads)
        loss = torch.nn.functional.mse_loss(self.net(self.x), self.y)
        loss.backward()
        self.after_backward()
        self.opt.step()
        if gpu:
            torch.cuda.synchronize(self.dev)
        dt = self.comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        if self.auto:
            self.codes.append(_code(self.decisions()))
        if timed:
            self.times.append(dt)
            self.loss = loss.item()


def run_interleaved(modes, args, comm):
    """``--interleave``: the rows, and a report per auto mode."""
    runners = [Runner(m, args, comm) for m in modes]
    for r in runners:
        n = args.warmup_auto if r.auto and args.warmup_auto is not None else args.warmup
        for _ in range(n):
            r.step(False)
    loads = [os.getloadavg()[0]]
    for i in range(args.steps):
        for k in range(len(runners)):
            runners[(i + k) % len(runners)].step(True)
        if i % max(1, args.steps // 4) == 0:
            loads.append(os.getloadavg()[0])
    loads.append(os.getloadavg()[0])
    return runners, loads


def report_interleaved(runners, loads, args, comm):
    by = {r.mode: r for r in runners}
    print(f"{'mode':<16} {'median ms':>10} {'min ms':>9} {'mean ms':>9} {'loss r0':>11}")
    for r in runners:
        print(f"{r.mode:<16} {statistics.median(r.times) * 1e3:10.1f} "
              f"{min(r.times) * 1e3:9.1f} {statistics.mean(r.times) * 1e3:9.1f} "
              f"{r.loss:11.5f}")
    for r in runners:
        if not r.auto:
            continue
        hook = r.mode.startswith("ddp-")
        pair = ("ddp", "ddp-mpigc-2bit") if hook else ("mpigc-none", "mpigc-2bit")
        warm = args.warmup_auto if args.warmup_auto is not None else args.warmup
        at = settled_at(r.codes)
        print(f"{r.mode}: per step (bucket letters; warm-up steps 0-{warm - 1}): "
              + " ".join(r.codes))
        final = r.codes[-1] if r.codes else ""
        where = (f"from step {at} on" if at is not None
                 else f"never in {len(r.codes)} steps (still measuring)")
        print(f"{r.mode}: on the model's choice {where} ({final.count('C')} bucket(s) "
              f"2bit, {final.count('N')} none at the last step)")
        if all(m in by for m in pair):
            med = {m: statistics.median(by[m].times) for m in pair}
            mins = {m: min(by[m].times) for m in pair}
            best = min(pair, key=med.get)
            bestmin = min(pair, key=mins.get)
            print(f"{r.mode}: auto / faster of {pair[0]}, {pair[1]} = "
                  f"{statistics.median(r.times) / med[best]:.3f} (medians; faster {best}), "
                  f"{min(r.times) / mins[bestmin]:.3f} (minima; faster {bestmin})")
    print("load average (1 min) during the run: " + " ".join(f"{x:.1f}" for x in loads)
          + f"; {os.cpu_count()} cores; fabric: "
          + os.environ.get("MPIGC_FABRIC", "none (shared memory)"), flush=True)


def main():
    args = parse_args()
    comm = MPI.COMM_WORLD
    local = comm.Split_type(MPI.COMM_TYPE_SHARED).size
    threads = args.threads or max(1, (os.cpu_count() or 1) // local)
    torch.set_num_threads(threads)
    modes = [m for m in args.modes.split(",") if m]
    nparams = sum(p.numel() for p in make_model(args).parameters())
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA GPU")
    where = "CPU"
    if args.device == "cuda":
        where = f"GPU {torch.cuda.get_device_name(device_of(args, comm))}"
    elif args.device == "sim":
        where = "CPU tensors, Numba's CUDA simulator for mpigc-OP (times mean nothing)"
    if comm.rank == 0:
        print(f"{comm.size} ranks ({local} on this host), {threads} torch thread(s) per rank, "
              f"{nparams / 1e6:.1f}M parameters, batch {args.batch}/rank, "
              f"{args.steps} timed steps after {args.warmup}, on {where}")
    if args.interleave:
        for mode in modes:
            if mode not in ALL_MODES and not mode.startswith(("mpigc-", "ddp-mpigc-")):
                raise SystemExit(f"unknown mode {mode!r}; expected one of {ALL_MODES}")
        runners, loads = run_interleaved(modes, args, comm)
        if comm.rank == 0:
            report_interleaved(runners, loads, args, comm)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        return
    if comm.rank == 0:
        print(f"{'mode':<16} {'step ms':>9} {'median':>9} {'min':>9} {'vs ddp':>7} "
              f"{'MiB sent/step/rank':>19} {'final loss':>11}", flush=True)
    base = None
    rows = []
    for mode in modes:
        if mode not in ALL_MODES and not mode.startswith(("mpigc-", "ddp-mpigc-")):
            raise SystemExit(f"unknown mode {mode!r}; expected one of {ALL_MODES}")
        times, sent, loss = run(mode, args, comm)
        mean = statistics.mean(times)
        if mode == "ddp":
            base = mean
        rows.append({"mode": mode, "mean_ms": mean * 1e3,
                     "median_ms": statistics.median(times) * 1e3, "min_ms": min(times) * 1e3,
                     "mib_sent_per_step": None if sent is None else sent / 2**20,
                     "final_loss": loss})
        if comm.rank == 0:
            ratio = f"{base / mean:6.2f}x" if base else "      -"
            mib = "-" if sent is None else f"{sent / 2**20:.2f}"
            print(f"{mode:<16} {mean * 1e3:9.1f} {statistics.median(times) * 1e3:9.1f} "
                  f"{min(times) * 1e3:9.1f} {ratio:>7} {mib:>19} {loss:11.5f}", flush=True)
    if args.json and comm.rank == 0:
        import json
        by = {r["mode"]: r["mean_ms"] for r in rows}
        for r in rows:  # > 1: faster than the other
            r["vs_ddp"] = by["ddp"] / r["mean_ms"] if "ddp" in by else None
            op = r["mode"][len("mpigc-"):] if r["mode"].startswith("mpigc-") else None
            staged = by.get(f"mpigc-staged-{op}") if op and not op.startswith("staged-") \
                else None
            r["vs_staged"] = staged / r["mean_ms"] if staged else None
        with open(args.json, "w") as f:
            json.dump({"ranks": comm.size, "device": args.device, "where": where,
                       "params": nparams, "batch": args.batch, "steps": args.steps,
                       "warmup": args.warmup, "rows": rows}, f, indent=1)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
