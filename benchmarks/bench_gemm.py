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
    python benchmarks/bench_gemm.py --suite llm      # projections of public LLMs (below)
    python benchmarks/bench_gemm.py --random 200 --seed 3   # random shapes (below)
    python benchmarks/bench_gemm.py --shapes 4096,4096,4096 32,2048,2048,128 --dtype fp16
    python benchmarks/bench_gemm.py --sweep --shapes 8192,8192,8192   # every legal config
    python benchmarks/bench_gemm.py --quick --layout NT   # b stored [N, K] (dot_general)
    python benchmarks/bench_gemm.py --breakdown --shapes 1,4096,4096  # kernels and durations
    python benchmarks/bench_gemm.py --read-once      # also time reading the operands once
    python benchmarks/bench_gemm.py --dry-run        # tiny shapes; runs without a GPU (CI)
    python benchmarks/bench_gemm.py --commit abc1234 # the commit that ran, if .git is stale
    python benchmarks/bench_gemm.py --random 600 --part 2/3   # one of 3 processes of a suite
    python benchmarks/bench_gemm.py --merge <results>/bench_gemm_random_part*of3.json
    python benchmarks/bench_gemm.py --random 200 --seed 7 --autotune   # tuned before timing

The jax_tma row of each product records the path its lowering takes (column "jax_tma path", key
"path" of the JSON rows): the kernel configuration (GemmConfig.describe()), "+ transpose" where an
operand is copied into the kernel's layout first, or "xla" where the product runs on XLA's dot.
It is worked out by gemm.kernel_choice, as the lowering does, which needs no GPU, so a dry run
shows the path a Hopper GPU would take.

--part I/N runs the I-th of N contiguous chunks of the shape list and writes its report under
the suite's name with a _partIofN suffix, so that a long suite can run as N processes (on several
GPUs at once, or one after another where a process has a time limit); each report records which
of the suite's shapes it holds. --merge reads part reports (JSON), checks that they come from one
suite (device, commit, dtype, layout, random draw, stem) and together hold each of its shapes
once (parts of different splits mix: 1/4 with 3/8, 4/8, 3/4 and 4/4), and writes the suite's
report from their rows in the suite's order, with the summary over all of them; it runs
nothing on a GPU.

