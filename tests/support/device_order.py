"""A numpy model of the summation order of ``mpigc.kernels.cuda.stats``.

terngrad's clip bound comes from a float64 sum and sum of squares, which the
device adds in an order that depends on the launch geometry, and so on the
GPU: ``kernels/cuda.py`` launches ``nb = min(ceil(n / T), SMs * 32)`` CUDA
blocks of ``T`` threads (T = 256 on a GPU; 64 threads and at most 3 blocks in
the simulator). This module adds in exactly that order, with numpy's
correctly rounded float64 operations (what ``add.rn.f64`` and ``mul.rn.f64``
do), so that the device's bits can be predicted on a host for any SM count:
132 (H100 SXM, H200), 114 (H100 PCIe), fewer under MIG.

The order, level by level:

1. ``_stats_kernel``: thread ``g = b * T + t`` of block ``b`` sums
   ``v[g], v[g + nb * T], v[g + 2 nb T], ...`` in that order, from 0.0
   (squares: ``v * v`` rounded, then added); then the block folds its T
   sums by the tree ``s[t] += s[t + h]``, h = T/2, ..., 1; ``s[0]`` is the
   block's partial.
2. ``_stats_combine_kernel`` (one block): thread t sums partials
   ``t, t + T, ...`` in order from 0.0, then the same tree.

``max |v|`` and the non-finite count do not depend on the order (they are
exact on every device).
"""
import numpy as np

__all__ = ["BLOCKS_PER_SM", "device_blocks", "stats_model", "clip_bound"]

BLOCKS_PER_SM = 32  # kernels/cuda.py: _BLOCKS_PER_SM


def device_blocks(n, max_blocks, threads=256):
    """CUDA blocks of the first stats launch for ``n`` values (``_grid``)."""
    return max(1, min((n + threads - 1) // threads, max_blocks))


def _thread_sums(v, nthreads):
    """Thread t's sequential sum of ``v[t], v[t + nthreads], ...`` from 0.0,
    for every t at once (padding with +0.0 adds nothing: a sum that starts
    at +0.0 is never -0.0)."""
    rows = max(1, -(-v.size // nthreads))
    m = np.zeros(rows * nthreads)
    m[:v.size] = v
    m = m.reshape(rows, nthreads)
    s = np.zeros(nthreads)
    for r in range(rows):
        s = s + m[r]
    return s


def _tree(s):
    """The block tree on the last axis: ``s[t] += s[t + h]``, h = T/2 ... 1."""
    s = s.copy()
    h = s.shape[-1] // 2
    while h > 0:
        s[..., :h] = s[..., :h] + s[..., h:2 * h]
        h //= 2
    return s[..., 0]


def _two_levels(v, nb, threads):
    partial = _tree(_thread_sums(v, nb * threads).reshape(nb, threads))
    return float(_tree(_thread_sums(partial, threads)))


def stats_model(x, e_in=None, *, max_blocks, threads=256):
    """``(sum, sum of squares, max |v|, non-finite count)`` of ``v = x +
    e_in`` (added in x's dtype, then float64) as ``kernels.cuda.stats``
    computes them with a grid cap of ``max_blocks`` CUDA blocks (on a GPU:
    ``SMs * BLOCKS_PER_SM``) of ``threads`` threads, bit for bit."""
    x = np.asarray(x)
    v = (x if e_in is None else x + np.asarray(e_in)).astype(np.float64)
    if v.size == 0:
        return 0.0, 0.0, 0.0, 0
    nb = device_blocks(v.size, max_blocks, threads)
    with np.errstate(over="ignore", invalid="ignore"):
        s = _two_levels(v, nb, threads)
        ss = _two_levels(v * v, nb, threads)
        a = np.abs(v)
    fin = ~np.isnan(a)
    amax = float(a[fin].max()) if fin.any() else 0.0
    return s, ss, max(amax, 0.0), int(np.count_nonzero(~np.isfinite(v)))


def clip_bound(stats, n, clip):
    """terngrad's clip bound from ``stats`` (``mpigc.compressors.TernGrad.
    local_scale``: ``clip * std``, inf without clip, for a non-finite
    count, or for a zero std)."""
    import math
    s, ss, _, nbad = stats
    if clip is None or nbad:
        return math.inf
    mean = s / n
    std = math.sqrt(max(ss / n - mean * mean, 0.0))
    return clip * std if std > 0.0 else math.inf
