"""Compressors: stateless configuration objects with a registry.

A compressor turns a float array into a packed byte payload of a size known in
advance (``payload_nbytes``) and back. It holds no state: residuals (error
feedback) are passed in by the caller, and live in :class:`mpigc.ErrorFeedback`
when the collectives are used. Modelled on numcodecs: an id, a JSON config,
``from_config``, ``==`` and ``repr`` derived from the config, a registry that
names the available ids.

Examples
--------
>>> import numpy as np, mpigc
>>> c = mpigc.get_compressor({"type": "2bit", "threshold": 2.0})
>>> c
TwoBit(threshold=2.0, error_feedback=True)
>>> x = np.array([0.5, 3.1, -1.0, -2.0, 2.0, 0.1, 1.9, -7.0], np.float32)
>>> c.compress(x).tolist()
[50, 194]
>>> c.decompress(c.compress(x), 8).tolist()
[0.0, 2.0, 0.0, -2.0, 2.0, 0.0, 0.0, -2.0]
"""
import json
import math
import numbers

import numpy as np

from . import _dispatch
from ._errors import ConfigError, DTypeError, InvalidBufferError, NonFiniteError

__all__ = [
    "Compressor", "NoCompression", "FP16", "BF16", "TwoBit", "OneBit", "TernGrad",
    "get_compressor", "register_compressor", "available_compressors",
]

_REGISTRY = {}

#: dtypes a gradient may have; float16 is computed in float32 (see work_dtype)
SUPPORTED_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


def work_dtype(dtype):
    """The dtype in which a gradient of ``dtype`` is quantized and its
    residuals are kept: float64 stays float64, float16 and float32 use float32."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def register_compressor(cls):
    """Register a :class:`Compressor` subclass under its ``codec_id``."""
    _REGISTRY[cls.codec_id] = cls
    return cls


def available_compressors():
    """The registered compressor ids, sorted."""
    return sorted(_REGISTRY)


def get_compressor(op, **params):
    """Return a compressor from an id, a config dict or a compressor object.

    Parameters
    ----------
    op : str, dict or Compressor
        ``"2bit"`` (without a threshold: the relative mode, ``rel_threshold=1.5``);
        an MXNet-style dict ``{"type": "2bit", "threshold": 0.5}`` (``"id"`` is
        accepted for ``"type"``); or a compressor, returned as is.
    **params
        Compressor parameters, merged over those of a dict.

    Raises
    ------
    ConfigError
        Unknown id or invalid parameters (a ``ValueError``).
    """
    if isinstance(op, Compressor):
        if params:
            raise ConfigError(f"parameters {sorted(params)} given with a compressor "
                              f"object {op!r}: pass an id or a dict instead")
        return op
    if isinstance(op, dict):
        params = {**{k: v for k, v in op.items() if k not in ("type", "id")}, **params}
        if "type" in op and "id" in op and op["type"] != op["id"]:
            raise ConfigError(f"config has both type={op['type']!r} and id={op['id']!r}")
        op = op.get("type", op.get("id"))
        if op is None:
            raise ConfigError("compressor config needs a 'type' key, e.g. "
                              "{'type': '2bit', 'threshold': 0.5}")
    if op is None:
        op = "none"
    if not isinstance(op, str):
        raise ConfigError(f"expected a compressor id, dict or Compressor, got "
                          f"{type(op).__name__}" + _reduction_hint(op))
    cls = _REGISTRY.get(op.lower())
    if cls is None:
        raise ConfigError(f"unknown compressor {op!r}; available: "
                          f"{', '.join(available_compressors())}" + _reduction_hint(op))
    return cls(**params)


#: Horovod's reduction ops (``hvd.Average``, ``hvd.Sum``, ... are these ints),
#: which users migrating from Horovod pass as ``op=``
_HOROVOD_OPS = {0: "average", 1: "sum", 2: "adasum", 3: "min", 4: "max", 5: "product"}


def _reduction_hint(op):
    """What to say when ``op`` names a reduction, not a compressor: in
    Horovod (and MPI) ``op=`` is the reduction; in mpigc it is the
    compressor, and the reduction is always a sum (``average=`` divides it)."""
    if isinstance(op, numbers.Integral) and not isinstance(op, bool):
        name = _HOROVOD_OPS.get(int(op))
        if name is None:
            return ""
        shown = f"op={int(op)} (Horovod's hvd.{name.capitalize()}?)"
    elif isinstance(op, str) and op.lower() in ("average", "avg", "mean", "sum", "adasum",
                                                "min", "max", "product"):
        name = {"avg": "average", "mean": "average"}.get(op.lower(), op.lower())
        shown = f"op={op!r}"
    else:
        return ""
    way = {"average": "average=True gives the mean (the default in mpigc.torch; "
                      "mpigc.allreduce sums by default)",
           "sum": "average=False gives the sum (mpigc.allreduce's default)"}.get(
        name, f"mpigc reduces by summing only ({name} has no mpigc equivalent; "
              "average=True gives the mean, average=False the sum)")
    return (f". {shown} names a reduction: in mpigc op= is the compressor ('none' for "
            f"the exact MPI sum, '2bit', '1bit', 'fp16', ...), and {way}")


_NO_KW = {}


def _kernels(a):
    """The kernels of ``a``'s side and the keywords of their calls: on a
    device, the engine's stream (``mpigc._cuda.stream_kw``: none, the
    legacy default stream, unless ``MPIGC_CUDA_STREAM`` asks for a stream of
    mpigc's own). Device arrays reach a compressor from the collectives
    only (:func:`_host_only`), so every device encode and decode runs in
    the engine's stream order."""
    k = _dispatch.kernels(a)
    if k.__name__ == "mpigc.kernels.cpu":
        return k, _NO_KW
    from . import _cuda
    return k, _cuda.stream_kw()


