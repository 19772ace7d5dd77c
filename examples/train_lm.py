"""Train a small GPT-style byte-level language model on the Python standard
library's own source, data parallel over MPI, with compressed gradient
averaging (mpigc.torch) and AdamW.

    mpirun -n 4 python examples/train_lm.py --op 2bit --steps 600
    mpirun -n 4 python examples/train_lm.py --op 1bit --steps 600 --checkpoint /tmp/lm
    mpirun -n 4 python examples/train_lm.py --op 1bit --steps 1200 --checkpoint /tmp/lm --resume

Data: every machine with Python has it, nothing is downloaded. The corpus is
the top-level ``*.py`` files of ``sysconfig.get_paths()["stdlib"]`` (no
subfolders), sorted by name, read as bytes and joined with a newline, then cut
to ``--corpus-mb`` MiB (default 4). The last ``--val-fraction`` (default 5%)
of the bytes is the validation set, the rest the training set. The text
differs between Python versions, so compare runs made with the same Python;
the first line printed gives the corpus size and a CRC32 of it.

Model: a decoder-only transformer (token and position embeddings, pre-norm
blocks of causal self-attention and a 4x MLP, tied output layer), 256 byte
tokens. Sizes are flags; the defaults (4 layers, width 256, 4 heads, context
128) make about 3.2 million parameters.

Optimizer: AdamW (betas 0.9/0.95, weight decay 0.1 on matrices only), linear
warm-up for ``--warmup`` steps, then cosine decay to 10% of ``--lr``. Every
``--eval-every`` steps the validation loss (mean cross-entropy in nats over
``--eval-batches`` fixed batches) and bits per byte (loss / ln 2) are printed.
Batches are drawn at random from the training bytes, from a generator seeded
by ``--seed``, the step and the rank, so a resumed run draws what an
uninterrupted run would have drawn.

``--checkpoint DIR`` saves every ``--eval-every`` steps and at the end: model,
optimizer and scheduler state and the step (``DIR/train.pt``, written by rank
0) and the residuals of the error feedback (``mpigc.save_checkpoint`` in
``DIR/residuals``, loadable on another number of ranks); ``--resume`` restores
all of it and continues. The last line printed is one JSON object for scripts
(final validation loss and bits per byte, the validation curve, bytes sent per
rank by mpigc in this run, seconds); ``benchmarks/bench_lm.py`` runs the
comparison of compressors with it.

``--optimizer compressed-adamw`` trains with ``mpigc.torch.CompressedAdamW`` instead
(exact warm-up for ``--freeze-steps``, default 20% of ``--steps``, then the momentum
compressed with error feedback and the variance frozen: 1-bit Adam's recipe), which
recovers what compressing gradients in front of AdamW loses (``docs/torch.md``).
Its other settings are flags too: ``--warmup-op bf16`` (the warm-up exchanged as
bfloat16), ``--freeze-steps auto``, ``--var-refresh N`` and ``--sync-every H`` (0/1
Adam's variance refreshes and local steps; with local steps every evaluation and
checkpoint first ends the open window with ``opt.synchronize()``).

``--diloco H`` trains with ``mpigc.torch.DiLoCo`` instead (``docs/lowcomm.md``): each
rank steps its own AdamW on its own batches (no gradient exchange), and every ``H``
steps the ranks average the pseudo-gradient (parameters at the last synchronisation
minus now) with ``--op`` (with error feedback) and apply an outer Nesterov step
(``--outer-lr``, default 0.7, ``--outer-momentum``, default 0.9). Every evaluation
and checkpoint first ends the open window (``synchronize()``); a checkpoint also
holds each rank's own AdamW state and outer state (``DIR/diloco.rank{R}.pt``), so a
resume at the same number of ranks is bit for bit. ``--streaming P`` makes it
``mpigc.torch.StreamingDiLoCo``: the parameters in ``P`` fragments, each
synchronised once every ``H`` steps on a staggered schedule, its exchange
nonblocking and overlapped with the next ``--overlap`` inner steps (default 0).

2bit runs in its relative mode (``--rel-threshold``, default 1.5; see
``docs/torch.md``) unless ``--threshold`` gives MXNet's absolute one.
"""
import argparse
import json
import math
import os
import shutil
import sysconfig
import time
import zlib

