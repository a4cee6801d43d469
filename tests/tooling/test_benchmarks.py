"""The benchmark scripts run: argument parsing, harness and output files, through --dry-run
(tiny sizes; without a Hopper GPU a stand-in is timed and the script says so). Timings are
never asserted."""

from __future__ import annotations

import csv
import dataclasses
import importlib.util
import io
import json
import math
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_tma import _ext
from support import REPO


@pytest.mark.parametrize("script", ["bench_tma_copy.py"])
def test_benchmark_dry_run(script, tmp_path):
    result = _run(script, "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / script.replace(".py", ".json")).read_text())
    assert report["dry_run"] and report["results"]
    if not _ext.kernel_status().available:
        assert "kernel path unavailable" in result.stdout


def _script(script: str, *args: str) -> subprocess.CompletedProcess:
    """benchmarks/<script> run by this interpreter with this process's import path, so that it
    imports the jax, jax_tma and packages the tests import: PYTHONPATH set to sys.path (under
    Bazel's test runner they are on sys.path only, not in a site directory), and -S where this
    process runs with it (a site-packages .pth may name another checkout)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    flags = ["-S"] if sys.flags.no_site else []
    return subprocess.run(
        [sys.executable, *flags, str(REPO / "benchmarks" / script), *args],
        capture_output=True, text=True, timeout=600, cwd=REPO, env=env,
    )


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    """The script with --dry-run."""
    return _script(script, "--dry-run", *args)


def _written(out: pathlib.Path, stem: str) -> dict:
    """The JSON of a run that wrote <out>/<device>/<stem>.{json,md[,png]}; checks the others."""
    (device_dir,) = out.iterdir()
    assert (device_dir / f"{stem}.md").read_text().startswith(
        json.loads((device_dir / f"{stem}.json").read_text())["environment"]["device"])
    assert (device_dir / f"{stem}.png").exists() == _has_matplotlib()
    return json.loads((device_dir / f"{stem}.json").read_text())


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_bench_gemm_dry_run(tmp_path):
    result = _run("bench_gemm.py", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    for shape in ("64×64×64", "7×129×72"):
        assert f"| {shape} |" in result.stdout, result.stdout
    assert "| M×N×K |" in result.stdout and "geometric mean of the ratio" in result.stdout
    assert "[2/2] 7x129x72" in result.stderr  # progress on stderr
    report = _written(tmp_path, "bench_gemm")
    env = report["environment"]
    for key in ("device", "driver", "cuda_runtime", "cuda_driver", "jax", "commit", "date"):
        assert key in env, key
    assert env["commit_source"].startswith("git rev-parse HEAD")
    assert report["dtype"] == "bf16" and report["dry_run"]
    assert {tuple(r["shape"]) for r in report["rows"]} == {(64, 64, 64), (7, 129, 72)}
    # the path jax_tma's lowering takes on a Hopper GPU, worked out without one
    assert "| ratio (XLA time / jax_tma time) | jax_tma path |" in result.stdout
    paths = {tuple(r["shape"]): r["path"] for r in report["rows"] if r["contender"] == "jax_tma"}
    assert paths[(64, 64, 64)].startswith("block_m="), paths
    # padding B costs more than the product: XLA's dot, unless JAX_TMA_KERNEL_ALWAYS (conftest)
    from jax_tma import _ext
    if _ext.kernel_always():
        assert paths[(7, 129, 72)].startswith("block_m="), paths
    else:
        assert paths[(7, 129, 72)] == "xla", paths
    assert f"| {paths[(7, 129, 72)]} |" in result.stdout
    assert f"TFLOP/s ({paths[(7, 129, 72)]})" in result.stderr
    assert all(r["path"] == "" for r in report["rows"] if r["contender"] != "jax_tma")


@pytest.mark.parametrize("layout", ["NT", "TN", "TT"])
def test_bench_gemm_transposed_layout_dry_run(tmp_path, layout):
    result = _run("bench_gemm.py", "--layout", layout, "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert f"layout {layout}" in result.stdout and "| 7×129×72 |" in result.stdout
    report = _written(tmp_path, f"bench_gemm_{layout}")
    assert report["layout"] == layout and len(report["rows"]) >= 4


def test_bench_gemm_layout_needs_2d_shapes():
    result = _run("bench_gemm.py", "--layout", "NT", "--batched")
    assert result.returncode == 2 and "2-D" in result.stderr


def test_bench_gemm_batched_fp16_dry_run(tmp_path):
    result = _run("bench_gemm.py", "--batched", "--dtype", "fp16", "--commit", "0123abc",
                  "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "| B×M×N×K |" in result.stdout
    for shape in ("2×64×64×64", "3×7×129×72"):
        assert f"| {shape} |" in result.stdout, result.stdout
    report = _written(tmp_path, "bench_gemm_batched_fp16")
    assert report["dtype"] == "fp16"
    assert report["environment"]["commit"] == "0123abc"
    assert report["environment"]["commit_source"] == "--commit"
    assert all(r["tflops"] > 0 for r in report["rows"] if r["seconds"])


def test_bench_gemm_mixed_shapes_without_files():
    result = _run("bench_gemm.py", "--shapes", "2,16,24,32", "16,24,32")
    assert result.returncode == 0, result.stderr
    assert "| 2×16×24×32 |" in result.stdout and "| 16×24×32 |" in result.stdout
    assert "wrote" not in result.stdout  # a dry run without --out writes nothing


def test_bench_gemm_read_once_is_listed_apart(tmp_path):
    result = _run("bench_gemm.py", "--read-once", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    listed = result.stdout.split("read_once:")[1].splitlines()
    assert listed[1].startswith("- 64×64×64: ") and "GB/s of operands; jax_tma reads" in listed[1]
    report = _written(tmp_path, "bench_gemm")
    rows = [r for r in report["rows"] if r["contender"] == "read_once"]
    assert len(rows) == 2 and all(r["seconds"] > 0 and r["tflops"] is None for r in rows)
    assert "over 2 shapes" in result.stdout  # read_once is no product: not in the ratio


@pytest.mark.parametrize("shapes", [["4,4"], ["1,2,3,4,5"], ["0,8,8"], ["a,b,c"]])
def test_bench_gemm_rejects_bad_shapes(shapes):
    result = _run("bench_gemm.py", "--shapes", *shapes)
    assert result.returncode == 2 and "M,N,K or B,M,N,K of positive ints" in result.stderr


@pytest.mark.parametrize("script,forms,good,bad", [
    ("bench_gemm", "M,N,K or B,M,N,K", ["8,16,32", "2,8,16,32"], ["8,16"]),
    ("bench_autotune", "M,N,K or B,M,N,K", ["8,16,32", "2,8,16,32"], ["2,8,16,32,1"]),
    ("bench_epilogues", "M,N,K", ["8,16,32"], ["2,8,16,32"]),
    ("bench_fp8", "M,N,K", ["8,16,32"], ["8,16,-32"]),
    ("bench_ragged_dot", "M,K,N,G", ["64,32,16,4"], ["64,32,16"]),
])
def test_benchmarks_share_one_shapes_parser(script, forms, good, bad, capsys):
    """Every benchmark's --shapes goes through benchmarks/_lib/harness.parse_shapes (directly or
    through chosen_shapes): positive ints in one of the script's forms, else a usage error that
    names them."""
    import argparse

    bench = _bench_module("_lib.harness")
    parser = argparse.ArgumentParser(prog=script)
    names = tuple(forms.split(" or "))
    assert bench.parse_shapes(parser, good, names) == [
        tuple(int(x) for x in s.split(",")) for s in good]
    for values in (bad, ["x,y,z"], [f"{good[0]},"]):
        with pytest.raises(SystemExit) as exit_:
            bench.parse_shapes(parser, values, names)
        assert exit_.value.code == 2
        assert f"--shapes takes {forms} of positive ints, got {' '.join(values)}" in (
            capsys.readouterr().err)
    source = (REPO / "benchmarks" / f"{script}.py").read_text()
    assert "parse_shapes(p, " in source or "chosen_shapes(p, " in source
    if script != "bench_gemm":  # which also splits its --splits list
        assert "s.split(\",\")" not in source  # shapes are parsed in _lib/harness.py only


def test_chosen_shapes_order():
    """--dry-run (one round, one iteration), then --shapes, then --quick, then the suite."""
    import argparse

    bench = _bench_module("_lib.harness")
    parser = argparse.ArgumentParser(prog="bench")

    def args(**kw):
        base = dict(dry_run=False, shapes=None, quick=False, rounds=5, iterations=3)
        return argparse.Namespace(**{**base, **kw})

    suite, quick, dry = [(1, 2, 3), (4, 5, 6)], [(1, 2, 3)], [(7, 8, 9)]
    a = args(dry_run=True, shapes=["2,2,2"], quick=True)
    assert bench.chosen_shapes(parser, a, suite, quick, dry) == dry
    assert (a.rounds, a.iterations) == (1, 1)
    a = args(shapes=["2,3,4"], quick=True)
    assert bench.chosen_shapes(parser, a, suite, quick, dry) == [(2, 3, 4)]
    assert (a.rounds, a.iterations) == (5, 3)
    assert bench.chosen_shapes(parser, args(quick=True), suite, quick, dry) == quick
    assert bench.chosen_shapes(parser, args(), suite, quick, dry) == suite


def test_no_benchmark_imports_another():
    """What scripts share lives in benchmarks/_lib (issue 59): a script importing another would
    run that script's module-level setup and tie the two scripts' private names together."""
    scripts = {path.stem for path in (REPO / "benchmarks").glob("*.py")}
    for path in [*(REPO / "benchmarks").glob("*.py"), *(REPO / "benchmarks" / "_lib").glob("*.py")]:
        imported = set(re.findall(r"^\s*(?:import|from)\s+(\w+)", path.read_text(), re.M))
        imported |= set(re.findall(r"import_module\(\s*[\"'](\w+)", path.read_text()))
        assert not imported & scripts, f"{path.name} imports {sorted(imported & scripts)}"


def _bench_module(name: str):
    """benchmarks/<name>.py (dots: folders) imported from this checkout (registered in
    sys.modules, where dataclasses look their module up)."""
    path = REPO / "benchmarks" / f"{name.replace('.', '/')}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _families(label: str) -> set[str]:
    """The model families of an --suite llm label ("llama3-8b/mixtral-8x7b qkv prefill, ...")."""
    return {family for part in label.split(", ") for family in part.split(" ")[0].split("/")}


def test_bench_gemm_llm_suite():
    bench = _bench_module("bench_gemm")
    args = bench._parse(["--suite", "llm"])
    shapes, labels = args.shape_list, args.labels
    assert len(set(shapes)) == len(shapes) <= 120 and set(shapes) == set(labels)
    assert f"{len(shapes)} distinct products" in bench.__doc__
    families = set().union(*map(_families, labels.values()))
    assert families == {"llama3-8b", "llama3-70b", "mixtral-8x7b", "qwen2.5-7b", "qwen2.5-72b",
                        "deepseek-v3"}
    for phase, tokens in (("prefill", {4096, 16384}), ("decode", {1, 16, 128})):
        of_phase = {s: label for s, label in labels.items() if phase in label}
        assert tokens <= {m for m, _, _ in of_phase}, phase
        assert families == set().union(*map(_families, of_phase.values())), phase
    # (M, N, K): M tokens, K in features, N out features; shared products name every origin
    assert labels[(4096, 6144, 4096)] == "llama3-8b/mixtral-8x7b qkv prefill"
    assert labels[(16, 10240, 8192)] == "llama3-70b/qwen2.5-72b qkv decode"
    assert labels[(16384, 4096, 14336)] == "llama3-8b down prefill"
    assert labels[(4096, 28672, 4096)] == (
        "llama3-8b gate_up prefill, mixtral-8x7b expert gate_up prefill")  # 16384 tokens / 4
    assert labels[(1024, 4096, 14336)] == "mixtral-8x7b expert down prefill"
    assert labels[(128, 59136, 8192)] == "qwen2.5-72b gate_up decode"
    assert labels[(1, 4608, 3584)] == "qwen2.5-7b qkv decode"
    assert labels[(1, 576, 7168)] == "deepseek-v3 kv_a decode"
    assert labels[(16384, 24576, 1536)] == "deepseek-v3 q_b prefill"
    assert labels[(128, 7168, 16384)] == "deepseek-v3 o decode"
    assert labels[(4096, 36864, 7168)] == "deepseek-v3 gate_up prefill"


def test_bench_gemm_llm_dry_run(tmp_path):
    result = _run("bench_gemm.py", "--suite", "llm", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "| M×N×K | origin | jax_tma µs |" in result.stdout
    assert "| 32×48×32 | llama3-8b/mixtral-8x7b qkv prefill |" in result.stdout, result.stdout
    report = _written(tmp_path, "bench_gemm_llm")
    assert report["suite"] == "llm" and report["dry_run"]
    labels = {tuple(r["shape"]): r["label"] for r in report["rows"]}
    assert len(labels) == 8 and all(labels.values())
    assert set().union(*map(_families, labels.values())) == {
        "llama3-8b", "llama3-70b", "mixtral-8x7b", "qwen2.5-7b", "qwen2.5-72b", "deepseek-v3"}
    assert {m for m, _, _ in labels} == {1, 32}  # 4096 prefill and 1 decode tokens, shrunk
    _check_summary(report, result.stdout)


def _check_summary(report: dict, stdout: str) -> None:
    """The report's summary agrees with its rows and is printed under the table."""
    seconds = {(tuple(r["shape"]), r["contender"]): r["seconds"] for r in report["rows"]}
    ratios = {s: seconds[(s, "xla")] / seconds[(s, "jax_tma")] for s, c in seconds if c == "xla"}
    summary = report["summary"]
    assert summary["shapes"] == len(ratios)
    assert math.isclose(summary["geomean"], math.exp(np.mean(np.log(list(ratios.values())))))
    assert summary["min"] == min(ratios.values())
    assert ratios[tuple(summary["slowest_shape"])] == summary["min"]
    assert summary["below_floor"] == sum(r < 0.95 for r in ratios.values())
    assert (f"geometric mean of the ratio: {summary['geomean']:.3f} over {len(ratios)} shapes; "
            f"slowest: {summary['min']:.3f} (") in stdout
    assert f"; {summary['below_floor']} below 0.95" in stdout