def _host_only(what, *arrays):
    for a in arrays:
        if a is not None and _dispatch.is_device_array(a):
            raise DTypeError(f"{what} takes host arrays; device arrays go to the "
                             "collectives (mpigc.allreduce) or to mpigc.kernels.cuda")


def _flat(x, what="x"):
    """A 1-D contiguous float view of array ``x`` (no copy)."""
    if not isinstance(x, np.ndarray) and not _dispatch.is_device_array(x):
        raise DTypeError(f"{what}: expected an array, got {type(x).__name__}")
    if np.dtype(x.dtype) not in SUPPORTED_DTYPES:
        raise DTypeError(f"{what}: expected float16, float32 or float64, got {x.dtype}")
    if not x.flags.c_contiguous:
        raise InvalidBufferError(f"{what}: expected a C-contiguous array")
    return x.reshape(-1)


class Compressor:
    """Base class: a configuration with an id.

    Subclasses define ``codec_id``, ``_params`` (name -> default) and the
    codec methods. Parameters are validated in ``_check``.
    """

    codec_id = None
    _params = {}
    #: fp16 and bf16 divide by the world size on the worker (pre-scaling) when
    #: averaging
    prescales_average = False
    #: terngrad needs a scale agreed by all ranks before it can quantize
    needs_global_scale = False
    #: the numbers on the wire whose range can be narrower than the buffer's
    #: (for the error raised when finite values do not fit)
    wire_range = "float32, magnitudes up to 3.4e38"

    def chunk_align(self):
        """A pipelined call (``$MPIGC_CHUNK_BYTES``) cuts each shard into
        pieces that start at multiples of this many elements from the
        shard's start, so that each piece encodes exactly as its part of the
        whole shard would (blocks, bytes of codes): the same bits either
        way. None: this compressor's calls are never pipelined (the
        default for registered compressors, whose layout mpigc cannot
        know)."""
        return None

    def __init__(self, **params):
        unknown = sorted(set(params) - set(self._params))
        if unknown:
            raise ConfigError(
                f"{self.codec_id} takes parameters "
                f"{', '.join(self._params) or '(none)'}; got {', '.join(map(repr, unknown))}"
                + self._others_params(unknown, params))
        for name, default in self._params.items():
            setattr(self, name, params.get(name, default))
        self._check()

    def _others_params(self, unknown, params):
        """Where ``unknown`` parameters belong to other compressors (a call
        whose ``op`` was changed and its parameters kept): which, and that
        they go with their op."""
        parts = []
        for name in unknown:
            owners = [cid for cid, cls in sorted(_REGISTRY.items())
                      if cid != self.codec_id and name in cls._params]
            if owners:
                parts.append(f"{name}={params[name]!r} is a parameter of "
                             f"{' and '.join(owners)}")
        if not parts:
            return ""
        return (" (" + "; ".join(parts) + f": leave it out with op={self.codec_id!r}, or "
                "keep it with its op)")

    def _check(self):
        if "error_feedback" in self._params and not isinstance(self.error_feedback, bool):
            raise ConfigError(f"{self.codec_id}: error_feedback must be True or False, "
                              f"got {self.error_feedback!r}")

    # -- configuration -------------------------------------------------------
    def get_config(self):
        """A JSON-serialisable dict ``{"id": ..., parameters...}``."""
        return {"id": self.codec_id, **{k: getattr(self, k) for k in self._params}}

    @classmethod
    def from_config(cls, config):
        """Rebuild a compressor from :meth:`get_config`'s output."""
        return get_compressor(dict(config))

    def __eq__(self, other):
        return isinstance(other, Compressor) and self.get_config() == other.get_config()

    def __hash__(self):
        return hash(json.dumps(self.get_config(), sort_keys=True))

    def __repr__(self):
        args = ", ".join(f"{k}={getattr(self, k)!r}" for k in self._params)
        return f"{type(self).__name__}({args})"

    @property
    def uses_feedback(self):
        """Whether this compressor keeps residuals (error feedback)."""
        return bool(getattr(self, "error_feedback", False))

    # -- codec (subclasses) --------------------------------------------------
    def payload_nbytes(self, n, dtype=np.float32):
        """Exact payload size in bytes for ``n`` elements (``dtype`` matters
        only for ``none``)."""
        raise NotImplementedError

    def encode_into(self, x, e_in, e_out, payload, *, scale=None, stream=0, offset=0,
                    divisor=1.0):
        """Pack ``x + e_in`` into ``payload`` (exactly ``payload_nbytes``
        bytes), residual to ``e_out``. Return the non-finite count."""
        raise NotImplementedError

    def decode_into(self, payload, out, accumulate):
        """Decode ``out.size`` values from ``payload`` into (or onto) ``out``."""
        return self.decode_shards(payload, 0, 1, (0, out.size), (0,), out, accumulate)

    def encode_shards(self, x, e_in, e_out, payload, starts, offs, *, offset=0, **kw):
        """:meth:`encode_into` of every shard ``x[starts[j]:starts[j + 1]]`` into
        ``payload[offs[j]:]`` (``starts``, ``offs``: tuples of ints); element
        i of ``x`` has global index ``offset + i``. Returns the total bad
        count. The built-in compressors hand all shards to one kernel call
        (one launch on a GPU); this default loops over :meth:`encode_into`."""
        nbad = 0
        for j in range(len(starts) - 1):
            lo, hi = starts[j], starts[j + 1]
            if hi > lo:
                nbad += self.encode_into(
                    x[lo:hi], None if e_in is None else e_in[lo:hi],
                    None if e_out is None else e_out[lo:hi],
                    payload[offs[j]:offs[j] + self.payload_nbytes(hi - lo, x.dtype)],
                    offset=offset + lo, **kw)
        return nbad

    def decode_shards(self, payload, stride, nsrc, starts, offs, out, accumulate):
        """Decode shard j of ``nsrc`` payloads (sender s's at ``payload[s *
        stride + offs[j]:]``) onto ``out[starts[j]:starts[j + 1]]``: sender 0
        written (added when ``accumulate``), the others added, in order."""
        raise NotImplementedError

    def mark_out_of_range(self, payload, n):
        """Make the payload of ``n`` values, which ``encode_into`` counted as not
        fitting the wire format, decode visibly non-finite. fp16's and bf16's
        inf values and 1bit's inf means do that by themselves, so by default
        nothing changes."""

    # -- public kernel-level API ---------------------------------------------
    def compress(self, x, residual=None, out=None, *, check_finite=True, **kw):
        """Compress ``x`` into a packed 1-D ``uint8`` payload.

        Parameters
        ----------
        x : array of float16, float32 or float64 (C-contiguous)
        residual : array, optional
            Error feedback: ``x + residual`` is compressed and ``residual``
            is updated in place to what the payload did not deliver. Same
            size as ``x``, dtype ``work_dtype(x.dtype)``.
        out : uint8 array, optional
            Where to write the payload (``payload_nbytes(x.size)`` bytes).
        check_finite : bool
            If true (default), a non-finite value raises
            :class:`NonFiniteError` and leaves ``residual`` unchanged. With a
            residual this costs a second pass: the first one only counts and
            packs, the second updates ``residual`` in place (no scratch
            buffer). ``check_finite=False`` is one pass, in place, as the
            collectives' fused kernels are; a non-finite value then reaches
            the payload and the residual.
        **kw
            ``scale``, ``stream``, ``offset`` for ``terngrad``.
        """
        _host_only("compress()", x, residual, out)
        xf = _flat(x)
        n = xf.size
        wd = work_dtype(xf.dtype)
        if xf.dtype != wd:
            xf = xf.astype(wd)
        e = None
        if residual is not None:
            e = _flat(residual, "residual")
            if e.size != n or e.dtype != wd:
                raise InvalidBufferError(f"residual: expected {n} values of {wd}, got "
                                         f"{e.size} of {e.dtype}")
            if not e.flags.writeable:
                raise InvalidBufferError("residual: expected a writable array")
        nbytes = self.payload_nbytes(n, wd)
        if out is None:
            out = np.empty(nbytes, np.uint8)
        elif not (isinstance(out, np.ndarray) and out.dtype == np.uint8 and out.ndim == 1
                  and out.size == nbytes and out.flags.c_contiguous):
            raise InvalidBufferError(f"out: expected a contiguous uint8 array of "
                                     f"{nbytes} bytes")
        if check_finite:
            # pass 1 writes no residual (e_out None): a non-finite value raises
            # with ``residual`` untouched, and no scratch residual is allocated
            nbad = self.encode_into(xf, e, None, out, **kw)
            if nbad:
                raise NonFiniteError(f"x holds {nbad} value(s) that are NaN or Inf, or would "
                                     f"be on the wire (beyond the {self.codec_id} range); "
                                     "residual unchanged")
            if e is None:
                return out
        self.encode_into(xf, e, e, out, **kw)  # in place (deterministic: the same payload)
        return out

    def decompress(self, payload, n, out=None, *, accumulate=False, dtype=np.float32):
        """Decode ``n`` values from ``payload``.

        Returns a new array of ``dtype``, or writes into ``out`` (adds to it
        when ``accumulate`` is true, as an owner does when it sums the
        contributions of all ranks) and returns ``out``.
        """
        _host_only("decompress()", payload, out)
        payload = np.asarray(payload)
        if payload.dtype != np.uint8 or payload.ndim != 1:
            raise InvalidBufferError("payload: expected a 1-D uint8 array")
        n = int(n)
        if out is None:
            out = np.zeros(n, dtype)
        of = _flat(out, "out")
        if of.size != n:
            raise InvalidBufferError(f"out: expected {n} values, got {of.size}")
        expected = self.payload_nbytes(n, work_dtype(of.dtype))
        if payload.size != expected:
            raise InvalidBufferError(f"payload: expected {expected} bytes for {n} values, "
                                     f"got {payload.size}")
        if of.dtype == np.float16:
            tmp = of.astype(np.float32) if accumulate else np.empty(n, np.float32)
            self.decode_into(payload, tmp, accumulate)
            of[...] = tmp
        else:
            self.decode_into(payload, of, accumulate)
        return out


