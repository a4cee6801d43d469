"""Every op sharded over the GPUs of one host against the same work on one GPU.

Each op runs on 1, 2 and 4 devices (those present; --devices picks) in every sharding form it
supports, with its operands already placed as the layout says and XLA left to choose the output
layout:

  op           layout            operands
  matmul       M sharded         a [M, K] rows, b [K, N] replicated
               N sharded         b's columns
               K sharded         a's columns and b's rows (one all-reduce of fp32 partials)
  ragged_dot   tokens sharded    x [M, K] rows (group sizes replicated: each device finds its
                                 rows' groups on the device), w [G, K, N] replicated
               N sharded         w's columns
  dense        M sharded         gelu(x @ w + bias): x's rows
               N sharded         w's and bias's columns
  gated_dense  M sharded         silu(x @ wg) * (x @ wu): x's rows
               N sharded         wg's and wu's columns
  fp8          M sharded         block-scaled e4m3 (1x128 / 128x128 scales): a's rows and scales
               K sharded         a's and b's K with their scales (one all-reduce)
  moe_layer    expert parallel   forward + backward of jax_tma.moe_mlp (SwiGLU experts, top-k)
                                 in bench_moe_layer's three configurations: tokens and experts
                                 sharded, rows exchanged by ragged all-to-all; one device runs
                                 the same layer with every expert

Timing: wall clock (a sharded call is done when its slowest device is), each timed call
evaluating --products distinct operand sets inside one jit, median over --repeats with half the
min-max spread. Speedup = one device's time / this one's. `kernel` says whether jax_tma's
kernel ran (its custom call in the compiled HLO). Writes bench_sharded.json (rows {op, layout,
size, devices, seconds, spread_s, speedup, kernel}; `size` as the case built its operands), .md
and .png under benchmarks/results/<device>/,
after every case (a run cut short keeps what it measured; the JSON's "complete" says whether
it finished).

    python benchmarks/bench_sharded.py                       # every op, 1 / 2 / 4 GPUs
    python benchmarks/bench_sharded.py --ops matmul fp8 --devices 1 4
    XLA_FLAGS=--xla_force_host_platform_device_count=4 python benchmarks/bench_sharded.py \\
        --dry-run                                            # tiny sizes on CPU devices (CI)
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import zlib
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_tma
from jax_tma import _timing

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _lib.report import banner, environment, pyplot, save_figure, write_progress  # noqa: E402

AX = "x"
BF16 = jnp.bfloat16
OPS = ("matmul", "ragged_dot", "dense", "gated_dense", "fp8", "moe_layer")
NT = (((1,), (1,)), ((), ()))


@dataclasses.dataclass(frozen=True)
class Case:
    """One op in one layout: `make(key)` builds one operand set (global arrays), `specs` their
    PartitionSpecs over the mesh axis AX, `fn` the work."""

    op: str
    layout: str
    fn: Callable
    make: Callable
    specs: tuple
    size: str = ""


def _normal(key, shape, dtype=BF16, scale=1.0):
    return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)


def _cases(sizes: dict) -> list[Case]:
    # Each builder takes its sizes as defaults: a closure would read the names' last binding.
    cases = []
    m, n, k = sizes["matmul"]

    def mm(key, m=m, n=n, k=k):
        ka, kb = jax.random.split(key)
        return _normal(ka, (m, k)), _normal(kb, (k, n), scale=k ** -0.5)
    for layout, specs in (("M sharded", (P(AX), P())), ("N sharded", (P(), P(None, AX))),
                          ("K sharded", (P(None, AX), P(AX)))):
        cases.append(Case("matmul", layout, jax_tma.matmul, mm, specs, f"{m}x{n}x{k}"))

    m, k, n, g = sizes["ragged_dot"]

    def ragged(key, m=m, k=k, n=n, g=g):
        kx, kw = jax.random.split(key)
        sizes_ = jnp.full((g,), m // g, jnp.int32)
        return _normal(kx, (m, k)), _normal(kw, (g, k, n), scale=k ** -0.5), sizes_
    for layout, specs in (("tokens sharded", (P(AX), P(), P())),
                          ("N sharded", (P(), P(None, None, AX), P()))):
        cases.append(Case("ragged_dot", layout, jax_tma.ragged_dot, ragged, specs,
                          f"{m}x{k}x{n} G={g}"))

    m, n, k = sizes["dense"]

    def dense_ops(key, m=m, n=n, k=k):
        kx, kw, kb = jax.random.split(key, 3)
        return _normal(kx, (m, k)), _normal(kw, (k, n), scale=k ** -0.5), _normal(kb, (n,))
    dense = lambda x, w, b: jax_tma.dense(x, w, b, "gelu")  # noqa: E731
    for layout, specs in (("M sharded", (P(AX), P(), P())),
                          ("N sharded", (P(), P(None, AX), P(AX)))):
        cases.append(Case("dense", layout, dense, dense_ops, specs, f"{m}x{n}x{k}"))

    def gated_ops(key, m=m, n=n, k=k):
        kx, kg, ku = jax.random.split(key, 3)
        return (_normal(kx, (m, k)), _normal(kg, (k, n), scale=k ** -0.5),
                _normal(ku, (k, n), scale=k ** -0.5))
    gated = lambda x, wg, wu: jax_tma.gated_dense(x, wg, wu, "silu")  # noqa: E731
    for layout, specs in (("M sharded", (P(AX), P(), P())),
                          ("N sharded", (P(), P(None, AX), P(None, AX)))):
        cases.append(Case("gated_dense", layout, gated, gated_ops, specs, f"{m}x{n}x{k}"))

    m, n, k = sizes["fp8"]

    def fp8_ops(key, m=m, n=n, k=k):
        kx, kw = jax.random.split(key)
        a, sa = jax_tma.quantize_fp8(_normal(kx, (m, k), jnp.float32), (1, 128))
        b, sb = jax_tma.quantize_fp8(_normal(kw, (n, k), jnp.float32), (128, 128))
        return a, b, sa, sb
    fp8 = lambda a, b, sa, sb: jax_tma.fp8_dot_general(a, b, sa, sb, NT)  # noqa: E731
    for layout, specs in (("M sharded", (P(AX), P(), P(None, AX), P())),
                          ("K sharded", (P(None, AX), P(None, AX), P(AX), P(AX)))):
        cases.append(Case("fp8", layout, fp8, fp8_ops, specs, f"{m}x{n}x{k}"))

    for name, tokens, d, experts, hidden, top_k in sizes["moe_layer"]:
        def moe_ops(key, tokens=tokens, d=d, experts=experts, hidden=hidden):
            ks = jax.random.split(key, 6)
            return (_normal(ks[0], (tokens, d)), _normal(ks[1], (tokens, d)),
                    _normal(ks[2], (d, experts), jnp.float32, d ** -0.5),
                    _normal(ks[3], (experts, d, hidden), jnp.float32, d ** -0.5),
                    _normal(ks[4], (experts, hidden, d), jnp.float32, hidden ** -0.5),
                    _normal(ks[5], (experts, d, hidden), jnp.float32, d ** -0.5))
        cases.append(Case("moe_layer", "expert parallel", _moe_step(top_k), moe_ops,
                          (P(AX), P(AX), P(), P(AX), P(AX), P(AX)),
                          f"{name}: {tokens} tokens, d {d}, {experts} x {hidden}, top-{top_k}"))
    return cases


def _moe_step(top_k: int) -> Callable:
    """value_and_grad of the layer (expert-parallel over AX when the mesh has several devices:
    `mesh` is bound by the caller)."""
    def step(x, dy, router, w_up, w_down, w_gate, *, mesh=None):
        def loss(x, router, w_up, w_down, w_gate):
            y, stats = jax_tma.moe_mlp(x, router, w_up, w_down, w_gate, top_k=top_k,
                                       dtype=BF16, expert_axis=None if mesh is None else AX,
                                       mesh=mesh)
            return (jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32))
                    + 1e-2 * stats.load_balancing_loss)
        return jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))(x, router, w_up, w_down, w_gate)
    step.moe = True
    return step


SIZES = {"matmul": (32768, 8192, 8192), "ragged_dot": (65536, 4096, 4096, 16),
         "dense": (32768, 14336, 4096), "fp8": (16384, 8192, 8192),
         # (name, tokens, d, experts, width, top-k): bench_moe_layer's three configurations
         "moe_layer": [("qwen3", 32768, 2048, 128, 768, 8), ("deepseek", 16384, 7168, 32, 2048, 8),
                       ("mixtral", 16384, 4096, 8, 14336, 2)]}
DRY_SIZES = {"matmul": (64, 32, 64), "ragged_dot": (64, 32, 16, 4), "dense": (64, 32, 64),
             "fp8": (64, 256, 512), "moe_layer": [("tiny", 64, 32, 8, 16, 2)]}


def _run_case(case: Case, devices: list, args) -> dict:
    mesh = Mesh(np.array(devices), (AX,))
    fn = case.fn
    if getattr(fn, "moe", False) and len(devices) > 1:
        fn = (lambda f: lambda *a: f(*a, mesh=mesh))(case.fn)
    seed = zlib.crc32(f"{case.op} {case.layout} {case.size}".encode())
    keys = jax.random.split(jax.random.key(seed), args.products)
    sets = []
    for key in keys:
        ops = jax.jit(case.make)(key)
        sets.append(tuple(jax.device_put(v, NamedSharding(mesh, s))
                          for v, s in zip(ops, case.specs)))
    hlo = jax.jit(fn).lower(*sets[0]).compile().as_text()
    t = _timing.time_products(fn, sets, repeats=args.repeats)
    row = {"op": case.op, "layout": case.layout, "size": case.size, "devices": len(devices),
           "seconds": t.median_s, "spread_s": t.spread_s,
           "kernel": 'custom_call_target="jax_tma_' in hlo}
    if args.breakdown:
        row.update(_breakdown(fn, sets[0], len(devices), args.breakdown))
    return row


def _breakdown(fn: Callable, operands: tuple, devices: int, most: int) -> dict:
    """Where one call's time goes: its kernels (CUPTI, every device's) by name, the seconds
    each name takes per device, the `most` longest; and all kernels' seconds per device (the
    rest of the wall time is gaps: launches, host syncs, waits between devices). Over several
    devices CUPTI's records interleave differently from call to call, so one call is timed;
    where CUPTI cannot split them, the row has no breakdown."""
    try:
        runs = _timing.kernel_breakdown(fn, operands, iterations=1 if devices > 1 else 3)
    except RuntimeError as err:  # jax's CUPTI reader: records that do not line up
        return {"kernels_note": f"no breakdown: {err}"}
    if runs is None:
        return {}
    per_name: dict[str, float] = {}
    for name, seconds in runs:
        short = _kernel_name(name)
        per_name[short] = per_name.get(short, 0.0) + seconds / devices
    top = sorted(per_name.items(), key=lambda kv: -kv[1])[:most]
    return {"kernel_s": sum(per_name.values()), "kernels": [[n, s] for n, s in top]}


# jax_tma's kernel template names its problem class (csrc/kernels/sm90_gemm_problems.cuh).
_PROBLEMS = (("RaggedGatedGradRowsGemm", "ragged_gated_grad"),
             ("RaggedGatedRowsGemm", "ragged_gated"), ("RaggedRowsGemm", "ragged_rows"),
             ("RaggedKGemm", "ragged_weight_grad"), ("DenseGemm", "gemm"))


def _kernel_name(name: str) -> str:
    """A readable key for a kernel's (often mangled) name: jax_tma's kernels by their problem
    class (FP8 ones marked), its ragged prepare kernel, NCCL's kernels by family, XLA's fusions
    as named."""
    if "nccl" in name.lower():
        return "nccl:" + name.split("(")[0][-40:]
    if "jax_tma" in name:
        if "ragged_prepare" in name:
            return "jax_tma:ragged_prepare"
        fp8 = "fp8_" if "__nv_fp8" in name else ""
        for problem, family in _PROBLEMS:
            if problem in name:
                return f"jax_tma:{fp8}{family}"
    return name[:60]


def _key(row: dict) -> tuple[str, str, str]:
    return row["op"], row["layout"], row["size"]


def _table(rows: list[dict], env: dict) -> str:
    lines = [f"{env['device']} x {env['device_count']}, driver {env['driver']}, jax {env['jax']}, "
             f"{env['date']}, commit {str(env.get('commit'))[:12]}; wall time per call, median "
             "(± half the spread); speedup over the same work on one device",
             "", "| op | layout | size | devices | ms | speedup | jax_tma kernel |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['op']} | {r['layout']} | {r['size']} | {r['devices']} "
                     f"| {r['seconds'] * 1e3:.3f} "
                     f"± {r['spread_s'] * 1e3:.3f} | {r['speedup']:.2f}x "
                     f"| {'yes' if r['kernel'] else 'no'} |")
    broken_down = [r for r in rows if "kernels" in r]
    if broken_down or any("kernels_note" in r for r in rows):
        lines += ["", "Kernels per device, one call of one operand set (CUPTI; wall time above "
                  "is per product of --products):", ""]
        for r in broken_down:
            top = ", ".join(f"{name} {sec * 1e3:.3f}" for name, sec in r["kernels"])
            lines.append(f"- {r['op']}, {r['layout']}, {r['size']}, {r['devices']} devices: "
                         f"{r['kernel_s'] * 1e3:.3f} ms of kernels; {top}")
        lines += [f"- {r['op']}, {r['layout']}, {r['size']}, {r['devices']} devices: "
                  f"{r['kernels_note']}" for r in rows if "kernels_note" in r]
    return "\n".join(lines)


def _plot(rows: list[dict], path: pathlib.Path, title: str) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key in dict.fromkeys(_key(r) for r in rows):
        pts = sorted((r["devices"], r["speedup"]) for r in rows if _key(r) == key)
        label = " / ".join(key[:2]) + (f" ({key[2].split(':')[0]})" if key[0] == "moe_layer"
                                        else "")
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    most = max(r["devices"] for r in rows)
    ax.plot([1, most], [1, most], color="gray", linestyle=":", label="linear")
    ax.set_xlabel("devices")
    ax.set_ylabel("speedup over one device")
    ax.set_title(title)
    ax.legend(fontsize=6)
    return save_figure(plt, fig, path)


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    p.add_argument("--devices", nargs="+", type=int, default=[1, 2, 4])
    p.add_argument("--products", type=int, default=3, help="operand sets per timed call")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=pathlib.Path, default=None)
    p.add_argument("--commit", help="commit to record instead of `git rev-parse HEAD`")
    p.add_argument("--dry-run", action="store_true",
                   help="tiny sizes, 1 repeat; files only with --out; runs on CPU devices")
    p.add_argument("--breakdown", type=int, default=0, metavar="N",
                   help="also each row's N longest kernels per device (CUPTI; GPU only)")
    args = p.parse_args(argv)
    if min(args.devices) < 1 or 1 not in args.devices:
        p.error(f"--devices must include 1 (the base of every speedup), got {args.devices}")
    if args.products < 1 or args.repeats < 1 or args.breakdown < 0:
        p.error("--products and --repeats must be positive, --breakdown not negative")
    if args.dry_run:
        args.repeats, args.products = 1, 1
    return args


def main(argv=None) -> int:
    args = _parse(argv)
    env = environment(args.commit)
    print(banner(env, "bf16"), flush=True)
    present = jax.devices()
    counts = sorted({c for c in args.devices if c <= len(present)})
    skipped = sorted(set(args.devices) - set(counts))
    if skipped:
        print(f"only {len(present)} devices: leaving out {skipped}", file=sys.stderr)
    rows = []
    cases = [c for c in _cases(DRY_SIZES if args.dry_run else SIZES) if c.op in args.ops]
    for i, case in enumerate(cases):
        for count in counts:
            print(f"{case.op} {case.layout} {case.size} on {count} ...", file=sys.stderr,
                  flush=True)
            rows.append(_run_case(case, present[:count], args))
        base = {_key(r): r["seconds"] for r in rows if r["devices"] == 1}
        for r in rows:
            r["speedup"] = base[_key(r)] / r["seconds"]
        # After every case, so that a run cut short keeps what it measured.
        if not args.dry_run or args.out is not None:
            write_progress(args.out, env, "bench_sharded",
                           {"environment": env, "dry_run": args.dry_run, "sizes": DRY_SIZES
                            if args.dry_run else SIZES, "rows": rows},
                           _table(rows, env),
                           lambda path: _plot(rows, path, f"{env['device']} x {len(present)}"),
                           i + 1, len(cases), "cases")
    print(_table(rows, env))
    return 0


if __name__ == "__main__":
    sys.exit(main())
