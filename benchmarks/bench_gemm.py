"""jax_tma.matmul against XLA's dot (and the Pallas Mosaic-GPU Hopper matmul where it runs):
one harness, shape suites (2-D and batched), a Markdown table, JSON and plots.

Every contender runs through jax_tma._timing.compare in the same run: each timed call evaluates
several products on distinct operand buffers (together larger than L2) inside one jit; rounds
alternate between contenders; on a GPU the time is the sum of the kernel durations of the call
(CUPTI, so dispatch does not count), reported as the median per product with the half
min-max spread. Outputs are checked against XLA before timing.

    python benchmarks/bench_gemm.py                  # the suite of the fast-matmul issue
    python benchmarks/bench_gemm.py --quick          # a handful of shapes, under a minute
    python benchmarks/bench_gemm.py --batched        # attention-like [B,M,K] @ [B,K,N]
    python benchmarks/bench_gemm.py --shapes 4096,4096,4096 32,2048,2048,128 --dtype fp16
    python benchmarks/bench_gemm.py --sweep --shapes 8192,8192,8192   # every legal config
    python benchmarks/bench_gemm.py --quick --layout NT   # b stored [N, K] (dot_general)
    python benchmarks/bench_gemm.py --breakdown --shapes 1,4096,4096  # kernels and durations
    python benchmarks/bench_gemm.py --read-once      # also time reading the operands once
    python benchmarks/bench_gemm.py --dry-run        # tiny shapes; runs without a GPU (CI)
    python benchmarks/bench_gemm.py --commit abc1234 # the commit that ran, if .git is stale

--read-once adds a contender that only reads both operands once (XLA's fp32 row sums of each):
a reference for products bound by memory, listed in GB/s of operand bytes beside jax_tma's
read rate and kept out of the ratio. It is no bound: a GEMM may read faster than XLA's
reductions do.

A shape is M,N,K (a[M,K] @ b[K,N]) or B,M,N,K (a[B,M,K] @ b[B,K,N]); every suite runs in bf16
or fp16. --layout NT/TN/TT stores b as [N, K] and/or a as [K, M] and times
jax_tma.dot_general against lax.dot_general on them (2-D shapes). Results go to
benchmarks/results/<device>/: bench_gemm[_batched][_sweep][_<layout>][_fp16] .json, .md and .png
(a dry run writes files only when --out is given).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.metadata
import json
import math
import pathlib
import re
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
from jax import lax
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
# (B, M, N, K): attention-like products over heads (scores [S,D] @ [D,S], then weights [S,S] @
# values [S,D]) and a few experts of a mixture-of-experts layer.
BATCHED_SUITE = [
    (32, 2048, 2048, 128), (32, 2048, 128, 2048),
    (8, 4096, 4096, 128), (8, 4096, 128, 4096),
    (64, 1024, 1024, 64), (64, 1024, 64, 1024),
    (16, 8192, 8192, 128), (16, 8192, 128, 8192),
    (8, 2048, 4096, 4096), (8, 512, 14336, 4096),
]
BATCHED_QUICK = [(32, 2048, 2048, 128), (32, 2048, 128, 2048), (8, 2048, 4096, 4096)]
BATCHED_DRY_RUN = [(2, 64, 64, 64), (3, 7, 129, 72)]
DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16}
LAYOUTS = ("NN", "NT", "TN", "TT")  # a then b: N as in a[M, K] @ b[K, N], T stored transposed
L2_BYTES = 50 * 2**20
READ_ONCE = "read_once"  # the --read-once contender
BUFFER_BUDGET = 4 * 2**30  # operand bytes allotted per shape


@dataclasses.dataclass
class Row:
    shape: tuple[int, ...]  # (M, N, K) or (B, M, N, K)
    contender: str
    seconds: float | None
    spread_s: float | None
    note: str = ""

    def tflops(self) -> float | None:
        if self.seconds is None or self.contender == READ_ONCE:
            return None
        return 2.0 * math.prod(self.shape) / self.seconds / 1e12


def _split(shape: tuple[int, ...]) -> tuple[tuple[int, ...], int, int, int]:
    """(batch dims, M, N, K) of a shape."""
    return shape[:-3], *shape[-3:]


def _label(shape: tuple[int, ...]) -> str:
    return "×".join(map(str, shape))


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a handful of shapes")
    p.add_argument("--batched", action="store_true",
                   help="the batched suite: [B,M,K] @ [B,K,N] (attention-like shapes)")
    p.add_argument("--shapes", nargs="+", metavar="[B,]M,N,K",
                   help="ad-hoc shapes: M,N,K for 2-D products, B,M,N,K for batched ones")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--layout", choices=sorted(LAYOUTS), default="NN",
                   help="operand layout: T stores a as [K, M] (first letter) or b as [N, K]")
    p.add_argument("--sweep", action="store_true", help="time every legal kernel configuration")
    p.add_argument("--splits", default="1,2,4,8", metavar="S,S,...",
                   help="split-K factors the sweep tries (default 1,2,4,8)")
    p.add_argument("--breakdown", action="store_true",
                   help="also print the kernels each contender launches, with their durations")
    p.add_argument("--no-pallas", action="store_true", help="skip the Pallas Mosaic-GPU matmul")
    p.add_argument("--read-once", action="store_true",
                   help="also time reading both operands once (XLA row sums): a reference for "
                        "products bound by memory")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iterations", type=int, default=3, help="timed calls per round")
    p.add_argument("--out", type=pathlib.Path, default=None,
                   help="results directory (default benchmarks/results; files go to "
                        "<out>/<device>/)")
    p.add_argument("--commit", help="commit to record in the JSON instead of `git rev-parse "
                                    "HEAD` (for a checkout whose .git is stale)")
    p.add_argument("--dry-run", action="store_true",
                   help="tiny shapes, 1 round; files only with --out; exercises the harness "
                        "without a GPU")
    args = p.parse_args(argv)
    try:
        args.split_list = tuple(int(x) for x in args.splits.split(","))
    except ValueError:
        args.split_list = ()
    if not args.split_list or min(args.split_list) < 1:
        p.error(f"--splits takes positive ints separated by commas, got {args.splits!r}")
    if args.shapes:
        try:
            args.shape_list = [tuple(int(x) for x in s.split(",")) for s in args.shapes]
        except ValueError:
            args.shape_list = []
        if not args.shape_list or any(len(s) not in (3, 4) or min(s) < 1
                                      for s in args.shape_list):
            p.error("--shapes takes M,N,K triples or B,M,N,K quadruples of positive ints, "
                    f"got {args.shapes}")
    elif args.batched:
        args.shape_list = (BATCHED_DRY_RUN if args.dry_run else BATCHED_QUICK if args.quick
                           else BATCHED_SUITE)
    else:
        args.shape_list = DRY_RUN if args.dry_run else QUICK if args.quick else SUITE
    if args.layout != "NN" and any(len(s) != 3 for s in args.shape_list):
        p.error("--layout applies to 2-D (M,N,K) shapes")
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


def operand_bytes(shape: tuple[int, ...], itemsize: int) -> int:
    """Bytes of both operands of a [B,]M,N,K product."""
    batch, m, n, k = _split(shape)
    return math.prod(batch) * (m * k + k * n) * itemsize


def _operand_sets(shape, dtype, key, layout="NN"):
    batch, m, n, k = _split(shape)
    per_set = operand_bytes(shape, jnp.dtype(dtype).itemsize)
    count = max(2, math.ceil(2 * L2_BYTES / per_set))
    count = int(min(count, 16, max(2, BUFFER_BUDGET // per_set)))
    a_shape = (k, m) if layout[0] == "T" else (m, k)
    b_shape = (n, k) if layout[1] == "T" else (k, n)
    return _timing.random_operands(key, [(*batch, *a_shape), (*batch, *b_shape)], dtype, count)


def _products(layout: str):
    """(jax_tma product, XLA product, config product) of a @ b with operands stored in
    `layout`: NN through matmul, the others through dot_general."""
    if layout == "NN":
        return (jax_tma.matmul, jnp.matmul,
                lambda cfg: lambda a, b: jax_tma.matmul(a, b, config=cfg))
    dims = (((0 if layout[0] == "T" else 1,), (1 if layout[1] == "T" else 0,)), ((), ()))
    return (lambda a, b: jax_tma.dot_general(a, b, dims),
            lambda a, b: lax.dot_general(a, b, dims),
            lambda cfg: lambda a, b: jax_tma.dot_general(a, b, dims, config=cfg))


def _read_once(a, b):
    """Reads every element of both operands once (fp32 sums of each row) and nothing else."""
    return jnp.sum(a, axis=-1, dtype=jnp.float32), jnp.sum(b, axis=-1, dtype=jnp.float32)


def _check(name, fn, ops, ref) -> str:
    out = jax.jit(fn)(*ops)
    err = _timing.relative_error(out, ref)
    return "" if err <= 2e-2 else f"{name}: rel. error {err:.2e} vs XLA"


def bench_shape(shape, dtype, args, pallas) -> list[Row]:
    batch, m, n, k = _split(shape)
    key = jax.random.key(math.prod(batch) * 131 + m * 31 + n * 7 + k)
    sets = _operand_sets(shape, dtype, key, args.layout)
    ours, xla, forced = _products(args.layout)
    ref = jax.jit(xla)(*sets[0])
    contenders = {"jax_tma": ours, "xla": xla}
    if args.sweep:
        for cfg in gemm.legal_configs(m, n, k, dtype, splits=args.split_list):
            contenders[f"jax_tma[{cfg.describe()}]"] = forced(cfg)
    if pallas is not None and not batch and args.layout == "NN" and pallas[1](m, n, k):
        contenders["pallas_mgpu"] = pallas[0]
    notes = {}
    for name in list(contenders):  # the products only: read_once computes something else
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
    if args.read_once:
        contenders[READ_ONCE] = _read_once
    timings = _timing.compare(contenders, sets, rounds=args.rounds, iterations=args.iterations)
    if args.breakdown:
        _print_breakdown(shape, {n: contenders[n] for n in ("jax_tma", "xla")}, sets[0])
    rows = [Row(shape, name, t.median_s, t.spread_s) for name, t in timings.items()]
    rows += [Row(shape, name, None, None, note) for name, note in notes.items()]
    return rows


def _print_breakdown(shape, contenders, ops) -> None:
    for name, fn in contenders.items():
        kernels = _timing.kernel_breakdown(fn, ops)
        if kernels is None:
            print(f"{_label(shape)} {name}: no per-kernel timing (CUPTI unavailable)")
            continue
        total = sum(t for _, t in kernels)
        print(f"{_label(shape)} {name}: {len(kernels)} kernel(s), {total * 1e6:.1f} us")
        for kernel, t in kernels:
            print(f"    {t * 1e6:9.2f} us  {kernel[:150]}")


def _run(cmd: list[str]) -> str | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=True,
                              timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def _cuda_versions() -> dict:
    """CUDA runtime and driver API versions as jax's CUDA plugin reports them ("13.0"), or
    None where there is no plugin."""
    found = {"cuda_runtime": None, "cuda_driver": None}
    for module in ("jax_cuda13_plugin._versions", "jax_cuda12_plugin._versions",
                   "jaxlib.cuda._versions"):
        try:
            versions = importlib.import_module(module)
        except ImportError:
            continue
        for key in found:
            try:
                v = int(getattr(versions, f"{key}_get_version")())
                found[key] = f"{v // 1000}.{v % 1000 // 10}"
            except Exception:  # noqa: BLE001 - an older plugin without this query
                pass
        break
    if found["cuda_driver"] is None:  # the "CUDA Version" of nvidia-smi's banner
        banner = _run(["nvidia-smi"]) or ""
        match = re.search(r"CUDA Version:\s*([\d.]+)", banner)
        found["cuda_driver"] = match.group(1) if match else None
    return found


def environment(commit: str | None = None) -> dict:
    """Device, driver, CUDA, jax and commit of this run (shared by the benchmarks here).

    ``commit`` overrides ``git rev-parse HEAD``: the checkout on a GPU machine may carry a stale
    .git while its working tree is another commit.
    """
    dev = jax.devices()[0]
    env = {"device": dev.device_kind, "platform": dev.platform,
           "device_count": jax.device_count(), "jax": jax.__version__,
           "jaxlib": jaxlib_version(), "timing": _timing.timing_method(),
           "date": time.strftime("%Y-%m-%d")}
    driver = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    env["driver"] = driver.splitlines()[0] if driver else None
    env.update(_cuda_versions())
    if commit:
        env["commit"], env["commit_source"] = commit, "--commit"
    else:
        env["commit"] = _run(["git", "rev-parse", "HEAD"])
        status = _run(["git", "status", "--porcelain", "--untracked-files=no"])
        env["commit_source"] = "git rev-parse HEAD" + (
            " (working tree has uncommitted changes)" if status else "")
    status = jax_tma.kernel_status()
    env["jax_tma_kernel"] = status.available
    if not status.available:
        env["jax_tma_kernel_reason"] = status.reason
    return env


def jaxlib_version() -> str | None:
    try:
        return importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        return None


def _table(rows: list[Row], env: dict, dtype: str) -> str:
    peak = max((r.tflops() for r in rows if r.tflops()), default=0.0)
    by_shape: dict = {}
    for r in rows:
        by_shape.setdefault(r.shape, {})[r.contender] = r
    ranks = {len(s) for s in by_shape}
    header = "M×N×K" if ranks == {3} else "B×M×N×K" if ranks == {4} else "[B×]M×N×K"
    lines = [
        f"{env['device']}, driver {env['driver']}, CUDA {env.get('cuda_runtime')}, "
        f"jax {env['jax']}, {env['date']}, {dtype} in and out, timing: {env['timing']}; "
        f"% of peak = of the highest TFLOP/s measured in this run ({peak:.1f})",
        "",
        f"| {header} | jax_tma µs | jax_tma TFLOP/s | % peak | XLA µs | XLA TFLOP/s | ratio (XLA time / jax_tma time) |",
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
            f"| {_label(shape)} | {ours.seconds * 1e6:.1f} ± {ours.spread_s * 1e6:.1f} "
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
                if not r.seconds:
                    what = r.note
                elif name == READ_ONCE:  # both suites' dtypes take 2 bytes an element
                    ours, size = by_shape[r.shape].get("jax_tma"), operand_bytes(r.shape, 2)
                    what = f"{r.seconds * 1e6:.1f} µs, {size / r.seconds / 1e9:.0f} GB/s of operands"
                    if ours and ours.seconds:
                        what += (f"; jax_tma reads them at {size / ours.seconds / 1e9:.0f} GB/s "
                                 f"({r.seconds / ours.seconds:.2f}× this speed)")
                else:
                    what = f"{r.seconds * 1e6:.1f} µs, {r.tflops():.1f} TFLOP/s"
                lines.append(f"- {_label(r.shape)}: {what}")
    return "\n".join(lines)


def banner(env: dict, dtype: str) -> str:
    """One line naming the device, its software and the run's dtype, timing and kernel path."""
    return (f"{env['device']} | driver {env['driver']} | CUDA {env['cuda_runtime']} | "
            f"jax {env['jax']} | {dtype} | timing {env['timing']} | jax_tma kernel "
            f"{'on' if env['jax_tma_kernel'] else 'off (XLA path)'}")


