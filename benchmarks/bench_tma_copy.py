"""Copy bandwidth: the persistent TMA load -> store kernel against cudaMemcpyAsync D2D.

Both run as FFI calls (jax_tma._testing.tma_copy / d2d_copy) in the same harness
(jax_tma._timing): every timed jit call copies R distinct buffers and returns every output, so
XLA can neither merge nor drop copies; warm-up calls first, then the median of the repeats.
Bandwidth counts bytes read plus bytes written. Each contender's copy is checked exact before
it is timed. Prints a table and writes JSON (and a PNG when matplotlib is installed).

    python benchmarks/bench_tma_copy.py                 # 64 MiB, 256 MiB, 1 GiB
    python benchmarks/bench_tma_copy.py --dry-run       # tiny sizes; runs without a GPU
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import subprocess
from typing import Callable

import jax
import jax.numpy as jnp

import jax_tma
from jax_tma import _testing, _timing

MIB = 1 << 20
ROW_BYTES = 16 * 1024  # buffers are float32 [size / ROW_BYTES, 4096]
TMA_CONFIGS = ((12, 1), (6, 2), (4, 3))  # (stages, CTAs per SM): about 192 KiB of ring per SM


@dataclasses.dataclass(frozen=True)
class Contender:
    name: str
    fn: Callable[[jax.Array], jax.Array]
    expected: Callable[[jax.Array], jax.Array]  # what fn must return, exactly


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-mib", type=float, nargs="+", default=[64, 256, 1024])
    p.add_argument("--repeats", type=int, default=7, help="timed calls; the median is reported")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls first")
    p.add_argument("--buffer-budget-gib", type=float, default=8.0,
                   help="bytes of distinct inputs per timed call (sets R, 4..64)")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results"),
                   help="directory for bench_tma_copy.json / .png")
    p.add_argument("--dry-run", action="store_true",
                   help="tiny sizes, 1 repeat; without a Hopper GPU only the harness runs")
    args = p.parse_args()
    if args.dry_run:
        args.sizes_mib, args.repeats, args.warmup, args.buffer_budget_gib = [0.25, 1], 1, 1, 0.01
    return args


def _driver_version() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        return out.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unavailable (no nvidia-smi)"


def _contenders(kernels: bool) -> list[Contender]:
    if not kernels:
        # Stand-in that exercises the harness on any backend; its figures mean nothing.
        return [Contender("xla negate (harness check)", jnp.negative, jnp.negative)]
    same = lambda x: x  # noqa: E731
    tma = [
        Contender(f"tma copy {s} stages x {c} CTA/SM",
                  lambda x, s=s, c=c: _testing.tma_copy(x, s, c), same)
        for s, c in TMA_CONFIGS
    ]
    return tma + [Contender("cudaMemcpyAsync D2D", _testing.d2d_copy, same)]


def _buffers(size_bytes: int, count: int) -> list[tuple[jax.Array]]:
    rows = max(1, size_bytes // ROW_BYTES)
    shape = (rows, ROW_BYTES // 4)
    return _timing.random_operands(jax.random.key(rows), [shape], jnp.float32, count)


def _check_exact(c: Contender, x: jax.Array) -> None:
    got, want = jax.jit(c.fn)(x), c.expected(x)
    if not bool(jnp.array_equal(got, want)):
        raise SystemExit(f"{c.name}: the copy is not exact for {x.shape} {x.dtype}")


def _measure(contenders: list[Contender], args: argparse.Namespace) -> list[dict]:
    rows = []
    for size_mib in args.sizes_mib:
        size = int(size_mib * MIB) // ROW_BYTES * ROW_BYTES or ROW_BYTES
        count = int(min(64, max(4, args.buffer_budget_gib * 1024 * MIB // size)))
        buffers = _buffers(size, count)
        for c in contenders:
            _check_exact(c, buffers[0][0])
            t = _timing.time_products(c.fn, buffers, warmup=args.warmup, repeats=args.repeats)
            rows.append({"contender": c.name, "bytes": size, "buffers_per_call": count,
                         "median_s": t.median_s, "spread_s": t.spread_s,
                         "gb_per_s": 2 * size / t.median_s / 1e9})
        del buffers
    return rows


def _print_table(rows: list[dict]) -> None:
    print(f"{'contender':<34} {'MiB':>8} {'GB/s':>9} {'+-us':>8} {'vs D2D':>7}")
    baseline = {r["bytes"]: r["gb_per_s"] for r in rows if r["contender"].startswith("cudaMemcpy")}
    for r in rows:
        ratio = r["gb_per_s"] / baseline[r["bytes"]] if r["bytes"] in baseline else float("nan")
        print(f"{r['contender']:<34} {r['bytes'] / MIB:>8.2f} {r['gb_per_s']:>9.1f} "
              f"{r['spread_s'] * 1e6:>8.1f} {ratio:>7.3f}")


def _write(rows: list[dict], meta: dict, out: pathlib.Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_tma_copy.json").write_text(json.dumps({**meta, "results": rows}, indent=2))
    try:
        import matplotlib  # type: ignore[import-not-found]
    except ImportError:
        print(f"wrote {out / 'bench_tma_copy.json'} (matplotlib not installed: no PNG)")
        return
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name in dict.fromkeys(r["contender"] for r in rows):
        pts = [(r["bytes"] / MIB, r["gb_per_s"]) for r in rows if r["contender"] == name]
        ax.plot(*zip(*pts), marker="o", label=name)
    ax.set(xscale="log", xlabel="MiB copied", ylabel="GB/s (read + write)", title=meta["device"])
    ax.legend(fontsize=8)
    fig.savefig(out / "bench_tma_copy.png", dpi=120, bbox_inches="tight")
    print(f"wrote {out / 'bench_tma_copy.json'} and {out / 'bench_tma_copy.png'}")


def main() -> None:
    args = _parse()
    status = jax_tma.kernel_status()
    meta = {"device": status.device, "driver": _driver_version(), "jax": jax.__version__,
            "kernels": status.available, "dry_run": args.dry_run}
    print(f"device: {meta['device']} | driver {meta['driver']} | jax {meta['jax']}")
    if not status.available:
        print(f"kernel path unavailable: {status.reason}; timing a stand-in to check the harness")
    rows = _measure(_contenders(status.available), args)
    _print_table(rows)
    _write(rows, meta, args.out)


if __name__ == "__main__":
    main()
