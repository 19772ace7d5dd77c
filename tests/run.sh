#!/usr/bin/env bash
# The whole mpigc test suite: the plain tests, the MPI tests under mpirun with 1, 2, 3
# and 4 ranks (3 gives uneven shards), then the emulated cluster. Every launch runs
# under `timeout`, so a hang fails instead of stalling. Rank 0's output is shown; the
# other ranks' output goes to $MPIGC_TEST_LOGS and is shown on failure.
#
# Everything runs as pytest runs side by side, $MPIGC_TEST_LANES at a time (default
# the cores this shell may use), the longest first: the heaviest plain files one run
# each, the rest of the plain suite one run, and the MPI tests one run per rank count.
# The MPI runs wait on each other's ranks much of the time (at 3 ranks 343 CPU s in 571
# s wall at load 28; the schedule search's first 40 seeds 42 CPU s in 215 s), so after
# the plain runs, one at a time, they left a core idle for much of their ~600 s; beside
# the plain runs they fill it. Each run's output is shown whole when it ends. MPIGC_TEST_LANES=1 runs them one
# after another.
#
#   bash tests/run.sh            # everything
#   RANKS="2 3" bash tests/run.sh
set -uo pipefail
cd "$(dirname "$0")/.."

RANKS=${RANKS:-"1 2 3 4"}
TIMEOUT=${MPIGC_TEST_TIMEOUT:-900}  # per MPI launch
# per pytest run of the plain suite (the CUDA simulator, the model checker and the
# jobs under mpirun are most of it)
PLAIN_TIMEOUT=${MPIGC_PLAIN_TEST_TIMEOUT:-3600}
LOGS=${MPIGC_TEST_LOGS:-$(mktemp -d /tmp/mpigc-tests.XXXXXX)}
if [ -n "${MPIGC_TEST_LANES:-}" ]; then
    LANES=$MPIGC_TEST_LANES
else
    LANES=$(nproc 2>/dev/null || echo 2)
fi
[ "$LANES" -ge 1 ] 2>/dev/null || LANES=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1  # harmless when not root
export OMPI_MCA_rmaps_base_oversubscribe=1 PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe
export PYTHONUNBUFFERED=1
# a rank that waits in MPI yields the core instead of spinning on it. Open MPI turns
# this on by itself only when a job has more ranks than cores; a job of 2 ranks on
# the 2 cores spun one rank at 100% while it waited, taking a core from the other
# lane, from its own other rank and from everyone else on the machine (a competitor
# beside such a job: +45% wall; with the yield, +5%. test_errors_mpi at 2 ranks under
# load 13-15: 17.9 and 17.3 s -> 9.5 and 11.0 s, CPU 8.2 and 9.1 -> 6.6 and 6.0 s)
export OMPI_MCA_mpi_yield_when_idle=1
PYTEST=(python -m pytest -p no:cacheprovider -q --color=no)

# the runs, the longest first (with 2 lanes, the next run starts where one ends). Seconds
# of each in the last full CI (2026-11-29, quiet 2-core VM, the plain runs two at a time
# and the MPI runs after them, one at a time): the MPI tests at 3 ranks 257, 2 ranks 172
# and 4 ranks 171; of the plain runs (the lanes 794 s before the cuts of 2026-11-29,
# ~540 since) test_gpu_path_sim 226, test_model_check 326 before its cuts (~120 CPU s
# since: one core, the model checker), test_cuda_sim 197, the rest of the plain suite
# 317, test_torch 94, the MPI tests at 1 rank 89, test_launch_abort 80, test_docs 55,
# and the examples' jobs of 2 ranks with torch, about 12 CPU s a job:
# test_example_gpt_fsdp 63 (5 jobs), test_example_lm 60 (its 15 runs share 2 jobs),
# test_example_gpt_ddp 57 (4 jobs). On 2 cores the plain tests take about their CPU
# seconds over 2; the MPI runs wait much of their time (tests/README.md, where the time
# goes)
# test_kernels is the first run (beside test_gpu_path_sim): it compiles every CPU
# kernel signature (166) into the kernel cache, which starts empty in a fresh clone (a
# folder per source path: mpigc/_jitcache.py), so that the runs after it load them: it
# took 146 CPU s with the cache empty, 17.5 with it full (load 25-40). The MPI runs
# start after it; before, they ran after the whole plain suite. Each rank of a job
# compiles what the cache lacks, the same signatures at once: test_allreduce_mpi and
# test_faults_mpi at 3 ranks, started together, took 83 CPU s and 523 s wall with an
# empty cache, 14 CPU s and 150 s with the cache test_kernels filled (load 17-31)
WARM=tests/test_kernels.py
HEAVY=(tests/test_gpu_path_sim.py tests/test_model_check.py tests/test_cuda_sim.py
       tests/test_torch.py)
LIGHT=(tests/test_launch_abort.py tests/test_docs.py tests/test_example_gpt_fsdp.py
       tests/test_example_lm.py tests/test_example_gpt_ddp.py)

passed=0; failed=0; status=0
tally() {  # add up the counts of a pytest summary line in file $1; exit status $2
    local line
    line=$(grep -aE '^[=]* ?[0-9]+ (passed|failed)|^[=]* ?(no tests ran)' "$1" | tail -n 1)
    if [ -z "$line" ] && [ "${2:-0}" -ne 0 ]; then
        # no summary (aborted, killed, timed out): one failure, so the tally shows it
        failed=$((failed + 1)); return
    fi
    local p f e
    p=$(grep -oE '[0-9]+ passed' <<<"$line" | grep -oE '[0-9]+' || true)
    f=$(grep -oE '[0-9]+ failed' <<<"$line" | grep -oE '[0-9]+' || true)
    e=$(grep -oE '[0-9]+ errors?' <<<"$line" | grep -oE '[0-9]+' || true)
    passed=$((passed + ${p:-0})); failed=$((failed + ${f:-0} + ${e:-0}))
}

