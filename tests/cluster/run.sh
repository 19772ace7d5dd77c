#!/usr/bin/env bash
# The hierarchical collectives on the real emulated cluster (benchmarks/cluster.sh:
# 2 network namespaces x 2 ranks, 1 Gbit/s links): tests/cluster/check_hierarchy.py.
# Skips (exit 0, a printed reason, no tally line) without root, ip, tc or unshare.
set -uo pipefail
cd "$(dirname "$0")/../.."
why=""
[ "$(id -u)" -eq 0 ] || why="not root"
for t in ip tc unshare; do command -v "$t" >/dev/null 2>&1 || why="${why:+$why, }no $t"; done
if [ -n "$why" ]; then
    echo "cluster test skipped: $why (benchmarks/cluster.sh needs root, ip, tc and unshare)"
    exit 0
fi
timeout "${MPIGC_CLUSTER_TEST_TIMEOUT:-600}" bash benchmarks/cluster.sh --timeout 500 -- \
    mpirun -n 4 python tests/cluster/check_hierarchy.py
