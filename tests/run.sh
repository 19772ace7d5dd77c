#!/usr/bin/env bash
# The whole mpigc test suite: the plain tests, then the MPI tests under mpirun
# with 1, 2, 3 and 4 ranks (3 gives uneven shards). Every launch runs under
# `timeout`, so a hang fails instead of stalling. Rank 0's output is shown;
# the other ranks' output goes to $MPIGC_TEST_LOGS and is shown on failure.
#
#   bash tests/run.sh            # everything
#   RANKS="2 3" bash tests/run.sh
set -uo pipefail
cd "$(dirname "$0")/.."

RANKS=${RANKS:-"1 2 3 4"}
TIMEOUT=${MPIGC_TEST_TIMEOUT:-900}  # per MPI launch
# the plain suite (the CUDA simulator and the PTX compile of every kernel are most of it)
PLAIN_TIMEOUT=${MPIGC_PLAIN_TEST_TIMEOUT:-3600}
LOGS=${MPIGC_TEST_LOGS:-$(mktemp -d /tmp/mpigc-tests.XXXXXX)}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1  # harmless when not root
export OMPI_MCA_rmaps_base_oversubscribe=1 PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe
export PYTHONUNBUFFERED=1
PYTEST=(python -m pytest -p no:cacheprovider -q --color=no)

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

echo "== plain tests"
timeout "$PLAIN_TIMEOUT" "${PYTEST[@]}" --ignore=tests/mpi tests 2>&1 | tee "$LOGS/plain.log"
rc=${PIPESTATUS[0]}; tally "$LOGS/plain.log" "$rc"
[ "$rc" -eq 0 ] || { echo "plain tests: exit $rc"; status=1; }

for k in $RANKS; do
    echo "== MPI tests, $k rank(s)"
    timeout "$TIMEOUT" mpirun --oversubscribe -n "$k" bash -c '
        r=${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-0}}
        if [ "$r" = 0 ]; then exec "$@"; else exec "$@" >"'"$LOGS"'/mpi'"$k"'.rank$r.log" 2>&1; fi
    ' _ "${PYTEST[@]}" --with-mpi tests/mpi 2>&1 | tee "$LOGS/mpi$k.log"
    rc=${PIPESTATUS[0]}; tally "$LOGS/mpi$k.log" "$rc"
    if [ "$rc" -ne 0 ]; then
        status=1
        echo "MPI tests with $k rank(s): exit $rc (124 = timed out; an abort of the job by the test watchdog of tests/mpi/conftest.py says why above or below); other ranks' logs:"
        for f in "$LOGS"/mpi"$k".rank*.log; do
            [ -f "$f" ] && { echo "--- $f"; tail -n 30 "$f"; }
        done
    fi
done

echo "== hierarchical collectives on the emulated cluster (tests/cluster/run.sh)"
bash tests/cluster/run.sh 2>&1 | tee "$LOGS/cluster.log"
rc=${PIPESTATUS[0]}; tally "$LOGS/cluster.log" "$rc"
[ "$rc" -eq 0 ] || { echo "cluster test: exit $rc"; status=1; }

echo "logs: $LOGS"
echo "mpigc tests: $passed passed, $failed failed"
exit $status
