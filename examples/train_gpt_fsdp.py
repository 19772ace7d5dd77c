"""A GPT training script written for FSDP2 (``fully_shard``) and ``torchrun``, as
people write them, and the lines that make its gradient exchange use mpigc
(``--mpigc OP``).

    mpirun -n 4 python -m mpigc.launch examples/train_gpt_fsdp.py                 # plain FSDP2
    mpirun -n 4 python -m mpigc.launch examples/train_gpt_fsdp.py --mpigc 2bit
    mpirun -n 4 python -m mpigc.launch examples/train_gpt_fsdp.py --hsdp 2        # native HSDP 2 x 2
    mpirun -n 4 python -m mpigc.launch examples/train_gpt_fsdp.py --hsdp 2 --mpigc 2bit
    mpirun -n 4 python -m mpigc.launch examples/train_gpt_fsdp.py --mpigc 2bit --out-dir out --init-from resume

The script is the usual FSDP2 shape: the process group from the environment
``torchrun`` sets (``python -m mpigc.launch`` sets it under ``mpirun``/``srun``),
a device mesh, ``fully_shard`` on every transformer block and then on the root,
a ``MixedPrecisionPolicy`` with ``--reduce-dtype``, AdamW with weight decay on
matrices only, a warm-up and cosine learning rate, gradient accumulation that
reduces only on the last micro-step (``set_requires_gradient_sync``),
``clip_grad_norm_``, evaluation every ``--eval-interval`` steps, and sharded
checkpoints with ``torch.distributed.checkpoint`` (``--out-dir``,
``--init-from resume``). With ``--hsdp R`` the mesh is 2-D, R replicas x
world/R shards, and the model is FSDP2's native HSDP (``fully_shard`` on the
2-D mesh).

With ``--mpigc OP`` the lines marked ``# mpigc`` take effect:
``mpigc.torch.register_fsdp_hooks`` makes FSDP's gradient reduce-scatter
mpigc's compressed reduce-scatter over MPI, with error feedback; under
``--hsdp R`` the model is sharded over the mesh's ``"shard"`` dimension, FSDP's
reduce-scatter inside a replica stays exact, and the all-reduce across the
replicas is mpigc's compressed allreduce. The hooks' residuals are saved and
loaded in the same ``dcp.save``/``dcp.load`` as the model and the optimizer.
Model and data are those of ``examples/train_lm.py`` (a byte-level
transformer on the Python standard library's source, nothing downloaded).
The last line printed is a JSON object: the final validation loss, the bytes
sent per rank by the gradient reduce-scatter and by the replica all-reduce
over this run's steps (mpigc's counters where mpigc sends them, else computed
for a bandwidth-optimal ring), the time per step (evaluation and checkpoints
left out) and a digest of every rank's parameter shards.
"""
import argparse
import hashlib
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_lm import ByteGPT, batch, loss_of, stdlib_corpus  # noqa: E402

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--mpigc", default=None, help="compressor of the FSDP hooks (e.g. 2bit, none)")
p.add_argument("--rel-threshold", type=float, default=None, help="--mpigc 2bit: its relative mode's threshold")
p.add_argument("--hsdp", type=int, default=1, metavar="R", help="R replicas x world/R shards")
p.add_argument("--reduce-dtype", choices=("fp32", "bf16"), default="fp32")
p.add_argument("--max-iters", type=int, default=200)
p.add_argument("--batch-size", type=int, default=8, help="sequences per micro-step and rank")
p.add_argument("--grad-accum", type=int, default=2, help="micro-steps per step")
p.add_argument("--context", type=int, default=64)
p.add_argument("--n-layer", type=int, default=2)
p.add_argument("--n-embd", type=int, default=128)
p.add_argument("--n-head", type=int, default=4)
p.add_argument("--lr", type=float, default=1e-3)
p.add_argument("--warmup-iters", type=int, default=20)
p.add_argument("--weight-decay", type=float, default=0.1)
p.add_argument("--grad-clip", type=float, default=1.0)
p.add_argument("--eval-interval", type=int, default=100)
p.add_argument("--eval-iters", type=int, default=8)
p.add_argument("--corpus-mb", type=float, default=4.0)
p.add_argument("--seed", type=int, default=0)
p.add_argument("--out-dir", default=None, help="sharded checkpoints (torch.distributed.checkpoint)")
p.add_argument("--init-from", choices=("scratch", "resume"), default="scratch")
args = p.parse_args()
if args.mpigc:
    import mpigc.torch                                                          # mpigc

# -- the process group and the mesh, as torchrun sets them up ------------------------
dist.init_process_group("gloo")
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
master_process = rank == 0
torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
if world % args.hsdp:
    raise SystemExit(f"--hsdp {args.hsdp} does not divide {world} ranks")
replicas, shards = args.hsdp, world // args.hsdp
if replicas > 1:
    mesh = init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("replicate", "shard"))
    if args.mpigc:
        mesh = mesh["shard"]  # FSDP in each replica; the hooks all-reduce the replicas  # mpigc
else:
    mesh = init_device_mesh("cpu", (world,))

data = stdlib_corpus(args.corpus_mb)
n_val = len(data) // 20
train_data = torch.from_numpy(data[:-n_val].copy())
val_data = torch.from_numpy(data[-n_val:].copy())