import numpy as np
import torch
from mpi4py import MPI

import mpigc
import mpigc.torch


def freeze_steps(text):
    return text if text == "auto" else int(text)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--op", default="2bit",
                   help="none, fp16, 2bit, 1bit, terngrad (default 2bit)")
    p.add_argument("--threshold", type=float, default=None,
                   help="2bit: MXNet's absolute threshold (default: the relative mode)")
    p.add_argument("--rel-threshold", type=float, default=None,
                   help="2bit relative mode: c x the block's RMS (default 1.5)")
    p.add_argument("--block-size", type=int, default=1024,
                   help="elements per block (2bit relative mode, 1bit)")
    p.add_argument("--gather", choices=("compressed", "exact"), default="compressed")
    p.add_argument("--steps", type=int, default=600, help="optimizer steps in all")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per rank per step")
    p.add_argument("--context", type=int, default=128, help="tokens per sequence")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=50, help="linear warm-up steps")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0,
                   help="clip the global gradient norm (after averaging; 0: off)")
    p.add_argument("--corpus-mb", type=float, default=4.0)
    p.add_argument("--val-fraction", type=float, default=0.05)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--optimizer", choices=("adamw", "compressed-adamw"), default="adamw",
                   help="adamw: torch's AdamW behind mpigc.torch.GradientSync (gradients "
                        "compressed); compressed-adamw: mpigc.torch.CompressedAdamW "
                        "(exact warm-up, then the momentum compressed, variance frozen)")
    p.add_argument("--freeze-steps", type=freeze_steps, default=None,
                   help="compressed-adamw: warm-up steps, or 'auto' (the variance's own "
                        "stability decides; default: 20%% of --steps)")
    p.add_argument("--warmup-op", choices=("none", "bf16", "fp16"), default="none",
                   help="compressed-adamw: the warm-up's exchange (default none: exact)")
    p.add_argument("--freeze-threshold", type=float, default=None,
                   help="compressed-adamw, --freeze-steps auto: relative change of the "
                        "variance over --freeze-window steps that counts as stable")
    p.add_argument("--freeze-window", type=int, default=None)
    p.add_argument("--sync-every", type=int, default=1,
                   help="compressed-adamw: after the freeze, local steps between "
                        "exchanges (0/1 Adam; default 1: every step)")
    p.add_argument("--var-refresh", type=int, default=0,
                   help="compressed-adamw: refresh the frozen variance after N, 2N, 4N, "
                        "... more steps (0/1 Adam; default 0: never)")
    p.add_argument("--diloco", type=int, default=0, metavar="H",
                   help="DiLoCo: H local AdamW steps per rank between outer "
                        "synchronisations of the pseudo-gradient with --op (default 0: off)")
    p.add_argument("--outer-lr", type=float, default=0.7, help="--diloco: outer learning rate")
    p.add_argument("--outer-momentum", type=float, default=0.9,
                   help="--diloco: outer Nesterov momentum")
    p.add_argument("--streaming", type=int, default=0, metavar="P",
                   help="--diloco: Streaming DiLoCo with P fragments, each synchronised "
                        "once every H steps, staggered (default 0: off)")
    p.add_argument("--overlap", type=int, default=0, metavar="TAU",
                   help="--streaming: inner steps a fragment's exchange overlaps before "
                        "its outer step is applied (0 <= TAU < H; default 0)")
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint", metavar="DIR", help="save every --eval-every steps")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    args = p.parse_args(argv)
    if args.threshold is not None and args.rel_threshold is not None:
        p.error("give at most one of --threshold, --rel-threshold")
    if args.resume and not args.checkpoint:
        p.error("--resume needs --checkpoint DIR")
    if args.diloco and args.optimizer != "adamw":
        p.error("--diloco takes AdamW as its inner optimizer (--optimizer adamw)")
    if args.diloco < 0:
        p.error("--diloco H needs H >= 1")
    if (args.streaming or args.overlap) and not args.diloco:
        p.error("--streaming and --overlap need --diloco H")
    if args.streaming < 0 or not 0 <= args.overlap < max(1, args.diloco):
        p.error("--streaming P needs P >= 1 and --overlap TAU 0 <= TAU < H")
    if args.n_embd % args.n_head:
        p.error("--n-embd must be a multiple of --n-head")
    return args