# ----------------------------------------------------------------------------
@register_compressor
class NoCompression(Compressor):
    """``none``: values travel as they are. In the collectives this is exactly
    ``MPI_Allreduce`` / ``MPI_Reduce_scatter`` with ``MPI.SUM``."""

    codec_id = "none"
    _params = {}

    def payload_nbytes(self, n, dtype=np.float32):
        return int(n) * np.dtype(dtype).itemsize

    def encode_into(self, x, e_in, e_out, payload, **kw):
        v = x if e_in is None else x + e_in
        payload[...] = v.view(np.uint8)
        if e_out is not None:
            e_out[...] = 0
        return _dispatch.kernels(x).count_nonfinite(v)

    def decode_into(self, payload, out, accumulate):
        v = payload.view(out.dtype)
        if accumulate:
            out += v
        else:
            out[...] = v

    def decode_shards(self, payload, stride, nsrc, starts, offs, out, accumulate):
        isz = np.dtype(out.dtype).itemsize
        for j in range(len(starts) - 1):
            lo, hi = starts[j], starts[j + 1]
            for s in range(nsrc if hi > lo else 0):
                b = s * stride + offs[j]
                self.decode_into(payload[b:b + isz * (hi - lo)], out[lo:hi], accumulate or s > 0)


class _TwoByte(Compressor):
    """fp16 and bf16: a 2-byte float per value, the kernels ``pack_{_kernel}``
    and ``unpack_{_kernel}_shards``; nothing else differs between them."""

    def chunk_align(self):
        return 1

    _kernel = None
    _params = {"error_feedback": False}
    prescales_average = True

    def payload_nbytes(self, n, dtype=np.float32):
        return 2 * int(n)

    def encode_into(self, x, e_in, e_out, payload, *, divisor=1.0, **kw):
        k, kw = _kernels(x)
        return getattr(k, "pack_" + self._kernel)(x, e_in, e_out, payload.view(np.uint16),
                                                  divisor, **kw)

    def encode_shards(self, x, e_in, e_out, payload, starts, offs, *, divisor=1.0, **kw):
        # the payloads of contiguous shards are the values, contiguous: one call
        lo, hi = starts[0], starts[-1]
        return self.encode_into(x[lo:hi], None if e_in is None else e_in[lo:hi],
                                None if e_out is None else e_out[lo:hi],
                                payload[offs[0]:offs[0] + 2 * (hi - lo)], divisor=divisor)

    def decode_shards(self, payload, stride, nsrc, starts, offs, out, accumulate):
        k, kw = _kernels(out)
        getattr(k, f"unpack_{self._kernel}_shards")(payload, stride, nsrc, starts, offs, out,
                                                     accumulate, **kw)


