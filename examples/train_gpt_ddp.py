"""A GPT training script written for DDP and ``torchrun``, as people write them,
and the five lines that make it use mpigc (``--mpigc OP``).

    torchrun --nproc_per_node 4 examples/train_gpt_ddp.py                  # plain DDP
    mpirun -n 4 python -m mpigc.launch examples/train_gpt_ddp.py           # the same, under MPI
    mpirun -n 4 python -m mpigc.launch examples/train_gpt_ddp.py --mpigc 1bit
    mpirun -n 4 python -m mpigc.launch examples/train_gpt_ddp.py --mpigc 1bit --init-from resume

The script is the usual shape (the one of widely used minimal GPT trainers): the
process group from the environment ``torchrun`` sets, ``DistributedDataParallel``,
AdamW with weight decay on matrices only, a warm-up and cosine learning rate,
gradient accumulation that syncs only on the last micro-step
(``model.require_backward_grad_sync``), ``clip_grad_norm_``, evaluation every
``--eval-interval`` steps, checkpoints written by rank 0 only, and
``--init-from resume``. ``python -m mpigc.launch`` runs it unchanged under
``mpirun``/``srun`` (it sets the environment from the MPI job).

With ``--mpigc OP`` the lines marked ``# mpigc`` take effect: DDP leaves the
gradients local (``mpigc.torch.local_gradients_hook``) and
``mpigc.torch.CompressedAdamW`` exchanges the momentum compressed with ``OP``
after an exact warm-up of ``--freeze-steps`` (1-bit Adam's recipe); its
residuals are saved next to rank 0's checkpoint, by every rank, before it (with
``step=``: a resume loads them only with the model file of their step). Clipping then
acts on each rank's local gradient. Model and data are those of
``examples/train_lm.py`` (a byte-level transformer on the Python standard
library's source, nothing downloaded). The last line printed is a JSON object
(final validation loss, bytes sent per rank by the gradient exchange).
"""
import argparse
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_lm import ByteGPT, batch, loss_of, stdlib_corpus  # noqa: E402

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--mpigc", default=None, help="compressor of CompressedAdamW (e.g. 1bit)")
p.add_argument("--freeze-steps", type=int, default=15)
p.add_argument("--max-iters", type=int, default=300)
p.add_argument("--batch-size", type=int, default=8, help="sequences per micro-step and rank")
p.add_argument("--grad-accum", type=int, default=2, help="micro-steps per step")
p.add_argument("--context", type=int, default=128)
p.add_argument("--n-layer", type=int, default=4)
p.add_argument("--n-embd", type=int, default=256)
p.add_argument("--n-head", type=int, default=4)
p.add_argument("--lr", type=float, default=1e-3)
p.add_argument("--warmup-iters", type=int, default=30)
p.add_argument("--weight-decay", type=float, default=0.1)
p.add_argument("--grad-clip", type=float, default=1.0)
p.add_argument("--eval-interval", type=int, default=100)
p.add_argument("--eval-iters", type=int, default=8)
p.add_argument("--corpus-mb", type=float, default=4.0)
p.add_argument("--seed", type=int, default=0)
p.add_argument("--out-dir", default=None, help="checkpoints (ckpt.pt, by rank 0)")
p.add_argument("--init-from", choices=("scratch", "resume"), default="scratch")
args = p.parse_args()
if args.mpigc:
    import mpigc.torch                                                          # mpigc

# -- the process group, as torchrun sets it up ---------------------------------------
dist.init_process_group("gloo")
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
master_process = rank == 0
torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
torch.manual_seed(args.seed)

data = stdlib_corpus(args.corpus_mb)
n_val = len(data) // 20
train_data = torch.from_numpy(data[:-n_val].copy())
val_data = torch.from_numpy(data[-n_val:].copy())

model = ByteGPT(args.n_layer, args.n_embd, args.n_head, args.context)
decay = [q for q in model.parameters() if q.dim() >= 2]
no_decay = [q for q in model.parameters() if q.dim() < 2]
groups = [{"params": decay, "weight_decay": args.weight_decay},
          {"params": no_decay, "weight_decay": 0.0}]
