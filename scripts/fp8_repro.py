"""Which FP8 kernel configurations fault or go wrong on the GPU: every compiled tile x
which block scales the kernel loads (none, A's, B's, both) x an aligned and a ragged shape,
e4m3 -> bf16, each against a float64 reference over a NaN-poisoned output.

A case that faults takes its process down, so the driver runs the cases in a child process,
which prints each case's name before running it; after a crash the driver names the case that
crashed and starts a new child at the next case. One line per case, then a summary.

    python3 scripts/fp8_repro.py            # the whole matrix
    python3 scripts/fp8_repro.py --only 3   # case 3 alone (in this process)

Written to find the fault of B's block-scale load (docs/fp8.md); kept as the quickest check
that no scale form of any tile crashes.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

SHAPES = ((512, 512, 512), (1000, 776, 1040))
SCALES = ("none", "a", "b", "both")


def cases():
    # NOTE: imported here: the driver does not import jax.
    from jax_tma.ops.fp8 import config as fp8_config  # noqa: PLC0415

    return [(cfg, scales, shape) for cfg in fp8_config.FP8_CONFIGS for scales in SCALES
            for shape in SHAPES]


def run_case(case) -> str:
    import functools  # noqa: PLC0415

    import jax  # noqa: PLC0415
    import ml_dtypes  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    import jax_tma  # noqa: PLC0415
    from jax_tma.ops.fp8 import primitive as fp8  # noqa: PLC0415
    from jax_tma.ops.fp8 import quantize as fp8_quantize  # noqa: PLC0415

    cfg, scales, (m, n, k) = case
    rng = np.random.default_rng(0)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    a_block = (1, 128) if scales in ("a", "both") else None
    b_block = (128, 128) if scales in ("b", "both") else None
    a, sa = jax_tma.quantize_fp8(x, a_block)
    b, sb = jax_tma.quantize_fp8(w, b_block)
    ref = (np.asarray(fp8_quantize.dequantize_fp8(a, sa, a_block), np.float64)
           @ np.asarray(fp8_quantize.dequantize_fp8(b, sb, b_block), np.float64).T)
    rest = []
    if a_block:
        rest.append(sa)
    if b_block:
        rest.append(sb)
    row = fp8.NONE if a_block else fp8.SCALAR
    col = fp8.NONE if b_block else fp8.SCALAR
    if not a_block:
        rest.append(sa)  # per-tensor: the epilogue's one value
    if not b_block:
        rest.append(sb)
    fn = jax.jit(functools.partial(
        fp8._kernel_call, has_sa=bool(a_block), has_sb=bool(b_block), row_scale=row,
        col_scale=col, has_bias=False, out_dtype=np.dtype(ml_dtypes.bfloat16), config=cfg,
        poison=True))
    out = np.asarray(jax.block_until_ready(fn(a, b, *rest)), np.float64)
    if np.isnan(out).any():
        return f"WRONG ({int(np.isnan(out).sum())} unwritten outputs)"
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    return f"{'ok' if err <= 1e-2 else 'WRONG'} (relative error {err:.2e})"


def name(case) -> str:
    cfg, scales, shape = case
    return f"{'x'.join(map(str, cfg.tile))} scales={scales} {'x'.join(map(str, shape))}"


def child(start: int) -> None:
    all_cases = cases()
    for i in range(start, len(all_cases)):
        print(f"RUN {i} {name(all_cases[i])}", flush=True)
        print(f"RESULT {i} {run_case(all_cases[i])}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", type=int, help="run this case in this process")
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.only is not None:
        case = cases()[args.only]
        print(name(case), run_case(case), flush=True)
        return 0
    if args.child is not None:
        child(args.child)
        return 0
    total = len(cases())
    results: dict[int, str] = {}
    start = 0
    while start < total:
        proc = subprocess.run([sys.executable, __file__, "--child", str(start)],
                              capture_output=True, text=True, timeout=600,
                              check=False)
        running = None
        for line in proc.stdout.splitlines():
            if line.startswith("RUN "):
                running = int(line.split()[1])
            elif line.startswith("RESULT "):
                i, text = line.split(" ", 2)[1:]
                results[int(i)] = text
                running = None
        if running is None:
            break
        tail = " | ".join(line for line in proc.stderr.splitlines()[-40:]
                          if "rror" in line or "ILLEGAL" in line or "illegal" in line)[-300:]
        results[running] = f"CRASH rc={proc.returncode}: {tail}"
        start = running + 1
    for i, case in enumerate(cases()):
        print(f"{i:3d} {name(case):40s} {results.get(i, 'not run')}")
    bad = sum(not results.get(i, "").startswith("ok") for i in range(total))
    print(f"{total} cases, {bad} crashed or wrong")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