@register_compressor
class FP16(_TwoByte):
    """``fp16``: IEEE half precision on the wire, sums in float32 at the owner.

    When averaging, workers divide by the world size before the cast
    (pre-scaling), so large gradients do not overflow the half range.
    Error feedback is off by default (as in DDP's fp16 hook and Horovod).
    """

    codec_id = "fp16"
    wire_range = "half precision, magnitudes up to 65504"

    _kernel = "fp16"


@register_compressor
class BF16(_TwoByte):
    """``bf16``: bfloat16 on the wire, sums in float32 at the owner.

    Each value is rounded to nearest even to bfloat16 (the upper 16 bits of
    its float32): float32's range, 8 significant bits (fp16 has 11, but
    overflows beyond 65504). A NaN travels as the quiet NaN ``0x7FC0`` (with
    its sign from host arrays; a GPU's arithmetic drops the sign of a NaN). float64 values beyond the bfloat16 range are values the wire
    format cannot carry (counted, as fp16 counts its out-of-range values).
    When averaging, workers divide by the world size before rounding
    (pre-scaling), as fp16 does. Error feedback is off by default (as in
    DDP's bf16 hook); ``error_feedback=True`` turns it on.
    """

    codec_id = "bf16"
    wire_range = "bfloat16, magnitudes up to 3.39e38"

    _kernel = "bf16"


