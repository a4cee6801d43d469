"""Nsight Compute's counters for jax_tma.matmul's kernel and XLA's on the same products: what
each launches (grid, cluster, threads, registers, shared memory), its duration under the
profiler, the bytes its TMA loads bring into the SMs, the L2 read requests and sectors behind
them, and the tensor pipes' activity. The README's explanations of the shapes where XLA is
faster cite it.
--pattern profiles a fused epilogue of bench_epilogues.py instead (jax_tma.dense /
gated_dense against XLA's unfused forms and its dot alone): where the tensor pipes idle while
the epilogue runs.

    python benchmarks/profile_gemm.py --shapes 1000,1000,1000 1024,1024,1024
    python benchmarks/profile_gemm.py --shapes 1000,1000,1000 --config 64,128,8,1
    python benchmarks/profile_gemm.py --shapes 16384,14336,4096 --pattern gelu
    python benchmarks/profile_gemm.py --summarize raw.csv   # a saved raw page, base units

The script runs itself under ncu with the clocks left alone (--clock-control none) and no cache
flush (--cache-control none); operand sets are rotated as bench_gemm rotates them, so that the
profiled call finds its operands where a timed call would. Only one call per contender and
shape is profiled, between cudaProfilerStart and cudaProfilerStop after warm-up, so XLA's
autotuning kernels stay out of the report; a tiny test kernel of the package opens each call,
so that every kernel a call launches (split-K, XLA's fusions) is put down to it. Durations
under the profiler run longer than bench_gemm's: compare them with each other, not with the
benchmark. The table goes to stdout
and to benchmarks/results/<device>/profile_gemm[_<config>].md, with .json and the ncu report
(.ncu-rep, which git ignores).
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import glob
import importlib
import io
import os
import pathlib
import re
import shutil
import subprocess
import sys

# (column, ncu metric, factor from ncu's base unit to the column's). Every metric is requested
# by name, so a run needs as few replay passes as these take.
COLUMNS = (
    ("µs", "gpu__time_duration.sum", 1e-3),
    ("grid", "launch__grid_size", 1),
    ("cluster", "launch__cluster_dim_x", 1),
    ("threads", "launch__block_size", 1),
    ("regs", "launch__registers_per_thread", 1),
    ("smem KB", "launch__shared_mem_per_block_dynamic", 1 / 1024),
    ("TMA MB into SMs", "l1tex__m_xbar2l1tex_read_bytes_mem_global_op_tma_ld.sum", 1e-6),
    ("L2 read requests K", "lts__t_requests_srcunit_tex_op_read.sum", 1e-3),
    ("L2 read sectors K", "lts__t_sectors_srcunit_tex_op_read.sum", 1e-3),
    ("DRAM read MB", "dram__bytes_read.sum", 1e-6),
    ("SM active cycles K", "sm__cycles_active.avg", 1e-3),
    ("tensor pipes %",
     "sm__pipe_tensor_type_hmma_hgmma_qgmma_imma_igmma_bmma_bgmma_cycles_active.avg"
     ".pct_of_peak_sustained_elapsed", 1),
)
METRICS = tuple(metric for _, metric, _ in COLUMNS)
_OUR_KERNEL = re.compile(r"sm90_gemm_kernel<.*?TileConfig<(\d+), (\d+), (\d+), (\d+)")
# A fused epilogue's Fusion<kind, activation> (csrc/epilogue/fusion.h), the enums demangled as
# casts ("(jax_tma::FusionKind)1") or bare.
_FUSION = re.compile(r"Fusion<(?:\([\w:]+\))?(\d+), (?:\([\w:]+\))?(\d+)>")
_FUSION_KINDS = {1: "bias+", 2: "grad ", 3: "gated ", 4: "scaled"}
_ACTIVATIONS = {0: "", 1: "relu", 2: "gelu", 3: "gelu_erf", 4: "silu"}
PATTERNS = ("matmul", "gelu", "residual", "swiglu")  # matmul, or bench_epilogues' patterns
_MARK = "profile_gemm: "  # prefix of the child's lines naming what it profiles, in order
# A tiny kernel of the package's test targets, profiled before each call: the kernels between
# two of these belong to one call, however many that call launched (split-K, XLA fusions).
_SEPARATOR = "named_barrier_ping_pong_kernel"


def kernel_label(name: str) -> str:
    """A short name: jax_tma's kernel by its tile ("jax_tma 64x128 s8 c2"), others as ncu
    names them."""
    match = _OUR_KERNEL.search(name)
    if not match:
        return name
    bm, bn, stages, cluster = match.groups()
    label = f"jax_tma {bm}x{bn} s{stages} c{cluster}"
    fused = _FUSION.search(name)
    if fused and int(fused.group(1)) in _FUSION_KINDS:
        kind, act = map(int, fused.groups())
        label += " " + (_FUSION_KINDS[kind] + _ACTIVATIONS.get(act, str(act))).strip()
    return label


def summarize(raw_csv: str) -> list[dict]:
    """The kernels of an ncu raw page (``--page raw --csv --print-units base``), in launch
    order: {"kernel": short name, "name": full name, <metric>: float or None}."""
    rows = list(csv.reader(io.StringIO(raw_csv)))
    start = next((i for i, r in enumerate(rows) if "Kernel Name" in r), None)
    if start is None:
        raise ValueError("not an ncu raw page: no 'Kernel Name' column")
    header = rows[start]
    kernels = []
    for row in rows[start + 2:]:  # the row after the header holds the units
        if len(row) != len(header):
            continue
        fields = dict(zip(header, row))
        entry = {"kernel": kernel_label(fields["Kernel Name"]), "name": fields["Kernel Name"]}
        for metric in METRICS:
            try:
                entry[metric] = float(fields[metric].replace(",", ""))
            except (KeyError, ValueError):
                entry[metric] = None
        kernels.append(entry)
    return kernels


def by_call(kernels: list[dict], labels: list[str]) -> list[tuple[str, dict]]:
    """(label of the call, kernel) for the kernels of a report whose calls each began with the
    separator kernel, `labels` naming the calls in order ("call 1", "call 2", ... where there
    are fewer labels; "?" before the first separator)."""
    out, call = [], -1
    for k in kernels:
        if _SEPARATOR in k["name"]:
            call += 1
            continue
        label = "?" if call < 0 else labels[call] if call < len(labels) else f"call {call + 1}"
        out.append((label, k))
    return out


def table(rows: list[tuple[str, dict]], caption: str) -> str:
    """Markdown: one row per (label of the call, kernel)."""
    head = ["call", "kernel"] + [column for column, _, _ in COLUMNS]
    lines = [caption, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, k in rows:
        cells = [label, k["kernel"]]
        for _, metric, factor in COLUMNS:
            v = k[metric]
            cells.append("–" if v is None else f"{v * factor:.4g}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", metavar="M,N,K", default=["1000,1000,1000"])
    p.add_argument("--config", metavar="BM,BN,STAGES,CLUSTER",
                   help="profile jax_tma with this GemmConfig (and not XLA) instead of the "
                        "heuristic's pick and XLA's dot")
    p.add_argument("--pattern", choices=PATTERNS, default="matmul",
                   help="the product, or a fused epilogue of bench_epilogues.py (gelu: "
                        "gelu(x @ w + b), residual: x @ w + b + r, swiglu: silu(x @ wg) * "
                        "(x @ wu)) against XLA's unfused forms and its dot")
    p.add_argument("--out", type=pathlib.Path, default=None,
                   help="results directory (default benchmarks/results; files go to "
                        "<out>/<device>/)")
    p.add_argument("--commit", help="commit to record instead of `git rev-parse HEAD`")
    p.add_argument("--summarize", type=pathlib.Path, metavar="RAW_CSV",
                   help="print the table of a saved raw page and exit (no GPU needed)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        args.shape_list = [tuple(int(x) for x in s.split(",")) for s in args.shapes]
    except ValueError:
        args.shape_list = []
    if not args.shape_list or any(len(s) != 3 or min(s) < 1 for s in args.shape_list):
        p.error(f"--shapes takes M,N,K triples of positive ints, got {args.shapes}")
    args.config_tuple = None
    if args.config:
        try:
            args.config_tuple = tuple(int(x) for x in args.config.split(","))
        except ValueError:
            pass
        if args.config_tuple is None or len(args.config_tuple) != 4:
            p.error(f"--config takes BM,BN,STAGES,CLUSTER, got {args.config!r}")
    return args


def _cudart() -> ctypes.CDLL:
    """The CUDA runtime library that jax's CUDA plugin loads, for cudaProfilerStart/Stop."""
    candidates = []
    for entry in sys.path:
        candidates += sorted(glob.glob(os.path.join(entry, "nvidia", "**", "libcudart.so*"),
                                       recursive=True))
    candidates += sorted(glob.glob("/usr/local/cuda/lib64/libcudart.so*"))
    for path in candidates:
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    raise RuntimeError("profile_gemm: no libcudart.so found for cudaProfilerStart")


