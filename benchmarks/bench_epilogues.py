"""Fused-epilogue benchmark: jax_tma.dense / gated_dense against XLA's unfused expressions and
XLA's dot alone (the floor: the same product with nothing after it), in one run and one harness
(jax_tma._timing.compare: CUPTI kernel time on a GPU, operands rotated over distinct buffers,
rounds alternating between contenders).

Patterns, bf16 in and out, bias bf16:
  gelu      gelu(x @ w + b)                  (jax.nn.gelu, tanh approximation)
  residual  x @ w + b + r
  swiglu    silu(x @ wg) * (x @ wu)          XLA: two dots, and one dot of [wg | wu] (the
                                             concatenated weights made once, outside the timing),
                                             the faster taken as XLA's best; the floor is the
                                             dot of twice the width
  swiglu_grad                                the SwiGLU block's backward product and gated
            h = dy @ wd^T;                   gradient (gated_mlp's backward): dy [M, K], wd
            (h * u * silu'(g), h * silu(g))  [N, K], g and u the saved [M, N] pre-activations;
                                             XLA: the dot, then one fusion writing both
Shapes M x N x K: 16384x14336x4096, 8192x4096x4096, 4096x11008x4096, 8192x28672x8192, and
decode rows M = 16, 64 against 14336x4096.

    python benchmarks/bench_epilogues.py             # the suite
    python benchmarks/bench_epilogues.py --quick     # two shapes
    python benchmarks/bench_epilogues.py --sweep     # jax_tma on every compiled configuration
                                                     # (and stream-K), its plain product,
                                                     # beside XLA's forms and its dot
    python benchmarks/bench_epilogues.py --floor     # also the time XLA takes to read the
                                                     # weights once (a sum over them): a
                                                     # reference for the decode rows, which
                                                     # are bound by that read
    python benchmarks/bench_epilogues.py --dry-run   # tiny shapes; runs without a GPU (CI)

Before timing, jax_tma's result is compared with XLA's (relative error). Writes
bench_epilogues.json, .md and .png under benchmarks/results/<device>/.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_tma
from jax_tma import _timing
from jax_tma._core.config import stream_k_variants
from jax_tma.ops.dense import config as ep_config

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _lib.harness import chosen_shapes, harness_arguments, sweep_label  # noqa: E402
from _lib.patterns import NT, PATTERNS, fused, pattern_forms, pattern_operands  # noqa: E402
from _lib.report import banner, environment, pyplot, save_figure, write_report  # noqa: E402

SHAPES = [(16384, 14336, 4096), (8192, 4096, 4096), (4096, 11008, 4096), (8192, 28672, 8192),
          (16, 14336, 4096), (64, 14336, 4096)]
DRY_RUN = [(64, 128, 64)]


@dataclasses.dataclass
class Row:
    pattern: str
    shape: tuple[int, int, int]
    contender: str
    seconds: float
    spread_s: float
    note: str = ""

    def tflops(self) -> float:
        m, n, k = self.shape
        width = 2 * n if self.pattern == "swiglu" else n
        return 2.0 * m * width * k / self.seconds / 1e12


def swept_configs(pattern: str = "gelu") -> list:
    """Every compiled configuration of `pattern`'s fused kernel, and stream-K on those that
    take it."""
    kind = ep_config.GATED_GRADIENT if pattern == "swiglu_grad" else ep_config.FORWARD
    compiled = ep_config.configs_for(kind, "silu")
    return [*compiled, *stream_k_variants(compiled)]


def swept_label(config) -> str:
    """A forced configuration's contender name: sweep_label's, " sk" added for stream-K."""
    return sweep_label(config) + (" sk" if config.stream_k else "")


# The sweep's plain product: jax_tma's own GEMM of the same operands, nothing fused (swiglu:
# of the concatenated weights), to tell the fusion's cost from the product's.
PLAIN = "jax_tma_dot"


def _swept(pattern) -> dict:
    """jax_tma's fused op on every compiled configuration (forced through config=), keyed by
    swept_label, and jax_tma's plain product."""
    found = {swept_label(cfg): fused(pattern, cfg) for cfg in swept_configs(pattern)}
    if pattern == "swiglu_grad":
        found[PLAIN] = lambda dy, wd, pre: jax_tma.dot_general(dy, wd, NT)
    elif pattern == "swiglu":
        found[PLAIN] = lambda x, w, b, r, w2, wc: jax_tma.matmul(x, wc)
    else:
        found[PLAIN] = lambda x, w, b, r, w2, wc: jax_tma.matmul(x, w)
    return found