#: What ``"2bit"`` without a threshold means in every layer (``op="2bit"``,
#: ``{"type": "2bit"}``, ``TwoBit()``, the torch layer): the relative mode with
#: ``rel_threshold=1.5``, measured on the mpi4py + numpy MLP
#: (``examples/mlp_numpy.py``; docs/user-guide.md, "Which compressor").
#: Before, it meant MXNet's absolute ``threshold=0.5``, which now has to be
#: given explicitly.
DEFAULT_REL_THRESHOLD = 1.5


def config_change_hint(saved, used):
    """What to tell a user whose residuals were made under compressor config
    ``saved`` (a checkpoint's, a key's entry) and are now used with ``used``
    (``get_config()`` forms): when ``saved`` is 2bit's absolute mode at
    MXNet's 0.5 and ``used`` is the relative default, the change of meaning
    of ``"2bit"`` and its fix (``threshold=0.5``); else ``""``. For the
    checks that compare configs (checkpoint loads, a call on a key whose
    residuals another config made)."""
    try:
        saved_c, used_c = get_compressor(dict(saved)), get_compressor(dict(used))
    except (ConfigError, TypeError, ValueError):
        return ""
    if (isinstance(saved_c, TwoBit) and isinstance(used_c, TwoBit)
            and not saved_c.relative and used_c.relative
            and used_c.rel_threshold == DEFAULT_REL_THRESHOLD):
        return (f"these residuals were made by 2bit's absolute mode "
                f"(threshold={saved_c.threshold:g}, what op=\"2bit\" meant before "
                f"it meant rel_threshold={DEFAULT_REL_THRESHOLD:g}): pass "
                f"threshold={saved_c.threshold:g} to continue with them, or start "
                "the relative mode afresh (reset the key, or load with strict=False)")
    return ""