def test_bench_gemm_random_shapes():
    bench = _bench_module("bench_gemm")
    shapes = bench._parse(["--random", "50", "--seed", "3"]).shape_list
    assert shapes == bench._parse(["--random", "50", "--seed", "3"]).shape_list
    assert shapes != bench._parse(["--random", "50", "--seed", "4"]).shape_list
    assert len(set(shapes)) == len(shapes) == 50
    dims = np.array(shapes)
    assert dims.min() >= 1 and dims.max() <= 32768
    assert (dims.max(axis=0) >= 100 * dims.min(axis=0)).all()  # two decades in M, N and K
    misaligned = [s for s in shapes if any(d % 8 for d in s)]
    assert all(d % 64 == 0 for s in set(shapes) - set(misaligned) for d in s)
    assert 50 / 6 < len(misaligned) < 50 / 2  # about a third
    for m, n, k in shapes:
        assert 2 * (m * k + k * n + m * n) <= 6 * 2**30 and 2 * m * n * k <= 2**41


def test_bench_gemm_random_sizes_are_log_uniform():
    """Quartiles of log-uniform sizes: on [1, 32768] at 2^3.75, 2^7.5 and 2^11.25 (misaligned
    shapes); on [64, 32768] the median is 2^10.5 (aligned ones, before rounding to 64)."""
    shapes, _ = _bench_module("_lib.shapes").random_shapes(3000, seed=3)
    misaligned = [s for s in shapes if any(d % 8 for d in s)]
    assert abs(len(misaligned) / len(shapes) - 1 / 3) < 0.03
    sizes = np.array(misaligned).ravel()
    for quantile, exponent in ((0.25, 3.75), (0.5, 7.5), (0.75, 11.25)):
        assert abs(np.mean(sizes <= 2**exponent) - quantile) < 0.05, quantile
    aligned = np.array(sorted(set(shapes) - set(misaligned))).ravel()
    assert abs(np.mean(aligned <= 2**10.5) - 0.5) < 0.05


def test_bench_gemm_random_caps_reject_draws(monkeypatch):
    shapes_module = _bench_module("_lib.shapes")
    monkeypatch.setattr(shapes_module, "RANDOM_MAX_FLOP", 2**30)
    monkeypatch.setattr(shapes_module, "RANDOM_MAX_BYTES", 2**22)
    shapes, rejected = shapes_module.random_shapes(50, seed=3)
    assert len(shapes) == 50 and rejected > 50
    for m, n, k in shapes:
        assert 2 * (m * k + k * n + m * n) <= 2**22 and 2 * m * n * k <= 2**30