# The floor contender (--floor): XLA's sum over the weights the product reads (swiglu: both,
# concatenated), a kernel that reads each of their bytes once and writes nothing of note. A
# product with few rows cannot finish before its weights have been read; this is how fast one
# of XLA's kernels reads them (its dot may stream them faster still: compare both columns).
READ_W = "xla_read_w"


def _read_weights(pattern):
    total = lambda w: jnp.sum(w, dtype=jnp.float32)  # noqa: E731
    if pattern == "swiglu_grad":
        return lambda dy, wd, pre: total(wd)
    if pattern == "swiglu":
        return lambda x, w, b, r, w2, wc: total(wc)
    return lambda x, w, b, r, w2, wc: total(w)


def _contenders(pattern, sweep: bool = False, floor: bool = False):
    found = pattern_forms(pattern)
    if sweep:
        found.update(_swept(pattern))
    if floor:
        found[READ_W] = _read_weights(pattern)
    return found


def weight_bytes(pattern, shape) -> int:
    """The bytes of bf16 weights a pattern's product reads."""
    _, n, k = shape
    return 2 * k * n * (2 if pattern == "swiglu" else 1)


def _flat(result) -> np.ndarray:
    """A contender's result (one array or a tuple of them) as one float32 vector."""
    return np.concatenate([np.asarray(r, np.float32).ravel() for r in jax.tree.leaves(result)])


def bench(pattern, shape, args) -> list[Row]:
    sets = pattern_operands(pattern, shape, args.sets, args.seed)
    contenders = _contenders(pattern, args.sweep, args.floor)
    xla = _flat(jax.jit(contenders["xla"])(*sets[0]))
    notes = {}
    for name, fn in contenders.items():
        if name.startswith("jax_tma"):  # the default, each forced config, the plain product
            ref, against = (xla, "XLA") if name != PLAIN else (
                _flat(jax.jit(contenders["xla_dot"])(*sets[0])), "XLA's dot")
            ours = _flat(jax.jit(fn)(*sets[0]))
            err = float(np.linalg.norm(ours - ref) / max(np.linalg.norm(ref), 1e-30))
            notes[name] = f"rel. difference from {against} {err:.1e}"
    timings = _timing.compare(contenders, sets, rounds=args.rounds, iterations=args.iterations)
    rows = [Row(pattern, shape, name, t.median_s, t.spread_s, notes.get(name, ""))
            for name, t in timings.items()]
    for r in rows:
        rate = (f"{weight_bytes(pattern, shape) / r.seconds / 1e12:8.2f} TB/s of weights"
                if r.contender == READ_W else f"{r.tflops():8.1f} TFLOP/s")
        print(f"  {pattern:8s} {'x'.join(map(str, shape)):18s} {r.contender:10s} "
              f"{r.seconds * 1e6:10.1f} us {rate} {r.note}", flush=True)
    return rows


