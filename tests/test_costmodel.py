"""mpigc.costmodel: the formulas' limits, payload sizes against the packers, monotonicity."""
import dataclasses
import math

import numpy as np
import pytest

import mpigc
from mpigc import costmodel as cm
try:
    from .support import reference as ref
except ImportError:
    from support import reference as ref

NET = cm.Network(alpha=5e-6, beta=25e9 / 8, ranks_per_node=8, overhead=2e-6,
                 call_overhead=1e-4, cores_per_node=8)
COMPRESSED = ("fp16", "bf16", "2bit", "2bit-abs", "1bit", "terngrad")


def _compressor(op):
    if op == "2bit-abs":
        return mpigc.get_compressor("2bit", rel_threshold=None, threshold=0.5)
    return mpigc.get_compressor(op)


@pytest.mark.parametrize("op", cm.OPS)
@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 8, 9, 1023, 1024, 1025, 4097, 100003])
def test_payload_equals_packers(op, n):
    c = _compressor(op)
    assert cm.payload_nbytes(op, n) == c.payload_nbytes(n, np.float32)
    if n:
        x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
        assert cm.payload_nbytes(op, n) == c.compress(x).nbytes


@pytest.mark.parametrize("op,fmt", [("2bit-abs", "2bit"), ("1bit", "1bit"),
                                    ("terngrad", "terngrad"), ("fp16", "fp16"),
                                    ("bf16", "bf16"), ("none", "none")])
def test_payload_equals_reference(op, fmt):
    for n in (0, 1, 7, 1024, 3001):
        assert cm.payload_nbytes(op, n) == ref.payload_nbytes(fmt, n)


def test_shard_sizes_are_array_split():
    for n, P in ((10, 3), (2, 4), (0, 5), (1 << 20, 7)):
        bounds = mpigc.shard_bounds(n, P)
        assert cm.shard_sizes(n, P) == [hi - lo for lo, hi in bounds]


@pytest.mark.parametrize("op", cm.OPS)
def test_one_rank_and_empty_cost_the_call_alone(op):
    for f in (cm.flat_allreduce, cm.hierarchical_allreduce, cm.grid_allreduce):
        assert f(op, 32 << 20, 1, NET).total == NET.call_overhead
        assert f(op, 0, 64, NET).total == NET.call_overhead
    assert cm.mpi_allreduce(32 << 20, 1, NET).total == 0
    assert cm.mpi_allreduce(0, 64, NET).total == 0


def _bandwidth_only(**kw):
    base = dict(alpha=0.0, beta=1e9, alpha_intra=0.0, beta_intra=4e9, overhead=0.0,
                call_overhead=0.0, sum_rate=math.inf, chunk_bytes=0,
                rates={op: cm.Rates(math.inf, math.inf) for op in cm.OPS})
    base.update(kw)
    return cm.Network(**base)