# -- data ---------------------------------------------------------------------------
def stdlib_corpus(megabytes):
    """The documented corpus: top-level stdlib ``*.py`` files, by name, joined."""
    root = sysconfig.get_paths()["stdlib"]
    names = sorted(f for f in os.listdir(root) if f.endswith(".py"))
    limit = int(megabytes * (1 << 20))
    parts, size = [], 0
    for name in names:
        with open(os.path.join(root, name), "rb") as f:
            parts.append(f.read() + b"\n")
        size += len(parts[-1])
        if size >= limit:
            break
    data = b"".join(parts)[:limit]
    if len(data) < limit:
        raise SystemExit(f"the stdlib at {root} holds only {len(data)} bytes of top-level "
                         f"*.py files; lower --corpus-mb")
    return np.frombuffer(data, np.uint8)


def batch(data, n, context, gen):
    """``n`` random windows of ``context + 1`` bytes: inputs and next-byte targets."""
    starts = torch.randint(0, data.numel() - context - 1, (n,), generator=gen)
    rows = torch.stack([data[s:s + context + 1] for s in starts.tolist()]).long()
    return rows[:, :-1], rows[:, 1:]


# -- model --------------------------------------------------------------------------
class Block(torch.nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.proj = torch.nn.Linear(d, d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(),
                                       torch.nn.Linear(4 * d, d))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for z in (q, k, v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class ByteGPT(torch.nn.Module):
    """A small decoder-only transformer over 256 byte tokens."""

    def __init__(self, n_layer, d, heads, context):
        super().__init__()
        self.tok = torch.nn.Embedding(256, d)
        self.pos = torch.nn.Embedding(context, d)
        self.blocks = torch.nn.ModuleList(Block(d, heads) for _ in range(n_layer))
        self.ln = torch.nn.LayerNorm(d)
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
            torch.nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, torch.nn.Linear) and m.bias is not None:
            torch.nn.init.zeros_(m.bias)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.ln(x) @ self.tok.weight.t()  # tied output layer


def loss_of(model, x, y):
    logits = model(x)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, 256), y.reshape(-1))


@torch.no_grad()
def evaluate(model, val, args, device, comm):
    """Mean validation loss (nats) over fixed batches, averaged over the ranks."""
    model.eval()
    gen = torch.Generator().manual_seed(12345 + comm.rank)
    total = 0.0
    for _ in range(args.eval_batches):
        x, y = batch(val, args.batch_size, args.context, gen)
        total += loss_of(model, x.to(device), y.to(device)).item()
    model.train()
    return comm.allreduce(total / args.eval_batches) / comm.size


