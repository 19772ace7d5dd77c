"""Numba kernels of mpigc (installed as ``mpigc.kernels``).

``cpu`` holds the host kernels; ``cuda`` (when present) the device kernels with
the same names and signatures. Nothing is compiled or initialised at import:
the CPU kernels compile on first use (and are cached on disk), the CUDA module
is imported only by the dispatch layer when a device array is seen.
"""
