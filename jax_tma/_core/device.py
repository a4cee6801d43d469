"""Facts about the device the kernels run on, for the configuration heuristics: SM count, L2
size and peak DRAM bandwidth, read from the first visible CUDA device (the extension's driver
queries) and defaulting to an H100's or H200's where there is none (cross-lowering, CPU
machines)."""

from __future__ import annotations

from jax_tma import _ext

# What the heuristics assume where no CUDA device answers.
DEFAULT_NUM_SMS = 132  # an H100's or H200's
DEFAULT_L2_BYTES = 50 * 2**20  # an H100's or H200's
DEFAULT_DRAM_BYTES_PER_S = 4.81e12  # an H200's


def _device_fact(query, default):
    """`query` (an _ext device query) of the device the kernels run on, or `default` where
    there is none or the driver does not say."""
    devices = _ext.cuda_devices()
    found = query(devices[0]) if devices else None
    return found or default


def num_sms() -> int:
    """Streaming multiprocessors of the device the kernels run on."""
    devices = _ext.cuda_devices()
    return int(getattr(devices[0], "core_count", DEFAULT_NUM_SMS)) if devices else DEFAULT_NUM_SMS


def dram_bytes_per_s() -> float:
    """Peak DRAM bandwidth of the device the kernels run on (the heuristics' memory model)."""
    return _device_fact(_ext.peak_dram_bytes_per_s, DEFAULT_DRAM_BYTES_PER_S)


def l2_bytes() -> int:
    """L2 cache of the device the kernels run on (the heuristics' model of stream-K)."""
    return _device_fact(_ext.l2_cache_bytes, DEFAULT_L2_BYTES)
