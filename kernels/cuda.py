"""Numba CUDA kernels: the device twins of ``mpigc.kernels.cpu``.

Every public function here has the name and the positional signature of its
sibling in :mod:`mpigc.kernels.cpu` (plus a keyword-only ``cuda_stream``) and the
same conventions (``e_in`` / ``e_out`` error feedback, ``None`` for no
residual, ``pack_*`` return the non-finite count). A kernel itself never
receives ``None``: an absent residual is launched as an empty device array
plus a flag (``has_e_in``, ``has_e_out``), see :func:`_launch`. Arrays are
CUDA device arrays: anything with ``__cuda_array_interface__`` (CuPy, CUDA torch tensors,
Numba device arrays); host ``numpy`` arrays are refused rather than silently
copied.

Shards: one launch per stage
----------------------------
The ``*_shards`` functions pack the shards of one collective call (``starts``:
the shard bounds in elements, ``offs``: where each shard's payload starts in
the payload buffer, both sequences of ints) and decode the payloads of
``nsrc`` senders (``stride`` bytes apart) onto ``out``, each with ONE kernel
launch: the shard is the grid's ``y`` index. The single-buffer functions
(``pack_2bit`` ...) are the one-shard case of the same kernels. The bounds
travel as small device arrays, cached per layout (uploaded once). Every pack
returns its non-finite count: the one device-to-host read of the stage.

Kernels
-------
- ``2bit``: one thread per payload byte (its 4 values), two bytes per round
  of the grid-stride loop, ``k`` and ``k`` + the grid's thread count, so
  that each byte store is a warp's 32 consecutive bytes and no lane idles.
  A thread issues all its loads (8 values of ``x``, 8 of ``e_in``) before
  the first compare or store (a store to ``e_out`` may alias them, so the
  compiler would not move a load past it); a whole byte's loads are one
  unsigned index plus constant offsets (no negative-index wrap-around per
  load), and in a byte not whole (the shard's last one, or past it) an
  index past the shard is clamped to its last value, loaded and dropped.
  No shuffles. Decoding: the same bytes per thread, ``out`` read (when
  accumulating) and written once, the senders summed in registers in rank
  order, two senders' bytes loaded before their sums. The launch puts
  ``LANES * _VALUES_2BIT`` values on a warp; ``launch_bounds`` gives ptxas
  the block size.
- ``terngrad``: the bytes, loads and stores of ``2bit``; a sender's scale
  (the float32 after its codes) is loaded with its two code bytes.
- ``1bit`` and relative ``2bit``: one warp per quantization block. Lane l
  reads elements l, l + 32, ... (coalesced rows of 32) and sums them in
  float64, in this order: the canonical order of ``kernels/cpu.py``; the
  pairwise tree ``sum[l] += sum[l + s]``, s = 16, 8, 4, 2, 1, is done by warp
  shuffles (``shfl_down``), bit for bit the CPU's tree. The second pass reads
  the block again row by row (1bit: a lane loads its values of 4 rows at
  once, in both passes, before it sums them or stores anything; an index
  past the block is clamped to its last value and dropped): 1bit signs by one
  ``ballot`` per row of 32
  (four bytes, MSB first after a bit reversal); relative 2bit, whose first
  two passes load 4 rows at once too, codes the block as ``2bit`` codes a
  shard (a lane per payload byte, its 4 values loaded at once). A
  relative 2bit block where no value reaches ``c * rms`` reads the block once
  more for its ``max |v|`` (an integer max of the bits of ``float64(|v|)``
  per lane, then a tree over ``shfl_down``: exact, and no float max) and
  selects again with the fallback
  threshold (``docs/wire-format.md``). The
  reconstruction pairs and magnitudes are written as little-endian float32
  bytes straight into the payload after the codes.
  1bit decoding: one thread per byte of bits (8 values of one block),
  ``out`` loaded once and stored once, and per sender, in rank order, the
  byte and both means of its block loaded before the sums; relative 2bit
  decoding likewise, a thread per byte of codes (4 values) and its block's
  magnitude.
- ``fp16`` / ``bf16``: one generic element-wise body, the conversion being
  the parameter (:func:`_make_half_kernels`). A thread handles 4 values a
  round, ``i + m * T`` (``T`` the grid's threads: each load and store a
  warp's coalesced row), all 4 (8 with ``e_in``; per sender when decoding)
  loaded before the first store.
- ``stats`` (terngrad's scale): a two-level reduction on the device (per
  CUDA block partials, then one block folds them); the host reads 4 numbers.

Bit-identity with the CPU kernels
---------------------------------
- ``2bit`` (both modes), ``1bit``, ``fp16``, ``bf16``, ``terngrad`` (same ``stream``,
  ``scale`` and ``clip``): packed bytes, block means or thresholds and
  residuals are bit-identical for finite inputs (the float64 block sums follow
  the canonical order above; squares by ``mul.rn``, never fused into the sum).
  float16 uses the same integer conversion as the CPU kernels (not
  the hardware ``cvt``, whose NaN payload differs); bfloat16 likewise (integer
  round to nearest even, NaN as ``0x7FC0``). The CPU keeps a NaN's sign and
  payload; a GPU's arithmetic makes every NaN the canonical positive one, so a
  NaN's bits, on the wire and in residuals, are the hardware's (seen on an
  H200; ``nonfinite="ignore"`` only). A product followed by a
  sum or difference (the fp16 and bf16 residual ``v - wire * divisor``) uses
  ``mul.rn`` (libdevice ``__fmul_rn`` / ``__dmul_rn``) so that neither NVVM
  nor ptxas contracts it into an fma, which rounds once where the CPU
  rounds twice. Decoding sums the senders in rank order in the output's
  dtype, as the CPU's ``accumulate`` calls do one after the other.
- No float ``min``/``max``: numba-cuda lowers them to ``min.f64``/``max.f64``
  (libdevice ``fmin``/``fmax``), which return the non-NaN operand, where the
  CPU's (Numba's, Python's rule) keep a NaN that comes first. terngrad's clip
  is two explicit compares, as the CPU's ``min(max(v, -c), c)`` evaluates:
  a NaN stays NaN (code ``00``), also under ``nonfinite="ignore"``.
- Non-finite values: the same codes, counts and residuals as the CPU
  (checked in the simulator with the GPU's float min/max, group
  ``gpu_semantics`` of ``tests/test_cuda_sim.py``).
- ``stats``: ``max |v|`` and the non-finite count are exact; the float64 sum
  and sum of squares are summed in a different order (per thread, then a
  tree per CUDA block, then the blocks by a tree), deterministic
  for a given device, but the grid depends on its SM count (132 on H100
  SXM and H200, 114 on H100 PCIe, fewer under MIG): ``tests/support/device_order.py``
  computes the device's bits on a host for any SM count. TernGrad with
  ``clip`` derives its clip bound from them, so in rare last-bit cases the
  bound (and then a code) can differ from the CPU's, and between GPU
  models. Without ``clip`` the scale is ``max |v|``: exact.

Preconditions
-------------
A 1bit ``block_size`` must be a positive multiple of 8 and a relative 2bit
one a multiple of 4 (one warp per block writes whole bytes; else two warps
would write one byte, and its bits would depend on timing): the pack
functions raise ``mpigc.ConfigError`` before any launch (the CPU kernels
too). The 1bit and relative 2bit decode functions too (a thread decodes a
byte with one block's numbers; the CPU's decode assumes it without
checking). A call's
shards are ``gridDim.y``, at most :data:`MAX_GRID_Y` (65535) per launch:
more shards take one launch per 65535.

Execution
---------
Nothing happens at import: no CUDA context, no compilation. Kernels compile
on first launch, once per signature and compute capability, and are cached
on disk (``cache=True``) next to the CPU kernels (``mpigc/_jitcache.py``):
a later process loads PTX and cubin instead of running NVVM and ptxas, and
the ranks of a node compile each kernel once (a lock per kernel and
signature). Launch geometry: integer ceil-division of the work by the
block size, capped at a multiple of the SM count; every kernel loops
grid-stride, warp-uniformly where it shuffles, and none returns early where
lanes must meet. No ``fastmath``. Kernels and copies run on ``cuda_stream``,
by default the legacy default stream named explicitly (:func:`_stream`:
not Numba's ``0``, which is a different stream in every thread when
per-thread default streams are on). Functions that return a value (counts,
stats) read it back once (a synchronisation); the others are asynchronous:
synchronise the stream before MPI reads ``out``.

The simulator
-------------
Numba's CUDA simulator (numba-cuda 0.30) has no warp intrinsics. Under
``NUMBA_ENABLE_CUDASIM=1`` the shuffles and the ballot are Python functions
with the hardware's semantics for a full warp (all 32 lanes meet, exchange,
and meet again; a lane missing from a full-mask warp operation raises instead
of hanging), so the simulator tests run the same kernels.
"""
import collections
import math
import threading

import numpy as np
from numba import cuda

from .. import _jitcache
from . import _driver
from .cpu import check_block_size  # the same preconditions as the CPU kernels
from .cpu import ternary_stream  # the host-side stream hash (pure Python), shared

try:  # numba-cuda
    from numba.cuda.core import config as _config
except ImportError:  # pragma: no cover - numba's bundled CUDA target
    from numba.core import config as _config

__all__ = [
    "pack_2bit", "unpack_2bit", "pack_2bit_shards", "unpack_2bit_shards",
    "pack_1bit", "unpack_1bit", "pack_1bit_shards", "unpack_1bit_shards",
    "pack_2bit_rel", "unpack_2bit_rel", "pack_2bit_rel_shards", "unpack_2bit_rel_shards",
    "stats", "pack_ternary", "pack_ternary_shards", "unpack_ternary_shards",
    "pack_fp16", "unpack_fp16", "unpack_fp16_shards",
    "pack_bf16", "unpack_bf16", "unpack_bf16_shards",
    "count_nonfinite", "ternary_stream",
    "PARALLEL_MIN_ELEMENTS",
]

#: Whether Numba's CUDA simulator runs these kernels (NUMBA_ENABLE_CUDASIM=1).
SIMULATOR = bool(getattr(_config, "ENABLE_CUDASIM", 0))

#: The kernels are cached on disk (``cache=True``) in the folder of the CPU
#: kernels (``mpigc/_jitcache.py``): PTX and cubin per signature and compute
#: capability, compiled by one rank of a node while the others wait and load
#: it. Off in the simulator (nothing to compile) and with MPIGC_CACHE_DIR=off.
_CACHE = False if SIMULATOR else _jitcache.enabled_for_cuda()

#: Kept for symmetry with the CPU module (the dispatch layer may read it);
#: the device kernels are always parallel.
PARALLEL_MIN_ELEMENTS = 0

LANES = 32  # canonical summation order of the 1bit block sums (see kernels/cpu.py)
FULL_MASK = 0xFFFFFFFF

# Geometry. The simulator runs every thread as a Python thread: small blocks
# and a tiny grid there, which also makes the grid-stride loops do several
# rounds in the tests.
THREADS = 64 if SIMULATOR else 256          # threads per CUDA block (a multiple of 32)
WARPS = THREADS // LANES                    # 1bit / relative 2bit: one warp per block
#: ``launch_bounds`` of the kernels launched on THREADS threads (the
#: simulator's ``cuda.jit`` takes no such option)
_BOUNDS = {} if SIMULATOR else {"launch_bounds": (THREADS,)}
_BLOCKS_PER_SM = 32
_SIM_MAX_BLOCKS = 3
_max_blocks_cache = {}


def _max_blocks():
    """Grid cap: a multiple of the current device's SM count."""
    if SIMULATOR:
        return _SIM_MAX_BLOCKS
    cap = _max_blocks_cache.get(_device_id())
    if cap is None:
        dev = cuda.get_current_device()
        cap = _max_blocks_cache[dev.id] = dev.MULTIPROCESSOR_COUNT * _BLOCKS_PER_SM
    return cap


