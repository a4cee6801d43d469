"""Grouped GEMM (MoE) benchmark: jax_tma.ragged_dot against XLA's lax.ragged_dot, the Pallas
Mosaic-GPU ragged_dot_mgpu kernel (best of its configurations that fit the shape) and the dense
product of the same FLOPs (the ceiling), in one run and one harness (jax_tma._timing.compare:
CUPTI kernel time on a GPU, operands rotated over distinct buffers, rounds alternating).

Shapes are M, K, N, G: lhs [M, K], rhs [G, K, N], group sizes summing to M. The suite has
large groups (MoE layers of 8-64 experts) and fine-grained ones (64-512 rows per expert, as
Qwen3-MoE and DeepSeek-V3 run on one GPU), with uniform group sizes and Zipf-skewed sizes
(exponent 1.2); the weight-gradient form (contraction: [M, K] x [M, N] -> [G, K, N]), whose
contenders are jax_tma and lax.ragged_dot_general (Pallas's kernel has no such form); and the
gated form (a SwiGLU expert's first half, act(x @ w_gate) * (x @ w_up), N = F): jax_tma.
gated_ragged_dot against jax_tma's and XLA's unfused forms, two ragged_dots and one of the
weights stored concatenated [G, K, 2F], each followed by the elementwise product; and the FP8
form (1x128 / 128x128 block scales, rhs [G, N, K]): jax_tma.fp8_ragged_dot against jax_tma's
and XLA's bf16 ragged_dot of the dequantised operands and the FP8 dense product of equal FLOPs.

    python benchmarks/bench_ragged_dot.py             # the suite
    python benchmarks/bench_ragged_dot.py --quick     # the first two shapes, fewer rounds
    python benchmarks/bench_ragged_dot.py --shapes 16384,4096,14336,8 --sizes zipf
    python benchmarks/bench_ragged_dot.py --form gated --shapes 16384,2048,1536,128
    python benchmarks/bench_ragged_dot.py --only fine gated  # parts: large, fine, gated, fp8
    python benchmarks/bench_ragged_dot.py --sweep     # every compiled jax_tma configuration
    python benchmarks/bench_ragged_dot.py --dry-run   # tiny shapes; runs without a GPU (CI)
    python benchmarks/bench_ragged_dot.py --only fine --part 1/2   # half the cases (a GPU each),
    python benchmarks/bench_ragged_dot.py --merge <results>/bench_ragged_dot_fine_part*of2.json

Before timing, every contender's result is compared with jax_tma's (relative error). Writes
bench_ragged_dot.json, .md and .png under benchmarks/results/<device>/ (a --part run's name ends
in _partIofN; --merge writes the suite's from its parts, which must share device, driver, jax,
commit and timing).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jax_tma
from jax_tma import _ext, _timing
from jax_tma.ops.fp8 import quantize as fp8_quantize

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _lib.harness import (harness_arguments, parse_part, parse_shapes, part,  # noqa: E402
                          sweep_label)
from _lib.report import (banner, environment, pyplot, read_parts, save_figure,  # noqa: E402
                         write_progress)

SUITE = [  # (M, K, N, G, sizes, form)
    # large groups
    (16384, 4096, 14336, 8, "uniform", "rows"),
    (32768, 2048, 1408, 64, "uniform", "rows"),
    (8192, 7168, 2048, 32, "uniform", "rows"),
    (4096, 4096, 1536, 128, "uniform", "rows"),
    (16384, 4096, 14336, 8, "zipf", "rows"),
    (32768, 2048, 1408, 64, "zipf", "rows"),
    (8192, 7168, 2048, 32, "zipf", "rows"),
    (16384, 4096, 14336, 8, "uniform", "contraction"),
    (32768, 2048, 1408, 64, "uniform", "contraction"),
    (8192, 7168, 2048, 32, "zipf", "contraction"),
    # fine-grained: 64-1024 rows per expert
    (16384, 2048, 1536, 128, "uniform", "rows"),
    (8192, 7168, 4096, 32, "uniform", "rows"),
    (4096, 7168, 4096, 32, "uniform", "rows"),
    (65536, 2048, 768, 64, "uniform", "rows"),
    (32768, 4096, 1536, 128, "uniform", "rows"),
    (32768, 4096, 1536, 128, "zipf", "rows"),
    (16384, 2048, 1536, 128, "uniform", "contraction"),
    (8192, 7168, 4096, 32, "uniform", "contraction"),
    (32768, 4096, 1536, 128, "zipf", "contraction"),
    # FP8 block-scaled (fp8_ragged_dot): DeepGEMM's contiguous (8192 / 4096 rows a group) and
    # masked-like (256 rows) cases, and fine-grained ones
    (32768, 7168, 4096, 4, "uniform", "fp8"),
    (32768, 2048, 7168, 8, "uniform", "fp8"),
    (1024, 7168, 4096, 4, "uniform", "fp8"),
    (1024, 2048, 7168, 4, "uniform", "fp8"),
    (16384, 2048, 1536, 128, "uniform", "fp8"),
    (32768, 7168, 4096, 128, "uniform", "fp8"),
    (16384, 4096, 14336, 8, "zipf", "fp8"),
    # gated (SwiGLU first half), N = F
    (16384, 2048, 1536, 128, "uniform", "gated"),
    (32768, 2048, 1408, 64, "zipf", "gated"),
    (8192, 7168, 2048, 32, "uniform", "gated"),
    (32768, 4096, 1536, 128, "uniform", "gated"),
    (16384, 4096, 14336, 8, "uniform", "gated"),
]
# --only: the suite's large-group cases, its fine-grained ones (G >= 32 with at most 1024 rows
# per expert), or its gated ones.
SUBSETS = {
    "large": lambda c: c[5] in ("rows", "contraction") and c[0] // c[3] > 1024,
    "fine": lambda c: c[5] in ("rows", "contraction") and c[0] // c[3] <= 1024,
    "gated": lambda c: c[5] == "gated",
    "fp8": lambda c: c[5] == "fp8",
}
DRY_RUN = [(256, 64, 128, 4, "uniform", "rows"), (256, 64, 128, 4, "zipf", "contraction"),
           (256, 64, 128, 4, "zipf", "gated"), (256, 256, 128, 4, "zipf", "fp8")]
# Pallas ragged_dot_mgpu configurations: (block_m, block_n, block_k, max_concurrent_steps,
# grid_block_n); those whose block_n x grid_block_n does not divide N are skipped.
PALLAS_CONFIGS = [(128, 128, 64, 4, 1), (64, 128, 64, 4, 1), (128, 192, 64, 4, 1),
                  (128, 128, 64, 6, 2), (128, 64, 64, 4, 1)]
CONTRACTION_DIMS = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[])


@dataclasses.dataclass
class Row:
    case: str
    contender: str
    flops: float
    seconds: float | None
    spread_s: float = 0.0
    note: str = ""
    bytes: int = 0  # the fewest bytes the product moves: operands read once, output written once

    def tflops(self) -> float | None:
        return self.flops / self.seconds / 1e12 if self.seconds else None


def group_sizes(kind: str, m: int, g: int, rng: np.random.Generator) -> np.ndarray:
    """Sizes summing to m: equal (the remainder spread over the first groups), or Zipf-skewed
    with exponent 1.2 in a random group order."""
    if kind == "uniform":
        s = np.full(g, m // g)
        s[: m % g] += 1
    else:
        weights = 1.0 / np.arange(1, g + 1) ** 1.2
        s = rng.multinomial(m, weights / weights.sum())
        rng.shuffle(s)
    return s.astype(np.int32)


def _label(case) -> str:
    m, k, n, g, sizes, form = case
    suffix = {"rows": "", "contraction": " dW", "gated": " gated", "fp8": " fp8"}[form]
    return f"{m}x{k}x{n} G={g} {sizes}{suffix}"


def _pallas(shape_n: int):
    """{name: fn(x, w, gs)} of the Pallas kernel's configurations that fit N, or {} where the
    kernel is not available."""
    try:
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
    except Exception:  # noqa: BLE001 - not available in this jax
        return {}
    found = {}
    for bm, bn, bk, steps, grid_n in PALLAS_CONFIGS:
        if shape_n % (bn * grid_n):
            continue
        found[f"pallas_mgpu {bm}x{bn}x{bk} s{steps} g{grid_n}"] = functools.partial(
            lambda x, w, gs, **kw: ragged_dot_mgpu.ragged_dot(x, w, group_sizes=gs, **kw),
            block_m=bm, block_n=bn, block_k=bk, max_concurrent_steps=steps, grid_block_n=grid_n)
    return found


def _operand_sets(case, dtype, count, seed):
    m, k, n, g, sizes, form = case
    rng = np.random.default_rng(seed)
    keys = jax.random.split(jax.random.key(seed), 2 * count)
    sets = []
    for i in range(count):
        gs = jnp.asarray(group_sizes(sizes, m, g, rng))
        x = jax.random.normal(keys[2 * i], (m, k), jnp.float32).astype(dtype)
        if form == "fp8":  # quantised operands and their scales, and their bf16 dequantised
            w = jax.random.normal(keys[2 * i + 1], (g, n, k), jnp.float32)  # [G, N, K]
            xq, xs = jax_tma.quantize_fp8(x.astype(jnp.float32), (1, 128))
            wq, ws = jax_tma.quantize_fp8(w, (128, 128))
            xb = fp8_quantize.dequantize_fp8(xq, xs, (1, 128)).astype(jnp.bfloat16)
            wb = jnp.swapaxes(fp8_quantize.dequantize_fp8(wq, ws, (128, 128)), 1, 2).astype(
                jnp.bfloat16)  # [G, K, N]
            sets.append((xq, wq, xs, ws, xb, wb, gs))
            continue
        if form == "gated":  # w_gate, w_up and the two stored concatenated [G, K, 2F]
            w = jax.random.normal(keys[2 * i + 1], (2, g, k, n), jnp.float32).astype(dtype)
            sets.append((x, w[0], w[1], jnp.concatenate([w[0], w[1]], axis=-1), gs))
            continue
        second = (g, k, n) if form == "rows" else (m, n)
        y = jax.random.normal(keys[2 * i + 1], second, jnp.float32).astype(dtype)
        sets.append((x, y, gs))
    return sets


def _gated_tail(h_gate, h_up, dtype):
    """silu(gate) * up in fp32, rounded once to the operands' type: the unfused forms' epilogue
    (the kernel's rounds the two products first, which is within the check's tolerance)."""
    return (jax.nn.silu(h_gate.astype(jnp.float32)) * h_up.astype(jnp.float32)).astype(dtype)


def _sweep(op, configs) -> dict:
    """--sweep's contenders: `op` with the heuristic's pick, and with each of `configs`."""
    return {"jax_tma": op, **{sweep_label(cfg): functools.partial(op, config=cfg)
                              for cfg in configs}}


def _fp8_contenders(sweep: bool):
    """{name: fn(xq, wq, xs, ws, xb, wb, group_sizes)} of the FP8 form: the block-scaled grouped
    kernel, the bf16 ragged products of the dequantised operands, and the FP8 dense product of
    equal FLOPs (group 0's weights for every row)."""
    def fp8(xq, wq, xs, ws, xb, wb, gs, **kw):
        return jax_tma.fp8_ragged_dot(xq, wq, xs, ws, gs, **kw)

    if sweep:
        return _sweep(fp8, jax_tma.FP8_RAGGED_CONFIGS)
    nt = (((1,), (1,)), ((), ()))
    return {"jax_tma": fp8,
            "jax_tma_bf16": lambda xq, wq, xs, ws, xb, wb, gs: jax_tma.ragged_dot(xb, wb, gs),
            "xla_bf16": lambda xq, wq, xs, ws, xb, wb, gs: lax.ragged_dot(xb, wb, gs),
            "dense": lambda xq, wq, xs, ws, xb, wb, gs: jax_tma.fp8_dot_general(
                xq, wq[0], xs, ws[0], nt)}


def _gated_contenders(sweep: bool):
    """{name: fn(x, w_gate, w_up, w_cat, group_sizes)} of the gated form."""
    def fused(x, wg, wu, wc, gs, **kw):
        return jax_tma.gated_ragged_dot(x, wg, wu, gs, "silu", **kw)

    if sweep:
        return _sweep(fused, jax_tma.GATED_RAGGED_CONFIGS)

    def two_calls(dot):
        return lambda x, wg, wu, wc, gs: _gated_tail(dot(x, wg, gs), dot(x, wu, gs), x.dtype)

    def concatenated(dot):
        def fn(x, wg, wu, wc, gs):
            h = dot(x, wc, gs)
            f = wg.shape[-1]
            return _gated_tail(h[:, :f], h[:, f:], x.dtype)
        return fn

    return {"jax_tma": fused, "jax_tma_two": two_calls(jax_tma.ragged_dot),
            "jax_tma_concat": concatenated(jax_tma.ragged_dot),
            "xla_two": two_calls(lax.ragged_dot), "xla_concat": concatenated(lax.ragged_dot),
            "dense": lambda x, wg, wu, wc, gs: x @ wc[0]}  # same FLOPs: M x K @ K x 2F


def _contenders(case, sweep: bool = False):
    m, k, n, g, sizes, form = case
    if form == "gated":
        return _gated_contenders(sweep)
    if form == "fp8":
        return _fp8_contenders(sweep)
    if sweep:  # every compiled configuration, and the heuristic's pick
        op = (jax_tma.ragged_dot if form == "rows" else functools.partial(
            jax_tma.ragged_dot_general, ragged_dot_dimension_numbers=CONTRACTION_DIMS))
        return _sweep(op, jax_tma.RAGGED_CONFIGS)
    if form == "rows":
        found = {"jax_tma": jax_tma.ragged_dot, "xla": lax.ragged_dot}
        found.update(_pallas(n))
        found["dense"] = lambda x, w, gs: x @ w[0]  # same FLOPs: M x K @ K x N
    else:
        found = {
            "jax_tma": functools.partial(jax_tma.ragged_dot_general,
                                         ragged_dot_dimension_numbers=CONTRACTION_DIMS),
            "xla": functools.partial(lax.ragged_dot_general,
                                     ragged_dot_dimension_numbers=CONTRACTION_DIMS),
            "dense": lambda x, dy, gs: x.T @ dy,  # same FLOPs: K x M @ M x N
        }
    return found


def min_bytes(case, itemsize: int) -> int:
    """Operands read once and the output written once (rows: x, every group's weights, out;
    contraction: x, dy and the [G, K, N] output)."""
    m, k, n, g, _, form = case
    if form == "rows":
        return itemsize * (m * k + g * k * n + m * n)
    if form == "gated":  # x, both weights, the [M, F] result
        return itemsize * (m * k + 2 * g * k * n + m * n)
    if form == "fp8":  # one-byte operands, the bf16 result
        return m * k + g * k * n + 2 * m * n
    return itemsize * (m * k + m * n + g * k * n)


def peak_dram_bytes_per_s() -> float | None:
    devices = [d for d in jax.devices() if d.platform == "gpu"]
    return _ext.peak_dram_bytes_per_s(devices[0]) if devices else None


def bench_case(case, dtype, args) -> list[Row]:
    m, k, n, g, sizes, form = case
    flops = 2.0 * m * k * n * (2 if form == "gated" else 1)
    sets = _operand_sets(case, dtype, args.sets, args.seed)
    contenders = _contenders(case, args.sweep)
    # Check every contender against jax_tma on the first set (the dense one computes another
    # product and is left out).
    ref = np.asarray(jax.jit(contenders["jax_tma"])(*sets[0]), np.float32)
    notes, usable = {}, {}
    for name, fn in contenders.items():
        try:
            out = np.asarray(jax.jit(fn)(*sets[0]), np.float32)
        except Exception as err:  # noqa: BLE001 - a contender that cannot run this shape
            notes[name] = f"failed: {type(err).__name__}: {str(err)[:120]}"
            continue
        usable[name] = fn
        if name != "dense":
            denom = np.linalg.norm(ref) or 1.0
            notes[name] = f"rel. error vs jax_tma {np.linalg.norm(out - ref) / denom:.1e}"
    timings = _timing.compare(usable, sets, rounds=args.rounds, iterations=args.iterations)
    size = min_bytes(case, jnp.dtype(dtype).itemsize)
    rows = [Row(_label(case), name, flops, t.median_s, t.spread_s, notes.get(name, ""), size)
            for name, t in timings.items()]
    rows += [Row(_label(case), name, flops, None, note=note)
             for name, note in notes.items() if name not in timings]
    # Pallas: keep its best configuration only.
    pallas = [r for r in rows if r.contender.startswith("pallas_mgpu") and r.seconds]
    if pallas:
        best = min(pallas, key=lambda r: r.seconds)
        rows = [r for r in rows if not r.contender.startswith("pallas_mgpu")]
        rows.append(dataclasses.replace(best, contender="pallas_mgpu",
                                        note=best.contender.split(" ", 1)[1] + "; " + best.note))
    for r in rows:
        print(f"  {r.case:42s} {r.contender:12s} "
              + (f"{r.seconds * 1e6:10.1f} us {r.tflops():8.1f} TFLOP/s  {r.note}"
                 if r.seconds else r.note), flush=True)
    return rows


def _table(rows: list[Row], env: dict, dtype: str) -> str:
    bw = env.get("peak_dram_bytes_per_s")
    lines = [
        f"{env['device']}, driver {env['driver']}, CUDA {env.get('cuda_runtime')}, jax "
        f"{env['jax']}, {env['date']}, commit {str(env.get('commit'))[:10]}, {dtype} in and out, "
        f"timing: {env['timing']}; floor = the longer of the dense product of equal FLOPs and "
        f"the fewest bytes at the peak DRAM bandwidth"
        + (f" ({bw / 1e12:.2f} TB/s)" if bw else ""),
    ]
    rows_header = [
        "",
        "| M×K×N, G, sizes | jax_tma µs | jax_tma TFLOP/s | XLA TFLOP/s | Pallas TFLOP/s | dense TFLOP/s "
        "| × XLA | × Pallas | % of dense | floor µs | % of floor |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows_lines = []
    bandwidth = env.get("peak_dram_bytes_per_s")
    by_case: dict = {}
    for r in rows:
        by_case.setdefault(r.case, {})[r.contender] = r

    def tf(r):
        return f"{r.tflops():.1f}" if r and r.seconds else "—"

    gated_header = [
        "",
        "Gated form, act(x @ w_gate) * (x @ w_up) with silu (FLOPs of both products; \"two\": two "
        "ragged_dots, \"concat\": one of the weights stored concatenated, each then the "
        "elementwise product in XLA):",
        "",
        "| M×K×F, G, sizes | jax_tma µs | jax_tma TFLOP/s | × jax_tma two | × jax_tma concat "
        "| × XLA best | XLA best | floor µs | % of floor |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    gated_lines = []
    fp8_header = [
        "",
        "FP8 form, 1x128 / 128x128 block scales, e4m3 in, bf16 out (\"bf16\": ragged_dot of the "
        "dequantised operands; dense: the FP8 block-scaled product of equal FLOPs):",
        "",
        "| M×K×N, G, sizes | jax_tma µs | jax_tma TFLOP/s | × jax_tma bf16 | × XLA bf16 "
        "| dense TFLOP/s | % of dense | floor µs | % of floor |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    fp8_lines = []
    for case, found in by_case.items():
        ours, dense = found.get("jax_tma"), found.get("dense")
        if not (ours and ours.seconds):
            continue

        def ratio(other):
            return f"{other.seconds / ours.seconds:.2f}" if other and other.seconds else "—"

        # The floor: the dense product's time (the chip's speed on these FLOPs) or the time to
        # move the fewest bytes at the device's peak DRAM bandwidth, whichever is longer.
        floor = max(dense.seconds if dense and dense.seconds else 0.0,
                    ours.bytes / bandwidth if bandwidth else 0.0)
        floor_cells = (f"{floor * 1e6:.1f} | {100 * floor / ours.seconds:.0f}" if floor
                       else "— | —")
        timed = f"{ours.seconds * 1e6:.1f} ± {ours.spread_s * 1e6:.1f}"
        if "jax_tma_bf16" in found:  # the FP8 form
            share = f"{100 * dense.seconds / ours.seconds:.0f}" if dense and dense.seconds else "—"
            fp8_lines.append(
                f"| {case} | {timed} | {tf(ours)} | {ratio(found.get('jax_tma_bf16'))} | "
                f"{ratio(found.get('xla_bf16'))} | {tf(dense)} | {share} | {floor_cells} |")
            continue
        if "jax_tma_two" in found:  # the gated form
            xla = [found[c] for c in ("xla_two", "xla_concat") if found.get(c)
                   and found[c].seconds]
            best = min(xla, key=lambda r: r.seconds) if xla else None
            gated_lines.append(
                f"| {case} | {timed} | {tf(ours)} | {ratio(found.get('jax_tma_two'))} | "
                f"{ratio(found.get('jax_tma_concat'))} | {ratio(best)} | "
                f"{best.contender if best else '—'} | {floor_cells} |")
            continue
        xla, pallas = found.get("xla"), found.get("pallas_mgpu")
        share = f"{100 * dense.seconds / ours.seconds:.0f}" if dense and dense.seconds else "—"
        rows_lines.append(f"| {case} | {timed} | "
                     f"{tf(ours)} | {tf(xla)} | {tf(pallas)} | {tf(dense)} | {ratio(xla)} | "
                     f"{ratio(pallas)} | {share} | {floor_cells} |")
    if rows_lines:
        lines += rows_header + rows_lines
    if gated_lines:
        lines += gated_header + gated_lines
    if fp8_lines:
        lines += fp8_header + fp8_lines
    notes = [f"- {r.case} {r.contender}: {r.note}" for r in rows
             if r.note and r.contender in ("pallas_mgpu", "xla") or r.note.startswith("failed")]
    if notes:
        lines += ["", "Notes (configuration, error against jax_tma):", *notes]
    return "\n".join(lines)


def _plot(rows: list[Row], path: pathlib.Path, title: str) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    cases = list(dict.fromkeys(r.case for r in rows))
    names = [c for c in ("jax_tma", "jax_tma_two", "jax_tma_concat", "jax_tma_bf16",
                         "pallas_mgpu", "xla", "xla_two", "xla_concat", "xla_bf16", "dense")
             if any(r.contender == c for r in rows)]
    value = {(r.case, r.contender): r.tflops() or 0.0 for r in rows}
    fig, ax = plt.subplots(figsize=(max(8, 0.9 * len(cases)), 5))
    x = np.arange(len(cases))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        ax.bar(x + i * width, [value.get((c, name), 0.0) for c in cases], width, label=name)
    ax.set_title(title)
    ax.set_ylabel("TFLOP/s")
    ax.set_xticks(x + width * (len(names) - 1) / 2, cases, rotation=50, ha="right", fontsize=7)
    ax.legend()
    return save_figure(plt, fig, path)


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the first two shapes, fewer rounds")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes (no GPU needed)")
    p.add_argument("--shapes", nargs="*", metavar="M,K,N,G", help="instead of the suite")
    p.add_argument("--sizes", choices=("uniform", "zipf"), default="uniform")
    p.add_argument("--form", choices=("rows", "contraction", "gated", "fp8"), default="rows")
    p.add_argument("--only", nargs="+", choices=tuple(SUBSETS), help="parts of the suite")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--sweep", action="store_true",
                   help="time every compiled configuration of jax_tma instead of the contenders")
    p.add_argument("--part", metavar="I/N",
                   help="the I-th of N contiguous chunks of the cases (one process per GPU); the "
                        "report's name gets a _partIofN suffix")
    p.add_argument("--merge", nargs="+", type=pathlib.Path, metavar="FILE.json",
                   help="write a suite's report from its --part reports (no GPU work)")
    harness_arguments(p)
    args = p.parse_args(argv)
    args.shape_list = parse_shapes(p, args.shapes, ("M,K,N,G",)) if args.shapes else []
    if args.dry_run:
        args.cases, args.rounds, args.iterations = DRY_RUN, 1, 1
    elif args.shapes:
        args.cases = [(*shape, args.sizes, args.form) for shape in args.shape_list]
    else:
        args.cases = [c for c in SUITE if args.only is None
                      or any(SUBSETS[name](c) for name in args.only)]
        args.cases = args.cases[:2] if args.quick else args.cases
        if args.quick:
            args.rounds = 3
    args.part_of = (None if args.part is None or args.merge
                    else parse_part(p, args.part, len(args.cases), "cases"))
    return args


def merge(paths: list[pathlib.Path]) -> tuple[dict, str, list[Row], int]:
    """(environment, the suite's report name, rows in its case order, the suite's number of
    cases) of the --part reports at `paths`: a ValueError where they come from different runs
    (read_parts) or suites, or hold a case twice."""
    env, payloads = read_parts(paths, "bench_ragged_dot --part")
    names = {(payload.get("stem"), tuple(payload.get("cases", ()))) for payload in payloads}
    if len(names) != 1 or None in next(iter(names)):
        raise ValueError("the reports are not --part runs of one suite: " + ", ".join(
            f"{path} ({payload.get('stem')!r})" for path, payload in zip(paths, payloads)))
    stem, cases = next(iter(names))
    rows = [Row(**row) for payload in payloads for row in payload["rows"]]
    per_part = [list(dict.fromkeys(r["case"] for r in payload["rows"])) for payload in payloads]
    if len({c for part_cases in per_part for c in part_cases}) != sum(map(len, per_part)):
        raise ValueError("a case appears in two of the reports")
    rows.sort(key=lambda r: cases.index(r.case) if r.case in cases else len(cases))
    return env, stem, rows, len(cases)


def main(argv=None) -> int:
    args = _parse(argv)
    dtype = jnp.bfloat16 if args.dtype == "bf16" else jnp.float16
    if args.merge:
        env, stem, rows, total = merge(args.merge)
        write_progress(args.out, env, stem,
                       {"environment": env, "rows": [dataclasses.asdict(r) for r in rows]},
                       _table(rows, env, args.dtype),
                       lambda path: _plot(rows, path, f"ragged_dot, {env['device']}"),
                       len(dict.fromkeys(r.case for r in rows)), total, "cases")
        print(_table(rows, env, args.dtype))
        return 0
    cases = args.cases
    env = environment(args.commit)
    env["peak_dram_bytes_per_s"] = peak_dram_bytes_per_s()
    print(banner(env, args.dtype))
    stem = "bench_ragged_dot" + "".join(f"_{name}" for name in args.only or ()) + (
        "_sweep" if args.sweep else "") + ("" if args.dtype == "bf16" else "_fp16")
    part_info = {}
    if args.part_of is not None:
        index, count = args.part_of
        part_info = {"stem": stem, "cases": [_label(c) for c in cases], "part": [index, count]}
        cases = part(cases, index, count)
        stem += f"_part{index}of{count}"
    rows = []
    for i, case in enumerate(cases):
        rows += bench_case(case, dtype, args)
        table = _table(rows, env, args.dtype)
        if not args.dry_run or args.out is not None:
            write_progress(args.out, env, stem,
                           {"environment": env, **part_info,
                            "rows": [dataclasses.asdict(r) for r in rows]},
                           table, lambda path: _plot(rows, path, f"ragged_dot, {env['device']}"),
                           i + 1, len(cases), "cases")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
