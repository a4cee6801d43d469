"""``python -m jax_tma``: which GEMM path runs here, is it right, and how fast.

Prints the device, whether the Hopper kernel or the XLA fallback ran (read from the compiled
HLO) and why, the relative error against XLA's dot and against a float64 reference, and the
TFLOP/s of jax_tma.matmul and XLA's dot measured by the same harness in the same run (where the
kernel ran: elsewhere both would be XLA's dot).
"""

from __future__ import annotations

import argparse
import importlib.metadata

import jax
import jax.numpy as jnp
import numpy as np

import jax_tma
from jax_tma import _timing
from jax_tma.ops.gemm import primitive as gemm
from jax_tma.ops.gemm.plan import MATMUL_DIMS


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jax_tma", description=__doc__)
    p.add_argument("--shape", type=int, nargs=3, metavar=("M", "N", "K"), default=None,
                   help="GEMM shape (default 8192^3 on a GPU, 512^3 otherwise)")
    p.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    p.add_argument("--reps", type=int, default=None, help="products per timed call")
    return p.parse_args()


def main() -> None:
    args = _parse()
    status = jax_tma.kernel_status()
    on_gpu = jax.devices()[0].platform == "gpu"
    m, n, k = args.shape or ((8192, 8192, 8192) if on_gpu else (512, 512, 512))
    dtype = jnp.dtype(args.dtype)
    reps = args.reps or (8 if on_gpu else 2)
    dev = jax.devices()[0]
    print(f"jax_tma {jax_tma.__version__} | jax {jax.__version__} | jaxlib "
          f"{importlib.metadata.version('jaxlib')}")
    print(f"device: {dev.device_kind} (platform {dev.platform}"
          + (f", compute capability {dev.compute_capability})" if on_gpu else ")"))

    def ours(a, b):
        return jax_tma.matmul(a, b)

    def xla(a, b):
        return jnp.matmul(a, b)

    sets = _timing.random_operands(jax.random.key(0), [(m, k), (k, n)], dtype, reps)
    hlo = jax.jit(ours).lower(*sets[0]).compile().as_text()
    avals = jax.ShapeDtypeStruct((m, k), dtype), jax.ShapeDtypeStruct((k, n), dtype)
    # The kernel's route and configuration, before the rule that leaves products to XLA.
    choice = gemm.kernel_choice(*avals, MATMUL_DIMS, dtype, xla_when_faster=False)
    on_kernel = gemm.KERNEL_TARGET in hlo
    if on_kernel:
        print(f"path: jax_tma kernel ({gemm.KERNEL_TARGET}; {choice[1].describe()})")
    elif not status.available:
        print(f"path: XLA fallback ({status.reason})")
    else:
        why = choice and gemm.why_xla(*choice, *avals, dtype)
        print(f"path: XLA's dot ({why or 'the kernel takes no configuration of this product'})")

    a, b = sets[0]
    out, ref_xla = jax.jit(ours)(a, b), jax.jit(xla)(a, b)
    print(f"check {m}x{n}x{k} {dtype.name}: rel. error vs XLA dot "
          f"{_timing.relative_error(out, ref_xla):.2e}")
    small = (min(m, 1024), min(n, 1024), k)
    a64 = np.asarray(a[: small[0]], np.float64)
    b64 = np.asarray(b[:, : small[1]], np.float64)
    err64 = _timing.relative_error(np.asarray(out[: small[0], : small[1]]), a64 @ b64)
    print(f"check first {small[0]}x{small[1]} block vs float64 reference: rel. error {err64:.2e}")

    if not on_kernel:
        # Both contenders would be XLA's dot: a ratio would compare XLA with itself.
        print("timing: skipped (jax_tma.matmul ran XLA's dot here; nothing to compare)")
        return
    timings = _timing.compare({"jax_tma": ours, "xla": xla}, sets)
    t_ours, t_xla = timings["jax_tma"], timings["xla"]
    print(f"timing: {_timing.timing_method()} (median per product, {t_ours.samples} samples, "
          f"rounds alternating between the two)")
    f_ours = _timing.tflops(m, n, k, t_ours.median_s)
    f_xla = _timing.tflops(m, n, k, t_xla.median_s)
    print(f"jax_tma.matmul: {t_ours.median_s * 1e6:10.1f} us  {f_ours:7.1f} TFLOP/s")
    print(f"XLA dot:        {t_xla.median_s * 1e6:10.1f} us  {f_xla:7.1f} TFLOP/s")
    print(f"speed ratio jax_tma / XLA: {t_xla.median_s / t_ours.median_s:.3f}x")


if __name__ == "__main__":
    main()