def _grid(work, per_block=THREADS, dev=None):
    """Number of CUDA blocks for ``work`` items, ``per_block`` per block, on
    the current GPU ``dev`` (None: asked; its cap once known is taken from
    the cache without asking the driver again)."""
    cap = _max_blocks_cache.get(dev) or _max_blocks()
    return max(1, min((work + per_block - 1) // per_block, cap))


def _grid2(work, nshard, per_block=THREADS, dev=None):
    """``(blocks per shard, shards)``: ``work`` items in the largest shard
    (``dev``: as :func:`_grid`'s)."""
    cap = max(1, (_max_blocks_cache.get(dev) or _max_blocks()) // max(1, nshard))
    return (max(1, min((work + per_block - 1) // per_block, cap)), nshard)


#: CUDA's limit on ``gridDim.y``, the shards of one launch. A call with more
#: shards (a communicator of more ranks) takes one launch per this many.
MAX_GRID_Y = 65535
_STARTS, _OFFS = object(), object()  # placeholders of _launch_shards' arguments


def _launch_shards(kernel, starts, offs, stream, *args, block=0, dev=None):
    """Launch ``kernel`` over the shards ``starts`` / ``offs`` (shard j is
    ``blockIdx.y``), ``args`` with ``_STARTS`` and ``_OFFS`` standing for the
    bounds as device arrays. ``block``: one warp per quantization block of
    that many elements (1bit, relative 2bit); else one thread per value. One
    launch per :data:`MAX_GRID_Y` shards (one launch below that); none for
    empty shards. ``dev``: the current GPU (:func:`_device_id`; None: asked
    here, once)."""
    if dev is None:
        dev = _device_id()
    m = len(starts) - 1
    for j0 in range(0, m, MAX_GRID_Y):
        st, of = starts[j0:j0 + MAX_GRID_Y + 1], offs[j0:j0 + MAX_GRID_Y]
        big = _max_shard(st)
        if not big:
            continue
        if block:
            blocks = _grid2((big + block - 1) // block, len(st) - 1, WARPS, dev)
        else:
            blocks = _grid2(big, len(st) - 1, dev=dev)
        _launch(kernel, blocks, stream,
                *[_index(st, dev) if a is _STARTS else _index(of, dev) if a is _OFFS else a
                  for a in args])


def _dev(a, what):
    """``a`` as a Numba device array (no copy); ``None`` stays ``None``."""
    if a is None:
        return None
    if getattr(a, "__cuda_ndarray__", False):  # Numba's (or the simulator's) own
        return a
    if isinstance(a, np.ndarray) or not hasattr(a, "__cuda_array_interface__"):
        raise TypeError(f"{what}: expected a CUDA device array, got {type(a).__name__}")
    return cuda.as_cuda_array(a)


_empty_cache = {}


def _opt(a, like):
    """An optional kernel input as the launch takes it: ``(array, True)``, or,
    for ``None``, ``(empty array of like's dtype, False)``. A real launch
    rejects ``None`` (numba-cuda's dispatcher raises ``NotImplementedError``),
    so a kernel never sees it: the flag says whether the array is there."""
    if a is None:
        dt = np.dtype(like.dtype)
        e = _empty_cache.get(dt)
        if e is None:  # a 0-byte array allocates nothing
            e = _empty_cache[dt] = cuda.device_array(0, dt)
        return e, False
    return a, True


_legacy = []


def _stream(stream):
    """The stream of a launch or a copy: ``stream`` (a ``cuda_stream=``
    argument) when given, else the legacy default stream, named explicitly
    (``CU_STREAM_LEGACY``). Not Numba's ``0``: with per-thread default
    streams on (``CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM=1``, which
    numba-cuda's ``NUMBA_CUDA_PER_THREAD_DEFAULT_STREAM`` asks for), ``0``
    is a different stream in every thread, and a call's kernels, launched
    from the caller's thread and from the progress thread, would not be in
    one order, nor waited for by one synchronisation. The legacy stream is
    one per device, and torch's default stream."""
    if stream:
        return stream
    if not _legacy:
        _legacy.append(cuda.legacy_default_stream())
    return _legacy[0]


def default_stream():
    """The stream of ``cuda_stream=0``: the legacy default stream (see
    :func:`_stream`). ``mpigc._cuda`` copies and synchronises on it."""
    return _stream(0)


def _launch(kernel, blocks, stream, *args):
    """Launch ``kernel`` on ``blocks`` CUDA blocks (an int, or ``(blocks per
    shard, shards)``) of ``THREADS`` threads, on ``_stream(stream)``.

    Every launch of this module goes through here, with device arrays and
    numeric scalars only (no ``None``, no host arrays): what a real launch
    accepts. The simulator tests wrap this function to check that contract,
    count the launches and record the argument types that
    ``tests/test_cuda_sim.py`` compiles to PTX. On a GPU the launch goes
    straight to the driver from a kernel's second launch with a set of
    argument types on (:mod:`mpigc.kernels._driver`)."""
    s = _stream(stream)
    if _driver.ON is False or not _driver.launch(kernel, blocks, THREADS, s, args):
        kernel[blocks, THREADS, s](*args)
    _queued[0] += 1


# -- small device buffers: layouts (cached) and counters (pooled) -------------
_lock = threading.Lock()
_INDEX_KEEP = 256
_index_cache = collections.OrderedDict()


def _device_id():
    """The GPU current in the calling thread: the key of the pools and caches
    below. A function of this module that needs it several times asks once
    and passes it to the helpers (their ``dev``), none keeps it past its
    return: the caller may make another GPU current between two calls
    (``cuda.select_device``, ``torch.cuda.set_device``)."""
    if SIMULATOR:
        return 0
    d = _driver.device_id() if _driver.ON is not False else None
    return cuda.get_current_device().id if d is None else d


def _index(values, dev=None):
    """The int64 device array of ``values`` (shard bounds, payload offsets),
    uploaded once per layout and device (``dev``, the current one; None:
    asked): a call with the layout of an earlier one transfers nothing."""
    # (numpy and Python integers of one value hash and compare equal)
    key = (_device_id() if dev is None else dev, tuple(values))
    with _lock:
        a = _index_cache.get(key)
        if a is not None:
            _index_cache.move_to_end(key)
            return a
    a = cuda.to_device(np.asarray(key[1], np.int64))
    with _lock:
        _index_cache[key] = a
        while len(_index_cache) > _INDEX_KEEP:
            _index_cache.popitem(last=False)
    return a


_counters = {}  # device id -> free counters (device int64[1])
_zero_host = {}


def _host_zero():
    z = _zero_host.get("z")
    if z is None:
        z = _zero_host["z"] = (np.zeros(1, np.int64) if SIMULATOR
                               else cuda.pinned_array(1, np.int64))
        z[0] = 0
    return z


def _counter(stream, dev=None):
    """A zeroed device counter (int64[1]) from the pool of the current GPU
    ``dev`` (None: asked): no allocation per call; zeroed by an asynchronous
    copy in stream order."""
    if dev is None:
        dev = _device_id()
    with _lock:
        free = _counters.setdefault(dev, [])
        c = free.pop() if free else None
    if c is None:
        c = cuda.device_array(1, np.int64)
    s = _stream(stream)
    if _driver.ON is False or not _driver.memset0(c, s):
        c.copy_to_device(_host_zero(), stream=s)
    _queued[0] += 1
    return c


# id(array) -> (array, its pinned host twin): for the pooled counters and
# scratch arrays. The entry holds the array, so its id is not reused while
# the entry is there (and the twin is checked to be its array's); a scratch
# array the pool drops takes its twin with it (_give_scratch)
_twins = {}


def _pinned_twin(d):
    t = _twins.get(id(d))
    if t is None or t[0] is not d:
        t = _twins[id(d)] = (d, cuda.pinned_array(d.shape, d.dtype))
    return t[1]


_scratch = {}  # (device id, shape, dtype) -> free device scratch arrays


def _take_scratch(shape, dtype, dev=None):
    """A device array of ``shape`` from the pool of the current GPU ``dev``
    (None: asked; contents undefined): no allocation once a call of that
    shape ran (terngrad's statistics)."""
    key = (_device_id() if dev is None else dev, shape, np.dtype(dtype))
    with _lock:
        free = _scratch.get(key)
        a = free.pop() if free else None
    return cuda.device_array(shape, dtype) if a is None else a


def _give_scratch(a, dev=None):
    """``a`` (from :func:`_take_scratch` on GPU ``dev``, the current one;
    None: asked) is free again: its results were read (a wait for its
    stream), so a later call may write it."""
    if dev is None:
        dev = _device_id()
    with _lock:
        free = _scratch.setdefault((dev, a.shape, np.dtype(a.dtype)), [])
        if len(free) < 4:
            free.append(a)
        else:
            _twins.pop(id(a), None)


_wait_events = threading.local()  # .ev: the thread's host-wait event (Numba's); .seen
#: launches and copies queued on a named stream by this module and ``mpigc._cuda`` so
#: far, counted AFTER each is queued: a thread that reads the count before it records
#: a wait's event knows that its event comes after every one it counted
_queued = [0]


def host_wait(stream, idle_ok=False):
    """Wait on the host for the work queued on ``stream`` (a named stream,
    not ``0``) so far, and no more: an event recorded there and synchronised
    (the driver's on its route, else Numba's, one per thread, made once),
    not the whole stream, which would also wait for what other threads
    queue on it meanwhile. ``idle_ok``: no wait when nothing was queued
    (:data:`_queued`, by any thread) since this thread's last wait on
    ``stream`` (a stream of mpigc's own, which only mpigc queues on)."""
    seen = getattr(_wait_events, "seen", None)
    if seen is None:
        seen = _wait_events.seen = {}
    n = _queued[0]  # (read before the event is recorded)
    if idle_ok and seen.get(id(stream)) == n:
        return
    if _driver.ON is False or not _driver.sync(stream):
        ev = getattr(_wait_events, "ev", None)
        if ev is None:
            ev = _wait_events.ev = cuda.event() if SIMULATOR else cuda.event(timing=False)
        ev.record(stream)
        ev.synchronize()
    seen[id(stream)] = n


def _small_to_host(d, stream):
    """Small device array ``d`` on the host (one wait): on the driver's route
    or a named ``stream``, an asynchronous copy into ``d``'s pinned twin,
    then, on a named stream, one wait for what was queued on it so far
    (:func:`host_wait`); else a synchronous copy (to pageable host memory:
    it returns when it is done)."""
    s = _stream(stream)
    route = _driver.ON or (_driver.ON is None and _driver.enabled())
    if stream:
        host = _pinned_twin(d)
        if not (route and _driver.copy(host, d, s, False)):
            d.copy_to_host(host, stream=s)
        _queued[0] += 1
        host_wait(s)
        return host
    host = _pinned_twin(d) if route else None
    if host is None or not _driver.to_host(host, d, s):
        host = d.copy_to_host(stream=s)
    return host


def _read_count(counter, stream, dev=None):
    """The counter's value: the one device-to-host read (and wait) of a pack;
    the counter then goes back to the pool of ``dev`` (the GPU of
    :func:`_counter`, current; None: asked). On the driver's route, or on a
    named ``stream``: an asynchronous copy into the counter's pinned twin,
    then one wait for what was queued on the stream so far
    (:func:`host_wait`); else a synchronous copy (to pageable host memory:
    it returns when it is done)."""
    host = _small_to_host(counter, stream)
    if dev is None:
        dev = _device_id()
    with _lock:
        _counters.setdefault(dev, []).append(counter)
    return int(host[0])


def _payload_bytes(payload):
    """The payload as uint8 (a uint16 view of fp16 bits, say)."""
    return payload if np.dtype(payload.dtype) == np.uint8 else payload.view(np.uint8)


# ----------------------------------------------------------------------------
# warp intrinsics (full warp); Python emulations in the simulator
# ----------------------------------------------------------------------------
if SIMULATOR:
    _warp_lock = threading.Lock()
    _WARP_TIMEOUT = 120.0

    class _WarpRendezvous:
        """The 32 lanes of one simulated warp meet here: each deposits a value
        and gets all 32. Two slot lists used in turn make one meeting per
        exchange (a lane writes the other list only after every lane has
        arrived at this meeting, and this list again only after every lane
        has read it and arrived at the next). Waiting lanes block on their own
        raw lock, released by the last to arrive: a fraction of the lock
        traffic of ``threading.Barrier``, which is most of the simulator's time
        in the warp kernels."""

        def __init__(self):
            self.slots = ([None] * LANES, [None] * LANES)
            self.phase = [0] * LANES
            self.count = 0
            self.lock = threading.Lock()
            self.waits = [threading.Lock() for _ in range(LANES)]
            for w in self.waits:
                w.acquire()

        def exchange(self, lane, value):
            phase = self.phase[lane]
            self.phase[lane] = phase ^ 1
            mine = self.slots[phase]
            mine[lane] = value
            with self.lock:
                self.count += 1
                last = self.count == LANES
                if last:
                    self.count = 0
            if last:
                for k in range(LANES):
                    if k != lane:
                        self.waits[k].release()
            elif not self.waits[lane].acquire(timeout=_WARP_TIMEOUT):
                raise RuntimeError("a full-warp shuffle or ballot that not all 32 lanes "
                                   "reached")
            return list(mine)

    def _warp_exchange(value):
        """All 32 lanes of the calling thread's warp deposit ``value``; each
        gets its lane and the 32 values. A lane that does not come (a
        divergent full-mask warp operation) is an error, as on the GPU it is
        undefined behaviour."""
        t = threading.current_thread()
        mgr = t._manager
        w, lane = divmod(t.thread_id, LANES)
        with _warp_lock:
            warps = mgr.__dict__.setdefault("_mpigc_warps", {})
            ent = warps.get(w)
            if ent is None:
                ent = warps[w] = _WarpRendezvous()
        return lane, ent.exchange(lane, value)

    def _shfl_xor(v, m):
        lane, vals = _warp_exchange(v)
        return vals[lane ^ m]

    def _shfl_down(v, d):
        lane, vals = _warp_exchange(v)
        return vals[lane + d] if lane + d < LANES else v

    def _shfl_idx(v, src):
        _, vals = _warp_exchange(v)
        return vals[src]

    def _ballot(p):
        _, vals = _warp_exchange(bool(p))
        m = 0
        for lane in range(LANES):
            if vals[lane]:
                m |= 1 << lane
        return np.uint32(m)

    def _brev(m):
        return np.uint32(int("{:032b}".format(int(m))[::-1], 2))
else:
    @cuda.jit(device=True)
    def _shfl_xor(v, m):
        return cuda.shfl_xor_sync(FULL_MASK, v, m)

    @cuda.jit(device=True)
    def _shfl_down(v, d):
        return cuda.shfl_down_sync(FULL_MASK, v, d)

    @cuda.jit(device=True)
    def _shfl_idx(v, src):
        return cuda.shfl_sync(FULL_MASK, v, src)

    @cuda.jit(device=True)
    def _ballot(p):
        return cuda.ballot_sync(FULL_MASK, p)

    @cuda.jit(device=True)
    def _brev(m):
        return cuda.brev(np.uint32(m))


# ----------------------------------------------------------------------------
# products that are never contracted into an fma (ptxas fuses a plain mul.f32
# and a following add/sub by default; the CPU kernels round both)
# ----------------------------------------------------------------------------
if SIMULATOR:
    @cuda.jit(device=True)
    def _fmul_rn(a, b):
        return a * b

    _dmul_rn = _fmul_rn
else:
    from numba.cuda import libdevice as _libdevice

    @cuda.jit(device=True)
    def _fmul_rn(a, b):
        return _libdevice.fmul_rn(a, b)

    @cuda.jit(device=True)
    def _dmul_rn(a, b):
        return _libdevice.dmul_rn(a, b)


# float32 <-> little-endian bytes of a uint8 array (the payload's tail numbers)
@cuda.jit(device=True)
def _put_f32(a, k, f):
    u = np.float32(f).view(np.uint32)
    a[k] = np.uint8(u & np.uint32(0xFF))
    a[k + 1] = np.uint8((u >> np.uint32(8)) & np.uint32(0xFF))
    a[k + 2] = np.uint8((u >> np.uint32(16)) & np.uint32(0xFF))
    a[k + 3] = np.uint8(u >> np.uint32(24))


@cuda.jit(device=True)
def _get_f32(a, k):
    u = np.uint32(a[k])
    u = np.uint32(u | np.uint32(np.uint32(a[k + 1]) << np.uint32(8)))
    u = np.uint32(u | np.uint32(np.uint32(a[k + 2]) << np.uint32(16)))
    u = np.uint32(u | np.uint32(np.uint32(a[k + 3]) << np.uint32(24)))
    return u.view(np.float32)


# ----------------------------------------------------------------------------
# float16 <-> float32 (the CPU kernels' integer conversion, bit for bit)
# ----------------------------------------------------------------------------
@cuda.jit(device=True)
def _f32_to_f16_bits(f):
    """float32 -> IEEE binary16 bits, round to nearest even (as numpy)."""
    u = f.view(np.uint32)
    sign = np.uint32((u >> np.uint32(16)) & np.uint32(0x8000))
    u = np.uint32(u & np.uint32(0x7FFFFFFF))
    if u >= np.uint32(0x47800000):  # >= 65536: inf, or NaN
        o = np.uint32(0x7E00) if u > np.uint32(0x7F800000) else np.uint32(0x7C00)
    elif u < np.uint32(0x38800000):  # below the smallest normal half: subnormal
        magic = np.uint32(0x3F000000)  # 0.5f: aligns the mantissa for rounding
        s = u.view(np.float32) + magic.view(np.float32)
        o = np.uint32(s.view(np.uint32) - magic)
    else:
        odd = np.uint32((u >> np.uint32(13)) & np.uint32(1))
        # u + 0xC8000FFF + odd modulo 2**32 (rebias, round half even), written
        # without the wrap-around: u >= 0x38800000 here
        u = np.uint32(u - np.uint32(0x37FFF001))
        u = np.uint32(u + odd)
        o = np.uint32(u >> np.uint32(13))
    return np.uint16(o | sign)


@cuda.jit(device=True)
def _f16_bits_to_f32(h):
    """IEEE binary16 bits -> float32 (exact)."""
    h = np.uint32(h)
    u = np.uint32((h & np.uint32(0x7FFF)) << np.uint32(13))
    exp = np.uint32(u & np.uint32(0x0F800000))
    u = np.uint32(u + np.uint32(0x38000000))  # (127 - 15) << 23
    if exp == np.uint32(0x0F800000):  # inf / NaN
        f = np.uint32(u + np.uint32(0x38000000)).view(np.float32)
    elif exp == np.uint32(0):  # zero / subnormal
        f = (np.uint32(u + np.uint32(0x00800000)).view(np.float32)
             - np.uint32(0x38800000).view(np.float32))
    else:
        f = u.view(np.float32)
    sign = np.uint32((h & np.uint32(0x8000)) << np.uint32(16))
    return np.uint32(f.view(np.uint32) | sign).view(np.float32)


@cuda.jit(device=True)
def _f32_to_bf16_bits(f):
    """float32 -> bfloat16 bits, round to nearest even; NaN -> ``0x7FC0`` with
    its sign (the CPU kernels' conversion, bit for bit; the NaNs it gets from the
    GPU's arithmetic are positive)."""
    u = f.view(np.uint32)
    if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):  # NaN
        o = np.uint32(((u >> np.uint32(16)) & np.uint32(0x8000)) | np.uint32(0x7FC0))
    else:  # u <= 0xFF800000: the sum does not wrap
        odd = np.uint32((u >> np.uint32(16)) & np.uint32(1))
        u = np.uint32(u + np.uint32(0x7FFF))
        u = np.uint32(u + odd)
        o = np.uint32(u >> np.uint32(16))
    return np.uint16(o)


@cuda.jit(device=True)
def _bf16_bits_to_f32(b):
    """bfloat16 bits -> float32 (exact)."""
    return np.uint32(np.uint32(b) << np.uint32(16)).view(np.float32)


# ----------------------------------------------------------------------------
# shard geometry inside a kernel: shard j = blockIdx.y
# ----------------------------------------------------------------------------
@cuda.jit(device=True)
def _warp_start():
    """Index of lane 0 of this thread's warp in the grid's x dimension."""
    return cuda.blockIdx.x * cuda.blockDim.x + (cuda.threadIdx.x // LANES) * LANES


@cuda.jit(device=True)
def _warp_sum_i(c):
    """The canonical tree over the warp (lane 0 gets the total)."""
    s = LANES // 2
    while s > 0:
        c += _shfl_down(c, s)
        s //= 2
    return c


# ----------------------------------------------------------------------------
# 2bit (MXNet layout): one thread per payload byte (4 values), two bytes a round
# ----------------------------------------------------------------------------
#: Payload bytes of 2bit codes a thread handles in one round of its
#: grid-stride loop (bytes k and k + the grid's thread count: each a
#: coalesced byte store of its warp), 4 values each: the launch puts
#: ``LANES * _VALUES_2BIT`` values on a warp.
_BYTES_2BIT = 2
_U1, _U2, _U3 = np.uint64(1), np.uint64(2), np.uint64(3)
_U4, _U5, _U6, _U7 = np.uint64(4), np.uint64(5), np.uint64(6), np.uint64(7)
_VALUES_2BIT = 4 * _BYTES_2BIT


@cuda.jit(device=True)
def _code_2bit(x, e_in, has_e_in, e_out, has_e_out, i, t_pos, t_neg, d_pos, d_neg, zero):
    """The 2bit code of ``x[i] (+ e_in[i])`` against the thresholds ``t_pos`` /
    ``t_neg``, which decode to ``d_pos`` / ``d_neg`` (the thresholds themselves
    in MXNet's mode, the block's mean magnitude in the relative one); the
    residual goes to ``e_out[i]``. Returns (code, 1 if the value is not finite)."""
    val = x[i]
    if has_e_in:
        val = val + e_in[i]
    return _code_of(val, True, e_out, has_e_out, i, t_pos, t_neg, d_pos, d_neg, zero)


@cuda.jit(device=True)
def _code_of(val, inside, e_out, has_e_out, i, t_pos, t_neg, d_pos, d_neg, zero):
    """The code of the value ``val`` (``x[i] + e_in[i]``), as
    :func:`_code_2bit`; ``inside`` false (a pad past the shard): code ``00``,
    no residual, not counted."""
    if not inside:
        return 0, 0
    pos = val >= t_pos
    neg = val <= t_neg
    d = d_pos if pos else (d_neg if neg else zero)
    if has_e_out:
        e_out[i] = val - d
    return (3 if pos else (2 if neg else 0)), (1 if (val - val) != zero else 0)


@cuda.jit(device=True)
def _load8(x, e_in, has_e_in, lo, n, v, v2):
    """``x + e_in`` at the values ``v`` .. ``v + 3`` and ``v2`` .. ``v2 + 3``
    (``v < v2``) of the shard ``lo``, ``n`` (> 0): loads only, no store
    between them, all 8 (16 with ``e_in``) issued at once. Where ``v2``'s
    byte is not whole (the shard's last byte, or past the shard), an index
    past the shard is clamped to its last value (a load in bounds, its value
    dropped by :func:`_codes4`). Indices are unsigned (no negative-index
    wrap-around per load): a whole byte's 4 loads are one address plus
    constant offsets."""
    i = np.uint64(lo + v)
    i2 = np.uint64(lo + v2)
    if v2 + 3 < n:
        a0, a1, a2, a3 = _load4_at(x, e_in, has_e_in, i, i + _U1, i + _U2, i + _U3)
        b0, b1, b2, b3 = _load4_at(x, e_in, has_e_in, i2, i2 + _U1, i2 + _U2, i2 + _U3)
    else:
        last = np.uint64(lo + n - 1)
        a0, a1, a2, a3 = _load4_at(x, e_in, has_e_in, min(i, last), min(i + _U1, last),
                                   min(i + _U2, last), min(i + _U3, last))
        b0, b1, b2, b3 = _load4_at(x, e_in, has_e_in, min(i2, last), min(i2 + _U1, last),
                                   min(i2 + _U2, last), min(i2 + _U3, last))
    return a0, a1, a2, a3, b0, b1, b2, b3


@cuda.jit(device=True)
def _load4_at(x, e_in, has_e_in, i0, i1, i2, i3):
    a0 = x[i0]
    a1 = x[i1]
    a2 = x[i2]
    a3 = x[i3]
    if has_e_in:
        a0 = a0 + e_in[i0]
        a1 = a1 + e_in[i1]
        a2 = a2 + e_in[i2]
        a3 = a3 + e_in[i3]
    return a0, a1, a2, a3


@cuda.jit(device=True)
def _codes4(a0, a1, a2, a3, e_out, has_e_out, lo, n, v, t_pos, t_neg, d_pos, d_neg, zero):
    """(payload byte, non-finite count) of the values ``v`` .. ``v + 3``
    (``a0`` .. ``a3``, from :func:`_load4`): codes MSB first, residuals to
    ``e_out``; values at or past ``n`` pad with ``00``."""
    i = np.uint64(lo + v)
    c0, b0 = _code_of(a0, v < n, e_out, has_e_out, i, t_pos, t_neg, d_pos, d_neg, zero)
    c1, b1 = _code_of(a1, v + 1 < n, e_out, has_e_out, i + _U1, t_pos, t_neg, d_pos, d_neg,
                      zero)
    c2, b2 = _code_of(a2, v + 2 < n, e_out, has_e_out, i + _U2, t_pos, t_neg, d_pos, d_neg,
                      zero)
    c3, b3 = _code_of(a3, v + 3 < n, e_out, has_e_out, i + _U3, t_pos, t_neg, d_pos, d_neg,
                      zero)
    return (c0 << 6) | (c1 << 4) | (c2 << 2) | c3, b0 + b1 + b2 + b3


@cuda.jit(device=True)
def _byte_of_codes(code, sh):
    """The byte of 4 consecutive lanes' codes (lane 4k+m shifted by ``sh`` =
    6 - 2m), assembled by two shuffles; every lane of the warp must call it."""
    c = np.int32(code << sh)
    c |= _shfl_xor(c, 1)
    c |= _shfl_xor(c, 2)
    return c


@cuda.jit(cache=_CACHE, **_BOUNDS)
def _pack_2bit_kernel(x, e_in, has_e_in, e_out, has_e_out, out, starts, offs, t, nbad_out):
    j = cuda.blockIdx.y
    lo = starts[j]
    n = starts[j + 1] - lo
    ob = offs[j]
    nb = (n + 3) // 4
    neg_t = -t
    zero = t - t
    step = cuda.gridDim.x * cuda.blockDim.x
    nbad = 0
    # bytes k and k2 = k + step: all their loads first, then codes and stores
    for k in range(cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x, nb, 2 * step):
        k2 = k + step
        a0, a1, a2, a3, b0, b1, b2, b3 = _load8(x, e_in, has_e_in, lo, n, 4 * k, 4 * k2)
        c, bad = _codes4(a0, a1, a2, a3, e_out, has_e_out, lo, n, 4 * k, t, neg_t, t, neg_t,
                         zero)
        out[ob + k] = c
        c2, bad2 = _codes4(b0, b1, b2, b3, e_out, has_e_out, lo, n, 4 * k2, t, neg_t, t,
                           neg_t, zero)
        if k2 < nb:
            out[ob + k2] = c2
        nbad += bad + bad2
    if nbad:
        cuda.atomic.add(nbad_out, 0, nbad)


@cuda.jit(device=True)
def _decode4(p, t, neg_t, zero):
    """The 4 values of the 2bit payload byte ``p`` (MSB first)."""
    c0 = (p >> 6) & 3
    c1 = (p >> 4) & 3
    c2 = (p >> 2) & 3
    c3 = p & 3
    return (t if c0 == 3 else (neg_t if c0 == 2 else zero),
            t if c1 == 3 else (neg_t if c1 == 2 else zero),
            t if c2 == 3 else (neg_t if c2 == 2 else zero),
            t if c3 == 3 else (neg_t if c3 == 2 else zero))


@cuda.jit(device=True)
def _add4(a0, a1, a2, a3, p, t, neg_t, zero):
    """``a0`` .. ``a3`` plus the 4 values of the payload byte ``p``."""
    d0, d1, d2, d3 = _decode4(p, t, neg_t, zero)
    return a0 + d0, a1 + d1, a2 + d2, a3 + d3


@cuda.jit(device=True)
def _store4(out, lo, n, v, a0, a1, a2, a3):
    """``out`` at the values ``v`` .. ``v + 3`` of the shard, those before ``n``."""
    i = np.uint64(lo + v)
    out[i] = a0  # v < n: v is a payload byte's first value
    if v + 1 < n:
        out[i + _U1] = a1
    if v + 2 < n:
        out[i + _U2] = a2
    if v + 3 < n:
        out[i + _U3] = a3


@cuda.jit(cache=_CACHE, **_BOUNDS)
def _unpack_2bit_kernel(payload, stride, nsrc, starts, offs, out, t, accumulate):
    j = cuda.blockIdx.y
    lo = starts[j]
    n = starts[j + 1] - lo
    ob = offs[j]
    nb = (n + 3) // 4
    neg_t = -t
    zero = t - t
    step = cuda.gridDim.x * cuda.blockDim.x
    # bytes k and k2 = k + step (a k2 past the shard reads its last byte and
    # stores nothing); every sender's values summed in rank order, two
    # senders' bytes loaded before their sums
    for k in range(cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x, nb, 2 * step):
        k2 = k + step
        q = min(k2, nb - 1)
        s = 0
        if accumulate:
            a0, a1, a2, a3, b0, b1, b2, b3 = _load8(out, out, False, lo, n, 4 * k, 4 * k2)
        else:  # sender 0 written, not added to 0 (a -0.0 stays -0.0)
            a0, a1, a2, a3 = _decode4(payload[ob + k], t, neg_t, zero)
            b0, b1, b2, b3 = _decode4(payload[ob + q], t, neg_t, zero)
            s = 1
        while s + 1 < nsrc:
            p = ob + s * stride
            pa = payload[p + k]
            pb = payload[p + q]
            pa2 = payload[p + stride + k]
            pb2 = payload[p + stride + q]
            a0, a1, a2, a3 = _add4(a0, a1, a2, a3, pa, t, neg_t, zero)
            b0, b1, b2, b3 = _add4(b0, b1, b2, b3, pb, t, neg_t, zero)
            a0, a1, a2, a3 = _add4(a0, a1, a2, a3, pa2, t, neg_t, zero)
            b0, b1, b2, b3 = _add4(b0, b1, b2, b3, pb2, t, neg_t, zero)
            s += 2
        if s < nsrc:
            p = ob + s * stride
            pa = payload[p + k]
            pb = payload[p + q]
            a0, a1, a2, a3 = _add4(a0, a1, a2, a3, pa, t, neg_t, zero)
            b0, b1, b2, b3 = _add4(b0, b1, b2, b3, pb, t, neg_t, zero)
        _store4(out, lo, n, 4 * k, a0, a1, a2, a3)
        if k2 < nb:
            _store4(out, lo, n, 4 * k2, b0, b1, b2, b3)


def _layout(starts, offs):
    starts = tuple(int(v) for v in starts)
    offs = tuple(int(v) for v in offs)
    if len(offs) < len(starts) - 1:
        raise ValueError(f"offs: expected {len(starts) - 1} payload offsets, got {len(offs)}")
    return starts, offs


def _max_shard(starts):
    return max([b - a for a, b in zip(starts[:-1], starts[1:])] + [0])


def pack_2bit_shards(x, e_in, e_out, payload, starts, offs, threshold, *, cuda_stream=0):
    """:func:`pack_2bit` of every shard ``x[starts[j]:starts[j + 1]]`` into
    ``payload[offs[j]:]`` (each shard from bit 0), in one launch. Returns
    the non-finite count of all shards."""
    x, e_in, e_out = _dev(x, "x"), _dev(e_in, "e_in"), _dev(e_out, "e_out")
    payload = _dev(payload, "payload")
    starts, offs = _layout(starts, offs)
    t = x.dtype.type(threshold)
    if not _max_shard(starts):
        return 0
    dev = _device_id()
    cnt = _counter(cuda_stream, dev)
    _launch_shards(_pack_2bit_kernel, starts, offs, cuda_stream,
                   x, *_opt(e_in, x), *_opt(e_out, x), payload, _STARTS, _OFFS, t, cnt,
                   block=LANES * _VALUES_2BIT, dev=dev)
    return _read_count(cnt, cuda_stream, dev)


def unpack_2bit_shards(payload, stride, nsrc, starts, offs, out, threshold, accumulate, *,
                       cuda_stream=0):
    """Decode shard j of ``nsrc`` payloads (sender s's at
    ``payload[s * stride + offs[j]:]``) onto ``out[starts[j]:starts[j + 1]]``:
    written (``accumulate`` false: sender 0 written, the others added) or
    added, senders in order, one launch. Asynchronous."""
    payload, out = _dev(payload, "payload"), _dev(out, "out")
    starts, offs = _layout(starts, offs)
    t = out.dtype.type(threshold)
    if nsrc:
        _launch_shards(_unpack_2bit_kernel, starts, offs, cuda_stream,
                       payload, int(stride), int(nsrc), _STARTS, _OFFS, out, t,
                       bool(accumulate), block=LANES * _VALUES_2BIT)


def pack_2bit(x, e_in, e_out, out, threshold, *, cuda_stream=0):
    """Quantize ``x + e_in`` to 2-bit codes (MXNet layout) into ``out``.

    ``out`` is uint8 of ``ceil(n / 4)`` bytes. Returns the non-finite count.
    """
    x = _dev(x, "x")
    return pack_2bit_shards(x, e_in, e_out, out, (0, x.size), (0,), threshold,
                            cuda_stream=cuda_stream)


def unpack_2bit(payload, out, threshold, accumulate, *, cuda_stream=0):
    """Decode ``out.size`` 2-bit codes: ``11`` -> +t, ``10`` -> -t, else 0.

    Writes into ``out``, or adds to it when ``accumulate`` is true.
    Asynchronous on ``cuda_stream``.
    """
    out = _dev(out, "out")
    unpack_2bit_shards(payload, 0, 1, (0, out.size), (0,), out, threshold, accumulate,
                       cuda_stream=cuda_stream)


# ----------------------------------------------------------------------------
# 1bit (Seide et al.): one warp per quantization block
# ----------------------------------------------------------------------------
#: Rows of 32 values a 1bit warp loads before it sums them (pass 1) or
#: ballots their signs (pass 2): one value per row and lane.
_ROWS_1BIT = 4
_U32, _U64, _U96 = np.uint64(32), np.uint64(64), np.uint64(96)


@cuda.jit(device=True)
def _rows4(x, e_in, has_e_in, lo, b1, v):
    """``x + e_in`` at the block values ``v``, ``v + 32``, ``v + 64``,
    ``v + 96`` (a lane's values of 4 rows): loads only, all issued at once;
    an index at or past the block's end ``b1`` is clamped to its last value
    (loaded, then dropped by the caller)."""
    last = np.uint64(lo + b1 - 1)
    i = np.uint64(lo + v)
    return _load4_at(x, e_in, has_e_in, min(i, last), min(i + _U32, last),
                     min(i + _U64, last), min(i + _U96, last))


@cuda.jit(device=True)
def _sum_signs(a, b, c, val, inside, zero):
    """One value into a lane's float64 sums of the values ``>= 0`` (``a``)
    and ``< 0`` (``b``) and its count of the first (``c``), as
    ``kernels/cpu.py`` adds them (a 0.0 for the other class)."""
    if inside:
        p = val >= zero
        f = np.float64(val)
        a += f if p else 0.0
        b += 0.0 if p else f
        c += 1 if p else 0
    return a, b, c


@cuda.jit(device=True)
def _sign_row(val, v, r0, b1, lane, lo, e_out, has_e_out, d1, d0, zero, bits, ob):
    """Row ``r0`` of a 1bit block (this lane's value ``val`` at ``v``, when
    ``v < b1``): the residual, the row's 4 bytes of signs by one ballot.
    Every lane of the warp calls it. Returns 1 if the value is not finite."""
    p = False
    bad = 0
    if v < b1:
        p = val >= zero
        if has_e_out:
            e_out[lo + v] = val - (d1 if p else d0)
        bad = 1 if (val - val) != zero else 0
    # element r0 + q is ballot bit q; reversed, element r0 + 8 m + q sits in
    # bit 31 - 8 m - q: byte m, MSB first
    m = np.uint32(_brev(_ballot(p)))
    if lane < 4 and r0 + 8 * lane < b1:
        bits[ob + (r0 >> 3) + lane] = np.uint8(
            (m >> np.uint32(24 - 8 * lane)) & np.uint32(0xFF))
    return bad


@cuda.jit(cache=_CACHE, **_BOUNDS)
def _pack_1bit_kernel(x, e_in, has_e_in, e_out, has_e_out, bits, tail, inline, starts, offs,
                      block, nbad_out):
    j = cuda.blockIdx.y
    lo = starts[j]
    n = starts[j + 1] - lo
    ob = offs[j]
    to = ob + (n + 7) // 8 if inline else ob  # the pairs: after the bits, or apart
    nblk = (n + block - 1) // block
    zero = x.dtype.type(0)
    lane = cuda.threadIdx.x % LANES
    nbad = 0
    for k in range(_warp_start() // LANES, nblk, cuda.gridDim.x * cuda.blockDim.x // LANES):
        b0 = k * block
        b1 = min(n, b0 + block)
        # pass 1: lane l sums elements b0+l, b0+l+32, ... sequentially, the
        # values of 4 rows loaded before their sums
        a = 0.0
        b = 0.0
        c = 0
        for v in range(b0 + lane, b1, _ROWS_1BIT * LANES):
            f0, f1, f2, f3 = _rows4(x, e_in, has_e_in, lo, b1, v)
            a, b, c = _sum_signs(a, b, c, f0, True, zero)
            a, b, c = _sum_signs(a, b, c, f1, v + LANES < b1, zero)
            a, b, c = _sum_signs(a, b, c, f2, v + 2 * LANES < b1, zero)
            a, b, c = _sum_signs(a, b, c, f3, v + 3 * LANES < b1, zero)
        s = LANES // 2
        while s > 0:  # the canonical pairwise tree: sum[l] += sum[l + s]
            a += _shfl_down(a, s)
            b += _shfl_down(b, s)
            c += _shfl_down(c, s)
            s //= 2
        a = _shfl_idx(a, 0)
        b = _shfl_idx(b, 0)
        npos = _shfl_idx(c, 0)
        nneg = (b1 - b0) - npos
        m1 = np.float32(a / npos) if npos > 0 else np.float32(0.0)
        m0 = np.float32(b / nneg) if nneg > 0 else np.float32(0.0)
        if lane == 0:
            _put_f32(tail, to + 8 * k, m0)
        elif lane == 1:
            _put_f32(tail, to + 8 * k + 4, m1)
        d1 = x.dtype.type(m1)
        d0 = x.dtype.type(m0)
        # pass 2 (the block was just read: in cache), 4 rows loaded at once,
        # then row by row: residuals, signs by ballot (warp-uniform loop)
        kbad = 0
        for r0 in range(b0, b1, _ROWS_1BIT * LANES):
            v = r0 + lane
            f0, f1, f2, f3 = _rows4(x, e_in, has_e_in, lo, b1, v)
            kbad += _sign_row(f0, v, r0, b1, lane, lo, e_out, has_e_out, d1, d0, zero, bits,
                              ob)
            kbad += _sign_row(f1, v + LANES, r0 + LANES, b1, lane, lo, e_out, has_e_out, d1,
                              d0, zero, bits, ob)
            kbad += _sign_row(f2, v + 2 * LANES, r0 + 2 * LANES, b1, lane, lo, e_out,
                              has_e_out, d1, d0, zero, bits, ob)
            kbad += _sign_row(f3, v + 3 * LANES, r0 + 3 * LANES, b1, lane, lo, e_out,
                              has_e_out, d1, d0, zero, bits, ob)
        kbad = _warp_sum_i(kbad)
        if lane == 0:
            # finite values whose mean is beyond float32: each such mean is
            # one bad value
            if kbad == 0:
                kbad = (0 if math.isfinite(m0) else 1) + (0 if math.isfinite(m1) else 1)
            nbad += kbad
    if nbad:
        cuda.atomic.add(nbad_out, 0, nbad)


@cuda.jit(device=True)
def _bits8(a0, a1, a2, a3, a4, a5, a6, a7, p, d0, d1, first):
    """``a0`` .. ``a7`` plus (or, with ``first``, set to) the values of the
    1bit byte ``p`` (MSB first): ``d1`` for a bit 1, ``d0`` for a 0."""
    e0 = d1 if (p >> 7) & 1 else d0
    e1 = d1 if (p >> 6) & 1 else d0
    e2 = d1 if (p >> 5) & 1 else d0
    e3 = d1 if (p >> 4) & 1 else d0
    e4 = d1 if (p >> 3) & 1 else d0
    e5 = d1 if (p >> 2) & 1 else d0
    e6 = d1 if (p >> 1) & 1 else d0
    e7 = d1 if p & 1 else d0
    if first:
        return e0, e1, e2, e3, e4, e5, e6, e7
    return a0 + e0, a1 + e1, a2 + e2, a3 + e3, a4 + e4, a5 + e5, a6 + e6, a7 + e7


@cuda.jit(device=True)
def _store_at(out, i, v, n, a):
    if v < n:
        out[i] = a


@cuda.jit(cache=_CACHE, **_BOUNDS)
def _unpack_1bit_kernel(bits, tail, inline, stride, nsrc, starts, offs, out, block,
                        accumulate):
    j = cuda.blockIdx.y
    lo = starts[j]
    n = starts[j + 1] - lo
    ob = offs[j]
    to = ob + (n + 7) // 8 if inline else ob
    zero = out.dtype.type(0)
    # one thread per byte of bits: its 8 values in one block (block_size is a
    # multiple of 8, checked by the launching functions)
    nb = (n + 7) // 8
    last = np.uint64(lo + n - 1)
    for k in range(cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x, nb,
                   cuda.gridDim.x * cuda.blockDim.x):
        v = 8 * k
        i = np.uint64(lo + v)
        mk = to + 8 * (v // block)
        a0, a1, a2, a3, a4, a5, a6, a7 = zero, zero, zero, zero, zero, zero, zero, zero
        if accumulate:  # out loaded once (past the shard: its last value, dropped)
            a0, a1, a2, a3 = _load4_at(out, out, False, min(i, last), min(i + _U1, last),
                                       min(i + _U2, last), min(i + _U3, last))
            a4, a5, a6, a7 = _load4_at(out, out, False, min(i + _U4, last),
                                       min(i + _U5, last), min(i + _U6, last),
                                       min(i + _U7, last))
        for s in range(nsrc):  # senders in rank order
            base = s * stride
            # the byte and both means loaded at once, the mean picked after
            p = bits[base + ob + k]
            d0 = out.dtype.type(_get_f32(tail, base + mk))
            d1 = out.dtype.type(_get_f32(tail, base + mk + 4))
            a0, a1, a2, a3, a4, a5, a6, a7 = _bits8(a0, a1, a2, a3, a4, a5, a6, a7, p,
                                                    d0, d1, s == 0 and not accumulate)
        out[i] = a0  # v < n: a byte's first value
        _store_at(out, i + _U1, v + 1, n, a1)
        _store_at(out, i + _U2, v + 2, n, a2)
        _store_at(out, i + _U3, v + 3, n, a3)
        _store_at(out, i + _U4, v + 4, n, a4)
        _store_at(out, i + _U5, v + 5, n, a5)
        _store_at(out, i + _U6, v + 6, n, a6)
        _store_at(out, i + _U7, v + 7, n, a7)


def pack_1bit_shards(x, e_in, e_out, payload, starts, offs, block_size, *, cuda_stream=0):
    """:func:`pack_1bit` of every shard into ``payload[offs[j]:]``: its bits,
    then its reconstruction pairs as little-endian float32 (the wire
    format), in one launch. Returns the bad count of all shards."""
    block_size = check_block_size(block_size, 8, "pack_1bit_shards")
    x, e_in, e_out = _dev(x, "x"), _dev(e_in, "e_in"), _dev(e_out, "e_out")
    payload = _dev(payload, "payload")
    starts, offs = _layout(starts, offs)
    return _pack_1bit(x, e_in, e_out, payload, payload, True, starts, offs, block_size,
                      cuda_stream)


def _pack_1bit(x, e_in, e_out, bits, tail, inline, starts, offs, block, stream):
    if not _max_shard(starts):
        return 0
    dev = _device_id()
    cnt = _counter(stream, dev)
    _launch_shards(_pack_1bit_kernel, starts, offs, stream,
                   x, *_opt(e_in, x), *_opt(e_out, x), bits, tail, bool(inline),
                   _STARTS, _OFFS, int(block), cnt, block=block, dev=dev)
    return _read_count(cnt, stream, dev)


def unpack_1bit_shards(payload, stride, nsrc, starts, offs, out, block_size, accumulate, *,
                       cuda_stream=0):
    """Decode 1bit shards (bits, then pairs) of ``nsrc`` payloads onto ``out``
    (as :func:`unpack_2bit_shards`), one launch. Asynchronous."""
    block_size = check_block_size(block_size, 8, "unpack_1bit_shards")  # a byte: 1 block
    payload, out = _dev(payload, "payload"), _dev(out, "out")
    starts, offs = _layout(starts, offs)
    if nsrc:
        _launch_shards(_unpack_1bit_kernel, starts, offs, cuda_stream,
                       payload, payload, True, int(stride), int(nsrc), _STARTS, _OFFS, out,
                       int(block_size), bool(accumulate), block=LANES * 8)


def pack_1bit(x, e_in, e_out, bits, means, block_size, *, cuda_stream=0):
    """Sign bits of ``x + e_in`` into ``bits`` (uint8, ``ceil(n/8)``) and the
    per-block reconstruction pairs into ``means`` (float32, 2 per block).

    ``block_size`` must be a positive multiple of 8 (else a ``ConfigError``,
    before any launch: two warps would write one byte). Returns the
    non-finite count.
    """
    block_size = check_block_size(block_size, 8, "pack_1bit")
    x, e_in, e_out = _dev(x, "x"), _dev(e_in, "e_in"), _dev(e_out, "e_out")
    bits, means = _dev(bits, "bits"), _dev(means, "means")
    return _pack_1bit(x, e_in, e_out, bits, _payload_bytes(means), False, (0, x.size), (0,),
                      block_size, cuda_stream)


def unpack_1bit(bits, means, out, block_size, accumulate, *, cuda_stream=0):
    """Decode ``out.size`` 1-bit values with their block pairs (asynchronous).
    ``block_size``: a positive multiple of 8, as the pack's (else a
    ``ConfigError``)."""
    block_size = check_block_size(block_size, 8, "unpack_1bit")
    bits, means, out = _dev(bits, "bits"), _dev(means, "means"), _dev(out, "out")
    _launch_shards(_unpack_1bit_kernel, (0, out.size), (0,), cuda_stream,
                   bits, _payload_bytes(means), False, 0, 1, _STARTS, _OFFS, out,
                   int(block_size), bool(accumulate), block=LANES * 8)


# ----------------------------------------------------------------------------
# 2bit, relative mode: one warp per quantization block (as 1bit)
# ----------------------------------------------------------------------------
@cuda.jit(device=True)
def _sum_selected(a, c, val, inside, tc, neg_tc):
    """One value into a lane's float64 sum of the selected ``|v|`` and its
    count (relative 2bit, pass 2)."""
    if inside:
        sel = (val >= tc) or (val <= neg_tc)
        a += abs(np.float64(val)) if sel else 0.0
        c += 1 if sel else 0
    return a, c


@cuda.jit(device=True)
def _sum_square(a, val, inside):
    """One value's float64 square (``mul.rn``) into a lane's sum (relative
    2bit, pass 1)."""
    if inside:
        f = np.float64(val)
        a += _dmul_rn(f, f)
    return a


@cuda.jit(device=True)
def _rel_selected_sum(x, e_in, has_e_in, lo, b0, b1, lane, tc):
    """(A, count) of the block's values selected by ``tc`` (``v >= tc`` or
    ``v <= -tc``), in every lane: lane l sums the float64 |v| of the selected
    b0+l, b0+l+32, ... in order, then the canonical tree; every lane of the
    warp must call it."""
    neg_tc = -tc
    a = 0.0
    c = 0
    for v in range(b0 + lane, b1, _ROWS_1BIT * LANES):  # 4 rows loaded at once
        f0, f1, f2, f3 = _rows4(x, e_in, has_e_in, lo, b1, v)
        a, c = _sum_selected(a, c, f0, True, tc, neg_tc)
        a, c = _sum_selected(a, c, f1, v + LANES < b1, tc, neg_tc)
        a, c = _sum_selected(a, c, f2, v + 2 * LANES < b1, tc, neg_tc)
        a, c = _sum_selected(a, c, f3, v + 3 * LANES < b1, tc, neg_tc)
    s = LANES // 2
    while s > 0:  # the same tree
        a += _shfl_down(a, s)
        c += _shfl_down(c, s)
        s //= 2
    return _shfl_idx(a, 0), _shfl_idx(c, 0)


@cuda.jit(cache=_CACHE)
def _pack_2bit_rel_kernel(x, e_in, has_e_in, e_out, has_e_out, out, tail, inline, starts,
                          offs, rel, block, nbad_out):
    j = cuda.blockIdx.y
    lo = starts[j]
    n = starts[j + 1] - lo
    ob = offs[j]
    to = ob + (n + 3) // 4 if inline else ob  # the magnitudes: after the codes
    nblk = (n + block - 1) // block
    zero = x.dtype.type(0)
    nan = x.dtype.type(np.nan)
    lane = cuda.threadIdx.x % LANES
    nbad = 0
    for k in range(_warp_start() // LANES, nblk, cuda.gridDim.x * cuda.blockDim.x // LANES):
        b0 = k * block
        b1 = min(n, b0 + block)
        # pass 1: lane l sums the squares of b0+l, b0+l+32, ... in order, 4
        # rows loaded at once
        a = 0.0
        for v in range(b0 + lane, b1, _ROWS_1BIT * LANES):
            f0, f1, f2, f3 = _rows4(x, e_in, has_e_in, lo, b1, v)
            a = _sum_square(a, f0, True)
            a = _sum_square(a, f1, v + LANES < b1)
            a = _sum_square(a, f2, v + 2 * LANES < b1)
            a = _sum_square(a, f3, v + 3 * LANES < b1)
        s = LANES // 2
        while s > 0:  # the canonical pairwise tree
            a += _shfl_down(a, s)
            s //= 2
        a = _shfl_idx(a, 0)
        t32 = np.float32(_dmul_rn(rel, math.sqrt(a / (b1 - b0))))
        tc = nan
        if t32 > np.float32(0.0):
            tc = x.dtype.type(t32)  # else (t_b = 0 or NaN) nothing selected
        # pass 2: lane l sums |v| of the selected b0+l, b0+l+32, ... in order
        a, cnt = _rel_selected_sum(x, e_in, has_e_in, lo, b0, b1, lane, tc)
        # (warp-uniform: cnt and t32 are the same in every lane)
        if cnt == 0 and math.isfinite(t32) and t32 > np.float32(0.0):
            # nothing reaches c * rms: the fallback threshold
            # dtype(float64(max|v|) / max(c, 1)) (max|v| itself should it
            # round to 0) selects at least the largest values, as the CPU's.
            # t_b is finite: so are the values. The max of |v| is an integer
            # max of the bits of float64(|v|) (ordered as the values for
            # non-negative finite floats; exact): a float compare-and-select
            # would become max.f64, which tests/test_cuda_sim.py bans
            mb = np.int64(0)
            for v in range(b0 + lane, b1, LANES):
                i = lo + v
                val = x[i]
                if has_e_in:
                    val = val + e_in[i]
                ab = np.float64(abs(val)).view(np.int64)
                if ab > mb:
                    mb = ab
            s = LANES // 2
            while s > 0:
                o = _shfl_down(mb, s)
                if o > mb:
                    mb = o
                s //= 2
            mf = np.int64(_shfl_idx(mb, 0)).view(np.float64)
            # (a branch, not max(rel, 1.0): NVVM would make that a max.f64)
            tc = x.dtype.type(mf)
            if rel > 1.0:
                tc = x.dtype.type(mf / rel)
            if not tc > zero:
                tc = x.dtype.type(mf)
            a, cnt = _rel_selected_sum(x, e_in, has_e_in, lo, b0, b1, lane, tc)
        neg_tc = -tc
        r32 = np.float32(0.0)
        if cnt > 0:
            r32 = np.float32(a / cnt)  # the mean magnitude r_b
        if lane == 0:
            _put_f32(tail, to + 4 * k, r32)
        td = x.dtype.type(r32)
        neg_td = -td
        # pass 3, as _pack_2bit_kernel within the block: a lane codes payload
        # byte q (b0 is a multiple of 4: the shard's bytes), its loads first
        kbad = 0
        for q in range(b0 // 4 + lane, (b1 + 3) // 4, LANES):
            i = np.uint64(lo + 4 * q)
            last = np.uint64(lo + b1 - 1)
            a0, a1, a2, a3 = _load4_at(x, e_in, has_e_in, i, min(i + _U1, last),
                                       min(i + _U2, last), min(i + _U3, last))
            cc, bad = _codes4(a0, a1, a2, a3, e_out, has_e_out, lo, b1, 4 * q, tc, neg_tc,
                              td, neg_td, zero)
            out[ob + q] = cc
            kbad += bad
        kbad = _warp_sum_i(kbad)
        if lane == 0:
            # finite values whose threshold or mean magnitude is not finite:
            # one bad value
            if kbad == 0 and not (math.isfinite(t32) and math.isfinite(r32)):
                kbad = 1
            nbad += kbad
    if nbad:
        cuda.atomic.add(nbad_out, 0, nbad)


@cuda.jit(cache=_CACHE, **_BOUNDS)
def _unpack_2bit_rel_kernel(payload, tail, inline, stride, nsrc, starts, offs, out, block,
                            accumulate):
    j = cuda.blockIdx.y
    lo = starts[j]
    n = starts[j + 1] - lo
    ob = offs[j]
    to = ob + (n + 3) // 4 if inline else ob
    zero = out.dtype.type(0)
    nb = (n + 3) // 4
    last = np.uint64(lo + n - 1)
    # one thread per payload byte: its 4 values in one block (block_size is a
    # multiple of 4, checked by the launching functions)
    for k in range(cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x, nb,
                   cuda.gridDim.x * cuda.blockDim.x):
        v = 4 * k
        i = np.uint64(lo + v)
        mk = to + 4 * (v // block)
        a0, a1, a2, a3 = zero, zero, zero, zero
        if accumulate:  # out loaded once (past the shard: its last value, dropped)
            a0, a1, a2, a3 = _load4_at(out, out, False, i, min(i + _U1, last),
                                       min(i + _U2, last), min(i + _U3, last))
        for s in range(nsrc):  # senders in rank order
            base = s * stride
            p = payload[base + ob + k]
            t = out.dtype.type(_get_f32(tail, base + mk))  # loaded with the byte
            if s == 0 and not accumulate:
                a0, a1, a2, a3 = _decode4(p, t, -t, zero)
            else:
                a0, a1, a2, a3 = _add4(a0, a1, a2, a3, p, t, -t, zero)
        _store4(out, lo, n, v, a0, a1, a2, a3)


def _pack_2bit_rel(x, e_in, e_out, out, tail, inline, starts, offs, rel, block, stream):
    if not _max_shard(starts):
        return 0
    dev = _device_id()
    cnt = _counter(stream, dev)
    _launch_shards(_pack_2bit_rel_kernel, starts, offs, stream,
                   x, *_opt(e_in, x), *_opt(e_out, x), out, tail, bool(inline),
                   _STARTS, _OFFS, float(rel), int(block), cnt, block=block, dev=dev)
    return _read_count(cnt, stream, dev)


def pack_2bit_rel_shards(x, e_in, e_out, payload, starts, offs, rel_threshold, block_size,
                         *, cuda_stream=0):
    """:func:`pack_2bit_rel` of every shard into ``payload[offs[j]:]``: its
    codes, then its block magnitudes as little-endian float32, one launch.
    Returns the bad count of all shards."""
    block_size = check_block_size(block_size, 4, "pack_2bit_rel_shards")
    x, e_in, e_out = _dev(x, "x"), _dev(e_in, "e_in"), _dev(e_out, "e_out")
    payload = _dev(payload, "payload")
    starts, offs = _layout(starts, offs)
    return _pack_2bit_rel(x, e_in, e_out, payload, payload, True, starts, offs,
                          rel_threshold, block_size, cuda_stream)


def unpack_2bit_rel_shards(payload, stride, nsrc, starts, offs, out, block_size, accumulate,
                           *, cuda_stream=0):
    """Decode relative 2bit shards (codes, then magnitudes) of ``nsrc``
    payloads onto ``out`` (as :func:`unpack_2bit_shards`). Asynchronous."""
    block_size = check_block_size(block_size, 4, "unpack_2bit_rel_shards")  # a byte: 1 block
    payload, out = _dev(payload, "payload"), _dev(out, "out")
    starts, offs = _layout(starts, offs)
    if nsrc:
        _launch_shards(_unpack_2bit_rel_kernel, starts, offs, cuda_stream,
                       payload, payload, True, int(stride), int(nsrc), _STARTS, _OFFS, out,
                       int(block_size), bool(accumulate), block=LANES * 4)


def pack_2bit_rel(x, e_in, e_out, out, scales, rel_threshold, block_size, *,
                  cuda_stream=0):
    """2bit codes of ``v = x + e_in`` with one threshold per block into ``out``
    (uint8, ``ceil(n / 4)``) and the selected values' mean magnitudes r_b
    into ``scales`` (float32, one per block): as
    ``kernels.cpu.pack_2bit_rel``, bit for bit.

    ``block_size`` must be a positive multiple of 4 (else a ``ConfigError``,
    before any launch). Returns the non-finite count.
    """
    block_size = check_block_size(block_size, 4, "pack_2bit_rel")
    x, e_in, e_out = _dev(x, "x"), _dev(e_in, "e_in"), _dev(e_out, "e_out")
    out, scales = _dev(out, "out"), _dev(scales, "scales")
    return _pack_2bit_rel(x, e_in, e_out, out, _payload_bytes(scales), False, (0, x.size),
                          (0,), rel_threshold, block_size, cuda_stream)


def unpack_2bit_rel(payload, scales, out, block_size, accumulate, *, cuda_stream=0):
    """Decode ``out.size`` 2bit codes with their block magnitudes r_b
    (asynchronous). ``block_size``: a positive multiple of 4, as the pack's
    (else a ``ConfigError``)."""
    block_size = check_block_size(block_size, 4, "unpack_2bit_rel")
    payload, scales, out = _dev(payload, "payload"), _dev(scales, "scales"), _dev(out, "out")
    _launch_shards(_unpack_2bit_rel_kernel, (0, out.size), (0,), cuda_stream,
                   payload, _payload_bytes(scales), False, 0, 1, _STARTS, _OFFS, out,
                   int(block_size), bool(accumulate), block=LANES * 4)


# ----------------------------------------------------------------------------
# terngrad: statistics (a two-level reduction), then stochastic ternary codes
# ----------------------------------------------------------------------------
@cuda.jit(cache=_CACHE)
def _stats_kernel(x, e_in, has_e_in, partial):
    ssum = cuda.shared.array(THREADS, np.float64)
    ssq = cuda.shared.array(THREADS, np.float64)
    smax = cuda.shared.array(THREADS, np.float64)
    sbad = cuda.shared.array(THREADS, np.int64)
    s = 0.0
    ss = 0.0
    amax = 0.0
    nbad = 0
    for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        v = x[i]
        if has_e_in:
            v = v + e_in[i]
        f = np.float64(v)
        s += f
        ss += _dmul_rn(f, f)
        a = abs(f)
        amax = a if a > amax else amax
        nbad += (f - f) != 0.0
    t = cuda.threadIdx.x
    ssum[t] = s
    ssq[t] = ss
    smax[t] = amax
    sbad[t] = nbad
    cuda.syncthreads()
    h = THREADS // 2
    while h > 0:
        if t < h:
            ssum[t] += ssum[t + h]
            ssq[t] += ssq[t + h]
            m = smax[t + h]
            smax[t] = m if m > smax[t] else smax[t]
            sbad[t] += sbad[t + h]
        cuda.syncthreads()
        h //= 2
    if t == 0:
        b = cuda.blockIdx.x
        partial[b, 0] = ssum[0]
        partial[b, 1] = ssq[0]
        partial[b, 2] = smax[0]
        partial[b, 3] = np.float64(sbad[0])


@cuda.jit(cache=_CACHE)
def _stats_combine_kernel(partial, result):
    """The second level: one CUDA block folds the per-block partials (thread
    t the rows t, t + THREADS, ... in order, then a tree)."""
    ssum = cuda.shared.array(THREADS, np.float64)
    ssq = cuda.shared.array(THREADS, np.float64)
    smax = cuda.shared.array(THREADS, np.float64)
    sbad = cuda.shared.array(THREADS, np.float64)
    t = cuda.threadIdx.x
    s = 0.0
    ss = 0.0
    amax = 0.0
    nbad = 0.0
    for b in range(t, partial.shape[0], THREADS):
        s += partial[b, 0]
        ss += partial[b, 1]
        m = partial[b, 2]
        amax = m if m > amax else amax
        nbad += partial[b, 3]
    ssum[t] = s
    ssq[t] = ss
    smax[t] = amax
    sbad[t] = nbad
    cuda.syncthreads()
    h = THREADS // 2
    while h > 0:
        if t < h:
            ssum[t] += ssum[t + h]
            ssq[t] += ssq[t + h]
            m = smax[t + h]
            smax[t] = m if m > smax[t] else smax[t]
            sbad[t] += sbad[t + h]
        cuda.syncthreads()
        h //= 2
    if t == 0:
        result[0] = ssum[0]
        result[1] = ssq[0]
        result[2] = smax[0]
        result[3] = sbad[0]


def stats(x, e_in, *, cuda_stream=0):
    """Return ``(sum, sum of squares, max |v|, non-finite count)`` of
    ``v = x + e_in``, accumulated in float64 (summation order: see the module
    docstring). Two launches, one read of four numbers."""
    x, e_in = _dev(x, "x"), _dev(e_in, "e_in")
    if x.size == 0:
        return 0.0, 0.0, 0.0, 0
    dev = _device_id()
    nb = _grid(x.size, dev=dev)
    partial = _take_scratch((nb, 4), np.float64, dev)
    result = _take_scratch((4,), np.float64, dev)
    _launch(_stats_kernel, nb, cuda_stream, x, *_opt(e_in, x), partial)
    _launch(_stats_combine_kernel, 1, cuda_stream, partial, result)
    p = _small_to_host(result, cuda_stream)  # (as _read_count: one wait)
    out = float(p[0]), float(p[1]), float(p[2]), int(p[3])
    _give_scratch(partial, dev)
    _give_scratch(result, dev)
    return out


@cuda.jit(device=True)
def _splitmix64(z):
    z = np.uint64(z + np.uint64(0x9E3779B97F4A7C15))
    z = np.uint64((z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9))
    z = np.uint64((z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB))
    return np.uint64(z ^ (z >> np.uint64(31)))


@cuda.jit(device=True)
def _ternary_code(val, inside, e_out, has_e_out, i, s, neg_s, zero, scale, clip, neg_clip,
                  stream_id, offset):
    """The terngrad code of the value ``val`` (``x[i] + e_in[i]``), as
    :func:`_code_of`: (code, 1 if not finite), the residual to ``e_out[i]``;
    ``inside`` false: code ``00``, nothing written or counted."""
    if not inside:
        return 0, 0
    # clip as the CPU's min(max(v, -clip), clip): explicit compares, so a
    # NaN stays NaN (a float min/max on the GPU is fmin/fmax, which returns
    # the other operand: NaN would become -clip)
    f = np.float64(val)
    f = neg_clip if neg_clip > f else f
    f = clip if clip < f else f
    ctr = np.uint64(offset + i)
    h = _splitmix64(stream_id ^ np.uint64(ctr * np.uint64(0x9E3779B97F4A7C15)))
    u = np.float64(h >> np.uint64(11)) * (1.0 / 9007199254740992.0)
    keep = scale > 0.0 and u < abs(f) / scale
    pos = keep and f > 0.0
    neg = keep and f < 0.0
    d = s if pos else (neg_s if neg else zero)
    if has_e_out:
        e_out[i] = val - d
    return (3 if pos else (2 if neg else 0)), (1 if (val - val) != zero else 0)


@cuda.jit(device=True)
def _ternary_codes4(a0, a1, a2, a3, e_out, has_e_out, lo, n, v, s, neg_s, zero, scale, clip,
                    neg_clip, stream_id, offset):
    """(payload byte, non-finite count) of the values ``v`` .. ``v + 3``, as
    :func:`_codes4`."""
    i = np.uint64(lo + v)
    c0, b0 = _ternary_code(a0, v < n, e_out, has_e_out, i, s, neg_s, zero, scale, clip,
                           neg_clip, stream_id, offset)
    c1, b1 = _ternary_code(a1, v + 1 < n, e_out, has_e_out, i + _U1, s, neg_s, zero, scale,
                           clip, neg_clip, stream_id, offset)
    c2, b2 = _ternary_code(a2, v + 2 < n, e_out, has_e_out, i + _U2, s, neg_s, zero, scale,
                           clip, neg_clip, stream_id, offset)
    c3, b3 = _ternary_code(a3, v + 3 < n, e_out, has_e_out, i + _U3, s, neg_s, zero, scale,
                           clip, neg_clip, stream_id, offset)
    return (c0 << 6) | (c1 << 4) | (c2 << 2) | c3, b0 + b1 + b2 + b3


@cuda.jit(cache=_CACHE, **_BOUNDS)
def _pack_ternary_kernel(x, e_in, has_e_in, e_out, has_e_out, out, inline, starts, offs, s,
                         scale, clip, stream_id, offset, nbad_out):
    j = cuda.blockIdx.y
    lo = starts[j]
    n = starts[j + 1] - lo
    ob = offs[j]
    nb = (n + 3) // 4
    neg_s = -s
    neg_clip = -clip
    zero = s - s
    if inline and n > 0 and cuda.blockIdx.x == 0 and cuda.threadIdx.x == 0:
        _put_f32(out, ob + nb, scale)  # the scale after the codes
    step = cuda.gridDim.x * cuda.blockDim.x
    nbad = 0
    # as _pack_2bit_kernel: bytes k and k + step, their loads first
    for k in range(cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x, nb, 2 * step):
        k2 = k + step
        a0, a1, a2, a3, b0, b1, b2, b3 = _load8(x, e_in, has_e_in, lo, n, 4 * k, 4 * k2)
        c, bad = _ternary_codes4(a0, a1, a2, a3, e_out, has_e_out, lo, n, 4 * k, s, neg_s,
                                 zero, scale, clip, neg_clip, stream_id, offset)
        out[ob + k] = c
        c2, bad2 = _ternary_codes4(b0, b1, b2, b3, e_out, has_e_out, lo, n, 4 * k2, s, neg_s,
                                   zero, scale, clip, neg_clip, stream_id, offset)
        if k2 < nb:
            out[ob + k2] = c2
        nbad += bad + bad2
    if nbad:
        cuda.atomic.add(nbad_out, 0, nbad)


@cuda.jit(cache=_CACHE, **_BOUNDS)
def _unpack_ternary_kernel(payload, stride, nsrc, starts, offs, out, accumulate):
    j = cuda.blockIdx.y
    lo = starts[j]
    n = starts[j + 1] - lo
    ob = offs[j]
    nb = (n + 3) // 4
    step = cuda.gridDim.x * cuda.blockDim.x
    # as _unpack_2bit_kernel; each sender's scale (after its codes) decodes
    # its codes (a NaN scale decodes to NaN everywhere: zero = t - t)
    for k in range(cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x, nb, 2 * step):
        k2 = k + step
        q = min(k2, nb - 1)
        s = 0
        if accumulate:
            a0, a1, a2, a3, b0, b1, b2, b3 = _load8(out, out, False, lo, n, 4 * k, 4 * k2)
        else:  # sender 0 written, not added to 0
            t = out.dtype.type(_get_f32(payload, ob + nb))
            zero = t - t
            a0, a1, a2, a3 = _decode4(payload[ob + k], t, -t, zero)
            b0, b1, b2, b3 = _decode4(payload[ob + q], t, -t, zero)
            s = 1
        while s + 1 < nsrc:
            p = ob + s * stride
            t32 = _get_f32(payload, p + nb)
            pa = payload[p + k]
            pb = payload[p + q]
            t32b = _get_f32(payload, p + stride + nb)
            pa2 = payload[p + stride + k]
            pb2 = payload[p + stride + q]
            t = out.dtype.type(t32)
            zero = t - t
            a0, a1, a2, a3 = _add4(a0, a1, a2, a3, pa, t, -t, zero)
            b0, b1, b2, b3 = _add4(b0, b1, b2, b3, pb, t, -t, zero)
            t = out.dtype.type(t32b)
            zero = t - t
            a0, a1, a2, a3 = _add4(a0, a1, a2, a3, pa2, t, -t, zero)
            b0, b1, b2, b3 = _add4(b0, b1, b2, b3, pb2, t, -t, zero)
            s += 2
        if s < nsrc:
            p = ob + s * stride
            t = out.dtype.type(_get_f32(payload, p + nb))
            zero = t - t
            a0, a1, a2, a3 = _add4(a0, a1, a2, a3, payload[p + k], t, -t, zero)
            b0, b1, b2, b3 = _add4(b0, b1, b2, b3, payload[p + q], t, -t, zero)
        _store4(out, lo, n, 4 * k, a0, a1, a2, a3)
        if k2 < nb:
            _store4(out, lo, n, 4 * k2, b0, b1, b2, b3)


def _pack_ternary(x, e_in, e_out, out, inline, starts, offs, scale, clip, stream, offset,
                  cuda_stream):
    scale = float(np.float32(scale))
    s = x.dtype.type(scale)
    if not _max_shard(starts):
        return 0
    dev = _device_id()
    cnt = _counter(cuda_stream, dev)
    _launch_shards(_pack_ternary_kernel, starts, offs, cuda_stream,
                   x, *_opt(e_in, x), *_opt(e_out, x), out, bool(inline), _STARTS, _OFFS,
                   s, scale, float(clip), np.uint64(stream), np.uint64(offset), cnt,
                   block=LANES * _VALUES_2BIT, dev=dev)
    return _read_count(cnt, cuda_stream, dev)


def pack_ternary_shards(x, e_in, e_out, payload, starts, offs, scale, clip, stream, offset,
                        *, cuda_stream=0):
    """:func:`pack_ternary` of every shard into ``payload[offs[j]:]``: its
    codes, then ``scale`` as a little-endian float32, one launch. Element i
    of ``x`` draws with counter ``offset + i``. Returns the non-finite count."""
    x, e_in, e_out = _dev(x, "x"), _dev(e_in, "e_in"), _dev(e_out, "e_out")
    payload = _dev(payload, "payload")
    starts, offs = _layout(starts, offs)
    return _pack_ternary(x, e_in, e_out, payload, True, starts, offs, scale, clip, stream,
                         offset, cuda_stream)


def unpack_ternary_shards(payload, stride, nsrc, starts, offs, out, accumulate, *,
                          cuda_stream=0):
    """Decode terngrad shards (codes, then the scale) of ``nsrc`` payloads
    onto ``out`` (as :func:`unpack_2bit_shards`). Asynchronous."""
    payload, out = _dev(payload, "payload"), _dev(out, "out")
    starts, offs = _layout(starts, offs)
    if nsrc:
        _launch_shards(_unpack_ternary_kernel, starts, offs, cuda_stream,
                       payload, int(stride), int(nsrc), _STARTS, _OFFS, out,
                       bool(accumulate), block=LANES * _VALUES_2BIT)


def pack_ternary(x, e_in, e_out, out, scale, clip, stream, offset, *, cuda_stream=0):
    """TernGrad codes of ``v = clip(x + e_in)`` in the 2bit layout.

    As ``kernels.cpu.pack_ternary``: ``stream`` is the RNG stream id (see
    :func:`ternary_stream`), ``offset`` the global index of ``x[0]``.
    Returns the non-finite count.
    """
    x, e_in, e_out, out = (_dev(x, "x"), _dev(e_in, "e_in"), _dev(e_out, "e_out"),
                           _dev(out, "out"))
    return _pack_ternary(x, e_in, e_out, out, False, (0, x.size), (0,), scale, clip, stream,
                         offset, cuda_stream)


# ----------------------------------------------------------------------------
# fp16 and bf16: one element-wise body, the conversion as the parameter
# ----------------------------------------------------------------------------
#: Values of a 16-bit format a thread handles in one round of its grid-stride
#: loop: ``i``, ``i + T``, ``i + 2T``, ``i + 3T`` (``T``: the grid's threads),
#: each a coalesced row of its warp; all loaded before the first store.
_VALUES_HALF = 4


def _make_half_kernels(to_bits, from_bits, inf_mask):
    """The pack kernels (float32 and float64 work dtypes: ``mul_rn`` of each)
    and the decode kernel of a 16-bit wire format: ``to_bits`` (float32 ->
    uint16 bits), ``from_bits`` (bits -> float32, exact), ``inf_mask`` (the
    exponent bits: all set means inf or NaN on the wire). A thread handles
    :data:`_VALUES_HALF` values a round (indices past the array clamped to
    its last one for the loads, then dropped)."""
    def make_pack(mul_rn):
        @cuda.jit(device=True)
        def put(x, v, i, inside, e_out, has_e_out, out, dv, zero):
            """``v`` (``x[i] + e_in[i]``) to the wire and its residual;
            returns 1 if it is bad (none where not ``inside``)."""
            if not inside:
                return 0
            h = to_bits(np.float32(v / dv))
            out[i] = h
            if has_e_out:
                e_out[i] = v - mul_rn(x.dtype.type(from_bits(h)), dv)
            # a value beyond the wire's range is as bad as a non-finite one
            return 1 if ((v - v) != zero) or ((h & inf_mask) == inf_mask) else 0

        @cuda.jit(cache=_CACHE, **_BOUNDS)
        def pack(x, e_in, has_e_in, e_out, has_e_out, out, dv, nbad_out):
            zero = dv - dv
            nbad = 0
            n = x.size
            step = cuda.gridsize(1)
            last = n - 1
            for i in range(cuda.grid(1), n, _VALUES_HALF * step):
                i1 = i + step
                i2 = i1 + step
                i3 = i2 + step
                u0, u1, u2, u3 = (np.uint64(i), np.uint64(min(i1, last)),
                                  np.uint64(min(i2, last)), np.uint64(min(i3, last)))
                v0, v1, v2, v3 = _load4_at(x, e_in, has_e_in, u0, u1, u2, u3)
                nbad += put(x, v0, u0, True, e_out, has_e_out, out, dv, zero)
                nbad += put(x, v1, u1, i1 < n, e_out, has_e_out, out, dv, zero)
                nbad += put(x, v2, u2, i2 < n, e_out, has_e_out, out, dv, zero)
                nbad += put(x, v3, u3, i3 < n, e_out, has_e_out, out, dv, zero)
            if nbad:
                cuda.atomic.add(nbad_out, 0, nbad)
        return pack

    @cuda.jit(device=True)
    def wire(out, p):
        return out.dtype.type(from_bits(p))  # exact

    @cuda.jit(cache=_CACHE, **_BOUNDS)
    def unpack(payload, stride, nsrc, out, accumulate):
        n = out.size
        step = cuda.gridsize(1)
        last = n - 1
        for i in range(cuda.grid(1), n, _VALUES_HALF * step):
            i1 = i + step
            i2 = i1 + step
            i3 = i2 + step
            u0, u1, u2, u3 = (np.uint64(i), np.uint64(min(i1, last)),
                              np.uint64(min(i2, last)), np.uint64(min(i3, last)))
            s = 0
            if accumulate:
                a0, a1, a2, a3 = _load4_at(out, out, False, u0, u1, u2, u3)
            else:  # sender 0 written, not added to 0
                a0, a1, a2, a3 = (wire(out, payload[u0]), wire(out, payload[u1]),
                                  wire(out, payload[u2]), wire(out, payload[u3]))
                s = 1
            while s < nsrc:  # senders in rank order
                b = np.uint64(s * stride)
                p0, p1, p2, p3 = (payload[b + u0], payload[b + u1], payload[b + u2],
                                  payload[b + u3])
                a0, a1, a2, a3 = (a0 + wire(out, p0), a1 + wire(out, p1),
                                  a2 + wire(out, p2), a3 + wire(out, p3))
                s += 1
            out[u0] = a0
            if i1 < n:
                out[u1] = a1
            if i2 < n:
                out[u2] = a2
            if i3 < n:
                out[u3] = a3

    return make_pack(_fmul_rn), make_pack(_dmul_rn), unpack


(_pack_fp16_kernel_f32, _pack_fp16_kernel_f64,
 _unpack_fp16_kernel) = _make_half_kernels(_f32_to_f16_bits, _f16_bits_to_f32, 0x7C00)
(_pack_bf16_kernel_f32, _pack_bf16_kernel_f64,
 _unpack_bf16_kernel) = _make_half_kernels(_f32_to_bf16_bits, _bf16_bits_to_f32, 0x7F80)
_HALF = {"fp16": (_pack_fp16_kernel_f32, _pack_fp16_kernel_f64, _unpack_fp16_kernel),
         "bf16": (_pack_bf16_kernel_f32, _pack_bf16_kernel_f64, _unpack_bf16_kernel)}


def _pack_half(fmt, x, e_in, e_out, out, divisor, cuda_stream):
    x, e_in, e_out, out = (_dev(x, "x"), _dev(e_in, "e_in"), _dev(e_out, "e_out"),
                           _dev(out, "out"))
    dv = x.dtype.type(divisor)
    if not x.size:
        return 0
    dev = _device_id()
    cnt = _counter(cuda_stream, dev)
    if x.size:
        k32, k64, _ = _HALF[fmt]
        _launch(k64 if x.dtype == np.float64 else k32,
                _grid(x.size, THREADS * _VALUES_HALF, dev), cuda_stream,
                x, *_opt(e_in, x), *_opt(e_out, x), out, dv, cnt)
    return _read_count(cnt, cuda_stream, dev)


def _unpack_half(fmt, payload, stride, nsrc, out, accumulate, cuda_stream):
    payload, out = _dev(payload, "payload"), _dev(out, "out")
    if out.size and nsrc:
        if np.dtype(payload.dtype) != np.uint16:
            payload = payload.view(np.uint16)
        _launch(_HALF[fmt][2], _grid(out.size, THREADS * _VALUES_HALF), cuda_stream,
                payload, int(stride), int(nsrc), out, bool(accumulate))


def _half_shards(starts, offs, stride):
    """The 16-bit formats' payload is the values themselves: shard j's bytes
    at ``2 * starts[j]``. Returns the stride in values."""
    starts, offs = _layout(starts, offs)
    for j in range(len(starts) - 1):
        if starts[j + 1] > starts[j] and offs[j] != 2 * (starts[j] - starts[0]):
            raise ValueError(f"offs: 16-bit payloads follow the values; shard {j} at byte "
                             f"{offs[j]}, expected {2 * (starts[j] - starts[0])}")
    if stride % 2:
        raise ValueError(f"stride: expected an even number of bytes, got {stride}")
    return starts, stride // 2


def pack_fp16(x, e_in, e_out, out, divisor, *, cuda_stream=0):
    """``out`` (uint16 bits of binary16) = half(float32((x + e_in) / divisor)).

    The residual is ``v - half * divisor``. Returns the non-finite count.
    (The payloads of a call's shards are contiguous: one call packs them all.)
    """
    return _pack_half("fp16", x, e_in, e_out, out, divisor, cuda_stream)


def unpack_fp16(payload, out, accumulate, *, cuda_stream=0):
    """Decode ``out.size`` binary16 values (uint16 bits) into ``out``
    (asynchronous)."""
    _unpack_half("fp16", payload, 0, 1, out, accumulate, cuda_stream)


def unpack_fp16_shards(payload, stride, nsrc, starts, offs, out, accumulate, *,
                       cuda_stream=0):
    """Decode the fp16 payloads (uint8) of ``nsrc`` senders onto
    ``out[starts[0]:starts[-1]]`` (as :func:`unpack_2bit_shards`), one launch."""
    starts, st = _half_shards(starts, offs, stride)
    out = _dev(out, "out")
    _unpack_half("fp16", payload, st, nsrc, out[starts[0]:starts[-1]], accumulate,
                 cuda_stream)


def pack_bf16(x, e_in, e_out, out, divisor, *, cuda_stream=0):
    """``out`` (uint16 bits of bfloat16) = bf16(float32((x + e_in) / divisor)).

    The residual is ``v - bf16 * divisor``. Returns the non-finite count.
    """
    return _pack_half("bf16", x, e_in, e_out, out, divisor, cuda_stream)


def unpack_bf16(payload, out, accumulate, *, cuda_stream=0):
    """Decode ``out.size`` bfloat16 values (uint16 bits) into ``out``
    (asynchronous)."""
    _unpack_half("bf16", payload, 0, 1, out, accumulate, cuda_stream)


def unpack_bf16_shards(payload, stride, nsrc, starts, offs, out, accumulate, *,
                       cuda_stream=0):
    """Decode the bf16 payloads (uint8) of ``nsrc`` senders onto
    ``out[starts[0]:starts[-1]]``, one launch."""
    starts, st = _half_shards(starts, offs, stride)
    out = _dev(out, "out")
    _unpack_half("bf16", payload, st, nsrc, out[starts[0]:starts[-1]], accumulate,
                 cuda_stream)


# ----------------------------------------------------------------------------
@cuda.jit(cache=_CACHE)
def _count_nonfinite_kernel(x, nbad_out):
    zero = x.dtype.type(0)
    nbad = 0
    for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        v = x[i]
        nbad += (v - v) != zero
    if nbad:
        cuda.atomic.add(nbad_out, 0, nbad)


def count_nonfinite(x, *, cuda_stream=0):
    """Number of NaN and infinite values in ``x``."""
    x = _dev(x, "x")
    dev = _device_id()
    cnt = _counter(cuda_stream, dev)
    if x.size:
        _launch(_count_nonfinite_kernel, _grid(x.size, dev=dev), cuda_stream, x, cnt)
    return _read_count(cnt, cuda_stream, dev)


# ----------------------------------------------------------------------------
# element-wise helpers of the collectives (float16 buffers, averaging); not
# in __all__ and not in kernels/cpu.py, where numpy does the same (astype,
# divide) bit for bit
# ----------------------------------------------------------------------------
@cuda.jit(cache=_CACHE)
def _f16_to_f32_kernel(src, dst):
    for i in range(cuda.grid(1), dst.size, cuda.gridsize(1)):
        dst[i] = _f16_bits_to_f32(src[i])


@cuda.jit(cache=_CACHE)
def _f32_to_f16_kernel(src, dst):
    for i in range(cuda.grid(1), dst.size, cuda.gridsize(1)):
        dst[i] = _f32_to_f16_bits(src[i])


@cuda.jit(cache=_CACHE)
def _convert_kernel(src, dst):
    for i in range(cuda.grid(1), dst.size, cuda.gridsize(1)):
        dst[i] = dst.dtype.type(src[i])


def convert(src, dst, *, cuda_stream=0):
    """``dst[:] = src`` converted to ``dst``'s dtype (float16, float32, float64),
    rounded as numpy's ``astype`` rounds (float16 through the CPU kernels'
    integer conversion: bit-identical to numpy except for NaN payloads).
    Asynchronous on ``cuda_stream``."""
    src, dst = _dev(src, "src"), _dev(dst, "dst")
    if src.size != dst.size:
        raise ValueError(f"convert: expected equal sizes, got {src.size} and {dst.size}")
    if dst.size == 0:
        return
    f16 = np.dtype(np.float16)
    if src.dtype == f16 and dst.dtype == f16:
        _copy_d2d(dst, src, cuda_stream)
        return
    if src.dtype == f16:
        if dst.dtype != np.float32:
            raise TypeError(f"convert: float16 converts to float32, not {dst.dtype}")
        _launch(_f16_to_f32_kernel, _grid(dst.size), cuda_stream, src.view(np.uint16), dst)
    elif dst.dtype == f16:
        if src.dtype != np.float32:
            raise TypeError(f"convert: float16 is made from float32, not {src.dtype}")
        _launch(_f32_to_f16_kernel, _grid(dst.size), cuda_stream, src, dst.view(np.uint16))
    elif src.dtype == dst.dtype:
        _copy_d2d(dst, src, cuda_stream)
    else:
        _launch(_convert_kernel, _grid(dst.size), cuda_stream, src, dst)


def _copy_d2d(dst, src, cuda_stream):
    """``dst[:] = src`` on the device, in stream order (the driver's
    ``cuMemcpyDtoDAsync`` on its route, else Numba's copy)."""
    s = _stream(cuda_stream)
    if _driver.ON is False or not _driver.copy(dst, src, s, False):
        dst.copy_to_device(src, stream=s)
    _queued[0] += 1


@cuda.jit(cache=_CACHE)
def _group_copy_kernel(fused, member, ats, base, q, r, to_fused):
    # element e of the member is in shard j of numpy.array_split(member, m)
    # (the first r shards hold q + 1 elements, the others q), at
    # fused[ats[base + j] + e - lo_j]
    big = r * (q + 1)
    qq = q if q > 0 else 1  # q == 0: every element is in the first r shards
    for e in range(cuda.grid(1), member.size, cuda.gridsize(1)):
        if e < big:
            j = e // (q + 1)
            lo = j * (q + 1)
        else:
            j = r + (e - big) // qq
            lo = big + (j - r) * q
        k = ats[base + j] + e - lo
        if to_fused:
            fused[k] = member[e]
        else:
            member[e] = fused[k]


def group_copy(fused, members, ats, nshards, to_fused, *, cuda_stream=0):
    """The members of a grouped call to (``to_fused``) or from their places
    in the fused buffer, bit for bit, one launch per member: member i (None:
    skipped) is cut as ``numpy.array_split`` cuts it into ``nshards``
    shards, and its shard j's elements are at ``fused[ats[i * nshards +
    j]:]``. One dtype on both sides. Asynchronous on ``cuda_stream``."""
    fused = _dev(fused, "fused")
    if len(ats) != len(members) * nshards:
        raise ValueError(f"group_copy: expected {len(members) * nshards} offsets, got "
                         f"{len(ats)}")
    dev = _device_id()
    table = _index(ats, dev)  # uploaded once per layout
    dtype = fused.dtype
    f16 = dtype == np.float16  # moved as bits, as every kernel here takes float16
    if f16:
        fused = fused.view(np.uint16)
    flag = 1 if to_fused else 0
    for i, member in enumerate(members):
        if member is None or member.size == 0:
            continue
        member = _dev(member, "member")
        if member.dtype != dtype:
            raise TypeError(f"group_copy: expected {dtype} members, got {member.dtype}")
        if f16:
            member = member.view(np.uint16)
        q, r = divmod(member.size, nshards)
        _launch(_group_copy_kernel, _grid(member.size, dev=dev), cuda_stream, fused, member,
                table, i * nshards, q, r, flag)


@cuda.jit(cache=_CACHE)
def _divide_kernel(a, d):
    for i in range(cuda.grid(1), a.size, cuda.gridsize(1)):
        a[i] = a[i] / d


def divide(a, divisor, *, cuda_stream=0):
    """``a /= divisor`` in ``a``'s dtype (float32 or float64; IEEE division, as
    ``numpy.divide(a, divisor, out=a)``). Asynchronous on ``cuda_stream``."""
    a = _dev(a, "a")
    if a.size:
        _launch(_divide_kernel, _grid(a.size), cuda_stream, a, a.dtype.type(divisor))
