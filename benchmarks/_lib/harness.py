"""Command-line pieces every benchmark shares: --shapes parsing, the timing harness's options, a
suite cut into parts, and the contender name of a forced configuration."""

from __future__ import annotations

import argparse
import pathlib
import re


def harness_arguments(p: argparse.ArgumentParser) -> None:
    """The options of the benchmarks that time contenders with _timing.compare over random
    operand sets (bench_ragged_dot, bench_epilogues, bench_fp8, bench_autotune)."""
    p.add_argument("--sets", type=int, default=2, help="distinct operand sets per timed call")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--commit", help="commit to record (default: git rev-parse HEAD)")
    p.add_argument("--out", type=pathlib.Path, help="results root (default benchmarks/results)")


def parse_shapes(p: argparse.ArgumentParser, values: list[str], names: tuple[str, ...] = (
        "M,N,K", "B,M,N,K")) -> list[tuple[int, ...]]:
    """The --shapes `values` of a benchmark ("1024,1024,64") as tuples of positive ints, each
    with as many sizes as one of the forms `names`; anything else is a usage error (`p.error`,
    exit 2) naming the forms and what was given."""
    try:
        shapes = [tuple(int(x) for x in s.split(",")) for s in values]
    except ValueError:
        shapes = []
    lengths = {name.count(",") + 1 for name in names}
    if not shapes or any(len(s) not in lengths or min(s) < 1 for s in shapes):
        p.error(f"--shapes takes {' or '.join(names)} of positive ints, got {' '.join(values)}")
    return shapes


def chosen_shapes(p: argparse.ArgumentParser, args, suite: list, quick: list,
                  dry_run: list, names: tuple[str, ...] = ("M,N,K",)) -> list[tuple[int, ...]]:
    """The shapes a benchmark runs: `dry_run` (with one round of one iteration) under
    --dry-run, else --shapes (parse_shapes), else `quick` under --quick, else `suite`."""
    if args.dry_run:
        args.rounds, args.iterations = 1, 1
        return dry_run
    if args.shapes:
        return parse_shapes(p, args.shapes, names)
    return quick if args.quick else suite


def sweep_label(config) -> str:
    """A forced configuration's contender name in the --sweep tables of bench_ragged_dot and
    bench_epilogues: "jax_tma 128x256x3x2" (block_m, block_n, stages, cluster_m)."""
    return "jax_tma " + "x".join(map(str, config.tile))


def part_bounds(total: int, index: int, count: int) -> tuple[int, int]:
    """[start, stop) of the `index`-th (from 1) of `count` contiguous chunks of `total` items,
    whose lengths differ by at most one."""
    return (index - 1) * total // count, index * total // count


def parse_part(p: argparse.ArgumentParser, value: str, items: int, noun: str) -> tuple[int, int]:
    """--part's I/N as (I, N); a parser error unless 1 <= I <= N <= `items` (the suite's number
    of `noun`)."""
    match = re.fullmatch(r"(\d+)/(\d+)", value)
    index, count = map(int, match.groups()) if match else (0, 0)
    if not 1 <= index <= count:
        p.error(f"--part takes I/N with 1 <= I <= N, got {value!r}")
    if count > items:
        p.error(f"--part {value}: {items} {noun} make fewer than {count} parts")
    return index, count


def part(shapes: list, index: int, count: int) -> list:
    """The `index`-th (from 1) of `count` contiguous chunks of `shapes` (part_bounds): the
    chunks of 1..count, in order, are `shapes`."""
    return shapes[slice(*part_bounds(len(shapes), index, count))]