def test_bench_gemm_random_dry_run(tmp_path):
    result = _run("bench_gemm.py", "--random", "3", "--seed", "3", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "3 random shapes, seed 3 (dry run: sizes up to 256)" in result.stdout
    report = _written(tmp_path, "bench_gemm_random")
    assert report["suite"] == "random" and report["random"]["seed"] == 3
    shapes, rejected = _bench_module("_lib.shapes").random_shapes(3, 3, max_dim=256)
    assert [tuple(r["shape"]) for r in report["rows"] if r["contender"] == "jax_tma"] == shapes
    assert report["random"] == {"count": 3, "seed": 3, "rejected": rejected}
    assert "| origin |" not in result.stdout  # random shapes carry no label
    _check_summary(report, result.stdout)


def test_bench_gemm_jax_tma_path(monkeypatch):
    """The path is what kernel_route and config_for choose for the product jax_tma hands its
    primitive; "xla" where there is none (fp32, or no jax_tma product at all)."""
    import jax
    import jax.numpy as jnp

    from jax_tma.ops.gemm import primitive as gemm

    bench = _bench_module("bench_gemm")

    def avals(*shapes, dtype=jnp.bfloat16):
        return [jax.ShapeDtypeStruct(s, dtype) for s in shapes]

    lhs, rhs = avals((72, 7), (129, 72))  # TT: a stored [K, M], b stored [N, K]
    dims = (((0,), (1,)), ((), ()))
    choice = gemm.kernel_choice(lhs, rhs, dims, jnp.bfloat16)
    expected = "xla" if choice is None else choice[1].describe() + (
        " + transpose" if choice[0].copies else "")
    ours = bench._products("TT")[0]
    assert bench.jax_tma_path(ours, [lhs, rhs]) == expected
    matmul = bench._products("NN")[0]
    assert bench.jax_tma_path(matmul, avals((3, 256, 512), (3, 512, 384))).startswith("block_m=")
    # B's rows (129 elements) padded: the copy costs more than so small a product, so the
    # lowering leaves it to XLA, unless JAX_TMA_KERNEL_ALWAYS says otherwise
    monkeypatch.setenv("JAX_TMA_KERNEL_ALWAYS", "0")
    assert bench.jax_tma_path(matmul, avals((7, 72), (72, 129))) == "xla"
    monkeypatch.setenv("JAX_TMA_KERNEL_ALWAYS", "1")
    assert bench.jax_tma_path(matmul, avals((7, 72), (72, 129))).startswith("block_m=")
    assert bench.jax_tma_path(matmul, avals((7, 72), (72, 129), dtype=jnp.float32)) == "xla"
    assert bench.jax_tma_path(jnp.matmul, avals((7, 72), (72, 129))) == "xla"


def test_bench_gemm_autotune_dry_run(tmp_path):
    """--autotune: the report's name, its note and JSON; without the kernels nothing is tuned
    (each product says why) and the run goes on."""
    cache = tmp_path / "cache.json"
    result = _run("bench_gemm.py", "--random", "3", "--seed", "3", "--autotune",
                  "--autotune-max", "2", "--autotune-cache", str(cache), "--out",
                  str(tmp_path / "out"), "--part", "1/1")
    assert result.returncode == 0, result.stderr
    report = _written(tmp_path / "out", "bench_gemm_random_autotuned_part1of1")
    assert report["autotune"]["max_candidates"] == 2
    assert report["autotune"]["tuning_seconds"] >= 0
    untuned = [r for r in report["rows"] if r["contender"] == "jax_tma_untuned"]
    assert len(untuned) == 3 and all(r["seconds"] > 0 and r["path"] for r in untuned)
    assert report["autotune"]["untuned_summary"]["shapes"] == 3
    assert "jax_tma_untuned (the same run, what jax_tma runs without the cache)" in result.stdout
    assert "the 2 configurations the cost model ranks first and XLA's dot" in report["about"]
    assert f"autotuning into {cache}" in result.stderr
    if "not tuned: jax_tma.autotune: the kernels cannot run here" not in result.stderr:
        assert cache.exists()  # a GPU machine: tuned
    bench = _bench_module("bench_gemm")
    assert bench._stem(bench._parse(["--random", "3", "--autotune"])) == (
        "bench_gemm_random_autotuned")


@pytest.mark.parametrize("args,message", [
    (["--autotune-max", "3"], "apply to --autotune"),
    (["--autotune-cache", "x.json"], "apply to --autotune"),
    (["--autotune", "--autotune-max", "0"], "--autotune-max takes a positive int"),
])
def test_bench_gemm_rejects_bad_autotune_flags(args, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        _bench_module("bench_gemm")._parse(["--dry-run", *args])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_bench_gemm_row_from_json():
    bench = _bench_module("bench_gemm")
    row = bench.Row((2, 3, 4), "jax_tma", 1e-3, 1e-5, path="block_m=64")
    as_json = json.loads(json.dumps(bench._json_row(row)))  # shape a list, tflops added
    assert bench.Row.from_json(as_json) == row
    del as_json["path"]  # a report older than the field
    assert bench.Row.from_json(as_json).path == ""


def test_bench_gemm_parts_split_the_shapes():
    bench = _bench_module("bench_gemm")
    flags = ["--random", "7", "--seed", "3", "--dry-run"]
    shapes = bench._parse(flags).shape_list
    for count in (1, 2, 3, 7):
        chunks = [bench._parse([*flags, "--part", f"{i}/{count}"]).shape_list
                  for i in range(1, count + 1)]
        assert [s for chunk in chunks for s in chunk] == shapes, count  # all, once, in order
        assert max(map(len, chunks)) - min(map(len, chunks)) <= 1, count
    args = bench._parse([*flags, "--part", "2/3"])
    assert bench._stem(args) == "bench_gemm_random_part2of3"
    assert args.part_note == "Part 2 of 3: shapes 3 to 4 of 7."


@pytest.mark.parametrize("part,message", [
    ("0/3", "1 <= I <= N"), ("4/3", "1 <= I <= N"), ("2", "1 <= I <= N"), ("a/b", "1 <= I <= N"),
    ("1/8", "7 shapes make fewer than 8 parts"),
])
def test_bench_gemm_rejects_bad_parts(part, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        _bench_module("bench_gemm")._parse(["--random", "7", "--dry-run", "--part", part])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.fixture(scope="module")
def random_runs(tmp_path_factory) -> pathlib.Path:
    """A --random 5 dry run, whole (reports under whole/), as two parts (under parts/), and
    the last two of four parts (under quarters/)."""
    root = tmp_path_factory.mktemp("random_runs")
    for out, extra in (("whole", []), ("parts", ["--part", "1/2"]), ("parts", ["--part", "2/2"]),
                       ("quarters", ["--part", "3/4"]), ("quarters", ["--part", "4/4"])):
        result = _run("bench_gemm.py", "--random", "5", "--seed", "3", "--out", str(root / out),
                      *extra)
        assert result.returncode == 0, result.stderr
    return root


def _part_files(random_runs: pathlib.Path) -> list[pathlib.Path]:
    (device_dir,) = (random_runs / "parts").iterdir()
    return [device_dir / f"bench_gemm_random_part{i}of2.json" for i in (1, 2)]


def test_bench_gemm_merge_parts(random_runs, tmp_path):
    files = _part_files(random_runs)
    parts = [_written(random_runs / "parts", f"bench_gemm_random_part{i}of2") for i in (1, 2)]
    assert [p["part"] for p in parts] == [
        {"index": 1, "count": 2, "start": 0, "stop": 2, "total": 5},
        {"index": 2, "count": 2, "start": 2, "stop": 5, "total": 5}]
    result = _script("bench_gemm.py", "--merge", *map(str, files[::-1]), "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    merged = _written(tmp_path, "bench_gemm_random")
    whole = _written(random_runs / "whole", "bench_gemm_random")
    assert merged["rows"] == parts[0]["rows"] + parts[1]["rows"]  # in the parts' order
    merged_rows, whole_rows = ([(r["shape"], r["contender"], r["label"], r["path"])
                                for r in report["rows"]] for report in (merged, whole))
    assert merged_rows == whole_rows  # the unsplit run's, but for the timings
    for key in ("dtype", "layout", "suite", "dry_run", "random", "stem", "about"):
        assert merged[key] == whole[key], key
    assert "part" not in merged and merged["summary"]["shapes"] == 5
    assert merged["merged_from"] == [f.name for f in files]  # file names, in the suite's order
    _check_summary(merged, result.stdout)  # over the rows of both parts
    assert "5 random shapes, seed 3 (dry run" in result.stdout and "Part " not in result.stdout
    assert "| jax_tma path |" in result.stdout


@pytest.mark.parametrize("what,change", [
    ("device", lambda p: p["environment"].update(device="NVIDIA H200")),
    ("commit", lambda p: p["environment"].update(commit="0123abc")),
    ("dtype", lambda p: p.update(dtype="fp16")),
    ("layout", lambda p: p.update(layout="NT")),
    ("random shapes", lambda p: p["random"].update(seed=4)),
])
def test_bench_gemm_merge_rejects_parts_of_other_runs(random_runs, tmp_path, what, change):
    first, second = _part_files(random_runs)
    other = json.loads(second.read_text())
    change(other)
    (tmp_path / second.name).write_text(json.dumps(other))
    with pytest.raises(ValueError, match=f"the parts differ in {what}: "):
        _bench_module("bench_gemm").merge([first, tmp_path / second.name])


def _quarter_files(random_runs: pathlib.Path) -> list[pathlib.Path]:
    (device_dir,) = (random_runs / "quarters").iterdir()
    return [device_dir / f"bench_gemm_random_part{i}of4.json" for i in (3, 4)]


def _without_bounds(path: pathlib.Path, tmp_path: pathlib.Path) -> pathlib.Path:
    """`path`'s report as bench_gemm wrote it before parts recorded their shapes' bounds."""
    payload = json.loads(path.read_text())
    payload["part"] = {key: payload["part"][key] for key in ("index", "count")}
    written = tmp_path / path.name
    written.write_text(json.dumps(payload))
    return written


def test_bench_gemm_merge_parts_of_different_splits(random_runs, tmp_path):
    # Part 1 of 2 holds shapes 1-2, parts 3 and 4 of 4 shapes 3 and 4-5: the whole suite.
    first, _ = _part_files(random_runs)
    whole = _written(random_runs / "whole", "bench_gemm_random")
    for head in (first, _without_bounds(first, tmp_path)):  # an older report: bounds computed
        files = [*_quarter_files(random_runs)[::-1], head]
        merged, _, table = _bench_module("bench_gemm").merge(files)
        assert [(list(r["shape"]), r["contender"]) for r in merged["rows"]] == [
            (r["shape"], r["contender"]) for r in whole["rows"]]
        assert merged["summary"]["shapes"] == 5 and merged["stem"] == "bench_gemm_random"
        assert "over 5 shapes" in table


def test_bench_gemm_merge_partial(random_runs, tmp_path):
    # Shapes 1-2 and 4-5 of 5 (part 1 of 2, part 4 of 4): a partial report says so.
    first, _ = _part_files(random_runs)
    _, fourth = _quarter_files(random_runs)
    result = _script("bench_gemm.py", "--merge", str(fourth), str(first), "--partial", "--out",
                     str(tmp_path))
    assert result.returncode == 0, result.stderr
    merged = _written(tmp_path, "bench_gemm_random_partial")
    whole = _written(random_runs / "whole", "bench_gemm_random")
    shapes = list(dict.fromkeys(tuple(r["shape"]) for r in whole["rows"]))
    held = [shapes[i] for i in (0, 1, 3, 4)]
    assert list(dict.fromkeys(tuple(r["shape"]) for r in merged["rows"])) == held
    assert merged["shapes_held"] == {"total": 5, "ranges": [[0, 2], [3, 5]]}
    assert merged["summary"]["shapes"] == 4
    assert "Partial: shapes 1 to 2, 4 to 5 of 5 (the others were not run)." in merged["about"]
    assert "Partial: shapes 1 to 2, 4 to 5 of 5" in result.stdout
    assert not list(tmp_path.glob("*/bench_gemm_random.json"))  # not written as the whole suite
    second = _part_files(random_runs)[1]
    with pytest.raises(ValueError, match="hold each of the suite's 5 shapes once, got shapes "
                                         "1 to 2, 3 to 5, 4 to 5$"):
        _bench_module("bench_gemm").merge([first, second, fourth], partial=True)  # overlap


def test_bench_gemm_merge_errors(random_runs, tmp_path):
    bench = _bench_module("bench_gemm")
    first, second = _part_files(random_runs)
    third, fourth = _quarter_files(random_runs)
    for files, got in (([first], "1 to 2"), ([first, first, second], "1 to 2, 1 to 2, 3 to 5"),
                       ([first, fourth], "1 to 2, 4 to 5"), ([second, third], "3 to 3, 3 to 5")):
        with pytest.raises(ValueError, match="the parts must hold each of the suite's 5 shapes "
                                             f"once, got shapes {got}$"):
            bench.merge(files)
    old_first, old_second = (_without_bounds(path, tmp_path) for path in (first, second))
    with pytest.raises(ValueError, match=r"a suite of 2 parts takes each once, got parts \[1\]"):
        bench.merge([old_first])
    (tmp_path / "quarter").mkdir()
    with pytest.raises(ValueError, match="or parts of different I/N splits, need reports that "):
        bench.merge([old_first, _without_bounds(third, tmp_path / "quarter")])
    assert bench.merge([old_second, old_first])[0]["summary"]["shapes"] == 5
    with pytest.raises(ValueError, match="a partial merge, or parts of different I/N splits"):
        bench.merge([old_first], partial=True)
    (whole,) = (random_runs / "whole").glob("*/bench_gemm_random.json")
    with pytest.raises(ValueError, match="no report of a bench_gemm --part run"):
        bench.merge([first, whole])
    other = json.loads(second.read_text())
    other["dtype"] = "fp16"
    (tmp_path / "other.json").write_text(json.dumps(other))
    result = _script("bench_gemm.py", "--merge", str(first), str(tmp_path / "other.json"),
                     "--out", str(tmp_path))
    assert result.returncode == 1 and "the parts differ in dtype: " in result.stderr
    assert "'bf16'" in result.stderr and "'fp16'" in result.stderr
    assert not list(tmp_path.glob("*/bench_gemm_random.*"))  # nothing written


def test_bench_parts_runs_parts_into_one_archive_and_one_cache(tmp_path):
    """scripts/bench_parts.sh: parts 1-2 of 2 of a dry run, their reports packed in one
    archive, every part tuning into the one cache file it names (BENCH_PARTS_CACHE)."""
    import tarfile

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "python3"  # the script runs python3: this interpreter, as _script runs it
    wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} {'-S' if sys.flags.no_site else ''} "
                       '"$@"\n')
    wrapper.chmod(0o755)
    cache = tmp_path / "cache.json"
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "OUT": str(tmp_path / "out"),
           "BENCH_PARTS_CACHE": str(cache)}
    result = subprocess.run(
        ["bash", str(REPO / "scripts" / "bench_parts.sh"), "2", "1", "2", "300", "--random", "3",
         "--seed", "3", "--dry-run", "--autotune"],
        capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"tuning into {cache}" in result.stdout
    assert "part 1/2 rc=0" in result.stdout and "part 2/2 rc=0" in result.stdout
    for i in (1, 2):
        assert f"autotuning into {cache}" in (tmp_path / "out" / f"part{i}.log").read_text()
    with tarfile.open(tmp_path / "out" / "reports.tgz") as archive:
        names = {pathlib.PurePath(n).name for n in archive.getnames()}
    assert {f"bench_gemm_random_autotuned_part{i}of2.json" for i in (1, 2)} <= names
    assert not (tmp_path / "out" / "reports").exists()


def test_on_each_gpu_runs_one_command_per_device(tmp_path):
    """scripts/on_each_gpu.sh: the i-th command sees CUDA_VISIBLE_DEVICES=i, each logs to its
    own file, the script fails when one command does, and without commands it is a usage
    error."""
    script = str(REPO / "scripts" / "on_each_gpu.sh")
    env = {**os.environ, "OUT": str(tmp_path)}
    result = subprocess.run(["bash", script, "echo first $CUDA_VISIBLE_DEVICES",
                             "echo second $CUDA_VISIBLE_DEVICES; exit 3"],
                            capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "gpu0 rc=0" in result.stdout and "gpu1 rc=3" in result.stdout
    assert (tmp_path / "gpu0.log").read_text() == "first 0\n"
    assert (tmp_path / "gpu1.log").read_text() == "second 1\n"
    assert subprocess.run(["bash", script], capture_output=True, timeout=60).returncode == 2


def test_bench_gemm_merge_takes_no_run_flags(capsys):
    with pytest.raises(SystemExit) as exit_:
        _bench_module("bench_gemm")._parse(["--merge", "a.json", "--dry-run", "--random", "3"])
    assert exit_.value.code == 2
    assert ("--merge takes only --out and --partial besides, got --random --dry-run"
            in capsys.readouterr().err)
    with pytest.raises(SystemExit):
        _bench_module("bench_gemm")._parse(["--partial", "--random", "3"])
    assert "--partial goes with --merge" in capsys.readouterr().err


@pytest.mark.parametrize("args,message", [
    (["--suite", "llm", "--random", "5"], "--suite llm and --random each choose the shapes"),
    (["--shapes", "8,8,8", "--suite", "llm"], "--shapes and --suite llm each choose"),
    (["--random", "5", "--batched"], "apply to the default suite, not to --random"),
    (["--suite", "llm", "--quick"], "apply to the default suite, not to --suite llm"),
    (["--seed", "3"], "applies to --random"),
    (["--random", "5", "--seed", "-1"], "non-negative"),
    (["--random", "0"], "positive number of shapes"),
])
def test_bench_gemm_rejects_conflicting_shape_sources(args, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        _bench_module("bench_gemm")._parse(args)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_bench_mlp_block_dry_run(tmp_path):
    """One dry run with --breakdown: the table, the report and, without CUPTI (no GPU), the
    breakdown said to be unavailable and recorded as such."""
    result = _run("bench_mlp_block.py", "--out", str(tmp_path), "--commit", "0123abc",
                  "--breakdown")
    assert result.returncode == 0, result.stderr
    assert "| block | tokens | d | f | jax_tma ms/step |" in result.stdout
    for row in ("| gelu | 64 | 64 | 256 |", "| swiglu | 64 | 64 | 192 |"):
        assert row in result.stdout, result.stdout
    assert "gelu xla: no kernel breakdown (CUPTI unavailable)" in result.stdout
    report = _written(tmp_path, "bench_mlp_block")
    assert report["environment"]["commit"] == "0123abc"
    rows = {r["block"]: r for r in report["rows"]}
    assert set(rows) == {"gelu", "swiglu"}
    assert rows["gelu"]["dense_params"] == 2 * 64 * 256
    assert rows["swiglu"]["dense_params"] == 3 * 64 * 192
    for r in rows.values():
        assert r["check_ok"], r  # both steps give the same loss and gradients
        assert r["breakdown"] == {"xla": None, "jax_tma_fused": None}
        for name in ("jax_tma", "xla"):
            assert r[name]["ms_per_step"] > 0 and r[name]["matmul_tflops"] > 0


def test_bench_mlp_block_breakdown_splits_products_from_the_rest(monkeypatch):
    module = _bench_module("bench_mlp_block")
    kernels = [("nvjet_sm90_tst_128x160_64x5_2x1_v_bz_NNT", 1.0e-3), ("loop_add_fusion", 5e-4),
               ("_ZN7jax_tma9sm90_gemm16sm90_gemm_kernelI13__nv_bfloat16", 2.0e-3),
               ("input_reduce_fusion", 2.5e-4)]
    monkeypatch.setattr(module._timing, "kernel_breakdown", lambda step, operands: kernels)
    found = module.breakdown(None, ())
    assert found["products_ms"] == pytest.approx(3.0)
    assert found["rest_ms"] == pytest.approx(0.75)
    assert found["total_ms"] == pytest.approx(3.75)
    assert [k for k, _ in found["kernels"]] == [k for k, _ in kernels]
    monkeypatch.setattr(module._timing, "kernel_breakdown", lambda step, operands: None)
    assert module.breakdown(None, ()) is None


def test_bench_mlp_block_rejects_bad_sizes():
    result = _run("bench_mlp_block.py", "--block", "gelu", "--tokens", "100", "--seq", "64")
    assert result.returncode == 2 and "multiple of --seq" in result.stderr


def _profile_gemm_module():
    return _bench_module("profile_gemm")


_SEPARATOR_NAME = "void jax_tma::testing::(anonymous namespace)::named_barrier_ping_pong_kernel()"
_OUR_NAME = ("void jax_tma::sm90_gemm_kernel<__nv_bfloat16, __nv_bfloat16, jax_tma::TileConfig<"
             "64, 128, 8, 2, 0, 2>, jax_tma::OperandLayout<0, 1>>(CUtensorMap_st)")


def _raw_page(kernels: list[tuple[str, str, str]]) -> str:
    """An ncu raw page (base units) of kernels given as (name, duration ns, TMA bytes); the
    grid size is a thousands-separated string, as ncu prints it, and the other metrics are
    left out, as where a metric was not collected."""
    buf = io.StringIO()
    out = csv.writer(buf, quoting=csv.QUOTE_ALL)
    out.writerow(["ID", "Kernel Name", "gpu__time_duration.sum", "launch__grid_size",
                  "l1tex__m_xbar2l1tex_read_bytes_mem_global_op_tma_ld.sum"])
    out.writerow(["", "", "ns", "", "byte"])
    for i, (name, ns, tma) in enumerate(kernels):
        out.writerow([str(i), name, ns, "1,954", tma])
    return buf.getvalue()


def test_profile_gemm_summarize(tmp_path):
    raw = tmp_path / "raw.csv"
    raw.write_text(_raw_page([
        (_SEPARATOR_NAME, "2000", "0"),
        (_OUR_NAME, "9280", "61467648"),
        ("loop_reduce_fusion", "1500", "0"),  # a second kernel of the same call
        (_SEPARATOR_NAME, "2000", "0"),
        ("nvjet_sm90_tst_128x72_64x8_4x2_h_bz_NNT", "8448", "58195200"),
    ]))
    result = _script("profile_gemm.py", "--summarize", str(raw))
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if re.match(r"\| call \d", line)]
    assert len(rows) == 3, result.stdout  # the separators are left out
    assert rows[0].startswith("| call 1 | jax_tma 64x128 s8 c2 | 9.28 | 1954 | – |")
    assert "| 61.47 |" in rows[0]
    assert rows[1].startswith("| call 1 | loop_reduce_fusion | 1.5 |")
    assert rows[2].startswith("| call 2 | nvjet_sm90_tst_128x72_64x8_4x2_h_bz_NNT | 8.448 |")


def test_profile_gemm_labels_fused_kernels():
    label = _profile_gemm_module().kernel_label
    name = ("void jax_tma::sm90_gemm::sm90_gemm_kernel<__nv_bfloat16, __nv_bfloat16, "
            "jax_tma::sm90_gemm::TileConfig<128, 256, 3, 2, (jax_tma::sm90_gemm::EpilogueKind)0, "
            "4, 2>, jax_tma::sm90_gemm::OperandLayout<0, 1>, jax_tma::DenseGemm, "
            "jax_tma::Fusion<(jax_tma::FusionKind){}, (jax_tma::Activation){}>>(CUtensorMap_st)")
    assert label(name.format(1, 2)) == "jax_tma 128x256 s3 c2 bias+gelu"
    assert label(name.format(3, 4)) == "jax_tma 128x256 s3 c2 gated silu"
    assert label(name.format(2, 1)) == "jax_tma 128x256 s3 c2 grad relu"
    assert label(name.format(1, 0)) == "jax_tma 128x256 s3 c2 bias+"
    assert label(_OUR_NAME) == "jax_tma 64x128 s8 c2"  # no fusion


@pytest.mark.parametrize("pattern,names", [
    ("gelu", ["jax_tma", "xla", "xla_dot"]),
    ("residual", ["jax_tma", "xla", "xla_dot"]),
    ("swiglu", ["jax_tma", "xla", "xla_concat", "xla_dot"]),
])
def test_profile_gemm_fused_patterns_profile_bench_epilogues_contenders(pattern, names):
    import jax
    module = _profile_gemm_module()
    args = module._parse(["--shapes", "64,128,64", "--pattern", pattern])
    work = module._work(args, (64, 128, 64), module._forced_config(args))
    assert [label for label, _, _ in work] == [f"64×128×64 {pattern} {n}" for n in names]
    (_, ours, ops), (_, xla, _) = work[:2]
    assert len(ops) == 2 and len(ops[0]) == 6  # bench_epilogues' operand sets
    np.testing.assert_allclose(np.asarray(ours(*ops[0]), np.float32),
                               np.asarray(xla(*ops[0]), np.float32), rtol=5e-2, atol=5e-2)
    forced = module._parse(["--shapes", "64,128,64", "--pattern", pattern,
                            "--config", "128,128,6,1"])
    ((label, fn, _),) = module._work(forced, (64, 128, 64), module._forced_config(forced))
    assert label == f"64×128×64 {pattern} jax_tma 128,128,6,1"
    assert jax.block_until_ready(fn(*ops[0])).shape == (64, 128)


def test_profile_gemm_labels_calls_and_rejects_other_pages():
    module = _profile_gemm_module()
    kernels = module.summarize(_raw_page([(_OUR_NAME, "10", "0"), (_SEPARATOR_NAME, "1", "0"),
                                          (_OUR_NAME, "20", "0")]))
    rows = module.by_call(kernels, ["1000×1000×1000 jax_tma"])
    assert [(label, k["gpu__time_duration.sum"]) for label, k in rows] == [
        ("?", 10.0), ("1000×1000×1000 jax_tma", 20.0)]
    with pytest.raises(ValueError, match="Kernel Name"):
        module.summarize("a,b\n1,2\n")


def test_profile_gemm_rejects_an_uncompiled_config_before_profiling(monkeypatch):
    module = _profile_gemm_module()
    monkeypatch.setattr(module, "_ncu", lambda: pytest.fail("ncu started"))
    with pytest.raises(SystemExit, match="not a compiled configuration"):
        module.main(["--config", "64,100,8,1"])


def test_profile_gemm_rejects_a_config_the_fused_epilogues_lack(monkeypatch):
    module = _profile_gemm_module()
    monkeypatch.setattr(module, "_ncu", lambda: pytest.fail("ncu started"))
    with pytest.raises(SystemExit, match="is not compiled for the"):
        module.main(["--pattern", "gelu", "--config", "64,256,4,1"])  # a GEMM tile only


def test_profile_gemm_without_ncu(monkeypatch):
    module = _profile_gemm_module()
    monkeypatch.setattr(module.shutil, "which", lambda name: None)
    monkeypatch.setattr(module.glob, "glob", lambda pattern, **kw: [])
    with pytest.raises(SystemExit, match="Nsight Compute"):
        module.main(["--shapes", "64,64,64"])


@pytest.mark.parametrize("args,message", [
    (["--shapes", "4,4"], "M,N,K triples"),
    (["--config", "64,128"], "BM,BN,STAGES,CLUSTER"),
    (["--pattern", "relu"], "invalid choice: 'relu'"),
])
def test_profile_gemm_rejects_bad_arguments(args, message):
    result = _script("profile_gemm.py", *args)
    assert result.returncode == 2 and message in result.stderr


def test_profile_gemm_writes_the_calls_table(tmp_path, monkeypatch):
    """main's wiring with ncu stood in for: the child's labels name the report's calls, and the
    table and JSON land in <out>/<device>/."""
    module = _profile_gemm_module()
    page = _raw_page([(_SEPARATOR_NAME, "1", "0"), (_OUR_NAME, "9280", "61467648"),
                      (_SEPARATOR_NAME, "1", "0"), ("nvjet_x", "8000", "58195200")])
    child_out = module._MARK + "64×64×64 jax_tma\n" + module._MARK + "64×64×64 XLA\n"
    commands = []

    real_run = subprocess.run

    def fake_run(cmd, **kw):
        if cmd[0] != "ncu":  # the environment record's own queries (nvidia-smi, git)
            return real_run(cmd, **kw)
        commands.append(cmd)
        stdout = page if "--import" in cmd else child_out
        return subprocess.CompletedProcess(cmd, 0, stdout=stdout, stderr="")

    monkeypatch.setattr(module, "_ncu", lambda: "ncu")
    monkeypatch.setattr(module.subprocess, "run", fake_run)
    assert module.main(["--shapes", "64,64,64", "--out", str(tmp_path), "--commit", "0123abc"]) == 0
    assert "--child" in commands[0] and "--import" in commands[1]
    (device_dir,) = tmp_path.iterdir()
    table = (device_dir / "profile_gemm.md").read_text()
    assert "| 64×64×64 jax_tma | jax_tma 64x128 s8 c2 | 9.28 |" in table
    assert "| 64×64×64 XLA | nvjet_x | 8 |" in table
    report = json.loads((device_dir / "profile_gemm.json").read_text())
    assert report["environment"]["commit"] == "0123abc"
    assert [k["call"] for k in report["kernels"]] == ["64×64×64 jax_tma", "64×64×64 XLA"]
    assert commands[0][commands[0].index("--pattern") + 1] == "matmul"
    commands.clear()
    assert module.main(["--shapes", "64,64,64", "--pattern", "swiglu", "--out", str(tmp_path),
                        "--commit", "0123abc"]) == 0
    assert commands[0][commands[0].index("--pattern") + 1] == "swiglu"
    fused = (device_dir / "profile_gemm_swiglu.md").read_text()
    assert "pattern swiglu (bench_epilogues.py)" in fused.splitlines()[0]


@pytest.mark.parametrize("flag", [None, "--sweep", "--floor"])
def test_bench_epilogues_dry_run(tmp_path, flag):
    sweep, floor = flag == "--sweep", flag == "--floor"
    result = _run("bench_epilogues.py", "--out", str(tmp_path), "--commit", "0123abc",
                  *([flag] if flag else []))
    assert result.returncode == 0, result.stderr
    report = _written(tmp_path, "bench_epilogues" + ("_sweep" if sweep else "")
                      + ("_floor" if floor else ""))
    assert report["environment"]["commit"] == "0123abc"
    names = {(r["pattern"], r["contender"]) for r in report["rows"]}
    for pattern in ("gelu", "residual", "swiglu", "swiglu_grad"):
        assert {(pattern, "jax_tma"), (pattern, "xla"), (pattern, "xla_dot")} <= names
        assert ((pattern, "xla_read_w") in names) == floor
    assert ("swiglu", "xla_concat") in names
    swept = {name for _, name in names if name.startswith("jax_tma ") or name == "jax_tma_dot"}
    import jax_tma
    expected = {"jax_tma " + "x".join(map(str, c.tile)) for c in jax_tma.DENSE_CONFIGS}
    expected |= {"jax_tma " + "x".join(map(str, c.tile)) + " sk" for c in jax_tma.DENSE_CONFIGS
                 if c.takes_stream_k} | {"jax_tma_dot"}
    assert swept == (expected if sweep else set())
    assert all(r["seconds"] > 0 for r in report["rows"])
    assert ("Every compiled configuration" in result.stdout) == sweep
    assert ("| weights read µs | read TB/s | jax_tma TB/s |" in result.stdout) == floor
    for r in report["rows"]:  # each jax_tma form checked against XLA's before timing
        if r["contender"].startswith("jax_tma"):
            against = "XLA's dot" if r["contender"] == "jax_tma_dot" else "XLA"
            assert r["note"].startswith(f"rel. difference from {against} "), r


def test_bench_epilogues_weight_bytes():
    module = _bench_module("bench_epilogues")
    assert module.weight_bytes("gelu", (16, 14336, 4096)) == 2 * 14336 * 4096
    assert module.weight_bytes("swiglu", (16, 14336, 4096)) == 4 * 14336 * 4096
    assert module.weight_bytes("swiglu_grad", (16, 14336, 4096)) == 2 * 14336 * 4096


@pytest.mark.parametrize("sweep", [False, True])
def test_bench_ragged_dot_dry_run(tmp_path, sweep):
    result = _run("bench_ragged_dot.py", "--out", str(tmp_path), *(["--sweep"] if sweep else []))
    assert result.returncode == 0, result.stderr
    report = _written(tmp_path, "bench_ragged_dot" + ("_sweep" if sweep else ""))
    names = {r["contender"] for r in report["rows"]}
    if sweep:
        import jax_tma
        assert names == {"jax_tma"} | {"jax_tma " + "x".join(map(str, c.tile))
                                       for c in (*jax_tma.RAGGED_CONFIGS,
                                                 *jax_tma.GATED_RAGGED_CONFIGS,
                                                 *jax_tma.FP8_RAGGED_CONFIGS)}
    else:
        assert {"jax_tma", "xla", "dense", "jax_tma_two", "jax_tma_concat", "xla_two",
                "xla_concat", "jax_tma_bf16", "xla_bf16"} <= names
        assert "| 256x64x128 G=4 zipf gated |" in result.stdout.split("Gated form")[1]
        assert "| 256x256x128 G=4 zipf fp8 |" in result.stdout.split("FP8 form")[1]
    assert all(r["seconds"] > 0 for r in report["rows"] if r["seconds"] is not None)


def test_bench_fp8_dry_run(tmp_path):
    result = _run("bench_fp8.py", "--out", str(tmp_path), "--commit", "0123abc")
    assert result.returncode == 0, result.stderr
    assert ("| M×N×K | jax_tma_tensor | jax_tma_block | jax_tma_fast | xla_fp8_highest | "
            "xla_fp8 | xla_dequant | jax_tma_bf16 |") in result.stdout
    for shape in ("64×256×256", "8×136×200"):
        assert f"| {shape} |" in result.stdout, result.stdout
    assert "Over 2 shapes, geometric mean (min): tensor × xla_fp8_highest" in result.stdout
    report = _written(tmp_path, "bench_fp8")
    assert report["environment"]["commit"] == "0123abc" and report["dry_run"]
    contenders = {r["contender"] for r in report["rows"]}
    assert contenders == {"jax_tma_tensor", "jax_tma_block", "jax_tma_fast", "xla_fp8_highest",
                          "xla_fp8", "xla_dequant", "jax_tma_bf16", "quantize"}
    assert all(r["seconds"] > 0 for r in report["rows"])


def test_bench_fp8_resume_takes_over_the_measured_shapes(tmp_path):
    """A run cut short after its first shape, resumed: that shape's rows come from the earlier
    report (a marked time shows they are not re-measured), the second is timed, the report is
    whole. A report of another commit, or of other options, is refused."""
    first = tmp_path / "first"
    assert _run("bench_fp8.py", "--out", str(first), "--commit", "0123abc").returncode == 0
    report = _written(first, "bench_fp8")
    assert report["complete"]
    kept = [r for r in report["rows"] if r["shape"] == [64, 256, 256]]
    for r in kept:
        r["seconds"] = 123.0
    cut = tmp_path / "cut.json"
    cut.write_text(json.dumps({**report, "rows": kept, "complete": False}))
    second = tmp_path / "second"
    result = _run("bench_fp8.py", "--out", str(second), "--commit", "0123abc", "--resume",
                  str(cut))
    assert result.returncode == 0, result.stderr
    resumed = _written(second, "bench_fp8")
    assert resumed["complete"] and len(resumed["rows"]) == len(report["rows"])
    assert {r["seconds"] for r in resumed["rows"] if r["shape"] == [64, 256, 256]} == {123.0}
    assert all(r["seconds"] < 1.0 for r in resumed["rows"] if r["shape"] == [8, 136, 200])
    assert "[1/2]" not in result.stderr and "[2/2]" in result.stderr
    # Resuming a whole report times nothing and writes it again, whole.
    whole = tmp_path / "whole.json"
    whole.write_text(json.dumps(resumed))
    third = tmp_path / "third"
    again = _run("bench_fp8.py", "--out", str(third), "--commit", "0123abc", "--resume",
                 str(whole))
    assert again.returncode == 0, again.stderr
    assert not re.search(r"^\[\d+/\d+\]", again.stderr, re.M), again.stderr  # nothing timed
    assert _written(third, "bench_fp8")["rows"] == resumed["rows"]
    broken = tmp_path / "broken.json"
    broken.write_text("[1, 2]")
    bad = _run("bench_fp8.py", "--commit", "0123abc", "--resume", str(broken))
    assert bad.returncode == 2 and "not a readable bench_fp8 report" in bad.stderr
    other = _run("bench_fp8.py", "--commit", "fedcba9", "--resume", str(cut))
    assert other.returncode == 2 and "another run's report: its commit '0123abc'" in other.stderr
    sets = _script("bench_fp8.py", "--dry-run", "--commit", "0123abc", "--sets", "3",
                     "--resume", str(cut))
    assert sets.returncode == 2 and "other options" in sets.stderr


def test_bench_fp8_merge_reports_of_different_shapes(tmp_path):
    """Runs of one commit that timed different shapes (two GPUs resuming one report) merge into
    one report in the suite's order, whole when together they hold every shape; a report of
    another commit, or one holding a shape with other results, is refused."""
    assert _run("bench_fp8.py", "--out", str(tmp_path / "run"), "--commit", "0123abc"
                ).returncode == 0
    whole = _written(tmp_path / "run", "bench_fp8")
    paths = []
    for shape in ([8, 136, 200], [64, 256, 256]):  # the suite's order reversed
        path = tmp_path / f"{shape[0]}.json"
        path.write_text(json.dumps(
            {**whole, "complete": False, "rows": [r for r in whole["rows"] if r["shape"] == shape]}))
        paths.append(path)
    merged = tmp_path / "merged"
    result = _script("bench_fp8.py", "--merge", *map(str, paths), "--out", str(merged))
    assert result.returncode == 0, result.stderr
    report = _written(merged, "bench_fp8")
    assert report["complete"] and report["dry_run"] and report["rows"] == whole["rows"]
    assert "Partial" not in result.stdout
    one = _script("bench_fp8.py", "--merge", str(paths[0]), "--out", str(tmp_path / "one"))
    assert one.returncode == 0 and not _written(tmp_path / "one", "bench_fp8")["complete"]
    changed = json.loads(paths[0].read_text())
    changed["rows"][0]["seconds"] *= 2
    twice = tmp_path / "twice.json"
    twice.write_text(json.dumps(changed))
    bad = _script("bench_fp8.py", "--merge", str(paths[0]), str(twice))
    assert bad.returncode == 2 and "with other results" in bad.stderr
    changed = json.loads(paths[1].read_text())
    changed["environment"]["commit"] = "fedcba9"
    other = tmp_path / "other.json"
    other.write_text(json.dumps(changed))
    bad = _script("bench_fp8.py", "--merge", str(paths[0]), str(other))
    assert bad.returncode == 2 and "commit 'fedcba9'" in bad.stderr


def test_bench_fp8_sweep_times_split_k_below_a_wave(tmp_path):
    """--sweep times each tile whole and, where its tiles fill less than a wave, split 2/4/8
    ways along K where K has that many 128-deep slices (64 x 256 x 256: 2 slices)."""
    result = _run("bench_fp8.py", "--sweep", "--tiles", "64x128x7x1", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    rows = [line.split()[1:4] for line in result.stdout.splitlines()
            if line.strip().startswith("64x256x256") and " sweep tensor " in line]
    assert [r[2] for r in rows] == ["64x128x7x1", "64x128x7x1"], rows
    assert "sweep tensor 64x128x7x1 k2 " in result.stdout and " k4 " not in result.stdout


def test_bench_fp8_rejects_bad_shapes():
    result = _script("bench_fp8.py", "--shapes", "4,4")
    assert result.returncode == 2 and "--shapes takes M,N,K of positive ints" in result.stderr
    result = _script("bench_fp8.py", "--sweep", "--tiles", "128x192x4x1", "128x100x4x1")
    assert result.returncode == 2 and "--tiles ['128x100x4x1']: not compiled" in result.stderr
    result = _script("bench_fp8.py", "--tiles", "128x192x4x1")
    assert result.returncode == 2 and "--tiles selects the tiles of a --sweep" in result.stderr


def test_bench_moe_layer_dry_run(tmp_path):
    result = _run("bench_moe_layer.py", "--out", str(tmp_path), "--commit", "0123abc")
    assert result.returncode == 0, result.stderr
    assert "| tiny | 128 | 64 | 8 | 32 | 2 |" in result.stdout, result.stdout
    (row,) = _written(tmp_path, "bench_moe_layer")["rows"]
    # The layer on the kernels (bf16 and FP8) and on lax.ragged_dot agree, each within its bound.
    assert set(row["checks"]) == {"jax_tma", "jax_tma_fp8"}, row
    assert all(ok for _, _, ok in row["checks"].values()), row
    assert row["expert_tflop_per_step"] == 6 * 128 * 2 * 3 * 64 * 32 / 1e12
    for name in ("jax_tma", "jax_tma_fp8", "xla_ragged", "einsum"):
        assert row[name]["ms_per_step"] > 0 and row[name]["tokens_per_s"] > 0


def test_bench_moe_layer_leaves_out_an_einsum_form_too_large(capsys):
    module = _bench_module("bench_moe_layer")
    big = module.LayerConfig("qwen3", *module.SHAPES["qwen3"], 32768)
    assert big.einsum_capacity == math.ceil(1.25 * 32768 * 8 / 128)
    assert big.einsum_gib() > 24  # the default --einsum-gib: not run at this size
    with pytest.raises(SystemExit):
        module._parse(["--config", "qwen3", "--tokens", "0"])
    assert "--tokens must be positive" in capsys.readouterr().err


def test_bench_moe_layer_times_what_fits_in_memory():
    """A contender whose step over every set does not fit is timed over one set, with every
    other; one that fits over none is left out and noted, the rest still timed."""
    module = _bench_module("bench_moe_layer")
    oom = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate")
    sets = [(jnp.ones((4,)),), (jnp.ones((5,)),)]

    def fits_one(x):  # out of memory once the second set is in the call
        if x.shape == (5,):
            raise oom
        return x * 2

    def never(x):
        raise oom

    def other(x):
        raise ValueError("another failure")

    args = module._parse(["--dry-run"])
    timings, count, notes = module._timed(
        {"ok": lambda x: x + 1, "fits_one": fits_one, "never": never}, sets, args)
    assert (set(timings), count) == ({"ok", "fits_one"}, 1)
    assert set(notes) == {"never"} and "out of device memory" in notes["never"]
    with pytest.raises(ValueError, match="another failure"):
        module._timed({"other": other}, sets, args)


def test_bench_moe_layer_times_each_contender_alone_when_together_they_do_not_fit(monkeypatch):
    """Steps that fit one at a time but not beside each other (XLA's layer needs one 88 GiB
    buffer at some sizes) are timed in rounds of their own, and the row says so; a run where
    nothing fits gives no timings instead of failing."""
    module = _bench_module("bench_moe_layer")
    oom = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate")
    calls = []

    def compare(contenders, sets, rounds, iterations):
        calls.append((tuple(contenders), iterations))
        if len(contenders) > 1:
            raise oom
        return {name: module._timing.Timing(1e-3, 0.0, rounds) for name in contenders}
    monkeypatch.setattr(module._timing, "compare", compare)
    args = module._parse(["--dry-run"])
    sets = [(jnp.ones((4,)),)]
    timings, count, notes = module._timed({"a": lambda x: x, "b": lambda x: x}, sets, args)
    assert set(timings) == {"a", "b"} and count == 1
    assert "timed alone" in notes["all"]
    assert calls[-2:] == [(("a",), 1), (("b",), 1)]

    def never(x):
        raise oom
    monkeypatch.undo()
    assert module._timed({"never": never}, sets, args)[:2] == ({}, 0)


def test_bench_moe_layer_parts_merge_in_suite_order(tmp_path):
    """--part runs' reports merge into the suite's, in its order; reports of another commit or
    holding a configuration twice are refused."""
    module = _bench_module("bench_moe_layer")
    env = {"device": "NVIDIA H200", "driver": "1", "jax": "0.11", "jaxlib": "0.11",
           "commit": "abc", "timing": "cupti"}
    last, first = module.SUITE[-1], module.SUITE[0]
    paths = []
    for i, cfg in enumerate((last, first)):
        path = tmp_path / f"p{i}.json"
        path.write_text(json.dumps({"environment": env, "complete": True, "dry_run": False,
                                    "sets": 2, "rows": [{"name": cfg.name, "tokens": cfg.tokens}]}))
        paths.append(path)
    got_env, rows, complete, options = module.merge(paths)
    assert got_env == env and not complete  # two of the suite's configurations
    assert options == {"dry_run": False, "sets": 2}
    assert [(r["name"], r["tokens"]) for r in rows] == [(first.name, first.tokens),
                                                      (last.name, last.tokens)]
    with pytest.raises(ValueError, match="appears twice"):
        module.merge([paths[0], paths[0]])
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"environment": dict(env, commit="def"), "rows": []}))
    with pytest.raises(ValueError, match="commit 'def'"):
        module.merge([paths[0], other])
    other.write_text(json.dumps({"environment": env, "dry_run": False, "sets": 3, "rows": []}))
    with pytest.raises(ValueError, match="different --dry-run / --sets"):
        module.merge([paths[0], other])
    args = module._parse(["--part", "2/2"])
    assert args.stem == "bench_moe_layer_part2of2"
    assert args.configs == module.SUITE[len(module.SUITE) // 2:]


def test_bench_ragged_dot_parts_merge_in_case_order(tmp_path):
    """--part reports of one suite merge in the suite's case order, with the count of its
    cases; reports of other suites, other runs, or sharing a case are refused."""
    module = _bench_module("bench_ragged_dot")
    env = {"device": "NVIDIA H200", "driver": "1", "jax": "0.11", "jaxlib": "0.11",
           "commit": "abc", "timing": "cupti"}
    cases = ["a", "b", "c"]

    def report(name, stem, rows, **env_changes):
        path = tmp_path / name
        path.write_text(json.dumps({
            "environment": dict(env, **env_changes), "stem": stem, "cases": cases,
            "rows": [dataclasses.asdict(module.Row(c, "jax_tma", 1.0, 1e-3)) for c in rows]}))
        return path
    second, first = report("p2.json", "s", ["c"]), report("p1.json", "s", ["a", "b"])
    got_env, stem, rows, total = module.merge([second, first])
    assert (got_env, stem, total) == (env, "s", 3)
    assert [r.case for r in rows] == cases
    with pytest.raises(ValueError, match="a case appears in two"):
        module.merge([first, report("p3.json", "s", ["b"])])
    with pytest.raises(ValueError, match="not --part runs of one suite"):
        module.merge([first, report("p4.json", "other", ["c"])])
    with pytest.raises(ValueError, match="commit 'def'"):
        module.merge([first, report("p5.json", "s", ["c"], commit="def")])
    assert module._parse(["--part", "2/3"]).part_of == (2, 3)
    with pytest.raises(SystemExit):
        module._parse(["--part", "3/2"])


def test_bench_moe_layer_checks_on_fewer_tokens_when_the_reference_fails_late(monkeypatch):
    """An allocation that fails only when the reference's result is read (XLA runs
    asynchronously) still moves the check to the first 1024 tokens, instead of ending the run."""
    module = _bench_module("bench_moe_layer")
    oom = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate")
    cfg = module.DRY_RUN[0]
    cfg = dataclasses.replace(cfg, tokens=2048)
    key = jax.random.key(0)
    params = module._params(cfg, key)
    x = jax.random.normal(key, (cfg.tokens, cfg.d_model), jnp.float32).astype(jnp.bfloat16)
    ready = jax.block_until_ready

    def block(value):  # the full-size reference fails when read
        leaves = jax.tree_util.tree_leaves(value)
        if any(getattr(leaf, "shape", ())[:1] == (cfg.tokens,) for leaf in leaves):
            raise oom
        return ready(value)
    monkeypatch.setattr(module.jax, "block_until_ready", block)
    checks, checked = module._checks(cfg, (x, x.astype(jnp.float32), *params))
    assert checked == "checked on the first 1024 tokens"
    assert set(checks) == {"jax_tma", "jax_tma_fp8"} and all(ok for *_, ok in checks.values())


def test_bench_sharded_dry_run(tmp_path):
    """On the forced host devices (conftest: 8): rows for 1 and 2 devices, speedups relative to
    the one-device row of the same op and layout."""
    result = _run("bench_sharded.py", "--out", str(tmp_path), "--commit", "0123abc",
                  "--ops", "matmul", "moe_layer", "--devices", "1", "2")
    assert result.returncode == 0, result.stderr
    report = _written(tmp_path, "bench_sharded")
    rows = {(r["op"], r["layout"], r["size"], r["devices"]): r for r in report["rows"]}
    assert set(rows) == {(op, layout, size, d) for op, layout, size in (
        ("matmul", "M sharded", "64x32x64"), ("matmul", "N sharded", "64x32x64"),
        ("matmul", "K sharded", "64x32x64"),
        ("moe_layer", "expert parallel", "tiny: 64 tokens, d 32, 8 x 16, top-2")) for d in (1, 2)}
    assert report["environment"]["device_count"] >= 2
    for (op, layout, size, d), r in rows.items():
        assert r["seconds"] > 0 and set(r) >= {"op", "layout", "size", "devices", "seconds",
                                                "speedup", "kernel"}
        assert math.isclose(r["speedup"], rows[(op, layout, size, 1)]["seconds"] / r["seconds"])


def test_bench_sharded_needs_the_one_device_base(capsys):
    with pytest.raises(SystemExit):
        _bench_module("bench_sharded")._parse(["--devices", "2", "4"])
    assert "--devices must include 1" in capsys.readouterr().err


def test_bench_sharded_cases_build_the_sizes_they_report():
    """Each case's operands have the sizes bench_sharded.json reports (SIZES), not another
    op's: the builders once read m, n, k after _cases had rebound them to the FP8 sizes."""
    module = _bench_module("bench_sharded")
    shapes, labels = {}, {}
    for case in module._cases(module.SIZES):
        ops = jax.eval_shape(case.make, jax.random.key(0))
        shapes.setdefault(case.op, []).append(tuple(tuple(o.shape) for o in ops[:3]))
        labels.setdefault(case.op, set()).add(case.size)
    shapes = {op: s[0] if op != "moe_layer" else s for op, s in shapes.items()}
    m, n, k = module.SIZES["matmul"]
    assert shapes["matmul"][:2] == ((m, k), (k, n)) and labels["matmul"] == {f"{m}x{n}x{k}"}
    m, k, n, g = module.SIZES["ragged_dot"]
    assert shapes["ragged_dot"] == ((m, k), (g, k, n), (g,))
    m, n, k = module.SIZES["dense"]
    assert shapes["dense"] == ((m, k), (k, n), (n,))
    assert shapes["gated_dense"] == ((m, k), (k, n), (k, n))
    m, n, k = module.SIZES["fp8"]
    assert shapes["fp8"][:2] == ((m, k), (n, k))
    assert shapes["moe_layer"] == [((tokens, d), (tokens, d), (d, experts))
                                   for _, tokens, d, experts, _, _ in module.SIZES["moe_layer"]]
    assert len(labels["moe_layer"]) == len(module.SIZES["moe_layer"])


def test_bench_sharded_names_jax_tma_kernels_by_problem():
    """The kernel template's problem class names the family (not a lowercase op name, which
    mangled names do not hold); FP8 kernels are marked; the prepare kernel is its own."""
    name = _bench_module("bench_sharded")._kernel_name
    head = "_ZN7jax_tma9sm90_gemm16sm90_gemm_kernelI"
    assert name(head + "13__nv_bfloat16S2_NS0_10TileNS_23RaggedGatedGradRowsGemmENS") \
        == "jax_tma:ragged_gated_grad"
    assert name(head + "13__nv_bfloat16S2_NS_11RaggedKGemmENS_6Fusion") \
        == "jax_tma:ragged_weight_grad"
    assert name(head + "13__nv_fp8_e4m3fNS0_10TileNS_14RaggedRowsGemmENS_6Fus") \
        == "jax_tma:fp8_ragged_rows"
    assert name(head + "13__nv_fp8_e4m313__nv_bfloat16NS_9DenseGemmENS_6F") == "jax_tma:fp8_gemm"
    assert name(head + "13__nv_bfloat16S2_NS_9DenseGemmENS_6F") == "jax_tma:gemm"
    assert name("_ZN7jax_tma9sm90_gemm55_GLOBAL__N__sm90_ragged_prepare_kernelENS0_15Ragged"
                "TemplatesENS0_19RaggedPrepareParamsE") == "jax_tma:ragged_prepare"
    assert name("input_concatenate_fusion") == "input_concatenate_fusion"


def test_bench_sharded_breakdown_sums_each_kernel_per_device(monkeypatch):
    """--breakdown: one call's kernels from every device, summed by name and divided by the
    device count; jax_tma's and NCCL's mangled names by family; the longest first."""
    module = _bench_module("bench_sharded")
    gemm = "_ZN7jax_tma9sm90_gemm16sm90_gemm_kernelI13__nv_bfloat16S2_NS0_10TileConfigILi128E"
    launches = [(gemm + "NS_19RaggedGatedRowsGemmENS_6Fus", 3e-3),
                ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 1e-3),
                ("loop_multiply_fusion", 2e-4)] * 4  # four devices
    seen = []
    monkeypatch.setattr(module._timing, "kernel_breakdown",
                        lambda fn, operands, iterations: seen.append(iterations) or launches)
    got = module._breakdown(None, (), 4, most=2)
    assert seen == [1]  # several devices: one call (their records interleave call to call)
    assert [name for name, _ in got["kernels"]] == ["jax_tma:ragged_gated",
                                                    "nccl:ncclDevKernel_SendRecv"]
    assert [sec for _, sec in got["kernels"]] == pytest.approx([3e-3, 1e-3])
    assert got["kernel_s"] == pytest.approx(4.2e-3)
    monkeypatch.setattr(module._timing, "kernel_breakdown", lambda *a, **k: None)
    assert module._breakdown(None, (), 4, most=2) == {}

    def misaligned(*args, **kwargs):
        raise RuntimeError("Kernel names are not consistent across iterations")
    monkeypatch.setattr(module._timing, "kernel_breakdown", misaligned)
    assert "not consistent" in module._breakdown(None, (), 4, most=2)["kernels_note"]
    row = {"op": "matmul", "layout": "M sharded", "size": "8x8x8", "devices": 4,
           "seconds": 5e-3, "spread_s": 0.0, "speedup": 1.0, "kernel": True, **got}
    table = module._table([row], {"device": "GPU", "device_count": 4, "driver": "1",
                                  "jax": "0", "date": "today", "commit": "abc"})
    assert ("- matmul, M sharded, 8x8x8, 4 devices: 4.200 ms of kernels; jax_tma:ragged_gated "
            "3.000") in table
