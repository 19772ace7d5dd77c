"""A cost model of one allreduce: mpigc's flat and hierarchical calls, MPI's own.

Pure Python (the module itself imports neither MPI nor numba): it predicts, from a few machine parameters, the
time of one ``allreduce`` of ``nbytes`` bytes of float32 at ``P`` ranks, so that
the configurations one cannot measure (64-4096 ranks, 10-100 Gbit/s links) can
be reasoned about on paper. ``benchmarks/costmodel.py`` fits the parameters on
the machine at hand and prints predicted against measured times;
docs/cluster.md ("Where mpigc pays at scale") has the tables and every
assumption.

The model is a sum of terms, each a stated formula (the docstrings below):

* a message costs the sender and the receiver ``overhead`` seconds of CPU each
  (posting, matching, Python), and a round of messages posted together costs
  one ``alpha`` of latency (they travel at the same time);
* bytes cross a node's NIC at ``beta`` bytes/s per direction, shared by the
  node's ``ranks_per_node`` ranks; bytes between ranks of one node move at
  ``beta_intra`` bytes/s per rank (shared memory: a CPU copy);
* a compressor encodes at ``compress`` and decodes (decode and add) at
  ``decode`` bytes/s of float32 values; MPI's sum runs at ``sum_rate``;
* CPU terms are multiplied by ``max(1, ranks_per_node / cores_per_node)``
  (oversubscribed cores share their time); NIC time overlaps CPU work only in
  pipelined calls (below); intra-node bytes are CPU work and never overlap.

Example
-------
>>> from mpigc import costmodel as cm
>>> net = cm.Network(alpha=5e-6, beta=25e9 / 8, ranks_per_node=8)
>>> t = cm.flat_allreduce("2bit", 32 << 20, 64, net)
>>> t.total > t.latency > 0
True
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Dict, Optional, Tuple

from ._errors import ConfigError

__all__ = [
    "Network", "Rates", "Cost", "DEFAULT_RATES", "OPS",
    "payload_nbytes", "shard_sizes", "flat_allreduce", "hierarchical_allreduce",
    "grid_allreduce", "mpi_allreduce", "mpi_algorithm",
]

#: The ops the model knows: compressor ids, ``"2bit-abs"`` for ``2bit`` with an
#: absolute threshold (``rel_threshold=None``); ``"2bit"`` is the relative default.
OPS = ("none", "fp16", "bf16", "2bit", "2bit-abs", "1bit", "terngrad")

AGREEMENT_ROW_BYTES = 80          # 10 int64 (docs/wire-format.md, "The agreement row")
P2P_AGREEMENT_MAX_RANKS = 16      # above: MPI_Allgather of the rows
INLINE_MAX_SHARD_BYTES = 256 << 10  # phase 1 travels with the rows up to this
CHUNK_BYTES = 2 << 20             # MPIGC_CHUNK_BYTES' default


@dataclass(frozen=True)
class Rates:
    """Kernel throughputs of one compressor, bytes of float32 values per second.

    ``compress``: encode (error feedback included); ``decode``: decode and add
    into the float32 accumulator (or into the buffer, phase 2).
    """

    compress: float
    decode: float


#: Defaults: rough single-core figures of the CPU kernels (numba) on an x86 VM;
#: fit your own with ``benchmarks/costmodel.py --fit``.
DEFAULT_RATES: Dict[str, Rates] = {
    "none": Rates(math.inf, math.inf),
    "fp16": Rates(2.0e9, 2.0e9),
    "bf16": Rates(2.0e9, 2.0e9),
    "2bit": Rates(0.8e9, 1.5e9),
    "2bit-abs": Rates(1.2e9, 1.5e9),
    "1bit": Rates(0.8e9, 1.5e9),
    "terngrad": Rates(0.5e9, 1.5e9),
}


@dataclass(frozen=True)
class Network:
    """The machine: links, CPU, software costs. Times in s, rates in bytes/s.

    Parameters
    ----------
    alpha : latency of a round of messages between nodes.
    beta : a node's NIC bandwidth per direction (bytes/s), shared by its ranks.
    ranks_per_node : L; ``P`` ranks make ``ceil(P / L)`` nodes, filled in order.
    alpha_intra, beta_intra : latency of a round and bandwidth per rank inside
        a node (shared memory).
    overhead : CPU time per message, at the sender and at the receiver each.
    call_overhead : fixed CPU time of one mpigc call (settings, agreement
        table, Python); MPI's own allreduce does not pay it.
    sum_rate : MPI's float32 sum, bytes/s of one operand.
    cores_per_node : CPU terms are scaled by ``max(1, L / cores_per_node)``;
        ``None``: one core per rank.
    chunk_bytes : ``MPIGC_CHUNK_BYTES`` (0: calls are not pipelined).
    rates : kernel throughputs per op (:data:`DEFAULT_RATES` for missing ops).
    """

    alpha: float
    beta: float
    ranks_per_node: int = 1
    alpha_intra: float = 1e-6
    beta_intra: float = 5e9
    overhead: float = 2e-6
    call_overhead: float = 0.0
    sum_rate: float = 4e9
    cores_per_node: Optional[int] = None
    chunk_bytes: int = CHUNK_BYTES
    rates: Dict[str, Rates] = field(default_factory=dict)

    def rate(self, op: str) -> Rates:
        return self.rates.get(op, DEFAULT_RATES[op])

    def cpu_factor(self, local: int) -> float:
        """``max(1, local / cores_per_node)``: oversubscription of a node's cores."""
        if self.cores_per_node is None:
            return 1.0
        return max(1.0, local / self.cores_per_node)