mpi_launch() {  # the MPI tests at $1 ranks: rank 0's output here, the others' in $LOGS
    timeout "$TIMEOUT" mpirun --oversubscribe -n "$1" bash -c '
        r=${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-0}}
        if [ "$r" = 0 ]; then exec "$@"; else exec "$@" >"'"$LOGS"'/mpi'"$1"'.rank$r.log" 2>&1; fi
    ' _ "${PYTEST[@]}" --with-mpi tests/mpi
}

# what mpirun prints when Open MPI's launcher failed before it started any rank
# (tests/support/launcher.py: then nothing ran, and the launch is made once more)
DID_NOT_START="The PMIx server's listener thread failed to start"

mpi_tests() {  # mpi_launch $1, made once more if mpirun never started pytest
    local rc
    mpi_launch "$1" 2>&1 | tee "$LOGS/launch$1.log"
    rc=${PIPESTATUS[0]}
    if [ "$rc" -ne 0 ] && grep -qF "$DID_NOT_START" "$LOGS/launch$1.log" &&
        ! grep -qaE '^[=]* ?[0-9]+ (passed|failed|skipped)' "$LOGS/launch$1.log"; then
        echo "mpirun did not start (Open MPI's launcher, no rank ran): once more"
        mpi_launch "$1" 2>&1
        rc=$?
    fi
    return "$rc"
}

mpi_failed() {  # what to say when the MPI tests at $1 ranks exited with $2
    echo "MPI tests with $1 rank(s): exit $2 (124 = timed out; an abort of the job by the test watchdog of tests/mpi/conftest.py says why above or below); other ranks' logs:"
    for f in "$LOGS"/mpi"$1".rank*.log; do
        [ -f "$f" ] && { echo "--- $f"; tail -n 30 "$f"; }
    done
}

# -- every pytest run, side by side ---------------------------------------------------
names=(); cmds=(); rest=(--ignore=tests/mpi)
own() {  # each file of "$@" that exists: a run of its own, left out of the rest
    for f in "$@"; do
        [ -f "$f" ] || continue
        names+=("$f"); cmds+=("plain $f"); rest+=("--ignore=$f")
    done
}
mpi_run() {  # the MPI tests at $1 ranks, when RANKS has $1
    [[ " $RANKS " == *" $1 "* ]] || return 0
    names+=("MPI tests, $1 rank(s)"); cmds+=("mpi $1")
}
own "$WARM"; own "${HEAVY[0]}"; mpi_run 3
names+=("the other plain tests"); cmds+=("rest")
mpi_run 2; mpi_run 4; own "${HEAVY[@]:1:2}"
own "${HEAVY[3]}"; mpi_run 1; own "${LIGHT[@]}"
for k in $RANKS; do  # other counts, after the rest
    case " 1 2 3 4 " in *" $k "*) ;; *) mpi_run "$k" ;; esac
done

run_item() {  # item $1: its command in $LOGS/item$1.log, its exit status and seconds in .rc
    local i=$1 t0=$SECONDS rc
    set -- ${cmds[$i]}
    case $1 in
        plain) timeout "$PLAIN_TIMEOUT" "${PYTEST[@]}" "$2" ;;
        rest) timeout "$PLAIN_TIMEOUT" "${PYTEST[@]}" "${rest[@]}" tests ;;
        mpi) mpi_tests "$2" ;;
    esac >"$LOGS/item$i.log" 2>&1
    rc=$?
    echo "$rc $((SECONDS - t0))" >"$LOGS/item$i.rc"
    {   # shown whole, one item at a time
        flock 9
        echo "== ${names[$i]}: exit $rc, $((SECONDS - t0)) s"
        cat "$LOGS/item$i.log"
    } 9>"$LOGS/print.lock"
}

echo "== the plain tests and the MPI tests at ${RANKS// /, } rank(s): ${#names[@]} pytest runs, $LANES at a time"
t0=$SECONDS
for i in "${!names[@]}"; do
    while [ "$(jobs -rp | wc -l)" -ge "$LANES" ]; do wait -n; done
    run_item "$i" &
done
wait
echo "== the pytest runs done in $((SECONDS - t0)) s"
: >"$LOGS/plain.log"
for i in "${!names[@]}"; do
    read -r rc secs <"$LOGS/item$i.rc" 2>/dev/null || rc=1
    echo "   ${names[$i]}: exit $rc, ${secs:-?} s"
    tally "$LOGS/item$i.log" "$rc"
    if [[ ${cmds[$i]} == mpi* ]]; then
        k=${cmds[$i]#mpi }
        cp "$LOGS/item$i.log" "$LOGS/mpi$k.log"
        [ "$rc" -eq 0 ] || { status=1; mpi_failed "$k" "$rc"; }
    else
        cat "$LOGS/item$i.log" >>"$LOGS/plain.log"
        [ "$rc" -eq 0 ] || { echo "plain tests, ${names[$i]}: exit $rc"; status=1; }
    fi
done

echo "== hierarchical collectives on the emulated cluster (tests/cluster/run.sh)"
bash tests/cluster/run.sh 2>&1 | tee "$LOGS/cluster.log"
rc=${PIPESTATUS[0]}; tally "$LOGS/cluster.log" "$rc"
[ "$rc" -eq 0 ] || { echo "cluster test: exit $rc"; status=1; }

echo "logs: $LOGS"
echo "mpigc tests: $passed passed, $failed failed"
exit $status