@register_compressor
class TwoBit(Compressor):
    """``2bit``: threshold quantization in MXNet's 2-bit code layout.

    ``v >= t`` -> ``11`` (+), ``v <= -t`` -> ``10`` (-), else ``00`` (0);
    four codes per byte, element 0 in the two most significant bits.

    Two modes:

    - relative (the default: ``TwoBit()``, ``get_compressor("2bit")``,
      ``op="2bit"`` and ``{"type": "2bit"}`` without a threshold mean
      ``rel_threshold=1.5``, :data:`DEFAULT_REL_THRESHOLD`; an mpigc
      extension): each block of ``block_size`` elements (default 1024, a
      multiple of 4) has its own selection threshold ``t_b = float32(c *
      rms(block))``; a block where no element reaches it (values of about
      the same magnitude: then ``max|v| < c * rms`` for c > 1) selects with
      ``max|v| / max(c, 1)`` instead, so its largest elements are always sent
      and no block starves. The selected elements decode to ``+-r_b``, their mean
      magnitude ``r_b = float32(sum |v| / count)`` (0 if none), not to
      ``+-t_b``: the codes are followed by one little-endian float32 ``r_b``
      per block (1.6% more bytes at 1024); ``t_b`` is not sent. Scale-free:
      it trains like ``none`` whatever the gradients' scale (the mpi4py +
      numpy MLP of ``examples/mlp_numpy.py``: docs/user-guide.md, "Which
      compressor"). Decoding to ``t_b`` lost 10 points of accuracy in
      ``examples/train_torch.py``; the mean matches ``none`` there
      (docs/torch.md). The compressor is contractive in every block,
      ``||v - C(v)||^2 = ||v||^2 - count * r_b^2 <= (1 - 1 / (B * max(c,
      1/c)^2)) ||v||^2``, so error-feedback residuals stay bounded
      (docs/error-feedback.md).
    - absolute (``threshold=t``, MXNet's): one threshold for every element,
      values beyond ``+-t`` send ``+-t``; the payload is the codes alone,
      bit-compatible with MXNet (whose default is ``t = 0.5``: give
      ``threshold=0.5`` for MXNet's behaviour and bytes). ``t`` must suit the
      gradients' scale: gradients far below it are almost never sent (the
      residuals hold them), and :func:`mpigc.allreduce` and the torch layer
      warn when a threshold let through almost nothing
      (:class:`mpigc._threshold.ThresholdWatch`).

    Giving both ``threshold`` and ``rel_threshold`` is an error, as is
    ``block_size`` with ``threshold``.

    Examples
    --------
    >>> TwoBit()
    TwoBit(rel_threshold=1.5, block_size=1024, error_feedback=True)
    >>> TwoBit(threshold=0.5)
    TwoBit(threshold=0.5, error_feedback=True)
    """

    codec_id = "2bit"
    _params = {"threshold": None, "rel_threshold": None, "block_size": 1024,
               "error_feedback": True}
    wire_range = "block thresholds and magnitudes in float32, up to 3.4e38"

    def __init__(self, **params):
        if params.get("rel_threshold") is not None and params.get("threshold") is not None:
            raise ConfigError(
                f"2bit: give either threshold (absolute, got {params['threshold']!r}) or "
                f"rel_threshold (relative to each block's RMS, got "
                f"{params['rel_threshold']!r}), not both")
        if params.get("threshold") is None and params.get("rel_threshold") is None:
            # no threshold: the relative mode (one meaning of "2bit" everywhere)
            params = {**params, "rel_threshold": DEFAULT_REL_THRESHOLD}
        super().__init__(**params)

    @property
    def relative(self):
        """Whether this is the relative (per-block threshold) mode."""
        return self.rel_threshold is not None

    def _check(self):
        super()._check()
        b = self.block_size
        if isinstance(b, bool) or not isinstance(b, numbers.Integral) or b <= 0 or b % 4:
            raise ConfigError(f"2bit: block_size must be a positive multiple of 4, got {b!r}")
        self.block_size = int(b)
        if self.relative:
            c = self.rel_threshold
            if (isinstance(c, bool) or not isinstance(c, numbers.Real)
                    or not math.isfinite(c) or c <= 0):
                raise ConfigError(f"2bit: rel_threshold must be None or a finite number > 0 "
                                  f"(a multiple of each block's RMS, e.g. 1.5), got {c!r}")
            self.rel_threshold = float(c)
            self.threshold = None
            return
        if self.block_size != self._params["block_size"]:
            raise ConfigError(f"2bit: block_size (got {b!r}) applies only to the relative "
                              f"mode, and threshold={self.threshold!r} gives the absolute "
                              "one: leave threshold out (or give rel_threshold), or leave "
                              "block_size out")
        t = self.threshold
        if (isinstance(t, bool) or not isinstance(t, numbers.Real) or not math.isfinite(t)
                or t <= 0):
            raise ConfigError(f"2bit: threshold must be a finite number > 0, got {t!r}")
        with np.errstate(over="ignore", under="ignore"):
            t32 = np.float32(t)
        if not np.isfinite(t32) or t32 == 0:
            raise ConfigError(f"2bit: threshold must be representable in float32 "
                              f"(between 1.2e-38 and 3.4e38), got {t!r}")
        self.threshold = float(t)

    def get_config(self):
        """``{"id": "2bit", "threshold": t, "error_feedback": ...}`` in the
        absolute mode (MXNet's form, unchanged); ``{"id": "2bit",
        "rel_threshold": c, "block_size": B, "error_feedback": ...}`` in the
        relative mode."""
        if self.relative:
            return {"id": self.codec_id, "rel_threshold": self.rel_threshold,
                    "block_size": self.block_size, "error_feedback": self.error_feedback}
        return {"id": self.codec_id, "threshold": self.threshold,
                "error_feedback": self.error_feedback}

    def __repr__(self):
        cfg = self.get_config()
        args = ", ".join(f"{k}={v!r}" for k, v in cfg.items() if k != "id")
        return f"{type(self).__name__}({args})"

    def _nblocks(self, n):
        return (int(n) + self.block_size - 1) // self.block_size

    def chunk_align(self):
        return self.block_size if self.relative else 4

    def payload_nbytes(self, n, dtype=np.float32):
        if self.relative:
            return (int(n) + 3) // 4 + 4 * self._nblocks(n)
        return (int(n) + 3) // 4

    def encode_into(self, x, e_in, e_out, payload, **kw):
        return self.encode_shards(x, e_in, e_out, payload, (0, x.size), (0,), **kw)

    def encode_shards(self, x, e_in, e_out, payload, starts, offs, **kw):
        k, kw = _kernels(x)
        if not self.relative:
            return k.pack_2bit_shards(x, e_in, e_out, payload, starts, offs, self.threshold,
                                      **kw)
        # codes, then the block magnitudes (little-endian float32) per shard
        return k.pack_2bit_rel_shards(x, e_in, e_out, payload, starts, offs,
                                      self.rel_threshold, self.block_size, **kw)

    def mark_out_of_range(self, payload, n):
        """Relative mode: a block whose threshold overflows selects nothing
        and would decode to 0, so every code becomes ``11`` and every
        magnitude NaN: the payload decodes to NaN. (The absolute mode sends
        no number: nothing to mark.)"""
        if not self.relative or n == 0:
            return
        nb = (n + 3) // 4
        nan = np.full(self._nblocks(n), np.nan, "<f4").view(np.uint8)
        _dispatch.put_bytes(payload, np.concatenate([np.full(nb, 0xFF, np.uint8), nan]))

    def decode_shards(self, payload, stride, nsrc, starts, offs, out, accumulate):
        k, kw = _kernels(out)
        if not self.relative:
            k.unpack_2bit_shards(payload, stride, nsrc, starts, offs, out, self.threshold,
                                 accumulate, **kw)
        else:
            k.unpack_2bit_rel_shards(payload, stride, nsrc, starts, offs, out,
                                     self.block_size, accumulate, **kw)