def _table(rows: list[Row], env: dict) -> str:
    floor = any(r.contender == READ_W for r in rows)
    lines = [
        f"{env['device']}, driver {env['driver']}, CUDA {env.get('cuda_runtime')}, jax "
        f"{env['jax']}, {env['date']}, commit {str(env.get('commit'))[:10]}, bf16, timing: "
        f"{env['timing']}. × XLA: XLA's best unfused form's time / jax_tma's; vs dot: the "
        "dot alone's time / jax_tma's (1.0 = the epilogue costs nothing)" + (
            "; weights read: XLA's sum over the weights the product reads (a kernel that only "
            "reads them), and the rate at which it and jax_tma go through them" if floor else ""),
        "",
        "| pattern | M×N×K | jax_tma µs | jax_tma TFLOP/s | XLA µs | XLA dot µs "
        "| × XLA | vs dot |" + (" weights read µs | read TB/s | jax_tma TB/s |" if floor else ""),
        "|---|---|---|---|---|---|---|---|" + ("---|---|---|" if floor else ""),
    ]
    groups: dict = {}
    for r in rows:
        groups.setdefault((r.pattern, r.shape), {})[r.contender] = r
    for (pattern, shape), found in groups.items():
        ours, dot = found["jax_tma"], found["xla_dot"]
        xla = min((found[c] for c in ("xla", "xla_concat") if c in found),
                  key=lambda r: r.seconds)
        lines.append(f"| {pattern} | {'×'.join(map(str, shape))} | {ours.seconds * 1e6:.1f} ± "
                     f"{ours.spread_s * 1e6:.1f} | {ours.tflops():.1f} | {xla.seconds * 1e6:.1f}"
                     f"{' (concat)' if xla.contender == 'xla_concat' else ''} | "
                     f"{dot.seconds * 1e6:.1f} | {xla.seconds / ours.seconds:.3f} | "
                     f"{dot.seconds / ours.seconds:.3f} |"
                     + (_floor_cells(found, pattern, shape) if floor else ""))
    timed = {r.contender for r in rows}
    labels = dict.fromkeys(swept_label(c) for p in PATTERNS for c in swept_configs(p))
    swept = [label for label in [*labels, PLAIN] if label in timed]
    if swept:
        lines += ["", "Every compiled configuration (`--sweep`; sk: stream-K), and jax_tma's plain "
                  "product of the same operands (jax_tma_dot; swiglu: of the concatenated "
                  "weights), µs; the default's pick is the jax_tma column above:", "",
                  "| pattern | M×N×K | " + " | ".join(swept) + " |",
                  "|---|---|" + "---|" * len(swept)]
        for (pattern, shape), found in groups.items():
            lines.append(f"| {pattern} | {'×'.join(map(str, shape))} | " + " | ".join(
                f"{found[c].seconds * 1e6:.1f}" if c in found else "—" for c in swept) + " |")
    return "\n".join(lines)


def _floor_cells(found: dict, pattern, shape) -> str:
    """The weights-read columns of a row (--floor gives every row the read)."""
    tb = weight_bytes(pattern, shape) / 1e12
    read, ours = found[READ_W].seconds, found["jax_tma"].seconds
    return f" {read * 1e6:.1f} | {tb / read:.2f} | {tb / ours:.2f} |"


def _plot(rows: list[Row], path: pathlib.Path, title: str) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    keys = list(dict.fromkeys((r.pattern, r.shape) for r in rows))
    names = ["jax_tma", "xla", "xla_concat", "xla_dot"]
    value = {(r.pattern, r.shape, r.contender): r.tflops() for r in rows}
    fig, ax = plt.subplots(figsize=(max(8, 0.8 * len(keys)), 5))
    x = np.arange(len(keys))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        ax.bar(x + i * width, [value.get((*k, name), 0.0) for k in keys], width, label=name)
    ax.set_title(title)
    ax.set_ylabel("TFLOP/s")
    ax.set_xticks(x + width * 1.5, [f"{p} {'x'.join(map(str, s))}" for p, s in keys],
                  rotation=50, ha="right", fontsize=7)
    ax.legend()
    return save_figure(plt, fig, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--shapes", nargs="*", metavar="M,N,K")
    p.add_argument("--patterns", nargs="*", choices=PATTERNS, default=list(PATTERNS))
    p.add_argument("--sweep", action="store_true",
                   help="also time jax_tma on every compiled configuration (config=)")
    p.add_argument("--floor", action="store_true",
                   help="also time XLA reading the weights once (a sum over them)")
    harness_arguments(p)
    args = p.parse_args(argv)
    shapes = chosen_shapes(p, args, SHAPES, SHAPES[1:3], DRY_RUN)
    env = environment(args.commit)
    print(banner(env, "bf16"))
    rows = []
    for shape in shapes:
        for pattern in args.patterns:
            rows += bench(pattern, shape, args)
    table = _table(rows, env)
    print(table)
    if args.dry_run and args.out is None:
        return 0
    payload = {"environment": env, "rows": [dataclasses.asdict(r) for r in rows]}
    name = "bench_epilogues" + ("_sweep" if args.sweep else "") + ("_floor" if args.floor else "")
    write_report(args.out, env, name, payload,
                 table,
                 lambda path: _plot(rows, path, f"fused epilogues, {env['device']}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