--autotune tunes each product before timing it (jax_tma.autotune: every legal configuration, or
the --autotune-max the cost model ranks first, and XLA's dot), into --autotune-cache or a new
cache file in a temporary directory, so that the jax_tma row runs what the cache then chooses:
the kernel with the tuned configuration, or XLA's dot where that measured faster (path "xla").
The report's name gets _autotuned, and its JSON the tuning's wall time.

--read-once adds a contender that only reads both operands once (XLA's fp32 row sums of each):
a reference for products bound by memory, listed in GB/s of operand bytes beside jax_tma's
read rate and kept out of the ratio. It is no bound: a GEMM may read faster than XLA's
reductions do.

--suite llm: the dense projections (M tokens × K in features -> N out features) of Llama 3 8B and
70B, Mixtral 8x7B, Qwen2.5 7B and 72B and DeepSeek-V3, at 4096 and 16384 prefill tokens and 1, 16
and 128 decode tokens; 106 distinct products, each named for every projection it stands for. QKV
and gate+up are fused, as serving stacks run them. Mixtral's attention is Llama 3 8B's; an expert
sees a quarter of the tokens (balanced top-2 of 8 routing). DeepSeek-V3 gives its MLA projections
(q_a, kv_a, q_b, o) and the FFN of its dense layers. Decode 64 is left out to stay near 100
products: up to 128 tokens a decode product is bound by reading its weights, so 16 and 128
bracket it.

--random N --seed S: N distinct shapes from numpy's Generator (the same for the same seed). A third
(on average) are misaligned: M, N and K log-uniform integers on [1, 32768], with at least one not
a multiple of 8. The others are log-uniform on [64, 32768] rounded to multiples of 64 (drawing from
1 would round 44 % of them to 64). A shape whose bf16 a, b and output take over 6 GiB, or whose
product takes over 2^41 FLOP (about 3 ms on an H100; each shape runs some 100 times: checks,
warm-up, rounds), is drawn again, so that 200 shapes take minutes of GPU time (compilation and
XLA's autotuning come on top).

A shape is M,N,K (a[M,K] @ b[K,N]) or B,M,N,K (a[B,M,K] @ b[B,K,N]); every suite runs in bf16
or fp16. --layout NT/TN/TT stores b as [N, K] and/or a as [K, M] and times
jax_tma.dot_general against lax.dot_general on them (2-D shapes). The table ends with the geometric
mean of the speed ratio, its minimum (the slowest product) and how many products fall below
0.95. Results go to benchmarks/results/<device>/:
bench_gemm[_llm|_random][_batched][_sweep][_<layout>][_fp16][_partIofN] .json, .md and .png (a
dry run writes files only when --out is given; it shrinks --suite llm to each family's first
projection, features and tokens divided by 128, and draws --random shapes on [1, 256]).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import re
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

import jax_tma
from jax_tma import _timing
from jax_tma.ops.gemm import config as gemm_config
from jax_tma.ops.gemm import primitive as gemm

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _lib.harness import parse_part, parse_shapes, part, part_bounds  # noqa: E402
from _lib.operands import gemm_operand_sets, operand_bytes  # noqa: E402
from _lib.report import banner, environment, pyplot, save_figure, write_report  # noqa: E402
from _lib.shapes import (  # noqa: E402
    BATCHED_DRY_RUN, BATCHED_QUICK, BATCHED_SUITE, DRY_RUN, LLM_DECODE, LLM_DRY_RUN_DIVISOR,
    LLM_PREFILL, LLM_PROJECTIONS, QUICK, RANDOM_ALIGN, RANDOM_DRY_RUN_MAX_DIM, RANDOM_MAX_BYTES,
    RANDOM_MAX_DIM, RANDOM_MAX_FLOP, SUITE, llm_suite, random_shapes, split_shape)

RATIO_FLOOR = 0.95  # the summary counts the products below this jax_tma/XLA speed ratio
DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16}
LAYOUTS = ("NN", "NT", "TN", "TT")  # a then b: N as in a[M, K] @ b[K, N], T stored transposed
READ_ONCE = "read_once"  # the --read-once contender
UNTUNED = "jax_tma_untuned"  # the --autotune run's heuristic contender


@dataclasses.dataclass
class Row:
    shape: tuple[int, ...]  # (M, N, K) or (B, M, N, K)
    contender: str
    seconds: float | None
    spread_s: float | None
    note: str = ""
    label: str = ""  # what the shape stands for (--suite llm), else empty
    path: str = ""  # jax_tma: the kernel configuration its lowering takes, or "xla" (jax_tma_path)

    @classmethod
    def from_json(cls, row: dict) -> Row:
        """A row of a report's JSON. Keys that are no field (tflops, derived) are left out and
        fields the row lacks (a report older than the field) take their defaults."""
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{**{k: v for k, v in row.items() if k in fields},
                      "shape": tuple(row["shape"])})

    def tflops(self) -> float | None:
        if self.seconds is None or self.contender == READ_ONCE:
            return None
        return 2.0 * math.prod(self.shape) / self.seconds / 1e12


def _label(shape: tuple[int, ...]) -> str:
    return "×".join(map(str, shape))


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a handful of shapes")
    p.add_argument("--batched", action="store_true",
                   help="the batched suite: [B,M,K] @ [B,K,N] (attention-like shapes)")
    p.add_argument("--shapes", nargs="+", metavar="[B,]M,N,K",
                   help="ad-hoc shapes: M,N,K for 2-D products, B,M,N,K for batched ones")
    p.add_argument("--suite", choices=("default", "llm"), default="default",
                   help="llm: dense projections of public models at prefill and decode token "
                        "counts")
    p.add_argument("--random", type=int, metavar="N",
                   help="N random shapes, log-uniform sizes in [1, 32768], a third misaligned")
    p.add_argument("--seed", type=int, help="seed of --random (default 0)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--layout", choices=sorted(LAYOUTS), default="NN",
                   help="operand layout: T stores a as [K, M] (first letter) or b as [N, K]")
    p.add_argument("--sweep", action="store_true", help="time every legal kernel configuration")
    p.add_argument("--splits", default="1,2,4,8", metavar="S,S,...",
                   help="split-K factors the sweep tries (default 1,2,4,8)")
    p.add_argument("--breakdown", action="store_true",
                   help="also print the kernels each contender launches, with their durations")
    p.add_argument("--no-pallas", action="store_true", help="skip the Pallas Mosaic-GPU matmul")
    p.add_argument("--autotune", action="store_true",
                   help="tune each product (jax_tma.autotune, XLA's dot among the candidates) "
                        "before timing it")
    p.add_argument("--autotune-max", type=int, metavar="N",
                   help="with --autotune: time the N configurations the cost model ranks first "
                        "(default: all)")
    p.add_argument("--autotune-cache", type=pathlib.Path, metavar="FILE",
                   help="with --autotune: the cache file (default: a new one in a temporary "
                        "directory)")
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
    p.add_argument("--part", metavar="I/N",
                   help="run the I-th (from 1) of N contiguous chunks of the shapes; the report "
                        "gets a _partIofN suffix")
    p.add_argument("--merge", nargs="+", type=pathlib.Path, metavar="FILE.json",
                   help="write the report of a whole suite from the JSON reports of its --part "
                        "runs (no GPU work); takes only --out and --partial besides")
    p.add_argument("--partial", action="store_true",
                   help="with --merge: parts may be missing; the report (stem _partial) says "
                        "which shapes it holds")
    args = p.parse_args(argv)
    if args.partial and not args.merge:
        p.error("--partial goes with --merge")
    if args.merge:
        defaults = vars(p.parse_args([]))
        others = [f"--{name.replace('_', '-')}" for name, value in vars(args).items()
                  if name not in ("merge", "out", "partial") and value != defaults[name]]
        if others:
            p.error(f"--merge takes only --out and --partial besides, got {' '.join(others)}")
        return args
    try:
        args.split_list = tuple(int(x) for x in args.splits.split(","))
    except ValueError:
        args.split_list = ()
    if not args.split_list or min(args.split_list) < 1:
        p.error(f"--splits takes positive ints separated by commas, got {args.splits!r}")
    chosen = [flag for flag, on in (("--shapes", args.shapes),
                                    ("--suite llm", args.suite == "llm"),
                                    ("--random", args.random is not None)) if on]
    if len(chosen) > 1:
        p.error(f"{' and '.join(chosen)} each choose the shapes: give one of them")
    if chosen and chosen[0] != "--shapes" and (args.quick or args.batched):
        p.error(f"--quick and --batched apply to the default suite, not to {chosen[0]}")
    if args.seed is not None and (args.random is None or args.seed < 0):
        p.error(f"--seed takes a non-negative int and applies to --random, got {args.seed}")
    if args.random is not None and args.random < 1:
        p.error(f"--random takes a positive number of shapes, got {args.random}")
    if not args.autotune and (args.autotune_max is not None or args.autotune_cache is not None):
        p.error("--autotune-max and --autotune-cache apply to --autotune")
    if args.autotune_max is not None and args.autotune_max < 1:
        p.error(f"--autotune-max takes a positive int, got {args.autotune_max}")
    args.labels, args.rejected, args.part_note = {}, 0, ""
    if args.shapes:
        args.shape_list = parse_shapes(p, args.shapes)
    elif args.suite == "llm":
        if args.dry_run:  # each family's first projection, shrunk
            firsts: dict[str, tuple] = {}
            for projection in LLM_PROJECTIONS:
                firsts.setdefault(projection[0], projection)
            args.labels = llm_suite(tuple(firsts.values()), LLM_PREFILL[:1], LLM_DECODE[:1],
                                    LLM_DRY_RUN_DIVISOR)
        else:
            args.labels = llm_suite()
        args.shape_list = list(args.labels)
    elif args.random is not None:
        args.seed = 0 if args.seed is None else args.seed
        args.shape_list, args.rejected = random_shapes(
            args.random, args.seed, RANDOM_DRY_RUN_MAX_DIM if args.dry_run else RANDOM_MAX_DIM)
    elif args.batched:
        args.shape_list = (BATCHED_DRY_RUN if args.dry_run else BATCHED_QUICK if args.quick
                           else BATCHED_SUITE)
    else:
        args.shape_list = DRY_RUN if args.dry_run else QUICK if args.quick else SUITE
    if args.layout != "NN" and any(len(s) != 3 for s in args.shape_list):
        p.error("--layout applies to 2-D (M,N,K) shapes")
    if args.part is not None:
        index, count = parse_part(p, args.part, len(args.shape_list), "shapes")
        total = len(args.shape_list)
        start, stop = part_bounds(total, index, count)
        args.part = (index, count, start, stop, total)
        args.part_note = f"Part {index} of {count}: shapes {start + 1} to {stop} of {total}."
        args.shape_list = part(args.shape_list, index, count)
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


def jax_tma_path(product, operands) -> str:
    """The path the lowering of `product(*operands)` (the jax_tma contender) takes: the kernel
    configuration it chooses ("block_m=128, block_n=256, ...", "+ transpose" where an operand is
    copied into the kernel's layout first), or "xla" where the product runs on XLA's dot.

    The product is traced, so that the dimension numbers are those jax_tma.matmul or
    dot_general hand the primitive rather than a copy of their rules; gemm.kernel_choice then
    decides as the lowering does. It is pure Python: without the kernel (a dry
    run on a CPU) this is the path a Hopper GPU would take (an H100, as gemm assumes without
    one); the lowering itself then runs XLA's dot."""
    return _paths(_lowering_choices(product, operands))


def _primitive_products(product, operands) -> list[tuple]:
    """(lhs aval, rhs aval, params) of every jax_tma primitive that `product(*operands)` binds,
    traced on abstract operands."""
    jaxpr = jax.make_jaxpr(product)(*(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in operands))
    return [(*(v.aval for v in eqn.invars), eqn.params) for eqn in jaxpr.eqns
            if eqn.primitive is gemm.dot_general_p]


def _lowering_choices(product, operands) -> list:
    """gemm.kernel_choice, as the lowering makes it, for each of those products."""
    return [gemm.kernel_choice(lhs, rhs, params["dimension_numbers"], params["out_dtype"],
                               params["precision"], params["config"])
            for lhs, rhs, params in _primitive_products(product, operands)]


def _paths(choices: list) -> str:
    """jax_tma_path's description of these kernel choices."""
    return "; ".join("xla" if choice is None else
                     choice[1].describe() + (" + transpose" if choice[0].copies else "")
                     for choice in choices) or "xla"


def untuned_product(ours, xla, forced, operands):
    """(product, path): what the jax_tma contender `ours` runs without the autotuning cache, as
    a product that keeps doing so once the cache has an entry (`xla` where the lowering leaves
    the product to XLA's dot, else `forced` with the configuration the heuristic picks), and
    its jax_tma_path. Called before tuning."""
    choices = _lowering_choices(ours, operands)
    chosen = choices[0] if choices else None
    return (xla if chosen is None else forced(chosen[1])), _paths(choices)


def tune(product, operands, max_candidates: int | None = None) -> str:
    """Autotunes every jax_tma product of `product(*operands)` (found as jax_tma_path finds
    them) into the current cache; returns what happened, for the log: the winners, or why
    nothing was tuned (the kernels cannot run here, or a product the kernel does not compute)."""
    done = []
    for lhs, rhs, params in _primitive_products(product, operands):
        try:
            result = jax_tma.autotune(
                jax.ShapeDtypeStruct(lhs.shape, lhs.dtype),
                jax.ShapeDtypeStruct(rhs.shape, rhs.dtype), params["dimension_numbers"],
                preferred_element_type=params["out_dtype"], precision=params["precision"],
                max_candidates=max_candidates)
        except (RuntimeError, ValueError) as e:
            done.append(f"not tuned: {str(e).splitlines()[0]}")
            continue
        done.append("xla" if result.xla_faster else result.best.describe())
    return "; ".join(done) or "no jax_tma product"


def _read_once(a, b):
    """Reads every element of both operands once (fp32 sums of each row) and nothing else."""
    return jnp.sum(a, axis=-1, dtype=jnp.float32), jnp.sum(b, axis=-1, dtype=jnp.float32)


def _check(name, fn, ops, ref) -> str:
    out = jax.jit(fn)(*ops)
    err = _timing.relative_error(out, ref)
    return "" if err <= 2e-2 else f"{name}: rel. error {err:.2e} vs XLA"


def bench_shape(shape, dtype, args, pallas) -> list[Row]:
    batch, m, n, k = split_shape(shape)
    key = jax.random.key(math.prod(batch) * 131 + m * 31 + n * 7 + k)
    sets = gemm_operand_sets(shape, dtype, key, args.layout)
    ours, xla, forced = _products(args.layout)
    contenders = {"jax_tma": ours, "xla": xla}
    paths = {}
    if args.autotune:  # before anything is compiled, so that every lowering reads the cache
        contenders[UNTUNED], paths[UNTUNED] = untuned_product(ours, xla, forced, sets[0])
        start = time.perf_counter()
        tuned = tune(ours, sets[0], args.autotune_max)
        args.tuning_seconds += time.perf_counter() - start
        print(f" tuned in {time.perf_counter() - start:.1f} s ({tuned}) ...", end="",
              file=sys.stderr, flush=True)
    ref = jax.jit(xla)(*sets[0])
    if args.sweep:
        for cfg in gemm_config.legal_configs(m, n, k, dtype, splits=args.split_list):
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
    path = jax_tma_path(ours, sets[0])
    paths["jax_tma"] = path
    rows = [Row(shape, name, t.median_s, t.spread_s, path=paths.get(name, ""))
            for name, t in timings.items()]
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


def _ratios(rows: list[Row], contender: str = "jax_tma") -> dict[tuple[int, ...], float]:
    """XLA time / `contender`'s time of each shape both timed, in the order of `rows`."""
    found = {(r.shape, r.contender): r.seconds for r in rows if r.seconds}
    return {shape: found[(shape, "xla")] / found[(shape, contender)]
            for shape in dict.fromkeys(r.shape for r in rows)
            if (shape, contender) in found and (shape, "xla") in found}


def ratio_summary(rows: list[Row], contender: str = "jax_tma") -> dict | None:
    """Geometric mean and minimum of the `contender`/XLA speed ratio over the shapes both timed,
    the slowest shape (with its label) and how many fall below RATIO_FLOOR; None where none."""
    ratios = _ratios(rows, contender)
    if not ratios:
        return None
    slowest = min(ratios, key=ratios.get)
    labels = {r.shape: r.label for r in rows}
    return {"shapes": len(ratios), "geomean": math.exp(np.mean(np.log(list(ratios.values())))),
            "min": ratios[slowest], "slowest_shape": list(slowest),
            "slowest_label": labels[slowest], "floor": RATIO_FLOOR,
            "below_floor": sum(r < RATIO_FLOOR for r in ratios.values())}


def _table(rows: list[Row], env: dict, dtype: str, about: str = "") -> str:
    """The Markdown report; `about` (where given) is a line saying where the shapes come from."""
    peak = max((r.tflops() for r in rows if r.tflops()), default=0.0)
    by_shape: dict = {}
    for r in rows:
        by_shape.setdefault(r.shape, {})[r.contender] = r
    labels = {r.shape: r.label for r in rows if r.label}
    ranks = {len(s) for s in by_shape}
    header = "M×N×K" if ranks == {3} else "B×M×N×K" if ranks == {4} else "[B×]M×N×K"
    header += " | origin" if labels else ""
    lines = [
        f"{env['device']}, driver {env['driver']}, CUDA {env.get('cuda_runtime')}, "
        f"jax {env['jax']}, {env['date']}, {dtype} in and out, timing: {env['timing']}; "
        f"% of peak = of the highest TFLOP/s measured in this run ({peak:.1f})",
        *(["", about] if about else []),
        "",
        (f"| {header} | jax_tma µs | jax_tma TFLOP/s | % peak | XLA µs | XLA TFLOP/s "
         "| ratio (XLA time / jax_tma time) | jax_tma path |"),
        "|---|---|---|---|---|---|---|---|" + ("---|" if labels else ""),
    ]
    for shape, ratio in _ratios(rows).items():
        ours, xla = by_shape[shape]["jax_tma"], by_shape[shape]["xla"]
        origin = f" | {labels.get(shape, '')}" if labels else ""
        lines.append(
            f"| {_label(shape)}{origin} | {ours.seconds * 1e6:.1f} ± {ours.spread_s * 1e6:.1f} "
            f"| {ours.tflops():.1f} | {100 * ours.tflops() / peak:.0f} | {xla.seconds * 1e6:.1f} "
            f"| {xla.tflops():.1f} | {ratio:.3f} | {ours.path or '–'} |")
    summary = ratio_summary(rows)
    if summary:
        slowest = _label(tuple(summary["slowest_shape"]))
        if summary["slowest_label"]:
            slowest += f", {summary['slowest_label']}"
        lines += ["", f"geometric mean of the ratio: {summary['geomean']:.3f} over "
                      f"{summary['shapes']} shapes; slowest: {summary['min']:.3f} ({slowest}); "
                      f"{summary['below_floor']} below {RATIO_FLOOR}"]
    untuned = ratio_summary(rows, UNTUNED)
    if untuned:
        lines += ["", (f"{UNTUNED} (the same run, what jax_tma runs without the cache): "
                       f"geometric mean of the ratio {untuned['geomean']:.3f}; slowest: "
                       f"{untuned['min']:.3f} ({_label(tuple(untuned['slowest_shape']))}); "
                       f"{untuned['below_floor']} below {RATIO_FLOOR}")]
    others = sorted({r.contender for r in rows} - {"jax_tma", "xla"})
    for name in others:
        lines += ["", f"{name}:"]
        for r in rows:
            if r.contender == name:
                if not r.seconds:
                    what = r.note
                elif name == READ_ONCE:  # both suites' dtypes take 2 bytes an element
                    ours, size = by_shape[r.shape].get("jax_tma"), operand_bytes(r.shape, 2)
                    what = (f"{r.seconds * 1e6:.1f} µs, "
                            f"{size / r.seconds / 1e9:.0f} GB/s of operands")
                    if ours and ours.seconds:
                        what += (f"; jax_tma reads them at {size / ours.seconds / 1e9:.0f} GB/s "
                                 f"({r.seconds / ours.seconds:.2f}× this speed)")
                else:
                    what = f"{r.seconds * 1e6:.1f} µs, {r.tflops():.1f} TFLOP/s"
                    if r.path:
                        what += f" ({r.path})"
                lines.append(f"- {_label(r.shape)}: {what}")
    return "\n".join(lines)


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
    """The report's name: the suite's, then _partIofN for a --part run."""
    suffixes = [name for name, on in (("llm", args.suite == "llm"),
                                      ("random", args.random is not None),
                                      ("batched", args.batched), ("sweep", args.sweep),
                                      (args.layout, args.layout != "NN"),
                                      (args.dtype, args.dtype != "bf16")) if on]
    if args.part:
        suffixes.append("part{}of{}".format(*args.part[:2]))
    if args.autotune:
        suffixes.insert(len(suffixes) - bool(args.part), "autotuned")
    return "_".join(["bench_gemm", *suffixes])


def _suite(args) -> str:
    """Where the shapes came from: shapes (--shapes), llm, random, batched or default."""
    if args.shapes:
        return "shapes"
    if args.random is not None:
        return "random"
    return "batched" if args.batched else args.suite


def _about(args) -> str:
    """Where the shapes of --suite llm and --random come from, and (--autotune) how jax_tma was
    tuned, for the report; else empty."""
    where = _shapes_about(args)
    if not args.autotune:
        return where
    tuned = ("jax_tma autotuned before timing (jax_tma.autotune: "
             + (f"the {args.autotune_max} configurations the cost model ranks first"
                if args.autotune_max else "every legal configuration")
             + " and XLA's dot; path xla: XLA's dot measured faster).")
    return " ".join(filter(None, [where, tuned]))


def _shapes_about(args) -> str:
    """Where the shapes of --suite llm and --random come from; else empty."""
    if args.suite == "llm":
        families = dict.fromkeys(family for family, *_ in LLM_PROJECTIONS)
        shrunk = (" (dry run: each family's first projection, tokens and features divided by "
                  f"{LLM_DRY_RUN_DIVISOR}, one prefill and one decode count)"
                  if args.dry_run else "")
        return (f"Dense projections of {', '.join(families)} at "
                f"{' and '.join(map(str, LLM_PREFILL))} prefill and "
                f"{', '.join(map(str, LLM_DECODE))} decode tokens{shrunk}; M = tokens (a quarter "
                f"for a Mixtral expert).")
    if args.random is not None:
        shrunk = f" (dry run: sizes up to {RANDOM_DRY_RUN_MAX_DIM})" if args.dry_run else ""
        return (f"{args.random} random shapes, seed {args.seed}{shrunk}: log-uniform sizes, a "
                f"third misaligned, the rest multiples of {RANDOM_ALIGN}; {args.rejected} draws "
                f"rejected (bf16 operands and output over {RANDOM_MAX_BYTES / 2**30:.0f} GiB, "
                f"over {RANDOM_MAX_FLOP / 1e12:.1f} TFLOP, or repeated).")
    return ""


def _what(dtype: str, layout: str) -> str:
    """The run's dtype and (where not NN) layout, for the table and the plot."""
    return dtype if layout == "NN" else f"{dtype}, layout {layout}"


def _json_row(r: Row) -> dict:
    return dict(dataclasses.asdict(r), tflops=r.tflops())


def _write(out_root: pathlib.Path | None, payload: dict, rows: list[Row], table: str) -> None:
    """Writes the report `payload` (of `rows`, with the Markdown `table`) under its stem."""
    env = payload["environment"]
    title = (f"{env['device']}, {_what(payload['dtype'], payload['layout'])}"
             + (f", {payload['suite']} suite" if payload.get("about") else ""))
    write_report(out_root, env, payload["stem"], payload, table,
                 lambda path: _plot(rows, path, title))


def _whole(stem: str) -> str:
    """The suite's stem of a --part report's stem."""
    return re.sub(r"_part\d+of\d+$", "", stem)


def _identity(payload: dict) -> dict:
    """What the reports of the parts of one suite share (--merge checks that they agree)."""
    env = payload["environment"]
    return {"device": env.get("device"), "commit": env.get("commit"),
            "dtype": payload.get("dtype"), "layout": payload.get("layout"),
            "suite": payload.get("suite"), "dry run": payload.get("dry_run"),
            "random shapes": payload.get("random"), "stem": _whole(payload["stem"])}


def _part_ranges(parts: list) -> tuple[int | None, list[tuple[int, int]]]:
    """The suite's number of shapes and [start, stop) of the shapes that each --part report of
    `parts` ((path, payload) pairs) holds: recorded in the report, or (reports written before
    the bounds were) computed from its I/N and the suite's length another report records;
    (None, []) where no report records it. ValueError where the reports give the suite different
    lengths."""
    totals = {payload["part"]["total"] for _, payload in parts if "total" in payload["part"]}
    if len(totals) > 1:
        raise ValueError("the parts differ in the suite's number of shapes: " + ", ".join(
            f"{path} {payload['part'].get('total')!r}" for path, payload in parts))
    if not totals:
        return None, []
    (total,) = totals
    return total, [(payload["part"]["start"], payload["part"]["stop"])
                   if "start" in payload["part"]
                   else part_bounds(total, payload["part"]["index"], payload["part"]["count"])
                   for _, payload in parts]


def merge(paths: list[pathlib.Path], partial: bool = False) -> tuple[dict, list[Row], str]:
    """The report (JSON payload, rows, Markdown table) of a whole suite from the JSON reports
    of its --part runs at `paths`, given in any order and of any I/N splits: their rows in the
    suite's order and the summary over all of them, under the suite's stem.

    ValueError where a file is no report of a --part run, where the reports differ in what
    identifies the suite (_identity; named), or where a shape is missing or held twice: the
    merged report stands for the whole suite, run by one commit on one device. With `partial`,
    shapes may be missing (not held twice): the report says which it holds, its summary is over
    those, and its stem ends in _partial."""
    parts = []
    for path in paths:
        try:
            payload = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read {path}: {e}") from None
        if not (isinstance(payload, dict)
                and {"environment", "rows", "part", "stem"} <= payload.keys()):
            raise ValueError(f"{path} is no report of a bench_gemm --part run")
        parts.append((path, payload))
    identities = [(path, _identity(payload)) for path, payload in parts]
    for key, value in identities[0][1].items():
        if any(identity[key] != value for _, identity in identities):
            raise ValueError(f"the parts differ in {key}: " + ", ".join(
                f"{path} {identity[key]!r}" for path, identity in identities))
    total, ranges = _part_ranges(parts)
    if total is None:  # reports written before parts recorded their shapes: one I/N split
        counts = {payload["part"]["count"] for _, payload in parts}
        if partial or len(counts) > 1:
            raise ValueError("a partial merge, or parts of different I/N splits, need reports "
                             "that record their shapes (written by this version of bench_gemm)")
        (count,) = counts
        parts.sort(key=lambda part: part[1]["part"]["index"])
        indices = [payload["part"]["index"] for _, payload in parts]
        if indices != list(range(1, count + 1)):
            raise ValueError(f"a suite of {count} parts takes each once, got parts {indices}")
    else:
        order = sorted(range(len(parts)), key=lambda i: ranges[i])
        parts, ranges = [parts[i] for i in order], [ranges[i] for i in order]
        after = [start for start, _ in ranges[1:]] + [total]  # where each range should stop
        twice = any(stop > end for (_, stop), end in zip(ranges, after))
        missing = ranges[0][0] > 0 or any(stop < end for (_, stop), end in zip(ranges, after))
        if twice or (missing and not partial):
            raise ValueError(
                "the parts must hold each of the suite's {} shapes once, got shapes {}".format(
                    total, ", ".join(f"{start + 1} to {stop}" for start, stop in ranges)))
    first = parts[0][1]
    rows = [Row.from_json(r) for _, payload in parts for r in payload["rows"]]
    merged = {key: value for key, value in first.items() if key != "part"}
    merged.update(stem=_whole(first["stem"]), summary=ratio_summary(rows),
                  rows=[_json_row(r) for r in rows], merged_from=[p.name for p, _ in parts])
    about = first.get("about", "")
    if partial:
        held = _joined(ranges)
        merged["stem"] += "_partial"
        merged["shapes_held"] = {"total": total, "ranges": [list(r) for r in held]}
        about = merged["about"] = " ".join(filter(None, [about, "Partial: shapes {} of {} (the "
            "others were not run).".format(", ".join(f"{a + 1} to {b}" for a, b in held), total)]))
    if "autotune" in first:
        merged["autotune"] = dict(first["autotune"], tuning_seconds=sum(
            payload.get("autotune", {}).get("tuning_seconds", 0.0) for _, payload in parts),
            untuned_summary=ratio_summary(rows, UNTUNED))
    table = _table(rows, first["environment"], _what(first["dtype"], first["layout"]), about)
    return merged, rows, table


def _joined(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, non-overlapping [start, stop) ranges with the adjacent ones joined."""
    joined: list[tuple[int, int]] = []
    for start, stop in ranges:
        if joined and joined[-1][1] == start:
            joined[-1] = (joined[-1][0], stop)
        else:
            joined.append((start, stop))
    return joined


def main(argv=None) -> int:
    args = _parse(argv)
    if args.merge:
        try:
            payload, rows, table = merge(args.merge, args.partial)
        except ValueError as e:
            sys.exit(f"bench_gemm --merge: {e}")
        print(table)
        _write(args.out, payload, rows, table)
        return 0
    dtype = DTYPES[args.dtype]
    env = environment(args.commit)
    print(banner(env, args.dtype), flush=True)
    pallas = None if args.no_pallas or args.dry_run else _pallas_contender(dtype)
    args.tuning_seconds = 0.0
    if args.autotune:
        cache = args.autotune_cache or pathlib.Path(tempfile.mkdtemp()) / "autotune.json"
        os.environ["JAX_TMA_AUTOTUNE_CACHE"] = str(cache)
        print(f"autotuning into {cache}", file=sys.stderr)
    if args.part:
        print(args.part_note, file=sys.stderr)
    rows: list[Row] = []
    for i, shape in enumerate(args.shape_list):
        label = args.labels.get(shape, "")
        print(f"[{i + 1}/{len(args.shape_list)}] {'x'.join(map(str, shape))}"
              f"{f' ({label})' if label else ''} ...", end="", file=sys.stderr, flush=True)
        new = bench_shape(shape, dtype, args, pallas)
        for r in new:
            r.label = label
        rows += new
        best = {r.contender: r for r in new if r.seconds}
        ours, xla = best.get("jax_tma"), best.get("xla")
        print(f" jax_tma {ours.tflops():.1f} vs XLA {xla.tflops():.1f} TFLOP/s ({ours.path})",
              file=sys.stderr, flush=True)
        if args.sweep:
            for r in sorted((r for r in new if r.tflops()), key=lambda r: r.seconds):
                print(f"    {r.seconds * 1e6:10.1f} us {r.tflops():7.1f} TFLOP/s  {r.contender}")
    about = _about(args)
    table = _table(rows, env, _what(args.dtype, args.layout),
                   " ".join(filter(None, [about, args.part_note])))
    print(table)
    if args.dry_run and args.out is None:
        return 0
    payload = {"environment": env, "dtype": args.dtype, "layout": args.layout,
               "dry_run": args.dry_run, "suite": _suite(args), "stem": _stem(args),
               "about": about, "summary": ratio_summary(rows),
               "rows": [_json_row(r) for r in rows]}
    if args.random is not None:
        payload["random"] = {"count": args.random, "seed": args.seed, "rejected": args.rejected}
    if args.part:
        payload["part"] = dict(zip(("index", "count", "start", "stop", "total"), args.part))
    if args.autotune:
        payload["autotune"] = {"max_candidates": args.autotune_max,
                               "tuning_seconds": round(args.tuning_seconds, 1),
                               "untuned_summary": ratio_summary(rows, UNTUNED)}
    _write(args.out, payload, rows, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