torch.manual_seed(args.seed)  # every rank builds the same model
model = ByteGPT(args.n_layer, args.n_embd, args.n_head, args.context)
reduce_dtype = torch.float32 if args.reduce_dtype == "fp32" else torch.bfloat16
mp = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
for block in model.blocks:
    fully_shard(block, mesh=mesh, mp_policy=mp)
fully_shard(model, mesh=mesh, mp_policy=mp)
if args.mpigc:
    params = {} if args.rel_threshold is None else {"rel_threshold": args.rel_threshold}  # mpigc
    hooks = mpigc.torch.register_fsdp_hooks(model, op=args.mpigc, **params)    # mpigc
decay = [q for q in model.parameters() if q.dim() >= 2]
no_decay = [q for q in model.parameters() if q.dim() < 2]
optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                               {"params": no_decay, "weight_decay": 0.0}],
                              lr=args.lr, betas=(0.9, 0.95))
progress = {"iter_num": 0, "best_val_loss": float("inf")}


def checkpoint_state():
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd, "progress": progress}
    if args.mpigc:
        state["mpigc"] = hooks                                                  # mpigc
    return state


if args.init_from == "resume":
    state = checkpoint_state()
    dcp.load(state, checkpoint_id=os.path.join(args.out_dir, "ckpt"))
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    progress.update(state["progress"])


def get_lr(it):
    if it < args.warmup_iters:
        return args.lr * (it + 1) / args.warmup_iters
    done = min(1.0, (it - args.warmup_iters) / max(1, args.max_iters - args.warmup_iters))
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done)))


@torch.no_grad()
def estimate_val_loss():
    model.eval()
    gen = torch.Generator().manual_seed(12345 + rank)
    total = torch.zeros(1)
    for _ in range(args.eval_iters):
        x, y = batch(val_data, args.batch_size, args.context, gen)
        total += loss_of(model, x, y)
    model.train()
    dist.all_reduce(total)
    return total.item() / (args.eval_iters * world)


train_seconds, steps_timed, val_loss, curve = 0.0, 0, None, []
t0 = time.perf_counter()
while progress["iter_num"] < args.max_iters:
    iter_num = progress["iter_num"]
    t_step = time.perf_counter()
    for g in optimizer.param_groups:
        g["lr"] = get_lr(iter_num)
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + iter_num * 1009 + rank)
    for micro_step in range(args.grad_accum):
        # reduce only on the last micro-step (FSDP2's accumulation without sync)
        model.set_requires_gradient_sync(micro_step == args.grad_accum - 1)
        x, y = batch(train_data, args.batch_size, args.context, gen)
        loss = loss_of(model, x, y) / args.grad_accum
        loss.backward()
    if args.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    progress["iter_num"] = iter_num = iter_num + 1
    train_seconds += time.perf_counter() - t_step
    steps_timed += 1
    if iter_num % args.eval_interval == 0 or iter_num == args.max_iters:
        val_loss = estimate_val_loss()
        curve.append((iter_num, val_loss))
        if master_process:
            print(f"iter {iter_num}: train loss {loss.item() * args.grad_accum:.4f}, "
                  f"val loss {val_loss:.4f}, {time.perf_counter() - t0:.1f} s", flush=True)
        progress["best_val_loss"] = min(progress["best_val_loss"], val_loss)
        if args.out_dir:
            dcp.save(checkpoint_state(), checkpoint_id=os.path.join(args.out_dir, "ckpt"))

# bytes per rank of the gradient exchange: mpigc counts its own calls; FSDP's gloo
# collectives are counted as bandwidth-optimal rings, (S-1)/S of FSDP's padded flat
# gradient (each parameter's dim 0 padded to a multiple of S shards) for the
# reduce-scatter, 2 (R-1)/R of one shard for the all-reduce of R replicas
padded = sum(-(-q.shape[0] // shards) * shards * (q.numel() // q.shape[0])
             for q in model.parameters())
grad_bytes = padded * torch.finfo(reduce_dtype).bits // 8
rs_sent = (shards - 1) / shards * grad_bytes * steps_timed
ar_sent = 2 * (replicas - 1) / replicas * grad_bytes / shards * steps_timed
if args.mpigc:
    if replicas > 1:
        ar_sent = float(hooks.bytes_sent)                                       # mpigc
    else:
        rs_sent = float(hooks.bytes_sent)                                       # mpigc
sent = torch.tensor([rs_sent, ar_sent, train_seconds], dtype=torch.float64)
dist.all_reduce(sent)
# the parameters' bits: a digest of every rank's own shards
shard = hashlib.sha256(b"".join(v.to_local().numpy().tobytes()
                                for v in model.state_dict().values()))
digests = [None] * world
dist.all_gather_object(digests, shard.hexdigest())
if master_process:
    print(json.dumps({"mpigc": args.mpigc, "rel_threshold": args.rel_threshold,
                      "hsdp": args.hsdp, "reduce_dtype": args.reduce_dtype,
                      "ranks": world, "seed": args.seed, "iters": args.max_iters,
                      "val_loss": val_loss, "val_curve": curve,
                      "reduce_scatter_bytes_per_rank": sent[0].item() / world,
                      "replica_allreduce_bytes_per_rank": sent[1].item() / world,
                      "params_sha256": hashlib.sha256("".join(digests).encode()).hexdigest(),
                      "seconds_per_step": sent[2].item() / world / max(1, steps_timed),
                      "seconds": time.perf_counter() - t0}))
dist.destroy_process_group()