model = DDP(model)  # broadcasts rank 0's parameters
raw_model = model.module
if args.mpigc:
    model.register_comm_hook(None, mpigc.torch.local_gradients_hook)            # mpigc
    optimizer = mpigc.torch.CompressedAdamW(groups, lr=args.lr, betas=(0.9, 0.95),  # mpigc
                                            op=args.mpigc, freeze_steps=args.freeze_steps)
else:
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))

iter_num, best_val = 0, float("inf")
if args.init_from == "resume":
    ckpt = torch.load(os.path.join(args.out_dir, "ckpt.pt"), map_location="cpu",
                      weights_only=True)
    raw_model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    iter_num, best_val = ckpt["iter_num"], ckpt["best_val_loss"]
    if args.mpigc:
        # mpigc: the residuals must be the model file's (MismatchError on every rank if not)
        optimizer.load_checkpoint(os.path.join(args.out_dir, "residuals"), step=iter_num)


def get_lr(it):
    if it < args.warmup_iters:
        return args.lr * (it + 1) / args.warmup_iters
    progress = min(1.0, (it - args.warmup_iters) / max(1, args.max_iters - args.warmup_iters))
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


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


t0, val_loss, curve = time.perf_counter(), None, []
while iter_num < args.max_iters:
    for g in optimizer.param_groups:
        g["lr"] = get_lr(iter_num)
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + iter_num * 1009 + rank)
    for micro_step in range(args.grad_accum):
        # sync only on the last micro-step (DDP's no_sync, the way minimal trainers do it)
        model.require_backward_grad_sync = micro_step == args.grad_accum - 1
        x, y = batch(train_data, args.batch_size, args.context, gen)
        loss = loss_of(model, x, y) / args.grad_accum
        loss.backward()
    if args.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    iter_num += 1
    if iter_num % args.eval_interval == 0 or iter_num == args.max_iters:
        val_loss = estimate_val_loss()
        curve.append((iter_num, val_loss))
        if master_process:
            print(f"iter {iter_num}: train loss {loss.item() * args.grad_accum:.4f}, "
                  f"val loss {val_loss:.4f}, {time.perf_counter() - t0:.1f} s", flush=True)
        best_val = min(best_val, val_loss)
        if args.out_dir:
            if args.mpigc:  # mpigc: the residuals first, then the model file naming their step
                optimizer.save_checkpoint(os.path.join(args.out_dir, "residuals"),
                                          step=iter_num)
            dist.barrier()
            if master_process:
                os.makedirs(args.out_dir, exist_ok=True)
                torch.save({"model": raw_model.state_dict(),
                            "optimizer": optimizer.state_dict(),
                            "iter_num": iter_num, "best_val_loss": best_val},
                           os.path.join(args.out_dir, "ckpt.pt.tmp"))
                os.replace(os.path.join(args.out_dir, "ckpt.pt.tmp"),
                           os.path.join(args.out_dir, "ckpt.pt"))
            dist.barrier()

# bytes of the gradient exchange per rank: mpigc counts its own; DDP's allreduce is
# counted as a bandwidth-optimal one (2 (N-1)/N of the gradient bytes per step)
n_params = sum(q.numel() for q in raw_model.parameters())
if args.mpigc:
    sent = float(mpigc.traffic()["bytes_sent"])
else:
    sent = 2 * (world - 1) / world * 4 * n_params * args.max_iters
total = torch.tensor([sent], dtype=torch.float64)
dist.all_reduce(total)
if master_process:
    print(json.dumps({"mpigc": args.mpigc, "freeze_steps": args.freeze_steps if args.mpigc
                      else None, "ranks": world, "seed": args.seed, "iters": args.max_iters,
                      "val_loss": val_loss, "val_curve": curve,
                      "bytes_sent_per_rank": total.item() / world,
                      "seconds": time.perf_counter() - t0}))
dist.destroy_process_group()