def _shared(name: str):
    """benchmarks/_lib/<name>.py, what the benchmarks share (imported late, so that --summarize
    needs no jax): report (the run record and report files), operands (bench_gemm's operand
    sets), patterns (bench_epilogues' fused patterns, their operands and contenders)."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    return importlib.import_module(f"_lib.{name}")


def _forced_config(args):
    """The GemmConfig that --config names, or None; ValueError where it is not compiled (for
    --pattern: where the fused op refuses it, traced on tiny operands)."""
    if not args.config_tuple:
        return None
    import jax

    import jax_tma
    bm, bn, stages, cluster = args.config_tuple
    config = jax_tma.GemmConfig(block_m=bm, block_n=bn, stages=stages, cluster_m=cluster)
    if args.pattern != "matmul":
        patterns = _shared("patterns")
        jax.eval_shape(patterns.fused(args.pattern, config),
                       *patterns.pattern_operands(args.pattern, (8, 8, 8), 1, 0)[0])
    return config


def _work(args, shape, config) -> list:
    """(label, jitted call, operand sets) of every contender profiled on `shape`."""
    import jax
    import jax.numpy as jnp

    import jax_tma
    label = "×".join(map(str, shape))
    if args.pattern == "matmul":
        ops = _shared("operands").gemm_operand_sets(shape, jnp.bfloat16,
                                                    jax.random.PRNGKey(sum(shape)))
        if config is not None:
            return [(f"{label} jax_tma {args.config}",
                     jax.jit(lambda a, b, c=config: jax_tma.matmul(a, b, config=c)), ops)]
        return [(f"{label} jax_tma", jax.jit(jax_tma.matmul), ops),
                (f"{label} XLA", jax.jit(jnp.matmul), ops)]
    patterns = _shared("patterns")
    ops = patterns.pattern_operands(args.pattern, shape, 2, sum(shape))
    label += f" {args.pattern}"
    if config is not None:
        return [(f"{label} jax_tma {args.config}", jax.jit(patterns.fused(args.pattern, config)),
                 ops)]
    return [(f"{label} {name}", jax.jit(fn), ops)
            for name, fn in patterns.pattern_forms(args.pattern).items()]


def child(args) -> int:
    """Runs under ncu: warms every contender up, then profiles one call of each."""
    import jax

    from jax_tma import _testing

    config = _forced_config(args)
    work = [entry for shape in args.shape_list for entry in _work(args, shape, config)]
    separator = jax.jit(lambda: _testing.named_barrier_ping_pong(1))
    jax.block_until_ready(separator())
    for _, fn, ops in work:
        for operands in ops + ops:
            fn(*operands)
        jax.block_until_ready(fn(*ops[0]))
    cudart = _cudart()
    for label, fn, ops in work:
        for operands in ops[1:]:  # the profiled call's operands are the least recently used
            fn(*operands)
        jax.block_until_ready(fn(*ops[1]))
        cudart.cudaProfilerStart()
        jax.block_until_ready(separator())
        jax.block_until_ready(fn(*ops[0]))
        cudart.cudaProfilerStop()
        print(_MARK + label, flush=True)
    return 0


def _ncu() -> str:
    found = shutil.which("ncu") or next(iter(sorted(glob.glob("/usr/local/cuda*/bin/ncu"))), None)
    if not found:
        raise SystemExit("profile_gemm: Nsight Compute (ncu) is not on PATH or in "
                         "/usr/local/cuda*/bin")
    return found


def main(argv=None) -> int:
    args = _parse(argv)
    if args.summarize:
        print(table(by_call(summarize(args.summarize.read_text()), []), f"from {args.summarize}"))
        return 0
    if args.child:
        return child(args)
    try:  # an illegal configuration fails here, not inside the profiler
        _forced_config(args)
    except ValueError as e:
        raise SystemExit(f"profile_gemm: --config {args.config}: {e}") from None
    ncu = _ncu()
    report_files = _shared("report")
    env = report_files.environment(args.commit)
    out = report_files.results_dir(args.out, env)
    parts = [args.pattern] if args.pattern != "matmul" else []
    if args.config:
        parts.append(args.config.replace(",", "-"))
    stem = "_".join(["profile_gemm", *parts])
    report = out / stem
    # ncu's kernel replays save and restore device memory: with jax's preallocated pool, each
    # replay would copy most of the GPU's memory.
    child_env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    cmd = [ncu, "--clock-control", "none", "--cache-control", "none",
           "--profile-from-start", "off", "--metrics", ",".join(METRICS),
           "--export", str(report), "--force-overwrite",
           sys.executable, str(pathlib.Path(__file__).resolve()), "--child",
           "--shapes", *args.shapes, "--pattern", args.pattern] + (
               ["--config", args.config] if args.config else [])
    run = subprocess.run(cmd, capture_output=True, text=True, env=child_env)
    labels = [line[len(_MARK):] for line in run.stdout.splitlines() if line.startswith(_MARK)]
    if run.returncode != 0:
        sys.stderr.write(run.stdout[-4000:] + run.stderr[-4000:])
        raise SystemExit(f"profile_gemm: ncu exited with {run.returncode}")
    raw = subprocess.run([ncu, "--import", f"{report}.ncu-rep", "--page", "raw", "--csv",
                          "--print-units", "base"], capture_output=True, text=True)
    if raw.returncode != 0:
        raise SystemExit(f"profile_gemm: ncu --import failed: {raw.stderr[-2000:]}")
    kernels = summarize(raw.stdout)
    calls = sum(_SEPARATOR in k["name"] for k in kernels)
    if calls != len(labels):
        raise SystemExit(f"profile_gemm: the report holds {calls} calls, the program made "
                         f"{len(labels)}")
    rows = by_call(kernels, labels)
    caption = (f"{env['device']}, driver {env['driver']}, CUDA {env.get('cuda_runtime')}, "
               f"jax {env['jax']}, {env['date']}, commit {env['commit']}; bf16 in and out; "
               + ("" if args.pattern == "matmul" else f"pattern {args.pattern} "
                  "(bench_epilogues.py); ")
               + "Nsight Compute, clocks and caches left alone")
    text = table(rows, caption)
    print(text)
    report_files.write_report(args.out, env, stem,
                            {"environment": env,
                             "kernels": [dict(k, call=label) for label, k in rows]},
                            text, plot=lambda path: False)
    print(f"and the ncu report {report}.ncu-rep")
    return 0


if __name__ == "__main__":
    sys.exit(main())
