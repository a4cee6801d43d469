"""FP8 GEMM benchmark: jax_tma's FP8 kernel (promoted per-tensor and block-scaled, and with the
tensor core's accumulation) against XLA's FP8 paths and jax_tma's bf16 kernel, in one run and
one harness (jax_tma._timing.compare: CUPTI kernel time on a GPU, operands rotated over distinct
buffers, rounds alternating).

Contenders for C = A @ B^T, A [M, K], B [N, K] (weights stored K-major), e4m3, bf16 out:
  jax_tma_tensor   fp8_dot_general, per-tensor scales (promoted every 128 K)
  jax_tma_block    fp8_dot_general, 1x128 scales on A and 128x128 on B (DeepSeek-V3)
  jax_tma_fast     fp8_dot_general, per-tensor scales, precision=DEFAULT (the tensor core's
                   accumulation over the whole K)
  xla_fp8_highest  XLA's e4m3 dot (lax.dot_general of the FP8 arrays), precision=HIGHEST
                   (cuBLASLt promoting: the accuracy of jax_tma_tensor)
  xla_fp8          the same at default precision (fast accumulation: jax_tma_fast's)
  xla_dequant      block-scaled through XLA: both operands dequantised to bf16, a bf16 dot
  jax_tma_bf16     jax_tma.dot_general on bf16 copies of the operands (the bf16 kernel)
The time of quantize_fp8 on the activations (bf16 [M, K] to e4m3 with 1x128 scales) is listed
apart, in GB/s. DeepGEMM's published block-scaled figures (H800 SXM5) stand beside its 12 shapes.

    python benchmarks/bench_fp8.py             # the suite (23 shapes)
    python benchmarks/bench_fp8.py --quick     # 8192^3 and 4096^3
    python benchmarks/bench_fp8.py --dry-run   # tiny shapes; runs without a GPU (CI)
    python benchmarks/bench_fp8.py --sweep --shapes 8192,8192,8192   # every compiled tile
    python benchmarks/bench_fp8.py --sweep --tiles 128x192x4x1 --shapes 4096,4096,4096

Before timing, jax_tma's block-scaled result is compared with XLA's dequantised product.
Writes bench_fp8.json, .md and .png under benchmarks/results/<device>/ after every shape (a run
cut short keeps what it measured; its JSON's "complete" is false). --resume FILE.json continues
such a run: the shapes it holds are taken from it, the rest are timed, and the report covers
both; it must come from the same device, driver, jax, commit and options. --merge FILE.json ...
writes one report from runs of the same commit and options that timed different shapes (e.g.
two GPUs resuming one report, each with its own --shapes).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jax_tma
from jax_tma import _timing
from jax_tma._core import device
from jax_tma._core.config import stream_k_variants
from jax_tma.ops.fp8 import config as fp8_config

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _lib.harness import chosen_shapes, harness_arguments  # noqa: E402
from _lib.report import (banner, environment, pyplot, read_parts, save_figure,  # noqa: E402
                         write_progress, write_report)

# DeepGEMM's published block-scaled TFLOP/s (H800 SXM5, 1x128 / 128x128 scales) for M x N x K.
DEEPGEMM_NK = ((2112, 7168), (24576, 1536), (32768, 512), (7168, 16384), (4096, 7168),
               (7168, 2048))
DEEPGEMM = {**{(4096, n, k): t for (n, k), t in zip(DEEPGEMM_NK, (1127, 1212, 775, 1520, 1410,
                                                                     1168))},
            **{(128, n, k): t for (n, k), t in zip(DEEPGEMM_NK, (352, 535, 358, 645, 533,
                                                                    510))}}
SHAPES = [(8192, 8192, 8192), (4096, 4096, 4096), (16384, 14336, 4096), (4096, 7168, 16384),
          (4096, 24576, 1536), (64, 28672, 4096), (128, 7168, 16384), (6144, 6144, 6144),
          (16384, 7168, 2048), (8192, 28672, 4096), (256, 7168, 2048)]
SHAPES += [s for s in DEEPGEMM if s not in SHAPES]
DRY_RUN = [(64, 256, 256), (8, 136, 200)]
PRODUCTS = ("jax_tma_tensor", "jax_tma_block", "jax_tma_fast", "xla_fp8_highest", "xla_fp8",
            "xla_dequant", "jax_tma_bf16")
NT = (((1,), (1,)), ((), ()))
BF16 = jnp.bfloat16


@dataclasses.dataclass
class Row:
    shape: tuple[int, int, int]
    contender: str
    seconds: float
    spread_s: float
    note: str = ""

    def tflops(self) -> float | None:
        if self.contender == "quantize":
            return None
        m, n, k = self.shape
        return 2.0 * m * n * k / self.seconds / 1e12

    def quantize_gbps(self) -> float:
        m, _, k = self.shape  # reads bf16 [M, K], writes e4m3 [M, K] and the scales
        return (3 * m * k + 4 * m * -(-k // 128)) / self.seconds / 1e9


def _expand(sa, sb, m, n, k):
    a_scale = jnp.repeat(sa.T, 128, axis=1)[:, :k]                          # [M, K]
    b_scale = jnp.repeat(jnp.repeat(sb.T, 128, axis=0), 128, axis=1)[:n, :k]  # [N, K]
    return a_scale.astype(BF16), b_scale.astype(BF16)


def _contenders(shape):
    m, n, k = shape

    def tensor(a, b, sa, sb, s_a, s_b, a16, b16):
        return jax_tma.fp8_dot_general(a, b, s_a, s_b, NT)

    def block(a, b, sa, sb, s_a, s_b, a16, b16):
        return jax_tma.fp8_dot_general(a, b, sa, sb, NT)

    def fast(a, b, sa, sb, s_a, s_b, a16, b16):
        return jax_tma.fp8_dot_general(a, b, s_a, s_b, NT, precision=lax.Precision.DEFAULT)

    def xla_fp8_highest(a, b, sa, sb, s_a, s_b, a16, b16):
        return lax.dot_general(a, b, NT, precision=lax.Precision.HIGHEST,
                               preferred_element_type=BF16)

    def xla_fp8(a, b, sa, sb, s_a, s_b, a16, b16):
        return lax.dot_general(a, b, NT, preferred_element_type=BF16)

    def xla_dequant(a, b, sa, sb, s_a, s_b, a16, b16):
        a_scale, b_scale = _expand(sa, sb, m, n, k)
        return lax.dot_general(a.astype(BF16) * a_scale, b.astype(BF16) * b_scale, NT,
                               preferred_element_type=BF16)

    def bf16(a, b, sa, sb, s_a, s_b, a16, b16):
        return jax_tma.dot_general(a16, b16, NT)

    return dict(zip(PRODUCTS, (tensor, block, fast, xla_fp8_highest, xla_fp8, xla_dequant,
                               bf16)))


def _operand_sets(shape, count, seed):
    m, n, k = shape

    @jax.jit
    def make(key):
        ka, kb = jax.random.split(key)
        x = jax.random.normal(ka, (m, k), jnp.float32)
        w = jax.random.normal(kb, (n, k), jnp.float32) / np.sqrt(k)
        a, sa = jax_tma.quantize_fp8(x, (1, 128))
        b, sb = jax_tma.quantize_fp8(w, (128, 128))
        s_a = jnp.max(jnp.abs(x)) / 448.0
        s_b = jnp.max(jnp.abs(w)) / 448.0
        return (a, b, sa, sb, s_a.astype(jnp.float32), s_b.astype(jnp.float32),
                x.astype(BF16), w.astype(BF16))

    return [make(key) for key in jax.random.split(jax.random.key(seed), count)]


def bench(shape, args) -> list[Row]:
    sets = _operand_sets(shape, args.sets, args.seed)
    contenders = _contenders(shape)
    ours = np.asarray(jax.jit(contenders["jax_tma_block"])(*sets[0]), np.float32)
    ref = np.asarray(jax.jit(contenders["xla_dequant"])(*sets[0]), np.float32)
    err = float(np.linalg.norm(ours - ref) / max(np.linalg.norm(ref), 1e-30))
    timings = _timing.compare(contenders, sets, rounds=args.rounds, iterations=args.iterations)
    rows = [Row(shape, name, t.median_s, t.spread_s,
                f"rel. difference from xla_dequant {err:.1e}" if name == "jax_tma_block" else "")
            for name, t in timings.items()]
    quant = _timing.compare({"quantize": lambda x: jax_tma.quantize_fp8(x, (1, 128))},
                            [(s[6],) for s in sets], rounds=args.rounds,
                            iterations=args.iterations)["quantize"]
    rows.append(Row(shape, "quantize", quant.median_s, quant.spread_s))
    for r in rows:
        rate = (f"{r.tflops():8.1f} TFLOP/s" if r.tflops() is not None
                else f"{r.quantize_gbps():8.1f} GB/s  ")
        print(f"  {'x'.join(map(str, shape)):18s} {r.contender:15s} {r.seconds * 1e6:10.1f} us "
              f"{rate} {r.note}", flush=True)
    return rows


def _and_streamed(configs, m: int, n: int, k: int) -> list:
    """`configs`, then each of them on stream-K where it applies to an M x N x K product."""
    return list(configs) + [c for c in stream_k_variants(configs) if c.stream_k_applies(
        -(-m // c.block_m) * -(-n // c.block_n), k, device.num_sms())]


def _tile_name(cfg) -> str:
    """A compiled tile as --tiles and the sweep's rows name it: block_m x block_n x stages x
    cluster_m."""
    return "x".join(map(str, cfg.tile))


def sweep(shape, args) -> list[Row]:
    """jax_tma's product with per-tensor and with block scales on every compiled tile (whole,
    on stream-K where it applies: "sk", and split 2, 4 or 8 ways along K where the tiles fill
    less than a wave: "k2" ...) and on the heuristic's choice, timed together: the data to tune
    the heuristic with."""
    sets = _operand_sets(shape, args.sets, args.seed)
    m, n, k = shape
    default = fp8_config.default_config(m, n, k).describe()
    contenders = {
        "default tensor " + default:
            lambda a, b, sa, sb, s_a, s_b, *rest: jax_tma.fp8_dot_general(a, b, s_a, s_b, NT),
        "default block " + default:
            lambda a, b, sa, sb, *rest: jax_tma.fp8_dot_general(a, b, sa, sb, NT)}
    def fitting(configs):
        return [c for c in configs if fp8_config.cluster_fits(c.block_m, c.cluster_m, m)
                and (not args.tiles or _tile_name(c) in args.tiles)]

    # Every candidate of the heuristic, rated or not (whole, split along K below a wave,
    # stream-K where it applies), in the tiles' compiled order.
    candidates = fp8_config.ranked_configs(m, n, k, measured_only=False)
    order = {tile: i for i, tile in enumerate(t.tile for t in fp8_config.FP8_CONFIGS)}
    candidates.sort(key=lambda c: (order[c.tile], c.stream_k, c.split_k))
    for cfg in fitting(candidates):
        name = _tile_name(cfg) + (" sk" if cfg.stream_k else "") + (
            f" k{cfg.split_k}" if cfg.split_k > 1 else "")
        contenders["tensor " + name] = (
            lambda a, b, sa, sb, s_a, s_b, *rest, cfg=cfg: jax_tma.fp8_dot_general(
                a, b, s_a, s_b, NT, config=cfg))
        contenders["block " + name] = (
            lambda a, b, sa, sb, *rest, cfg=cfg: jax_tma.fp8_dot_general(a, b, sa, sb, NT,
                                                                         config=cfg))
    # The tensor core's own accumulation over the whole K (precision=DEFAULT, per-tensor).
    for cfg in fitting(_and_streamed(fp8_config.FP8_FAST_CONFIGS, m, n, k)):
        contenders["fast " + _tile_name(cfg) + (" sk" if cfg.stream_k else "")] = (
            lambda a, b, sa, sb, s_a, s_b, *rest, cfg=cfg: jax_tma.fp8_dot_general(
                a, b, s_a, s_b, NT, precision=lax.Precision.DEFAULT, config=cfg))
    # XLA's e4m3 dot as the same run measures it: promoted (HIGHEST) and tensor-core
    # accumulation (default).
    contenders["xla_fp8_highest"] = lambda a, b, *rest: lax.dot_general(
        a, b, NT, precision=lax.Precision.HIGHEST, preferred_element_type=BF16)
    contenders["xla_fp8"] = lambda a, b, *rest: lax.dot_general(
        a, b, NT, preferred_element_type=BF16)
    timings = _timing.compare(contenders, sets, rounds=args.rounds, iterations=args.iterations)
    rows = [Row(shape, "sweep " + name, t.median_s, t.spread_s) for name, t in timings.items()]
    for r in rows:
        print(f"  {'x'.join(map(str, shape)):18s} {r.contender:60s} {r.seconds * 1e6:10.1f} us "
              f"{r.tflops():8.1f} TFLOP/s", flush=True)
    return rows


def _by_shape(rows):
    groups: dict = {}
    for r in rows:
        groups.setdefault(r.shape, {})[r.contender] = r
    return groups


def _geomean(values):
    return math.exp(sum(map(math.log, values)) / len(values)) if values else float("nan")


def _table(rows: list[Row], env: dict) -> str:
    lines = [
        f"{env['device']}, driver {env['driver']}, CUDA {env.get('cuda_runtime')}, jax "
        f"{env['jax']}, {env['date']}, commit {str(env.get('commit'))[:10]}, e4m3 in, bf16 out, "
        f"timing: {env['timing']}. TFLOP/s; tensor, block: jax_tma promoted against "
        "xla_fp8_highest (same accuracy); fast: jax_tma_fast against xla_fp8 (both the tensor "
        "core's accumulation); × = their time / jax_tma's. DeepGEMM: its published figure "
        "(H800), block-scaled.",
        "",
        "| M×N×K | " + " | ".join(PRODUCTS) + " | × (tensor) | × (block) | × (fast) | "
        "DeepGEMM | quantize GB/s |",
        "|---|" + "---|" * (len(PRODUCTS) + 5),
    ]
    ratios = {"tensor": [], "block": [], "fast": []}
    for shape, found in _by_shape(rows).items():
        hi, fast = found["xla_fp8_highest"].seconds, found["xla_fp8"].seconds
        r = {"tensor": hi / found["jax_tma_tensor"].seconds,
             "block": hi / found["jax_tma_block"].seconds,
             "fast": fast / found["jax_tma_fast"].seconds}
        for key, v in r.items():
            ratios[key].append(v)
        cells = " | ".join(f"{found[c].tflops():.1f}" for c in PRODUCTS)
        deepgemm = DEEPGEMM.get(shape)
        lines.append(f"| {'×'.join(map(str, shape))} | {cells} | {r['tensor']:.2f} | "
                     f"{r['block']:.2f} | {r['fast']:.2f} | "
                     f"{deepgemm if deepgemm else ''} | "
                     f"{found['quantize'].quantize_gbps():.0f} |")
    lines += ["", f"Over {len(ratios['tensor'])} shapes, geometric mean (min): tensor × "
              f"xla_fp8_highest {_geomean(ratios['tensor']):.2f} "
              f"({min(ratios['tensor'], default=float('nan')):.2f}), block × xla_fp8_highest "
              f"{_geomean(ratios['block']):.2f} "
              f"({min(ratios['block'], default=float('nan')):.2f}), fast × xla_fp8 "
              f"{_geomean(ratios['fast']):.2f} "
              f"({min(ratios['fast'], default=float('nan')):.2f})"]
    return "\n".join(lines)


def _plot(rows: list[Row], path: pathlib.Path, title: str) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    groups = _by_shape(rows)
    shapes = list(groups)
    fig, ax = plt.subplots(figsize=(max(8, 1.4 * len(shapes)), 5))
    x = np.arange(len(shapes))
    width = 0.8 / len(PRODUCTS)
    for i, name in enumerate(PRODUCTS):
        ax.bar(x + i * width, [groups[s][name].tflops() for s in shapes], width, label=name)
    ax.axhline(1979, color="grey", linestyle="--", linewidth=0.8)
    ax.set_title(title)
    ax.set_ylabel("TFLOP/s (dashed: H100 dense FP8 peak)")
    ax.set_xticks(x + width * (len(PRODUCTS) - 1) / 2, ["x".join(map(str, s)) for s in shapes],
                  rotation=30, ha="right", fontsize=8)
    ax.legend(fontsize=8)
    return save_figure(plt, fig, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--sweep", action="store_true",
                   help="time per-tensor and block-scaled products on every compiled tile instead")
    p.add_argument("--tiles", nargs="+", metavar="MxNxSxC",
                   help="with --sweep: only these tiles (block_m x block_n x stages x cluster_m)")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--shapes", nargs="*", metavar="M,N,K")
    p.add_argument("--resume", type=pathlib.Path, metavar="FILE.json",
                   help="continue the unfinished run whose report this is")
    p.add_argument("--merge", nargs="+", type=pathlib.Path, metavar="FILE.json",
                   help="write one report from these reports of the suite's shapes")
    harness_arguments(p)
    args = p.parse_args(argv)
    if args.resume is not None and args.sweep:
        p.error("--resume continues a bench_fp8 report, not a --sweep")
    if args.tiles and not args.sweep:
        p.error("--tiles selects the tiles of a --sweep")
    compiled = {_tile_name(c) for c in fp8_config.FP8_CONFIGS + fp8_config.FP8_FAST_CONFIGS}
    if args.tiles and not set(args.tiles) <= compiled:
        p.error(f"--tiles {sorted(set(args.tiles) - compiled)}: not compiled; the FP8 tiles are "
                f"{sorted(compiled)}")
    if args.merge:
        try:
            env, rows = merged_rows(args.merge, args)
        except (OSError, ValueError, KeyError, TypeError) as err:
            p.error(f"--merge: {err}")
        suite = DRY_RUN if args.dry_run else SHAPES
        rows.sort(key=lambda r: suite.index(r.shape))
        write_progress(args.out, env, "bench_fp8", _payload(rows, env, args), _table(rows, env),
                       lambda path: _plot(rows, path, _title(env)),
                       len({r.shape for r in rows}), len(suite), "shapes")
        print(_table(rows, env))
        return 0
    shapes = chosen_shapes(p, args, SHAPES, SHAPES[:2], DRY_RUN)
    env = environment(args.commit)
    print(banner(env, "e4m3"))
    rows: list[Row] = []
    resumed: list[Row] = []
    if args.resume is not None:
        try:
            resumed = resumed_rows(json.loads(args.resume.read_text()), env, args, shapes)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            p.error(f"--resume {args.resume}: not a readable bench_fp8 report ({err!r})")
        rows += resumed
    done = {r.shape for r in rows}

    def report() -> None:  # the rows so far, in the suite's order
        rows.sort(key=lambda r: shapes.index(r.shape))
        if not args.dry_run or args.out is not None:
            write_progress(args.out, env, "bench_fp8", _payload(rows, env, args),
                           _table(rows, env), lambda path: _plot(rows, path, _title(env)),
                           len(done), len(shapes), "shapes")

    for i, shape in enumerate(shapes):
        if shape in done:
            continue
        print(f"[{i + 1}/{len(shapes)}] {'x'.join(map(str, shape))}", file=sys.stderr, flush=True)
        if args.sweep:
            rows += sweep(shape, args)
            continue
        rows += bench(shape, args)
        done.add(shape)
        report()
    if not args.sweep and done == {r.shape for r in resumed}:
        report()  # every shape came from the resumed report: written once, whole
    if args.sweep:
        if args.out is not None:
            payload = {"environment": env, "rows": [dataclasses.asdict(r) for r in rows]}
            write_report(args.out, env, "bench_fp8_sweep", payload, "\n".join(
                f"{'x'.join(map(str, r.shape))} {r.contender}: {r.seconds * 1e6:.1f} us, "
                f"{r.tflops():.1f} TFLOP/s" for r in rows), lambda path: False)
        return 0
    print(_table(rows, env))
    return 0


# What a resumed run must share with the run it continues.
_SAME_RUN = ("device", "driver", "jax", "jaxlib", "commit", "timing", "jax_tma_kernel")


def _payload(rows: list[Row], env: dict, args) -> dict:
    return {"environment": env, "dry_run": args.dry_run,
            "options": {"sets": args.sets, "rounds": args.rounds,
                        "iterations": args.iterations, "seed": args.seed},
            "rows": [dict(dataclasses.asdict(r), tflops=r.tflops()) for r in rows]}


def _title(env: dict) -> str:
    return f"FP8 GEMM (e4m3, bf16 out), {env['device']}"


def _report_rows(report: dict) -> list[Row]:
    """The rows of a bench_fp8 report's JSON."""
    return [Row(tuple(r["shape"]), r["contender"], r["seconds"], r["spread_s"], r["note"])
            for r in report["rows"]]