def lr_factor(step, args):
    if step < args.warmup:
        return (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


# -- checkpoints ----------------------------------------------------------------------
def save(args, comm, step, model, opt, sched, sync):
    """The residuals (every rank, ``DIR/residuals-<step>``, saved with
    ``step=``) and DiLoCo's per-rank state, then model, optimizer and
    schedule (rank 0, ``DIR/train.pt``) naming them. Crash-consistent:
    ``train.pt`` is replaced last and atomically, so a job killed anywhere in
    here resumes from the previous pair; older files go only after that."""
    sync = sync or opt  # CompressedAdamW keeps its own residuals
    os.makedirs(args.checkpoint, exist_ok=True)
    comm.Barrier()
    name = f"residuals-{step}"
    own = None
    if isinstance(sync, mpigc.torch.DiLoCo):  # each rank's own AdamW and outer state
        own = f"diloco-{step}.rank{{rank}}.pt"
        torch.save({"optimizer": opt.state_dict(), "diloco": sync.state_dict()},
                   os.path.join(args.checkpoint, own.format(rank=comm.rank)))
    sync.save_checkpoint(os.path.join(args.checkpoint, name), step=step)
    comm.Barrier()  # every rank's files are written before the model file names them
    if comm.rank == 0:
        tmp = os.path.join(args.checkpoint, "train.pt.tmp")
        torch.save({"step": step, "model": model.state_dict(), "optimizer": opt.state_dict(),
                    "scheduler": sched.state_dict(), "op": args.op,
                    "world_size": comm.size, "residuals": name, "diloco": own}, tmp)
        os.replace(tmp, os.path.join(args.checkpoint, "train.pt"))
        for old in os.listdir(args.checkpoint):
            path = os.path.join(args.checkpoint, old)
            if old.startswith("residuals") and old != name:
                shutil.rmtree(path, ignore_errors=True)
            elif old.startswith("diloco") and not (own and old.startswith(f"diloco-{step}.")):
                os.remove(path)
    comm.Barrier()


def resume(args, model, opt, sched, sync):
    """Restore what :func:`save` saved; returns the step. The residuals must
    be the model file's step's (``load_checkpoint(step=)``: MismatchError
    on every rank otherwise)."""
    sync = sync or opt
    ck = torch.load(os.path.join(args.checkpoint, "train.pt"), weights_only=True,
                    map_location="cpu")
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["optimizer"])
    sched.load_state_dict(ck["scheduler"])
    sync.load_checkpoint(os.path.join(args.checkpoint, ck.get("residuals", "residuals")),
                         step=ck["step"])
    if isinstance(sync, mpigc.torch.DiLoCo):
        own = ck.get("diloco") or "diloco.rank{rank}.pt"
        own = torch.load(os.path.join(args.checkpoint, own.format(rank=MPI.COMM_WORLD.rank)),
                         weights_only=True, map_location="cpu")
        opt.load_state_dict(own["optimizer"])
        sync.load_state_dict(own["diloco"])
    return ck["step"]


# -- training ---------------------------------------------------------------------------
def compressor_params(args):
    if args.op == "2bit":
        if args.threshold is not None:
            return {"threshold": args.threshold}
        return {"rel_threshold": 1.5 if args.rel_threshold is None else args.rel_threshold,
                "block_size": args.block_size}
    if args.op == "1bit":
        return {"block_size": args.block_size}
    return {}