@register_compressor
class OneBit(Compressor):
    """``1bit``: Seide et al. 1-bit SGD, sign bits with per-block reconstruction.

    Bit 1 for ``x >= 0``, MSB first. Each block of ``block_size`` elements
    carries the pair (mean of its bit-0 elements, mean of its bit-1
    elements) as little-endian float32 after all the bits: the pairs cost
    8 bytes per ``block_size / 8`` bytes of bits (6.25% at 1024).
    """

    codec_id = "1bit"
    _params = {"block_size": 1024, "error_feedback": True}
    wire_range = "block means in float32, magnitudes up to 3.4e38"

    def _check(self):
        super()._check()
        b = self.block_size
        if isinstance(b, bool) or not isinstance(b, numbers.Integral) or b <= 0 or b % 8:
            raise ConfigError(f"1bit: block_size must be a positive multiple of 8, got {b!r}")
        self.block_size = int(b)

    def _nblocks(self, n):
        return (int(n) + self.block_size - 1) // self.block_size

    def chunk_align(self):
        return self.block_size

    def payload_nbytes(self, n, dtype=np.float32):
        return (int(n) + 7) // 8 + 8 * self._nblocks(n)

    def encode_into(self, x, e_in, e_out, payload, **kw):
        return self.encode_shards(x, e_in, e_out, payload, (0, x.size), (0,), **kw)

    def encode_shards(self, x, e_in, e_out, payload, starts, offs, **kw):
        # bits, then the pairs (little-endian float32) per shard
        k, kw = _kernels(x)
        return k.pack_1bit_shards(x, e_in, e_out, payload, starts, offs, self.block_size, **kw)

    def decode_shards(self, payload, stride, nsrc, starts, offs, out, accumulate):
        k, kw = _kernels(out)
        k.unpack_1bit_shards(payload, stride, nsrc, starts, offs, out, self.block_size,
                             accumulate, **kw)


