"""Loads the compiled extensions, registers their FFI targets and says whether kernels can run.

The production extension ``_jax_tma`` (the ops' targets) is registered on import. The test
extension ``_jax_tma_testing`` (the ops' ``_into`` variants, which write over a given buffer, and
the ``jax_tma_test_*`` primitive test kernels) is registered by ``register_testing``, which
jax_tma._testing calls; a wheel has none unless built with JAX_TMA_BUILD_TESTING=1.

Everything that decides "kernel or XLA" on the process level lives here: whether the
extension was built, whether the running jaxlib accepts its FFI API version, whether the
user disabled it (``JAX_TMA_DISABLE=1``), and what GPU is visible. Shape/dtype decisions
belong to the op modules.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import importlib.util
import os
import pathlib
import re
import sys
import warnings
from typing import Any

import jax


def _import_extension() -> tuple[Any, str | None]:
    """(the compiled extension, None), or (None, what happened): not built at all, or built but
    failing to load (then the loader's own message)."""
    name = f"{__package__}._jax_tma"
    spec = importlib.util.find_spec(name)
    if spec is None:
        return None, (
            "the jax_tma extension is not built: the install found no CUDA compiler (or was "
            "given JAX_TMA_BUILD_CUDA=0). Reinstall with nvcc on PATH or CUDACXX / CUDA_HOME "
            "pointing at a CUDA >= 12.8 toolkit; JAX_TMA_REQUIRE_KERNELS=1 makes a missing "
            "compiler an install error"
        )
    try:
        return importlib.import_module(name), None
    except ImportError as err:
        return None, f"the jax_tma extension {spec.origin} is built but fails to load: {err}"


_C, _IMPORT_ERROR = _import_extension()

HOPPER_CAPABILITY = "9.0"


def _runtime_ffi_api_minor() -> int | None:
    """XLA FFI API minor version of the running jaxlib, read from its headers."""
    try:
        header = pathlib.Path(jax.ffi.include_dir()) / "xla" / "ffi" / "api" / "c_api.h"
        match = re.search(r"#define XLA_FFI_API_MINOR (\d+)", header.read_text())
    except (OSError, AttributeError):
        return None
    return int(match.group(1)) if match else None


def _jaxlib_version() -> str:
    try:
        return importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        return "(unknown version)"


def _register(module: Any, what: str) -> str | None:
    """Registers every FFI target of a compiled extension (`what` names it in the error);
    returns why it could not, or None."""
    runtime_minor = _runtime_ffi_api_minor()
    if runtime_minor is not None and module.ffi_api_minor > runtime_minor:
        return (
            f"{what} was built against XLA FFI API 0.{module.ffi_api_minor} but the "
            f"installed jaxlib {_jaxlib_version()} provides 0.{runtime_minor}; rebuild "
            "jax_tma against this jaxlib"
        )
    for name, capsule in module.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
    return None


_REGISTRATION_ERROR = _IMPORT_ERROR if _C is None else _register(_C, "the extension")


@functools.cache
def register_testing() -> str | None:
    """Registers the FFI targets of the test extension ``_jax_tma_testing``: the ops' ``_into``
    variants (poison=True) and the primitive test kernels (``jax_tma_test_*``). Returns None
    once they are registered, otherwise why not (a missing or unloadable extension, named); the
    calls that need them then fail in XLA for want of a handler. The first call does the work;
    later calls return the same answer."""
    if _REGISTRATION_ERROR is not None:
        return f"the test extension needs the jax_tma extension, and {_REGISTRATION_ERROR}"
    name = f"{__package__}._jax_tma_testing"
    spec = importlib.util.find_spec(name)
    if spec is None:
        return (
            f"the jax_tma test extension {name} is not built: wheels leave it out (an editable "
            "install, `pip install -e .`, builds it; JAX_TMA_BUILD_TESTING=1 builds it for any "
            "install). It runs the primitive tests, the NaN-poisoned output tests and the copy "
            "benchmark"
        )
    try:
        module = importlib.import_module(name)
    except ImportError as err:
        return f"the jax_tma test extension {spec.origin} is built but fails to load: {err}"
    return _register(module, "the test extension")


_TRUE_WORDS = ("1", "true", "yes", "on", "y", "t")
_FALSE_WORDS = ("0", "false", "no", "off", "n", "f")


def env_flag(name: str, *, default: bool, on: str, off: str) -> bool:
    """A boolean environment variable, read (case-insensitive, surrounding spaces ignored) each
    time it is asked: 1, true, yes, on, y, t are True; 0, false, no, off, n, f are False; unset
    or empty is `default`. Any other value raises ValueError naming the variable and what
    each choice does (`on`, `off`)."""
    value = os.environ.get(name, "")
    word = value.strip().lower()
    if not word:
        return default
    if word in _TRUE_WORDS:
        return True
    if word in _FALSE_WORDS:
        return False
    unset = " (or leave it unset)"
    raise ValueError(
        f"{name}={value!r} is not a boolean: use one of {', '.join(_TRUE_WORDS)} {on}"
        f"{unset if default else ''}, or one of {', '.join(_FALSE_WORDS)}"
        f"{'' if default else unset} {off}"
    )


def kernel_always() -> bool:
    """True when ``JAX_TMA_KERNEL_ALWAYS`` asks the GEMM lowering to take the kernel for every
    product it can compute, also those it leaves to XLA's dot as faster there
    (jax_tma.ops.gemm.config.xla_reason): tests of the kernel on small products, measurements.
    Read at lowering time (env_flag's words; unset: XLA takes those products)."""
    return env_flag("JAX_TMA_KERNEL_ALWAYS", default=False,
                    on="to run the kernel also where XLA's dot is faster",
                    off="to leave XLA's dot the products it computes faster")


def disabled_by_env() -> bool:
    """True when ``JAX_TMA_DISABLE`` asks for the XLA path everywhere (env_flag's words; unset
    keeps the kernels). Any other value raises ValueError at the first op, not at import."""
    return env_flag("JAX_TMA_DISABLE", default=False, on="to run every op through XLA",
                    off="to use the kernels")


def extension_error() -> str | None:
    """Why the extension's handlers are not registered, or None when they are."""
    return _REGISTRATION_ERROR


def cuda_devices() -> list[Any]:
    """The visible CUDA devices (empty on a machine without a CUDA backend)."""
    try:
        return list(jax.devices("cuda"))
    except RuntimeError:
        return []


def _device_attribute(device: Any, query: str):
    """The extension's `query` for a CUDA device by ordinal; None without the extension or
    where the driver does not say (the query returns 0)."""
    ordinal = getattr(device, "local_hardware_id", None)
    if _C is None or ordinal is None:
        return None
    value = getattr(_C, query)(int(ordinal))
    return value if value > 0 else None


def peak_dram_bytes_per_s(device: Any) -> float | None:
    """Peak DRAM bandwidth of a CUDA device in bytes per second, from the memory clock and bus
    width its driver reports; None without the extension or where the driver does not say."""
    return _device_attribute(device, "peak_dram_bytes_per_s")


def l2_cache_bytes(device: Any) -> int | None:
    """Bytes of L2 cache of a CUDA device; None without the extension or where the driver does
    not say."""
    return _device_attribute(device, "l2_cache_bytes")


def non_hopper_reason(devices: list[Any]) -> str | None:
    """None when every device is compute capability 9.0, otherwise which one is not."""
    for dev in devices:
        cap = getattr(dev, "compute_capability", None)
        if cap != HOPPER_CAPABILITY:
            return (
                f"{dev.device_kind} (compute capability {cap}) is not a Hopper GPU; the "
                "kernels are built for sm_90a"
            )
    return None


@dataclasses.dataclass(frozen=True)
class KernelStatus:
    """Whether jax_tma's kernels run on the default backend, and why not if they don't."""

    available: bool
    reason: str
    device: str


def kernel_status() -> KernelStatus:
    """Reports whether ops traced now would run the Hopper kernels on the default backend."""
    device = jax.devices()[0]
    desc = f"{device.device_kind} ({device.platform})"
    if disabled_by_env():
        return KernelStatus(False, "JAX_TMA_DISABLE is set", desc)
    if _REGISTRATION_ERROR is not None:
        return KernelStatus(False, _REGISTRATION_ERROR, desc)
    if device.platform != "gpu" or not cuda_devices():
        return KernelStatus(False, f"kernels compiled, but no CUDA GPU here: the default backend "
                                   f"is {device.platform}", desc)
    reason = non_hopper_reason(cuda_devices())
    if reason is not None:
        return KernelStatus(False, reason, desc)
    return KernelStatus(True, "Hopper GPU and compiled kernels present", desc)


@functools.cache
def warn_if_unavailable() -> None:
    """Once per process: warn when kernels cannot run and the user did not ask for that."""
    status = kernel_status()
    if not status.available and not disabled_by_env():
        warnings.warn(
            f"jax_tma: Hopper kernels are not in use ({status.reason}); ops run through XLA.",
            RuntimeWarning,
            stacklevel=_caller_stacklevel(),
        )


def _caller_stacklevel() -> int:
    """warnings.warn's stacklevel of the first frame outside jax_tma and jax, counted from
    warn_if_unavailable's caller: the user's line, also when the op is traced under jit."""
    skip = tuple(os.path.dirname(m.__file__) + os.sep for m in (jax, _package()))
    frame, level = sys._getframe(2), 2  # warnings.warn counts itself as level 1
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame, level = frame.f_back, level + 1
    return level


def _package():
    return importlib.import_module(__package__)


def cuda_lowering_blocker() -> str | None:
    """Why a CUDA lowering must not emit jax_tma custom calls, or None when it may.

    When no CUDA device is visible (cross-lowering, ``jax.export``), Hopper is assumed.
    """
    if disabled_by_env():
        return "JAX_TMA_DISABLE is set"
    if _REGISTRATION_ERROR is not None:
        return _REGISTRATION_ERROR
    return non_hopper_reason(cuda_devices())