def results_dir(out_root: pathlib.Path | None, env: dict) -> pathlib.Path:
    """`out_root` (default benchmarks/results) / the device's name, created."""
    out = (out_root or pathlib.Path("benchmarks/results")) / env["device"].lower().replace(" ", "-")
    out.mkdir(parents=True, exist_ok=True)
    return out


def write_report(out_root: pathlib.Path | None, env: dict, stem: str, payload: dict, table: str,
                 plot) -> None:
    """Writes <stem>.json (`payload`), <stem>.md (`table`) and, where `plot(path)` draws one,
    <stem>.png under results_dir(out_root, env)."""
    out = results_dir(out_root, env)
    (out / f"{stem}.json").write_text(json.dumps(payload, indent=1))
    (out / f"{stem}.md").write_text(table + "\n")
    plotted = plot(out / f"{stem}.png")
    print(f"wrote {out}/{stem}.json, .md" + (", .png" if plotted else ""))


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend, or None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_figure(plt, fig, path: pathlib.Path) -> bool:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _plot(rows: list[Row], path: pathlib.Path, title: str) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    shapes = list(dict.fromkeys(r.shape for r in rows))
    names = [c for c in ("jax_tma", "xla", "pallas_mgpu") if any(r.contender == c for r in rows)]
    value = {(r.shape, r.contender): r.tflops() or 0.0 for r in rows}
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(8, 0.7 * len(shapes)), 8))
    x = np.arange(len(shapes))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        ax1.bar(x + i * width, [value.get((s, name), 0.0) for s in shapes], width, label=name)
    labels = [_label(s) for s in shapes]
    ax1.set_title(title)
    ax1.set_ylabel("TFLOP/s")
    ax1.set_xticks(x + width * (len(names) - 1) / 2, labels, rotation=60, ha="right", fontsize=7)
    ax1.legend()
    ratio = [value.get((s, "jax_tma"), 0) / value[(s, "xla")] if value.get((s, "xla")) else 0
             for s in shapes]
    ax2.bar(x, ratio, color=["tab:green" if r >= 1 else "tab:red" for r in ratio])
    ax2.axhline(1.0, color="black", linewidth=0.8)
    ax2.set_ylabel("jax_tma speed / XLA speed")
    ax2.set_xticks(x, labels, rotation=60, ha="right", fontsize=7)
    return save_figure(plt, fig, path)


def _stem(args) -> str:
    suffixes = [name for name, on in (("batched", args.batched), ("sweep", args.sweep),
                                      (args.layout, args.layout != "NN"),
                                      (args.dtype, args.dtype != "bf16")) if on]
    return "_".join(["bench_gemm", *suffixes])


def main(argv=None) -> int:
    args = _parse(argv)
    dtype = DTYPES[args.dtype]
    env = environment(args.commit)
    print(banner(env, args.dtype), flush=True)
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
            for r in sorted((r for r in new if r.tflops()), key=lambda r: r.seconds):
                print(f"    {r.seconds * 1e6:10.1f} us {r.tflops():7.1f} TFLOP/s  {r.contender}")
    what = args.dtype if args.layout == "NN" else f"{args.dtype}, layout {args.layout}"
    table = _table(rows, env, what)
    print(table)
    if args.dry_run and args.out is None:
        return 0
    write_report(
        args.out, env, _stem(args),
        {"environment": env, "dtype": args.dtype, "layout": args.layout, "dry_run": args.dry_run,
         "rows": [dict(dataclasses.asdict(r), tflops=r.tflops()) for r in rows]},
        table, lambda path: _plot(rows, path, f"{env['device']}, {what}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
