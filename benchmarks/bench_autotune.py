"""What autotuning buys on products the heuristic was not fitted to: for each shape,
jax_tma.autotune times every legal configuration and XLA's dot (a fresh cache, so nothing is
reused), then one harness run (jax_tma._timing.compare: CUPTI kernel time, operands rotated,
rounds alternating) times XLA's dot, jax_tma untuned (the heuristic's configuration, or XLA's dot
where the rule leaves the product to it: "default path") and jax_tma tuned (what the cache then
chooses: the tuned configuration, or XLA's dot where that measured faster: "tuned path").

Default shapes: those of issue 32 (bf16, A @ B with A [M, K], B [K, N]; batched B x M x N x K
products as einsum "bmk,bkn->bmn").

    python benchmarks/bench_autotune.py                 # the suite
    python benchmarks/bench_autotune.py --shapes 1536,1536,1536 16,8192,8192,128
    python benchmarks/bench_autotune.py --dry-run       # tiny shapes, runs without a GPU (CI)

Writes bench_autotune.json and .md under benchmarks/results/<device>/.
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
from jax import lax

import jax_tma
from jax_tma import _timing
from jax_tma.ops.gemm import primitive as gemm

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _lib.harness import harness_arguments, parse_shapes  # noqa: E402
from _lib.report import banner, environment, pyplot, save_figure, write_report  # noqa: E402

SHAPES = [(6144, 3072, 24576), (1536, 1536, 1536), (2048, 13824, 5120), (12288, 12288, 4096),
          (1000, 1000, 1000), (777, 1234, 3000), (4096, 24576, 3072), (16, 8192, 8192, 128),
          (8, 4096, 4096, 128)]
DRY_RUN = [(64, 96, 128), (2, 32, 48, 64)]


def _dims(shape):
    if len(shape) == 3:
        return (((1,), (0,)), ((), ()))
    return (((2,), (1,)), ((0,), (0,)))


def _specs(shape):
    if len(shape) == 3:
        m, n, k = shape
        return (m, k), (k, n)
    b, m, n, k = shape
    return (b, m, k), (b, k, n)


def run_shape(shape, args) -> dict:
    lhs_shape, rhs_shape = _specs(shape)
    dims = _dims(shape)
    bf16 = jnp.bfloat16
    flops = 2.0 * math.prod(shape)
    row = {"shape": list(shape), "flops": flops}
    specs = jax.ShapeDtypeStruct(lhs_shape, bf16), jax.ShapeDtypeStruct(rhs_shape, bf16)
    # What jax_tma runs untuned (this run's cache is new): the heuristic's configuration, or
    # XLA's dot where the rule leaves the product to it.
    untuned = gemm.kernel_choice(*specs, dims, bf16)
    default = None if untuned is None else untuned[1]
    row["default"] = "xla" if default is None else default.describe()
    contenders = {
        "xla": lambda a, b: lax.dot_general(a, b, dims),
        "jax_tma_default": (lambda a, b: lax.dot_general(a, b, dims)) if default is None else
                           (lambda a, b: jax_tma.dot_general(a, b, dims, config=default)),
    }
    if jax_tma.kernel_status().available:
        start = time.perf_counter()
        result = jax_tma.autotune(*specs, dims, rounds=args.rounds, force=True)
        row.update(tuned="xla" if result.xla_faster else result.best.describe(),
                   candidates=len(result.seconds), tuning_s=time.perf_counter() - start)
        # What jax_tma runs now: the cache's choice (the tuned configuration, or XLA's dot).
        contenders["jax_tma_tuned"] = lambda a, b: jax_tma.dot_general(a, b, dims)
    sets = _timing.random_operands(jax.random.key(args.seed), [lhs_shape, rhs_shape], bf16,
                                   args.sets)
    timings = _timing.compare(contenders, sets, rounds=args.rounds, iterations=args.iterations)
    for name, t in timings.items():
        row[name + "_s"] = t.median_s
    return row


def _table(rows) -> str:
    lines = ["| shape | XLA TFLOP/s | jax_tma default | jax_tma tuned | default / XLA | "
             "tuned / XLA | default path | tuned path |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tf = lambda s: r["flops"] / s / 1e12  # noqa: E731
        xla, dflt = r["xla_s"], r["jax_tma_default_s"]
        tuned = r.get("jax_tma_tuned_s")
        lines.append(
            f"| {'x'.join(map(str, r['shape']))} | {tf(xla):.1f} | {tf(dflt):.1f} | "
            f"{tf(tuned):.1f} | {xla / dflt:.2f} | {xla / tuned:.2f} | {r['default']} | "
            f"{r['tuned']} |"
            if tuned else
            f"| {'x'.join(map(str, r['shape']))} | {tf(xla):.1f} | {tf(dflt):.1f} | - | "
            f"{xla / dflt:.2f} | - | {r['default']} | - |")
    ratios = [r["xla_s"] / r.get("jax_tma_tuned_s", r["jax_tma_default_s"]) for r in rows]
    default_ratios = [r["xla_s"] / r["jax_tma_default_s"] for r in rows]
    gmean = lambda v: math.exp(sum(map(math.log, v)) / len(v))  # noqa: E731
    lines.append("")
    lines.append(f"Geometric mean x XLA: default {gmean(default_ratios):.3f}, tuned "
                 f"{gmean(ratios):.3f}; worst: default {min(default_ratios):.2f}, tuned "
                 f"{min(ratios):.2f}")
    return "\n".join(lines)


def _plot(rows, env):
    """Bars of jax_tma's speed relative to XLA per shape, heuristic and tuned."""
    def draw(path) -> bool:
        plt = pyplot()
        if plt is None:
            return False
        names = ["x".join(map(str, r["shape"])) for r in rows]
        fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(rows)), 4))
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs], [r["xla_s"] / r["jax_tma_default_s"] for r in rows],
               0.4, label="jax_tma, heuristic")
        ax.bar([x + 0.2 for x in xs],
               [r["xla_s"] / r.get("jax_tma_tuned_s", r["jax_tma_default_s"]) for r in rows],
               0.4, label="jax_tma, autotuned")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axhline(0.95, color="r", lw=0.8, ls="--")
        ax.set_xticks(list(xs), names, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("speed relative to XLA")
        ax.set_title(f"{env['device']}, jax {env['jax']}, commit {str(env['commit'])[:10]}",
                     fontsize=9)
        ax.legend(fontsize=8)
        return save_figure(plt, fig, path)
    return draw


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="*", metavar="[B,]M,N,K")
    p.add_argument("--dry-run", action="store_true")
    harness_arguments(p)
    args = p.parse_args(argv)
    if args.shapes:
        shapes = parse_shapes(p, args.shapes)
    else:
        shapes = DRY_RUN if args.dry_run else SHAPES
    if args.dry_run:
        args.sets, args.rounds, args.iterations = 1, 1, 1
    env = environment(args.commit)
    print(banner(env, "bf16"), flush=True)
    rows = []
    # A cache of this run's own: the tuning is what is measured, not an earlier one.
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["JAX_TMA_AUTOTUNE_CACHE"] = str(pathlib.Path(tmp) / "autotune.json")
        for shape in shapes:
            rows.append(run_shape(shape, args))
            print(_table(rows[-1:]).splitlines()[2], flush=True)
    table = banner(env, "bf16") + "\n\n" + _table(rows)
    print(table)
    if not args.dry_run or args.out:
        write_report(args.out, env, "bench_autotune", {"environment": env, "rows": rows},
                     table, _plot(rows, env))
    return 0


if __name__ == "__main__":
    sys.exit(main())