@register_compressor
class TernGrad(Compressor):
    """``terngrad``: Wen et al. stochastic ternary quantization.

    Element i becomes ``s * sign(x_i) * b_i`` with ``b_i ~ Bernoulli(|x_i|/s)``
    (unbiased). In the collectives ``s`` is the maximum of ``max |x|`` over
    all ranks (one MAX reduction); with ``clip=c`` each rank first clips its
    values to ``c * std``. Codes use the 2bit layout, followed by ``s`` as a
    little-endian float32. Draws are reproducible: a counter-based hash of
    ``seed``, the rank, the call count and the element index.
    Error feedback is off by default (the method is unbiased).
    """

    codec_id = "terngrad"
    _params = {"seed": 0, "clip": None, "error_feedback": False}
    needs_global_scale = True
    wire_range = "the scale in float32, up to 3.4e38"

    def _check(self):
        super()._check()
        if isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral):
            raise ConfigError(f"terngrad: seed must be an integer, got {self.seed!r}")
        self.seed = int(self.seed)
        c = self.clip
        if c is not None:
            if (isinstance(c, bool) or not isinstance(c, numbers.Real)
                    or not math.isfinite(c) or c <= 0):
                raise ConfigError(f"terngrad: clip must be None or a number > 0 "
                                  f"(the paper uses 2.5), got {c!r}")
            self.clip = float(c)

    def payload_nbytes(self, n, dtype=np.float32):
        return (int(n) + 3) // 4 + 4 if n else 0

    def local_scale(self, x, e_in):
        """``(max |v| after clipping, clip bound, bad count)`` of
        ``v = x + e_in`` on this rank. The bad count is the number of
        non-finite values of ``v``, or, when they are all finite, 1 if the
        scale is beyond float32 (it travels as float32: float64 input)."""
        if x.size == 0:
            return 0.0, math.inf, 0
        k, kw = _kernels(x)
        return self.scale_of(k.stats(x, e_in, **kw), x.size)

    def scale_of(self, stats, n):
        """:meth:`local_scale` of ``n > 0`` values from their ``stats``, the
        kernels' ``(sum, sum of squares, max |v|, non-finite count)`` (the
        collectives compute them by their backend)."""
        s, ss, amax, nbad = stats
        bound = math.inf
        if self.clip is not None and nbad == 0:
            mean = s / n
            std = math.sqrt(max(ss / n - mean * mean, 0.0))
            if std > 0.0:  # values all equal (one element, say): nothing to clip
                bound = self.clip * std
                amax = min(amax, bound)
        if nbad == 0:
            with np.errstate(over="ignore"):
                nbad = int(not np.isfinite(np.float32(amax)))
        return amax, bound, nbad

    def encode_into(self, x, e_in, e_out, payload, **kw):
        return self.encode_shards(x, e_in, e_out, payload, (0, x.size), (0,), **kw)

    def encode_shards(self, x, e_in, e_out, payload, starts, offs, *, scale=None, stream=0,
                      offset=0, clip_bound=None, **kw):
        if x.size == 0:
            return 0
        nbad = 0
        if scale is None or clip_bound is None:
            amax, bound, nbad = self.local_scale(x, e_in)
            scale = amax if scale is None else scale
            clip_bound = bound if clip_bound is None else clip_bound
        with np.errstate(over="ignore"):  # counted by local_scale
            s32 = np.float32(scale)
        # codes, then the scale (little-endian float32) per shard
        k, kw = _kernels(x)
        nbad_pack = k.pack_ternary_shards(x, e_in, e_out, payload, starts, offs, s32,
                                          clip_bound, stream, offset, **kw)
        return max(nbad, nbad_pack)

    def mark_out_of_range(self, payload, n):
        """Every code ``11`` and the scale NaN: the payload decodes to NaN (an
        owner's sum that is NaN would otherwise get scale 0 and decode to 0)."""
        if n == 0:
            return
        nb = (n + 3) // 4
        _dispatch.put_bytes(payload, np.concatenate([np.full(nb, 0xFF, np.uint8),
                                                     np.array([np.nan], "<f4").view(np.uint8)]))

    def decode_shards(self, payload, stride, nsrc, starts, offs, out, accumulate):
        k, kw = _kernels(out)
        k.unpack_ternary_shards(payload, stride, nsrc, starts, offs, out, accumulate, **kw)