def resumed_rows(report: dict, env: dict, args, shapes: list) -> list[Row]:
    """The rows of `report` (an unfinished bench_fp8 report) that this run takes over: a
    ValueError where the report comes from another device, driver, jax or commit, other timing
    options, or holds shapes this run does not time."""
    if not {"environment", "rows", "options"} <= report.keys():
        raise ValueError("not a bench_fp8 report")
    differ = [key for key in _SAME_RUN if report["environment"].get(key) != env.get(key)]
    if differ:
        raise ValueError("another run's report: its " + ", ".join(
            f"{key} {report['environment'].get(key)!r} (this run: {env.get(key)!r})"
            for key in differ))
    options = _payload([], env, args)["options"]
    if report["options"] != options or report.get("dry_run") != args.dry_run:
        raise ValueError(f"other options: {report['options']} (this run: {options})")
    rows = _report_rows(report)
    extra = sorted({r.shape for r in rows} - set(shapes))
    if extra:
        raise ValueError(f"shapes this run does not time: {extra}")
    return rows


def merged_rows(paths: list[pathlib.Path], args) -> tuple[dict, list[Row]]:
    """(environment, rows) of the bench_fp8 reports at `paths`, which must come from one device,
    driver, jax, commit and timing (read_parts) with the same options, hold only the suite's
    shapes (the dry run's, for dry runs), and agree on every shape two of them hold. Sets args'
    timing options and dry_run to theirs."""
    env, payloads = read_parts(paths, "bench_fp8")
    options, dry_run = payloads[0].get("options"), payloads[0].get("dry_run")
    suite = DRY_RUN if dry_run else SHAPES
    by_shape: dict[tuple, list[Row]] = {}
    for path, payload in zip(paths, payloads):
        if payload.get("options") != options or payload.get("dry_run") != dry_run:
            raise ValueError(f"{path}: options {payload.get('options')}, dry run "
                             f"{payload.get('dry_run')} (first: {options}, {dry_run})")
        rows = _report_rows(payload)
        for shape in dict.fromkeys(r.shape for r in rows):
            if shape not in suite:
                raise ValueError(f"{path} holds {shape}, not a shape of the suite")
            mine = [r for r in rows if r.shape == shape]
            if by_shape.setdefault(shape, mine) != mine:
                raise ValueError(f"{path} holds {shape} with other results than an earlier file")
    for name, value in options.items():
        setattr(args, name, value)
    args.dry_run = bool(dry_run)
    return env, [r for rows in by_shape.values() for r in rows]


if __name__ == "__main__":
    sys.exit(main())
