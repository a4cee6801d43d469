"""jax_tma.matmul against XLA's dot (and the Pallas Mosaic-GPU Hopper matmul where it runs):
one harness, a shape suite, a Markdown table, JSON and plots.

Every contender runs through jax_tma._timing.compare in the same run: each timed call evaluates
several products on distinct operand buffers (together larger than L2) inside one jit; rounds
alternate between contenders; on a GPU the time is the sum of the kernel durations of the call
(CUPTI, so dispatch does not count), reported as the median per product with the half
min-max spread. Outputs are checked against XLA before timing.

    python benchmarks/bench_gemm.py                  # the suite of the fast-matmul issue
    python benchmarks/bench_gemm.py --quick          # a handful of shapes, under a minute
    python benchmarks/bench_gemm.py --shapes 4096,4096,4096 1,4096,4096 --dtype fp16
    python benchmarks/bench_gemm.py --sweep --shapes 8192,8192,8192   # every legal config
    python benchmarks/bench_gemm.py --dry-run        # tiny shapes; runs without a GPU (CI)

Results go to benchmarks/results/<device>/ (bench_gemm.json, bench_gemm.md, bench_gemm.png).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_tma
from jax_tma import _timing, gemm

SUITE = [
    # square
    (1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096), (8192, 8192, 8192),
    (16384, 16384, 16384),
    # 16384 tokens through 8B-class projections
    (16384, 6144, 4096), (16384, 4096, 4096), (16384, 28672, 4096), (16384, 4096, 14336),
    # 8192 tokens through 70B-class projections
    (8192, 10240, 8192), (8192, 57344, 8192), (8192, 8192, 28672),
    # decode-like
    (1, 4096, 4096), (16, 6144, 4096), (64, 28672, 4096), (128, 4096, 14336),
    # odd
    (3000, 5000, 2048), (1000, 1000, 1000), (4095, 4097, 4096), (512, 512, 65536),
]
QUICK = [(4096, 4096, 4096), (8192, 8192, 8192), (16, 6144, 4096), (512, 512, 65536),
         (4095, 4097, 4096)]
DRY_RUN = [(64, 64, 64), (7, 129, 72)]
DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16}
L2_BYTES = 50 * 2**20
BUFFER_BUDGET = 4 * 2**30  # operand bytes allotted per shape


@dataclasses.dataclass
class Row:
    shape: tuple[int, int, int]
    contender: str
    seconds: float | None
    spread_s: float | None
    note: str = ""

    def tflops(self) -> float | None:
        return None if self.seconds is None else _timing.tflops(*self.shape, self.seconds)


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a handful of shapes")
    p.add_argument("--shapes", nargs="+", metavar="M,N,K", help="ad-hoc shapes")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--sweep", action="store_true", help="time every legal kernel configuration")
    p.add_argument("--no-pallas", action="store_true", help="skip the Pallas Mosaic-GPU matmul")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iterations", type=int, default=3, help="timed calls per round")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results"))
    p.add_argument("--dry-run", action="store_true",
                   help="tiny shapes, 1 round, no files; exercises the harness without a GPU")
    args = p.parse_args(argv)
    if args.shapes:
        args.shape_list = [tuple(int(x) for x in s.split(",")) for s in args.shapes]
        if any(len(s) != 3 or min(s) < 1 for s in args.shape_list):
            p.error(f"--shapes takes M,N,K triples of positive ints, got {args.shapes}")
    else:
        args.shape_list = DRY_RUN if args.dry_run else QUICK if args.quick else SUITE
    if args.dry_run:
        args.rounds, args.iterations = 1, 1
    return args


def _pallas_contender(dtype):
    """The Hopper matmul shipped with Pallas (fixed tiles), or None where it does not import."""
    try:
        from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm
    except Exception:  # noqa: BLE001
        return None
    config = hm.TuningConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4,
                             grid_minor_dim=hm.MatmulDimension.N, grid_tile_width=8,
                             wg_dimension=hm.MatmulDimension.N)

    def fits(m, n, k):
        return m % config.tile_m == 0 and n % config.tile_n == 0 and k % config.tile_k == 0

    def run(a, b):
        return hm.matmul(a, b, None, config)

    return run, fits


def _operand_sets(m, n, k, dtype, key):
    per_set = (m * k + k * n) * jnp.dtype(dtype).itemsize
    count = max(2, math.ceil(2 * L2_BYTES / per_set))
    count = int(min(count, 16, max(2, BUFFER_BUDGET // per_set)))
    return _timing.random_operands(key, [(m, k), (k, n)], dtype, count)


def _check(name, fn, ops, ref) -> str:
    out = jax.jit(fn)(*ops)
    err = _timing.relative_error(out, ref)
    return "" if err <= 2e-2 else f"{name}: rel. error {err:.2e} vs XLA"


def bench_shape(shape, dtype, args, pallas) -> list[Row]:
    m, n, k = shape
    sets = _operand_sets(m, n, k, dtype, jax.random.key(m * 31 + n * 7 + k))
    ref = jax.jit(jnp.matmul)(*sets[0])
    contenders = {"jax_tma": jax_tma.matmul, "xla": jnp.matmul}
    if args.sweep:
        for cfg in _sweep_configs(m, n, k, dtype):
            contenders[f"jax_tma[{cfg.describe()}]"] = (
                lambda a, b, cfg=cfg: jax_tma.matmul(a, b, config=cfg))
    if pallas is not None and pallas[1](m, n, k):
        contenders["pallas_mgpu"] = pallas[0]
    notes = {}
    for name in list(contenders):
        try:
            problem = _check(name, contenders[name], sets[0], ref)
        except Exception as e:  # noqa: BLE001 - a contender that cannot run this shape
            problem = f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
        if problem:
            notes[name] = problem
            if name != "jax_tma":
                del contenders[name]
    if "jax_tma" in notes:
        raise RuntimeError(notes["jax_tma"])
    timings = _timing.compare(contenders, sets, rounds=args.rounds, iterations=args.iterations)
    rows = [Row(shape, name, t.median_s, t.spread_s) for name, t in timings.items()]
    rows += [Row(shape, name, None, None, note) for name, note in notes.items()]
    return rows


def _sweep_configs(m, n, k, dtype):
    for tile in gemm.COMPILED_CONFIGS:
        for split in (1, 2, 4, 8):
            cfg = dataclasses.replace(tile, split_k=split)
            if split > 1 and cfg.splits_for(k) != split:
                continue
            try:
                gemm.check_config(cfg, m, n, k, dtype)
            except ValueError:
                continue
            yield cfg


def _environment() -> dict:
    dev = jax.devices()[0]
    env = {"device": dev.device_kind, "platform": dev.platform, "jax": jax.__version__,
           "timing": _timing.timing_method(), "date": time.strftime("%Y-%m-%d")}
    try:
        env["driver"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, check=True).stdout.strip().splitlines()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        env["driver"] = None
    try:
        import jaxlib.cuda._versions as cuda_versions  # type: ignore[import-not-found]
        env["cuda_runtime"] = cuda_versions.cuda_runtime_get_version()
    except Exception:  # noqa: BLE001
        env["cuda_runtime"] = None
    try:
        env["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                       text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        env["commit"] = None
    env["jax_tma_kernel"] = jax_tma.kernel_status().available
    return env


def _table(rows: list[Row], env: dict) -> str:
    peak = max((r.tflops() for r in rows if r.seconds), default=0.0)
    by_shape: dict = {}
    for r in rows:
        by_shape.setdefault(r.shape, {})[r.contender] = r
    lines = [
        f"{env['device']}, driver {env['driver']}, jax {env['jax']}, {env['date']}, "
        f"timing: {env['timing']}; % of peak = of the highest TFLOP/s measured in this run "
        f"({peak:.1f})",
        "",
        "| M×N×K | jax_tma µs | jax_tma TFLOP/s | % peak | XLA µs | XLA TFLOP/s | ratio (XLA time / jax_tma time) |",
        "|---|---|---|---|---|---|---|",
    ]
    ratios = []
    for shape, found in by_shape.items():
        ours, xla = found.get("jax_tma"), found.get("xla")
        if not (ours and xla and ours.seconds and xla.seconds):
            continue
        ratio = xla.seconds / ours.seconds
        ratios.append(ratio)
        lines.append(
            f"| {'×'.join(map(str, shape))} | {ours.seconds * 1e6:.1f} ± {ours.spread_s * 1e6:.1f} "
            f"| {ours.tflops():.1f} | {100 * ours.tflops() / peak:.0f} | {xla.seconds * 1e6:.1f} "
            f"| {xla.tflops():.1f} | {ratio:.3f} |")
    if ratios:
        lines += ["", f"geometric mean of the ratio: {math.exp(np.mean(np.log(ratios))):.3f} "
                      f"over {len(ratios)} shapes; slowest: {min(ratios):.3f}"]
    others = sorted({r.contender for r in rows} - {"jax_tma", "xla"})
    for name in others:
        lines += ["", f"{name}:"]
        for r in rows:
            if r.contender == name:
                what = f"{r.seconds * 1e6:.1f} µs, {r.tflops():.1f} TFLOP/s" if r.seconds else r.note
                lines.append(f"- {'×'.join(map(str, r.shape))}: {what}")
    return "\n".join(lines)


def _plot(rows: list[Row], path: pathlib.Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    shapes = list(dict.fromkeys(r.shape for r in rows))
    names = [c for c in ("jax_tma", "xla", "pallas_mgpu") if any(r.contender == c for r in rows)]
    value = {(r.shape, r.contender): r.tflops() or 0.0 for r in rows}
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(8, 0.7 * len(shapes)), 8))
    x = np.arange(len(shapes))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        ax1.bar(x + i * width, [value.get((s, name), 0.0) for s in shapes], width, label=name)
    labels = ["×".join(map(str, s)) for s in shapes]
    ax1.set_ylabel("TFLOP/s")
    ax1.set_xticks(x + width * (len(names) - 1) / 2, labels, rotation=60, ha="right", fontsize=7)
    ax1.legend()
    ratio = [value.get((s, "jax_tma"), 0) / value[(s, "xla")] if value.get((s, "xla")) else 0
             for s in shapes]
    ax2.bar(x, ratio, color=["tab:green" if r >= 1 else "tab:red" for r in ratio])
    ax2.axhline(1.0, color="black", linewidth=0.8)
    ax2.set_ylabel("jax_tma speed / XLA speed")
    ax2.set_xticks(x, labels, rotation=60, ha="right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv=None) -> int:
    args = _parse(argv)
    dtype = DTYPES[args.dtype]
    env = _environment()
    print(f"{env['device']} | driver {env['driver']} | jax {env['jax']} | timing {env['timing']}"
          f" | jax_tma kernel {'on' if env['jax_tma_kernel'] else 'off (XLA path)'}", flush=True)
    pallas = None if args.no_pallas or args.dry_run else _pallas_contender(dtype)
    rows: list[Row] = []
    for i, shape in enumerate(args.shape_list):
        print(f"[{i + 1}/{len(args.shape_list)}] {'x'.join(map(str, shape))} ...", end="",
              file=sys.stderr, flush=True)
        new = bench_shape(shape, dtype, args, pallas)
        rows += new
        best = {r.contender: r for r in new if r.seconds}
        ours, xla = best.get("jax_tma"), best.get("xla")
        print(f" jax_tma {ours.tflops():.1f} vs XLA {xla.tflops():.1f} TFLOP/s",
              file=sys.stderr, flush=True)
        if args.sweep:
            for r in sorted((r for r in new if r.seconds), key=lambda r: r.seconds):
                print(f"    {r.seconds * 1e6:10.1f} us {r.tflops():7.1f} TFLOP/s  {r.contender}")
    table = _table(rows, env)
    print(table)
    if args.dry_run:
        return 0
    out = args.out / env["device"].lower().replace(" ", "-")
    out.mkdir(parents=True, exist_ok=True)
    stem = "bench_gemm_sweep" if args.sweep else "bench_gemm"
    (out / f"{stem}.json").write_text(json.dumps(
        {"environment": env, "dtype": args.dtype,
         "rows": [dict(dataclasses.asdict(r), tflops=r.tflops()) for r in rows]}, indent=1))
    (out / f"{stem}.md").write_text(table + "\n")
    plotted = _plot(rows, out / f"{stem}.png")
    print(f"wrote {out}/{stem}.json, .md" + (", .png" if plotted else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