def main(argv=None):
    args = parse_args(argv)
    comm = MPI.COMM_WORLD
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(mpigc.select_device())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // comm.size))
    data = stdlib_corpus(args.corpus_mb)
    n_val = int(len(data) * args.val_fraction)
    train = torch.from_numpy(data[:-n_val].copy())
    val = torch.from_numpy(data[-n_val:].copy())

    torch.manual_seed(args.seed)
    model = ByteGPT(args.n_layer, args.n_embd, args.n_head, args.context).to(device)
    mpigc.torch.broadcast_parameters(model, root=0)
    params = compressor_params(args)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    if args.diloco:  # local AdamW; the outer exchange is DiLoCo's own
        opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))
        kind, more = mpigc.torch.DiLoCo, {}
        if args.streaming:   # fragments on a staggered schedule, nonblocking exchanges
            kind = mpigc.torch.StreamingDiLoCo
            more = {"fragments": args.streaming, "overlap": args.overlap}
        sync = kind(model, opt, sync_every=args.diloco, outer_lr=args.outer_lr,
                    outer_momentum=args.outer_momentum, op=args.op, gather=args.gather,
                    **more, **params)
        params = dict(params, diloco=args.diloco, outer_lr=args.outer_lr,
                      outer_momentum=args.outer_momentum, **more)
    elif args.optimizer == "adamw":
        sync = mpigc.torch.GradientSync(model, op=args.op, bucket_mb=args.bucket_mb,
                                        gather=args.gather, **params)
        opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))
    else:
        sync = None  # the optimizer exchanges the momentum itself
        freeze = args.freeze_steps if args.freeze_steps is not None else max(1, args.steps // 5)
        params = dict(params, freeze_steps=freeze)
        if args.warmup_op != "none":
            params["warmup_op"] = args.warmup_op
        for name in ("freeze_threshold", "freeze_window", "var_refresh", "sync_every"):
            if getattr(args, name) not in (None, 0, 1):
                params[name] = getattr(args, name)
        opt = mpigc.torch.CompressedAdamW(groups, lr=args.lr, betas=(0.9, 0.95),
                                          op=args.op, gather=args.gather, **params)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, args))
    start = resume(args, model, opt, sched, sync) if args.resume else 0
    if comm.rank == 0:
        print(f"{comm.size} rank(s), {args.optimizer}, op={args.op} {params}, "
              f"{sum(p.numel() for p in model.parameters())} parameters, corpus "
              f"{len(data)} bytes (crc32 {zlib.crc32(data.tobytes()):08x}), "
              f"start at step {start}", flush=True)

    mpigc.reset_traffic()
    t0 = time.perf_counter()
    val_loss, curve = None, []
    for step in range(start, args.steps):
        gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + comm.rank)
        x, y = batch(train, args.batch_size, args.context, gen)
        opt.zero_grad()
        loss = loss_of(model, x.to(device), y.to(device))
        loss.backward()       # buckets start their compressed allreduce as they fill
        if sync is not None and not args.diloco:
            sync.wait()       # averaged gradients in param.grad
        if args.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        if args.diloco:
            sync.step()       # AdamW's local step; every H-th ends with the outer one
        else:
            opt.step()
        sched.step()
        last = step + 1 == args.steps
        if (step + 1) % args.eval_every == 0 or last:
            if sync is None:
                opt.synchronize()  # local steps (--sync-every): end the window first
            elif args.diloco:
                sync.synchronize()  # DiLoCo: the outer step of the open window first
            val_loss = evaluate(model, val, args, device, comm)
            curve.append((step + 1, val_loss))
            if comm.rank == 0:
                print(f"step {step + 1:5d}  train loss {loss.item():.4f}  val loss "
                      f"{val_loss:.4f}  val bits/byte {val_loss / math.log(2):.4f}  "
                      f"lr {sched.get_last_lr()[0]:.2e}  {time.perf_counter() - t0:7.1f} s",
                      flush=True)
            if args.checkpoint:
                save(args, comm, step + 1, model, opt, sched, sync)
    sent = comm.allreduce(mpigc.traffic()["bytes_sent"]) / comm.size
    same = comm.allgather(float(sum(p.detach().double().sum() for p in model.parameters())))
    if comm.rank == 0:
        print(json.dumps({"op": args.op, "optimizer": args.optimizer, "params": params,
                          "ranks": comm.size,
                          "seed": args.seed, "steps": args.steps,
                          "val_loss": val_loss,
                          "val_bits_per_byte": None if val_loss is None
                          else val_loss / math.log(2),
                          "bytes_sent_per_rank": sent, "val_curve": curve,
                          "seconds": time.perf_counter() - t0,
                          "parameters_equal": all(v == same[0] for v in same),
                          "frozen_at": getattr(opt, "frozen_at", None),
                          "outer_syncs": sync.syncs if args.diloco else None,
                          "fragment_syncs": getattr(sync, "fragment_syncs", None)}))


if __name__ == "__main__":
    main()
