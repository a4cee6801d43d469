"""jax_tma.dot_general sharded over the GPUs of one host against the same product on one GPU.

A large bf16 product runs on one GPU, then with its M dimension sharded over every GPU (no
communication) and with its K dimension sharded (one all-reduce of fp32 partial products).
Each timed call evaluates several products on distinct operands inside one jit; the figure is
the median wall time per product over repeats (wall time, because the sharded product is only
done when the slowest GPU is). Writes JSON and a Markdown table under
benchmarks/results/<device>/.

    python benchmarks/bench_sharded_gemm.py                 # 16384 x 8192 x 8192
    python benchmarks/bench_sharded_gemm.py --shape 8192,8192,8192
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_tma
from jax_tma import _timing
from jax_tma.ops.gemm import plan as gemm_plan
from jax_tma.ops.gemm import primitive as gemm


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="16384,8192,8192", help="M,N,K")
    p.add_argument("--products", type=int, default=4, help="distinct products per timed call")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results"))
    p.add_argument("--commit", default=None, help="commit to record (default: git HEAD)")
    return p.parse_args()


def _commit(override):
    if override:
        return override
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> int:
    args = _parse()
    m, n, k = (int(v) for v in args.shape.split(","))
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if len(gpus) < 2:
        print(f"needs at least two GPUs, found {len(gpus)}: nothing to compare")
        return 1
    mesh = Mesh(np.array(gpus), ("x",))
    sets = _timing.random_operands(jax.random.key(0), [(m, k), (k, n)], jnp.bfloat16, args.products)
    dot = lambda a, b: jax_tma.dot_general(a, b, gemm_plan.MATMUL_DIMS)  # noqa: E731
    layouts = {
        "1 GPU": (None, None),
        f"{len(gpus)} GPUs, M sharded": (P("x", None), P()),
        f"{len(gpus)} GPUs, K sharded": (P(None, "x"), P("x", None)),
    }
    rows = []
    for name, (a_spec, b_spec) in layouts.items():
        if a_spec is None:
            placed = [tuple(jax.device_put(x, gpus[0]) for x in s) for s in sets]
        else:
            placed = [(jax.device_put(a, NamedSharding(mesh, a_spec)),
                       jax.device_put(b, NamedSharding(mesh, b_spec))) for a, b in sets]
        hlo = jax.jit(dot).lower(*placed[0]).compile().as_text()
        kernel = f'custom_call_target="{gemm.KERNEL_TARGET}"' in hlo
        t = _timing.time_products(dot, placed, repeats=args.repeats)
        rows.append({"layout": name, "median_s": t.median_s, "spread_s": t.spread_s,
                     "tflops": _timing.tflops(m, n, k, t.median_s), "kernel": kernel})
        print(f"{name:>22}: {t.median_s * 1e3:8.3f} ms  {rows[-1]['tflops']:7.1f} TFLOP/s  "
              f"kernel={'yes' if kernel else 'no'}", flush=True)
    base = rows[0]["median_s"]
    for r in rows:
        r["speedup"] = base / r["median_s"]
    device = gpus[0].device_kind
    report = {
        "shape": [m, n, k], "dtype": "bf16", "devices": len(gpus), "device": device,
        "jax": jax.__version__, "commit": _commit(args.commit), "timing": "wall", "rows": rows,
    }
    out_dir = args.out / device.lower().replace(" ", "-")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_sharded_gemm.json").write_text(json.dumps(report, indent=2))
    lines = [f"{m}×{n}×{k} bf16 on {len(gpus)}× {device}, jax {jax.__version__}, wall time", "",
             "| layout | ms | TFLOP/s | speedup over 1 GPU | kernel |", "|---|---|---|---|---|"]
    lines += [f"| {r['layout']} | {r['median_s'] * 1e3:.3f} | {r['tflops']:.1f} "
              f"| {r['speedup']:.2f}× | {'yes' if r['kernel'] else 'no'} |" for r in rows]
    (out_dir / "bench_sharded_gemm.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