@dataclass(frozen=True)
class Cost:
    """A predicted time and its parts (s): ``total`` is what they add up to.

    ``latency``: ``alpha`` rounds; ``messages``: per-message CPU overhead;
    ``bandwidth``: bytes over links and shared memory (after any overlap);
    ``compute``: kernels and sums; ``fixed``: per-call software cost.
    """

    latency: float = 0.0
    messages: float = 0.0
    bandwidth: float = 0.0
    compute: float = 0.0
    fixed: float = 0.0

    @property
    def total(self) -> float:
        return self.latency + self.messages + self.bandwidth + self.compute + self.fixed

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(*(a + b for a, b in zip(self._parts(), other._parts())))

    def _parts(self) -> Tuple[float, ...]:
        return (self.latency, self.messages, self.bandwidth, self.compute, self.fixed)


def _check(op: str, nbytes: int, P: int) -> None:
    if op not in OPS:
        raise ConfigError(f"unknown op {op!r}: expecting one of {', '.join(OPS)}")
    if nbytes < 0 or nbytes % 4:
        raise ConfigError(f"expecting a multiple of 4 bytes >= 0 (float32), got {nbytes}")
    if P < 1:
        raise ConfigError(f"expecting P >= 1 ranks, got {P}")


def payload_nbytes(op: str, n: int, block_size: int = 1024) -> int:
    """Payload bytes of ``n`` float32 values (docs/wire-format.md, summary table).

    ``none`` ``4n``; ``fp16``/``bf16`` ``2n``; ``2bit-abs`` ``ceil(n/4)``; ``2bit``
    (relative) ``ceil(n/4) + 4 ceil(n/B)``; ``1bit`` ``ceil(n/8) + 8 ceil(n/B)``;
    ``terngrad`` ``ceil(n/4) + 4`` (0 for ``n = 0``), with ``B = block_size``.
    """
    _check(op, 0, 1)
    if n < 0:
        raise ConfigError(f"expecting n >= 0, got {n}")
    cdiv = lambda a, b: -(-a // b)  # noqa: E731
    if op == "none":
        return 4 * n
    if op in ("fp16", "bf16"):
        return 2 * n
    if op == "2bit-abs":
        return cdiv(n, 4)
    if op == "2bit":
        return cdiv(n, 4) + 4 * cdiv(n, block_size)
    if op == "1bit":
        return cdiv(n, 8) + 8 * cdiv(n, block_size)
    return cdiv(n, 4) + 4 if n else 0  # terngrad


def shard_sizes(n: int, P: int) -> list:
    """Elements per shard, as ``numpy.array_split`` (and ``mpigc.shard_bounds``)."""
    q, r = divmod(n, P)
    return [q + 1] * r + [q] * (P - r)


def _exchange(net: Network, op: str, n: int, P: int, L: int, *, agree: bool,
              cpu: float) -> Cost:
    """The compressed two-phase exchange of ``n`` values among ``P`` ranks, ``L`` per node.

    With ``S`` = the sum of the ``P`` shard payloads, ``C`` = the number of
    chunks (``ceil(4n / chunk_bytes)`` when ``4n >= 2 chunk_bytes`` and the op
    is not ``terngrad``, else 1) and ``M = ceil(P / L)`` nodes:

    * per phase, each rank posts ``C (P-1)`` sends and as many receives:
      ``messages = 2 phases x 2 C (P-1) x overhead x cpu``;
    * ``latency = 2 alpha`` (``alpha_intra`` when ``M = 1``), one round per phase;
    * bytes per phase: a node's NIC carries ``L (P-L)/P x S`` out and in, a rank
      moves ``(L-1)/P x S`` through shared memory:
      ``nic = 2 L (P-L)/P S / beta``, ``shm = 2 (L-1)/P S / beta_intra x cpu``;
    * ``compute = cpu x (4n (1 + 1/P) / compress + 2 x 4n / decode)``: encode
      everything, decode P contributions of one's shard, re-encode one's shard,
      decode all P slots;
    * pipelined (``C > 1``): the NIC time overlaps the CPU work, so
      ``bandwidth = shm + max(nic, work) + min(nic, work) / C - work`` where
      ``work = compute + shm``; else ``bandwidth = nic + shm``;
    * ``agree``: the agreement before phase 1 (``P <= 16``: rows point to
      point, one round, ``2 (P-1)`` messages, merged with phase 1 when not
      pipelined, not terngrad and no shard payload is over 256 KiB; ``P > 16``:
      an ``MPI_Allgather`` of 80-byte rows by recursive doubling,
      ``ceil(log2 P)`` rounds of 2 messages).
    """
    if P == 1 or n == 0:
        return Cost()
    sizes = shard_sizes(n, P)
    S = sum(payload_nbytes(op, m) for m in sizes)
    M = -(-P // L)
    pipelined = (net.chunk_bytes > 0 and 4 * n >= 2 * net.chunk_bytes
                 and op != "terngrad")
    C = -(-4 * n // net.chunk_bytes) if pipelined else 1
    a = net.alpha if M > 1 else net.alpha_intra
    r = net.rate(op)
    compute = cpu * (4 * n * (1 + 1 / P) / r.compress + 2 * 4 * n / r.decode)
    nic = 2 * L * (P - L) / P * S / net.beta if M > 1 else 0.0
    shm = 2 * (L - 1) / P * S / net.beta_intra * cpu
    if pipelined:
        work = compute + shm
        bw = shm + max(nic, work) + min(nic, work) / C - work
    else:
        bw = nic + shm
    cost = Cost(latency=2 * a, messages=4 * C * (P - 1) * net.overhead * cpu,
                bandwidth=bw, compute=compute)
    if agree:
        inline = (P <= P2P_AGREEMENT_MAX_RANKS and not pipelined and op != "terngrad"
                  and max(payload_nbytes(op, m) for m in sizes) <= INLINE_MAX_SHARD_BYTES)
        if not inline:
            cost += _agreement(net, P, L, cpu)
        if pipelined and P <= P2P_AGREEMENT_MAX_RANKS:  # the trailers: a row to every peer
            cost += Cost(messages=2 * (P - 1) * net.overhead * cpu)
    return cost


def _agreement(net: Network, P: int, L: int, cpu: float) -> Cost:
    """The agreement rows alone among ``P`` ranks, ``L`` per node.

    ``P <= 16``: one row to every peer, one round: ``alpha + 2 (P-1) overhead
    cpu``; ``P > 16``: ``MPI_Allgather`` of the 80-byte rows, taken as
    recursive doubling: ``ceil(log2 P) (alpha + 2 overhead cpu)`` plus
    ``(P-1) 80 L / beta`` on the NIC. ``alpha_intra`` when ``P <= L``.
    """
    a = net.alpha if P > L else net.alpha_intra
    if P <= P2P_AGREEMENT_MAX_RANKS:
        return Cost(latency=a, messages=2 * (P - 1) * net.overhead * cpu)
    rounds = math.ceil(math.log2(P))
    bw = (P - 1) * AGREEMENT_ROW_BYTES * L / net.beta if P > L else 0.0
    return Cost(latency=rounds * a, messages=2 * rounds * net.overhead * cpu, bandwidth=bw)


def flat_allreduce(op: str, nbytes: int, P: int, net: Network) -> Cost:
    """``mpigc.allreduce(buf, op, hierarchy="flat")`` of ``nbytes`` of float32 at ``P`` ranks.

    ``op="none"`` is the agreement round then MPI's allreduce
    (:func:`mpi_allreduce`); a compressed op is the two-phase exchange among
    all ``P`` ranks (``gather="compressed"``; see ``_exchange``'s formula in
    the module source). Both pay ``call_overhead`` once. ``P = 1`` or
    ``nbytes = 0``: ``call_overhead`` alone. Buffers under
    ``MPIGC_MIN_COMPRESS_BYTES`` (8 KiB), which go uncompressed, are not modelled.
    """
    _check(op, nbytes, P)
    if P == 1 or nbytes == 0:
        return Cost(fixed=net.call_overhead)
    L = min(net.ranks_per_node, P)
    cpu = net.cpu_factor(L)
    if op == "none":
        agree = _agreement(net, P, L, cpu)
        return agree + mpi_allreduce(nbytes, P, net) + Cost(fixed=net.call_overhead)
    return _exchange(net, op, nbytes // 4, P, L, agree=True, cpu=cpu) \
        + Cost(fixed=net.call_overhead)


def hierarchical_allreduce(op: str, nbytes: int, P: int, net: Network,
                           inter: str = "flat") -> Cost:
    """``mpigc.allreduce(buf, op, hierarchy="node")``: ``L = ranks_per_node`` per node.

    With ``M = ceil(P / L)`` nodes (all assumed full):

    0. the input agreement among all ``P`` ranks (``_agreement``), and one
       more round inside the node for the groups' outcomes (``alpha_intra``);
    1. exact reduce-scatter inside the node through the shared window: each
       rank writes its ``4n`` bytes and sums ``L`` slices of ``4n/L``:
       ``2 x 4n / beta_intra x cpu + alpha_intra`` (a fence);
    2. the ``L`` slice groups (one rank per node each) run the two-phase
       exchange of ``n/L`` values among ``M`` ranks at once; the node's NIC
       carries all ``L`` groups: it is ``_exchange`` at ``M`` ranks, one per
       node, with ``beta / L`` per group (``inter="grid"``: the 2-D exchange of
       :func:`grid_allreduce` over the nodes instead);
    3. exact allgather inside the node: each rank reads the ``4n`` bytes of the
       result: ``4n / beta_intra x cpu + alpha_intra``.

    ``M = 1``: steps 1 and 3 alone; ``L = 1``: :func:`flat_allreduce`.
    ``op="none"`` takes the flat path (as the library does).
    """
    _check(op, nbytes, P)
    L = min(net.ranks_per_node, P)
    if op == "none" or L == 1 or P == 1 or nbytes == 0:
        return flat_allreduce(op, nbytes, P, net)
    M = -(-P // L)
    cpu = net.cpu_factor(L)
    n = nbytes // 4
    intra = Cost(latency=2 * net.alpha_intra,
                 bandwidth=3 * nbytes / net.beta_intra * cpu)
    intra += _agreement(net, P, L, cpu) + Cost(latency=net.alpha_intra)
    if M == 1:
        return intra + Cost(fixed=net.call_overhead)
    group = replace(net, beta=net.beta / L, ranks_per_node=1)
    m = -(-n // L)
    if inter == "grid":
        between = _grid(group, op, m, M, cpu)
    else:
        between = _exchange(group, op, m, M, 1, agree=True, cpu=cpu)
    return intra + between + Cost(fixed=net.call_overhead)


def _grid(net: Network, op: str, n: int, P: int, cpu: float) -> Cost:
    """The 2-D exchange among ``P = X x Y`` ranks, one per node (``X`` the
    largest divisor of ``P`` at most ``sqrt P``): a compressed reduce-scatter
    along ``Y`` (rows of ``Y``), then along ``X`` on the row's shard, and the
    allgathers back; per rank ``(X-1) + (Y-1)`` messages per phase instead of
    ``P - 1``, about the same bytes, one more decode and re-encode of a
    ``1/Y`` shard (and one more rounding of it). Not implemented in mpigc:
    the model's answer to "what would a 2-D exchange buy".
    """
    X = max(d for d in range(1, math.isqrt(P) + 1) if P % d == 0)
    Y = P // X
    if X == 1:
        return _exchange(net, op, n, P, 1, agree=True, cpu=cpu)
    first = _exchange(net, op, n, Y, 1, agree=True, cpu=cpu)
    second = _exchange(net, op, -(-n // Y), X, 1, agree=False, cpu=cpu)
    return first + second


def grid_allreduce(op: str, nbytes: int, P: int, net: Network) -> Cost:
    """The hierarchical call with a 2-D exchange between the nodes (hypothetical).

    Steps 1 and 3 of :func:`hierarchical_allreduce`, with step 2 as ``_grid``:
    the nodes form an ``X x Y`` grid and each slice group reduce-scatters
    along one axis, then the other.
    """
    return hierarchical_allreduce(op, nbytes, P, net, inter="grid")


def mpi_algorithm(nbytes: int, P: int) -> str:
    """The algorithm assumed for MPI's allreduce (an assumption, not Open MPI's table).

    Open MPI's ``tuned`` component picks, for a commutative sum, recursive
    doubling for small messages and a ring (or Rabenseifner's reduce-scatter +
    allgather, with the same bandwidth term) for large ones. The model takes:
    recursive doubling below 64 KiB or when ``nbytes < 4 P`` (shards under one
    value), the ring otherwise.
    """
    if nbytes < (64 << 10) or nbytes < 4 * P:
        return "recursive_doubling"
    return "ring"


def mpi_allreduce(nbytes: int, P: int, net: Network,
                  algorithm: Optional[str] = None) -> Cost:
    """MPI_Allreduce of ``nbytes`` of float32 at ``P`` ranks (no ``call_overhead``).

    * ``"ring"``: ``2 (P-1)`` steps, each one message of ``nbytes/P`` to the
      next rank and one from the previous: ``2 (P-1) (a + 2 overhead cpu)``,
      bytes ``2 (P-1)/P nbytes`` over the slowest edge (ranks in order, ``L``
      per node: one edge per node leaves it, so the NIC is not shared; with
      ``M = 1`` the edge is shared memory at ``beta_intra / cpu``), sums
      ``(P-1)/P nbytes / sum_rate x cpu``;
    * ``"recursive_doubling"``: ``ceil(log2 P)`` steps of the whole buffer:
      latency ``ceil(log2 P) a``, bytes ``ceil(log2 P) nbytes`` (the first
      ``log2 L`` steps inside the node, the rest over the NIC shared by ``L``),
      sums ``ceil(log2 P) nbytes / sum_rate x cpu``.
    """
    if P == 1 or nbytes == 0:
        return Cost()
    algorithm = algorithm or mpi_algorithm(nbytes, P)
    L = min(net.ranks_per_node, P)
    M = -(-P // L)
    cpu = net.cpu_factor(L)
    a = net.alpha if M > 1 else net.alpha_intra
    if algorithm == "ring":
        bw = net.beta if M > 1 else net.beta_intra / cpu
        return Cost(latency=2 * (P - 1) * a,
                    messages=4 * (P - 1) * net.overhead * cpu,
                    bandwidth=2 * (P - 1) / P * nbytes / bw,
                    compute=(P - 1) / P * nbytes / net.sum_rate * cpu)
    if algorithm == "recursive_doubling":
        k = math.ceil(math.log2(P))
        k_in = min(k, math.ceil(math.log2(L))) if L > 1 else 0
        bw = k_in * nbytes / net.beta_intra * cpu + (k - k_in) * nbytes * L / net.beta
        return Cost(latency=k_in * net.alpha_intra + (k - k_in) * net.alpha,
                    messages=2 * k * net.overhead * cpu, bandwidth=bw,
                    compute=k * nbytes / net.sum_rate * cpu)
    raise ConfigError(f"unknown algorithm {algorithm!r}: expecting 'ring' or "
                     "'recursive_doubling'")
