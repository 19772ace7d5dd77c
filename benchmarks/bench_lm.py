"""Training quality under AdamW: examples/train_lm.py for several compressors
and seeds, one table and one plot.

    python benchmarks/bench_lm.py --ranks 4 --seeds 0,1,2 --steps 600 \\
        --json docs/benchmarks/lm.json --plot docs/benchmarks/lm.png
    python benchmarks/bench_lm.py --ops none,1bit --seeds 0 -- --n-layer 2 --lr 6e-4
    python benchmarks/bench_lm.py --ops 1bit:compressed-adamw --label "1bit h2" \\
        --json h2.json -- --sync-every 2
    python benchmarks/bench_lm.py --merge none.json h2.json --plot both.png
    python benchmarks/bench_lm.py --ops none,none:diloco=50,2bit:diloco=50 --steps 1200
    python benchmarks/bench_lm.py --ops bf16:diloco=50:streaming=5:overlap=2

An entry of ``--ops`` is ``OP`` followed by ``:``-separated options:
``OP:compressed-adamw`` runs ``--optimizer compressed-adamw --op OP``;
``OP:diloco=H`` runs ``--diloco H --op OP`` (``mpigc.torch.DiLoCo``: local AdamW, the
outer exchange every H steps with OP; ``docs/lowcomm.md``), and with ``:streaming=P``
(and ``:overlap=TAU``) ``--streaming P --overlap TAU`` (``StreamingDiLoCo``, P
fragments on a staggered schedule).

Runs ``mpirun -n RANKS python examples/train_lm.py --op OP --seed S --steps STEPS``
for every op and seed, one after the other (arguments after ``--`` go to every
run), reads the JSON line each run prints last, and prints, per op: the final
validation loss (mean and spread over the seeds), its ratio to ``none``'s mean,
bits per byte, and the bytes mpigc sent per rank against ``none``'s. ``--plot``
draws the mean validation curve of every op (needs matplotlib: the ``bench``
extra). This is a benchmark, not a test: it takes minutes per run.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples",
                       "train_lm.py")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", default="none,fp16,2bit,1bit,terngrad",
                   help="comma-separated ops (default: all five); OP:compressed-adamw "
                        "runs OP with --optimizer compressed-adamw, OP:diloco=H with "
                        "--diloco H (the outer exchange with OP), "
                        "OP:diloco=H:streaming=P[:overlap=TAU] with --streaming P "
                        "(--overlap TAU) as well")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--mpirun", default=shutil.which("mpirun") or "mpirun")
    p.add_argument("--json", metavar="FILE", help="write every run's summary here")
    p.add_argument("--plot", metavar="PNG", help="plot the mean validation curves")
    p.add_argument("--keep", action="store_true",
                   help="with --json: keep the runs already in FILE (same op and seed) "
                        "and run only the missing ones")
    p.add_argument("--label", help="name the runs of this command (one op) so in the "
                                   "table and plot, e.g. by the settings after --")
    p.add_argument("--merge", nargs="+", metavar="JSON",
                   help="run nothing: one table (and --plot) of the rows of these "
                        "--json files, in their order; 'none' is the first label")
    p.add_argument("extra", nargs=argparse.REMAINDER,
                   help="after --: arguments for every train_lm.py run")
    args = p.parse_args(argv)
    args.ops = [o for o in args.ops.split(",") if o]
    for o in args.ops:
        try:
            entry_args(o)
        except ValueError as e:
            p.error(str(e))
    args.seeds = [int(s) for s in args.seeds.split(",") if s]
    args.extra = args.extra[1:] if args.extra[:1] == ["--"] else args.extra
    if args.label and len(args.ops) != 1:
        p.error("--label names the runs of one op")
    return args


OPTIONS = {"diloco": "--diloco", "streaming": "--streaming", "overlap": "--overlap"}


def entry_args(entry):
    """An entry of --ops, ``OP[:compressed-adamw|:diloco=H[:streaming=P[:overlap=TAU]]]``,
    as (op, train_lm.py arguments); ValueError for anything else."""
    op, *opts = entry.split(":")
    out, seen = [], {}
    for o in opts:
        name, eq, value = o.partition("=")
        if not eq and name in ("adamw", "compressed-adamw") and not seen:
            out += ["--optimizer", name]
            seen["optimizer"] = name
            continue
        if not eq or name not in OPTIONS or name in seen or not value.isdigit():
            raise ValueError(f"--ops entry {entry!r}: expected OP, OP:compressed-adamw or "
                             f"OP:diloco=H[:streaming=P[:overlap=TAU]] (H, P, TAU "
                             f"integers), got {o!r}")
        seen[name] = value
        out += [OPTIONS[name], value]
    if ("streaming" in seen or "overlap" in seen) and "diloco" not in seen:
        raise ValueError(f"--ops entry {entry!r}: streaming= and overlap= need diloco=H")
    if "overlap" in seen and "streaming" not in seen:
        raise ValueError(f"--ops entry {entry!r}: overlap= needs streaming=P")
    if "optimizer" in seen and "diloco" in seen:
        raise ValueError(f"--ops entry {entry!r}: diloco= runs AdamW inside DiLoCo; "
                         "drop the optimizer")
    if not op:
        raise ValueError(f"--ops entry {entry!r}: expected an op before ':'")
    return op, out


def variant(r):
    return r.get("variant", r["op"])


def run_one(args, entry, seed):
    op, more = entry_args(args.entry if args.label else entry)
    cmd = [args.mpirun, "--oversubscribe", "-n", str(args.ranks), sys.executable, EXAMPLE,
           "--op", op, "--seed", str(seed), "--steps", str(args.steps), *args.extra, *more]
    print("$", " ".join(cmd), flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"run failed (exit {p.returncode}):\n{p.stdout[-2000:]}{p.stderr[-2000:]}")
    row = json.loads(p.stdout.strip().splitlines()[-1])
    row["variant"] = args.label or entry
    print(f"  val loss {row['val_loss']:.4f}  {row['seconds']:.0f} s", flush=True)
    return row


def summarise(rows, ops):
    by = {op: [r for r in rows if variant(r) == op] for op in ops}
    ref = by.get("none") or by[ops[0]]
    ref_loss = statistics.mean(r["val_loss"] for r in ref) if ref else None
    ref_bytes = statistics.mean(r["bytes_sent_per_rank"] for r in ref) if ref else None
    w = max(10, *(len(op) for op in ops))
    lines = [f"{'op':{w}s} {'val loss':>9s} {'spread':>7s} {'vs none':>8s} {'bits/byte':>9s} "
             f"{'MiB/rank':>9s} {'fewer bytes':>11s}  per seed"]
    for op, rs in by.items():
        losses = [r["val_loss"] for r in rs]
        mean = statistics.mean(losses)
        sent = statistics.mean(r["bytes_sent_per_rank"] for r in rs)
        vs = f"{mean / ref_loss:8.4f}" if ref_loss else f"{'':8s}"
        fewer = f"{ref_bytes / sent:10.1f}x" if ref_bytes and sent else f"{'':11s}"
        lines.append(f"{op:{w}s} {mean:9.4f} {max(losses) - min(losses):7.4f} {vs} "
                     f"{mean / 0.6931471805599453:9.4f} {sent / 2**20:9.2f} {fewer}  "
                     + " ".join(f"{v:.4f}" for v in losses))
    return "\n".join(lines)


def plot(rows, ops, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for op in ops:
        curves = [r["val_curve"] for r in rows if variant(r) == op]
        steps = [s for s, _ in curves[0]]
        mean = [statistics.mean(c[i][1] for c in curves) for i in range(len(steps))]
        ax.plot(steps, mean, label=f"{op} ({len(curves)} seeds)")
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (nats per byte)")
    ax.set_title("examples/train_lm.py, AdamW, mean over seeds")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write(args, rows, table=None):
    if args.json:
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"command": sys.argv, "rows": rows, "table": table}, f, indent=1)
        os.replace(tmp, args.json)


def merge(args):
    rows, labels = [], []
    for path in args.merge:
        with open(path) as f:
            for r in json.load(f)["rows"]:
                rows.append(r)
                if variant(r) not in labels:
                    labels.append(variant(r))
    table = summarise(rows, labels)
    print(table)
    if args.plot:
        plot(rows, labels, args.plot)


def main(argv=None):
    args = parse_args(argv)
    if args.merge:
        return merge(args)
    if args.label:  # the one op's runs go by the label
        args.entry, args.ops = args.ops[0], [args.label]
    rows = []
    if args.keep and args.json and os.path.exists(args.json):
        with open(args.json) as f:
            rows = [r for r in json.load(f)["rows"]
                    if variant(r) in args.ops and r["seed"] in args.seeds]
    done = {(variant(r), r["seed"]) for r in rows}
    # seed by seed, so that a cut-short comparison still has every op for the first seeds
    for seed in args.seeds:
        for op in args.ops:
            if (op, seed) not in done:
                rows.append(run_one(args, op, seed))
                write(args, rows)
    rows.sort(key=lambda r: (args.ops.index(variant(r)), r["seed"]))
    table = summarise(rows, args.ops)
    print(table)
    write(args, rows, table)
    if args.plot:
        plot(rows, args.ops, args.plot)


if __name__ == "__main__":
    main()