@pytest.mark.parametrize("op", COMPRESSED)
def test_flat_bandwidth_term_exact(op):
    # alpha = 0, free CPU: one rank per node, P nodes; each phase moves (P-1)/P
    # of the shard payloads' sum S out of every NIC, two phases (P > 16: plus the rows)
    net = _bandwidth_only()
    for P, nbytes in ((2, 4000), (3, 4 << 20), (16, 1 << 20)):
        S = sum(cm.payload_nbytes(op, m) for m in cm.shard_sizes(nbytes // 4, P))
        t = cm.flat_allreduce(op, nbytes, P, net)
        assert t.total == pytest.approx(2 * (P - 1) / P * S / net.beta, rel=1e-12)
        assert t.bandwidth == t.total


def test_flat_bandwidth_shared_nic():
    # L ranks per node share the NIC: L (P-L)/P S per phase; inside the node shm
    net = _bandwidth_only(ranks_per_node=4)
    P, nbytes = 8, 1 << 20
    S = sum(cm.payload_nbytes("1bit", m) for m in cm.shard_sizes(nbytes // 4, P))
    t = cm.flat_allreduce("1bit", nbytes, P, net)
    assert t.total == pytest.approx(2 * 4 * 4 / 8 * S / 1e9 + 2 * 3 / 8 * S / 4e9)


def test_mpi_ring_bandwidth_term_exact():
    net = _bandwidth_only()
    for P in (2, 5, 64):
        t = cm.mpi_allreduce(1 << 24, P, net, algorithm="ring")
        assert t.total == pytest.approx(2 * (P - 1) / P * (1 << 24) / 1e9, rel=1e-12)
        rows = (P - 1) * 80 / 1e9 if P > 16 else 0.0  # the agreement's MPI_Allgather
        assert cm.flat_allreduce("none", 1 << 24, P, net).total == pytest.approx(t.total + rows)
    t = cm.mpi_allreduce(1 << 10, 8, net, algorithm="recursive_doubling")
    assert t.total == pytest.approx(3 * (1 << 10) / 1e9)


def test_hierarchical_terms():
    net = _bandwidth_only(ranks_per_node=4)
    nbytes, P = 4 << 20, 16
    n, L, M = nbytes // 4, 4, 4
    S = sum(cm.payload_nbytes("2bit", m) for m in cm.shard_sizes(n // L, M))
    t = cm.hierarchical_allreduce("2bit", nbytes, P, net)
    # node sums and allgather: 3 x 4n through shared memory; between the nodes the L
    # groups share the NIC: L x 2 (M-1)/M S
    assert t.total == pytest.approx(3 * nbytes / 4e9 + L * 2 * (M - 1) / M * S / 1e9)
    assert cm.hierarchical_allreduce("none", nbytes, P, net) == \
        cm.flat_allreduce("none", nbytes, P, net)


def test_alpha_counts_rounds_and_overhead_counts_messages():
    net = _bandwidth_only(alpha=1.0, beta=math.inf, beta_intra=math.inf)
    # P <= 16, shards under 256 KiB: the rows carry phase 1 (2 rounds)
    assert cm.flat_allreduce("2bit", 1 << 20, 8, net).total == 2.0
    # terngrad: the rows alone first (3 rounds)
    assert cm.flat_allreduce("terngrad", 1 << 20, 8, net).total == 3.0
    # P > 16: the rows by recursive doubling, log2 P rounds
    assert cm.flat_allreduce("2bit", 1 << 20, 64, net).total == 2.0 + 6
    net = _bandwidth_only(overhead=1.0, beta=math.inf, beta_intra=math.inf)
    # 4 MiB, chunks of 2 MiB: 2 chunks; 2 phases x (send + receive) x 2 x (P-1),
    # the rows 2 (P-1), the trailers 2 (P-1)
    net = replace_chunks(net, 2 << 20)
    P = 4
    assert cm.flat_allreduce("2bit", 4 << 20, P, net).total == 2 * 2 * 2 * (P - 1) + 4 * (P - 1)


def replace_chunks(net, c):
    return dataclasses.replace(net, chunk_bytes=c)


@pytest.mark.parametrize("f", [cm.flat_allreduce, cm.hierarchical_allreduce])
@pytest.mark.parametrize("op", cm.OPS)
def test_monotone_in_bytes_and_ranks(f, op):
    sizes = [1 << 20, 4 << 20, 32 << 20, 100 << 20]
    for P in (2, 8, 64, 512, 4096):
        ts = [f(op, b, P, NET).total for b in sizes]
        assert ts == sorted(ts), (P, ts)
    # in P: the rounds and messages grow on each side of 16 ranks (above, the rows go
    # by MPI_Allgather, log2 P rounds, instead of a message to every peer); the total grows from two nodes on
    # with free kernels (with real ones a rank re-encodes a 1/P shard, which shrinks,
    # and from one node (8) to two (16) its shared-memory bytes halve)
    free = dataclasses.replace(NET, rates={o: cm.Rates(math.inf, math.inf) for o in cm.OPS})
    for b in sizes:
        for Ps in ((2, 4, 8, 16), (32, 64, 256, 1024, 4096)):
            ts = [(lambda c: c.latency + c.messages)(f(op, b, P, NET)) for P in Ps]
            assert ts == sorted(ts), (b, ts)
        ts = [f(op, b, P, free).total for P in (16, 32, 64, 256, 1024, 4096)]
        assert ts == sorted(ts), (b, ts)


def test_oversubscription_scales_cpu():
    one = cm.Network(alpha=0, beta=1e9, ranks_per_node=4, cores_per_node=4)
    two = cm.Network(alpha=0, beta=1e9, ranks_per_node=4, cores_per_node=2)
    a, b = cm.flat_allreduce("1bit", 1 << 20, 4, one), cm.flat_allreduce("1bit", 1 << 20, 4, two)
    assert b.compute == pytest.approx(2 * a.compute)
    assert b.messages == pytest.approx(2 * a.messages)


def test_bad_input_raises():
    with pytest.raises(mpigc.ConfigError, match="unknown op"):
        cm.flat_allreduce("3bit", 1024, 4, NET)
    with pytest.raises(mpigc.ConfigError, match="multiple of 4"):
        cm.flat_allreduce("2bit", 1023, 4, NET)
    with pytest.raises(mpigc.ConfigError, match="P >= 1"):
        cm.hierarchical_allreduce("2bit", 1024, 0, NET)
    with pytest.raises(mpigc.ConfigError, match="algorithm"):
        cm.mpi_allreduce(1024, 4, NET, algorithm="tree")


def test_payload_equals_wire_format_doc():
    # docs/wire-format.md prints the per-shard payloads of n = 10 on 3 ranks and the
    # 1bit payload of 2^20 values: the model must say the same
    import os
    import re
    doc = open(os.path.join(os.path.dirname(__file__), "..", "docs", "wire-format.md")).read()
    rows = re.findall(r"^(\w+)\s+per-shard payloads \[([\d, ]+)\]", doc, re.M)
    assert {op for op, _ in rows} == {"none", "fp16", "bf16", "2bit", "1bit", "terngrad"}
    for op, sizes in rows:
        got = [cm.payload_nbytes(op, m) for m in cm.shard_sizes(10, 3)]
        assert got == [int(v) for v in sizes.split(",")], op
    assert "(139264, 30.11764705882353)" in doc
    assert cm.payload_nbytes("1bit", 1 << 20) == 139264
