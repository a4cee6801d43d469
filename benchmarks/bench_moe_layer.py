"""Forward + backward of a Mixture-of-Experts layer (jax_tma.moe_mlp, the function behind
jax_tma.flax.MoE): tokens per second, every contender in one run and one harness.

Contenders, on the same float32 parameters (router [d, E], SwiGLU experts gate / up [E, d, F]
and down [E, F, d], cast to bf16 for the experts as the layer does) and the same tokens:
  jax_tma      the layer on jax_tma's grouped kernel (implementation="jax_tma")
  jax_tma_fp8  the layer with its expert products in FP8 (implementation="jax_tma_fp8": e4m3
               rows per 1 x 128 and weights per 128 x 128 block, quantised in the step; dW in
               bf16), checked against xla_ragged within FP8's rounding (FP8_CHECK_TOLERANCE)
  xla_ragged   the same layer on lax.ragged_dot (implementation="xla")
  einsum       the capacity-based dense form many JAX codebases use (GShard / Switch): one-hot
               dispatch and combine tensors [T, E, C] with C = ceil(1.25 * T * k / E), the
               experts as batched einsums over [E, C, d]; it drops the pairs past C (a different
               layer when routing is uneven: its output is not compared). Left out where its
               dispatch tensors would pass --einsum-gib.
A step is value_and_grad of sum(y * dy) + 1e-2 * load-balancing loss with respect to x and
every parameter. Timing: jax_tma._timing.compare (on a GPU the sum of the step's kernel times,
CUPTI; each timed call runs --sets steps on distinct tokens; rounds alternate between the
contenders). Before timing, jax_tma's and jax_tma_fp8's loss and gradients are compared with
xla_ragged's.

    python benchmarks/bench_moe_layer.py             # the suite below
    python benchmarks/bench_moe_layer.py --quick     # its first configuration
    python benchmarks/bench_moe_layer.py --config qwen3 --tokens 16384
    python benchmarks/bench_moe_layer.py --dry-run   # tiny sizes; runs without a GPU (CI)
    python benchmarks/bench_moe_layer.py --part 1/2  # half the suite (one process per GPU), then
    python benchmarks/bench_moe_layer.py --merge <results>/bench_moe_layer_part*of2.json

Reports ms per step, tokens/s and the TFLOP/s of the expert products (6 * T * k * 3 * d * F
per step: forward and both gradients of three d x F products per pair); writes
bench_moe_layer.json, .md and .png under benchmarks/results/<device>/.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jax_tma
from jax_tma import _timing

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _lib.harness import parse_part, part  # noqa: E402
from _lib.report import (banner, environment, pyplot, read_parts, save_figure,  # noqa: E402
                         write_progress)

CHECK_TOLERANCE = 2e-2
# e4m3 rounds each product's operands to 3 mantissa bits: 5-6.5 % from the exact layer at random
# data (tests/ops/moe/test_moe.py measures it); an error of order 1 means a wrong product.
FP8_CHECK_TOLERANCE = 0.1
EINSUM_CAPACITY = 1.25
AUX_WEIGHT = 1e-2
CONTENDERS = ("jax_tma", "jax_tma_fp8", "xla_ragged", "einsum")


@dataclasses.dataclass(frozen=True)
class LayerConfig:
    name: str
    d_model: int
    hidden: int
    experts: int
    top_k: int
    tokens: int

    @property
    def expert_flops(self) -> float:
        return 6.0 * self.tokens * self.top_k * 3 * self.d_model * self.hidden

    @property
    def einsum_capacity(self) -> int:
        return math.ceil(EINSUM_CAPACITY * self.tokens * self.top_k / self.experts)

    def einsum_gib(self) -> float:
        """The dense form's dispatch and combine tensors (bf16 and fp32), GiB."""
        return self.tokens * self.experts * self.einsum_capacity * 6 / 2 ** 30

    def describe(self) -> str:
        return (f"{self.name}: {self.tokens} tokens, d {self.d_model}, {self.experts} experts of "
                f"width {self.hidden}, top-{self.top_k}")


SHAPES = {"qwen3": (2048, 768, 128, 8), "deepseek": (7168, 2048, 32, 8),
          "mixtral": (4096, 14336, 8, 2)}
# XLA's layer (lax.ragged_dot) does not fit in an H200's 141 GB at deepseek / 8192 tokens or
# qwen3 / 32768 (its backward allocates one buffer of 85-128 GiB): 4096 tokens of each is where
# the two are compared.
# Ordered so that --part I/3 splits it into thirds of similar time on an H200: the last third,
# the two DeepSeek-like layers, is the longest (XLA's ragged_dot layer at 4096 tokens).
SUITE = [LayerConfig("qwen3", *SHAPES["qwen3"], 4096), LayerConfig("qwen3", *SHAPES["qwen3"], 8192),
         LayerConfig("qwen3", *SHAPES["qwen3"], 32768),
         LayerConfig("mixtral", *SHAPES["mixtral"], 8192),
         LayerConfig("deepseek", *SHAPES["deepseek"], 4096),
         LayerConfig("deepseek", *SHAPES["deepseek"], 8192)]
DRY_RUN = [LayerConfig("tiny", 64, 32, 8, 2, 128)]


def _params(cfg: LayerConfig, key) -> tuple[jax.Array, ...]:
    """router, w_up, w_down, w_gate in fp32 (lecun-normal scale)."""
    k = jax.random.split(key, 4)
    d, f, e = cfg.d_model, cfg.hidden, cfg.experts
    normal = lambda key, shape, fan_in: (jax.random.normal(key, shape, jnp.float32)  # noqa: E731
                                         / math.sqrt(fan_in))
    return (normal(k[0], (d, e), d), normal(k[1], (e, d, f), d), normal(k[2], (e, f, d), f),
            normal(k[3], (e, d, f), d))


def _layer(implementation: str, cfg: LayerConfig):
    def run(x, router, w_up, w_down, w_gate):
        y, stats = jax_tma.moe_mlp(x, router, w_up, w_down, w_gate, top_k=cfg.top_k,
                                   dtype=jnp.bfloat16, implementation=implementation)
        return y, stats.load_balancing_loss
    return run


def _einsum_layer(cfg: LayerConfig):
    """The dense dispatch / combine form with capacity C (pairs past it dropped)."""
    capacity = cfg.einsum_capacity

    def run(x, router, w_up, w_down, w_gate):
        bf = jnp.bfloat16
        logits = jnp.dot(x.astype(jnp.float32), router, precision=lax.Precision.HIGHEST)
        probs = jax.nn.softmax(logits)
        top, choice = lax.top_k(probs, cfg.top_k)
        weights = top / top.sum(-1, keepdims=True)
        mask = jax.nn.one_hot(choice, cfg.experts, dtype=jnp.int32)  # [T, k, E]
        # Position of each pair in its expert's buffer: first choices first, as the layer does.
        flat = mask.transpose(1, 0, 2).reshape(-1, cfg.experts)
        position = (jnp.cumsum(flat, axis=0) - 1).reshape(cfg.top_k, -1, cfg.experts)
        position = position.transpose(1, 0, 2)
        keep = mask * (position < capacity)
        slot = jax.nn.one_hot(jnp.sum(position * keep, -1), capacity, dtype=jnp.float32)
        combine = jnp.einsum("tk,tke,tkc->tec", weights, keep.astype(jnp.float32), slot)
        dispatch = (combine > 0).astype(bf)
        rows = jnp.einsum("td,tec->ecd", x.astype(bf), dispatch)
        gate = jnp.einsum("ecd,edf->ecf", rows, w_gate.astype(bf))
        up = jnp.einsum("ecd,edf->ecf", rows, w_up.astype(bf))
        h = (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(bf)
        out = jnp.einsum("ecf,efd->ecd", h, w_down.astype(bf))
        y = jnp.einsum("ecd,tec->td", out, combine.astype(bf))
        f = jnp.sum(mask, (0, 1)) / (x.shape[0] * cfg.top_k)
        return y, cfg.experts * jnp.sum(f * probs.mean(0))
    return run


def _step(layer, scale: bool = False):
    """(x, dy, router, w_up, w_down, w_gate) -> (loss, gradients of x and every parameter);
    with `scale`, ((loss, sum |y * dy|), gradients): the scale a difference of the loss (a sum
    of terms of either sign) is measured against."""
    def loss(x, dy, *params):
        y, balance = layer(x, *params)
        terms = y.astype(jnp.float32) * dy
        value = jnp.sum(terms) + AUX_WEIGHT * balance
        return (value, jnp.sum(jnp.abs(terms))) if scale else value
    return jax.value_and_grad(loss, argnums=(0, 2, 3, 4, 5), has_aux=scale)


def _checks(cfg: LayerConfig, operands: tuple) -> tuple[dict, str]:
    """{contender: (loss difference / sum |y * dy|, gradients' relative error, ok)} of jax_tma
    and jax_tma_fp8 against xla_ragged on `operands`; where xla_ragged's step does not fit, on
    the first 1024 tokens. Also says which tokens were checked."""
    for tokens in dict.fromkeys((cfg.tokens, min(cfg.tokens, 1024))):
        ops = (operands[0][:tokens], operands[1][:tokens], *operands[2:])
        try:
            # (Blocked on: an allocation that fails may surface only when the result is read.)
            (ref, scale), ref_grads = jax.block_until_ready(
                jax.jit(_step(_layer("xla", cfg), True))(*ops))
        except jax.errors.JaxRuntimeError as err:
            if not _out_of_memory(err):
                raise
            continue
        checks = {}
        for name, tol in (("jax_tma", CHECK_TOLERANCE), ("jax_tma_fp8", FP8_CHECK_TOLERANCE)):
            try:  # the contenders are named by their implementation
                (ours, _), grads = jax.block_until_ready(
                    jax.jit(_step(_layer(name, cfg), True))(*ops))
            except jax.errors.JaxRuntimeError as err:  # left unchecked (the table says so)
                if not _out_of_memory(err):
                    raise
                continue
            loss_diff = abs(float(ours) - float(ref)) / max(float(scale), 1e-30)
            grad_err = _timing.tree_relative_error(grads, ref_grads)
            checks[name] = (loss_diff, grad_err, loss_diff <= tol and grad_err <= tol)
            del grads
        return checks, ("" if tokens == cfg.tokens else f"checked on the first {tokens} tokens")
    return {}, ""


def _out_of_memory(err: Exception) -> bool:
    return "RESOURCE_EXHAUSTED" in str(err)


def _timed(steps: dict, sets: list, args) -> tuple[dict, int, dict]:
    """(timings, sets per timed call, {contender: note}). A contender whose step over every set
    in one call (as _timing.compare runs it) does not fit in device memory is tried over one
    set; if that fits, every contender is timed over one set, else it is left out, noted."""
    try:
        return _timing.compare(steps, sets, rounds=args.rounds, iterations=args.iterations), \
            len(sets), {}
    except jax.errors.JaxRuntimeError as err:
        if not _out_of_memory(err):
            raise
    notes, fits = {}, {}
    for name, step in steps.items():
        for count in dict.fromkeys((len(sets), 1)):
            try:
                jax.block_until_ready(jax.jit(lambda s, f=step: [f(*o) for o in s])(sets[:count]))
            except jax.errors.JaxRuntimeError as err:
                if not _out_of_memory(err):
                    raise
                continue
            fits[name] = count
            break
        else:
            notes[name] = "out of device memory (XLA's buffers for one step)"
    if not fits:
        return {}, 0, notes
    count = min(fits.values())
    kept = {name: steps[name] for name in fits}
    for iterations in dict.fromkeys((args.iterations, 1)):
        # CUPTI's measure queues its iterations at once: a step whose XLA buffers fit once
        # may not fit several times over (then one per sample, more rounds instead).
        try:
            timings = _timing.compare(kept, sets[:count], iterations=iterations,
                                      rounds=args.rounds * args.iterations // iterations)
            if iterations < args.iterations:
                notes["all"] = "one step in flight per sample (several did not fit)"
            break
        except jax.errors.JaxRuntimeError as err:
            if not _out_of_memory(err):
                raise
    else:
        # Together their buffers do not fit: each contender in rounds of its own.
        notes["all"] = "each contender timed alone (together they did not fit)"
        timings = {}
        # XLA's layer, the largest, first, before the others' buffers fragment the allocator's
        # pool (at qwen3 / 8192 tokens on an H200 it still did not fit when timed).
        for name, step in sorted(kept.items(), key=lambda item: item[0] != "xla_ragged"):
            try:
                timings.update(_timing.compare({name: step}, sets[:count], iterations=1,
                                               rounds=args.rounds * args.iterations))
            except jax.errors.JaxRuntimeError as err:
                if not _out_of_memory(err):
                    raise
                notes[name] = "out of device memory when timed"
    return timings, count, notes


def bench(cfg: LayerConfig, args) -> dict:
    params = _params(cfg, jax.random.key(cfg.tokens + cfg.experts))
    sets = []
    for i in range(args.sets):
        kx, kd = jax.random.split(jax.random.key(1000 + i))
        x = jax.random.normal(kx, (cfg.tokens, cfg.d_model), jnp.float32).astype(jnp.bfloat16)
        dy = jax.random.normal(kd, (cfg.tokens, cfg.d_model), jnp.float32)
        sets.append((x, dy, *params))
    steps = {"jax_tma": _step(_layer("jax_tma", cfg)),
             "jax_tma_fp8": _step(_layer("jax_tma_fp8", cfg)),
             "xla_ragged": _step(_layer("xla", cfg))}
    if cfg.einsum_gib() <= args.einsum_gib:
        steps["einsum"] = _step(_einsum_layer(cfg))
    checks, checked = _checks(cfg, sets[0])
    timings, timed_sets, notes = _timed(steps, sets, args)
    row = dict(dataclasses.asdict(cfg), expert_tflop_per_step=cfg.expert_flops / 1e12,
               checks=checks,
               einsum_capacity=cfg.einsum_capacity, einsum_gib=cfg.einsum_gib(),
               sets=len(sets), timed_sets=timed_sets,
               notes=dict(notes, **({"checked": checked} if checked else {})))
    for name, t in timings.items():
        row[name] = {"ms_per_step": t.median_s * 1e3, "spread_ms": t.spread_s * 1e3,
                     "samples": t.samples, "tokens_per_s": cfg.tokens / t.median_s,
                     "expert_tflops": cfg.expert_flops / t.median_s / 1e12}
    return row


def _table(rows: list[dict], env: dict) -> str:
    lines = [
        f"{env['device']}, driver {env['driver']}, CUDA {env.get('cuda_runtime')}, "
        f"jax {env['jax']}, {env['date']}, commit {str(env.get('commit'))[:10]}, bf16 experts, "
        f"fp32 router and parameters, timing: "
        f"{env['timing']}; forward + backward of the layer; TFLOP/s counts the expert products "
        f"(6 · T · k · 3 · d · F); einsum drops pairs past C = 1.25 · T · k / E",
        "",
        "| config | tokens | d | E | F | k | " + " | ".join(
            f"{c} ms (tokens/s, TFLOP/s)" for c in CONTENDERS)
        + " | jax_tma vs xla_ragged | fp8 vs jax_tma | check |",
        "|---|---|---|---|---|---|" + "---|" * len(CONTENDERS) + "---|---|---|",
    ]
    for r in rows:
        cells = []
        for c in CONTENDERS:
            t = r.get(c)
            cells.append(r["notes"].get(c, "not run (dispatch > --einsum-gib)") if t is None
                         else f"{t['ms_per_step']:.3f} ± {t['spread_ms']:.3f} "
                         f"({t['tokens_per_s'] / 1e3:.0f} k, {t['expert_tflops']:.0f})")
        ratio, fp8_ratio = (
            f"{r[a]['ms_per_step'] / r[b]['ms_per_step']:.2f}x" if a in r and b in r else "—"
            for a, b in (("xla_ragged", "jax_tma"), ("jax_tma", "jax_tma_fp8")))
        checks = r["checks"]
        check = ("not checked (xla_ragged's layer does not fit)" if not checks else "; ".join(
            f"{name} " + ("ok" if ok else f"MISMATCH (loss {loss:.1e}, grads {grads:.1e})")
            for name, (loss, grads, ok) in checks.items()))
        if r["timed_sets"] < r["sets"]:
            check += f"; timed over {r['timed_sets']} set"
        for key in ("checked", "all"):
            if key in r["notes"]:
                check += f"; {r['notes'][key]}"
        lines.append(f"| {r['name']} | {r['tokens']} | {r['d_model']} | {r['experts']} "
                     f"| {r['hidden']} | {r['top_k']} | " + " | ".join(cells)
                     + f" | {ratio} | {fp8_ratio} | {check} |")
    return "\n".join(lines)


def _plot(rows: list[dict], path: pathlib.Path, title: str) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(5, 2.5 * len(rows)), 4))
    width = 0.8 / len(CONTENDERS)
    for i, name in enumerate(CONTENDERS):
        ax.bar(x + (i - (len(CONTENDERS) - 1) / 2) * width,
               [r[name]["tokens_per_s"] / 1e3 if name in r else 0 for r in rows], width,
               label=name)
    ax.set_xticks(x, [f"{r['name']}\n{r['tokens']} tokens" for r in rows], fontsize=8)
    ax.set_ylabel("thousand tokens / s (forward + backward)")
    ax.set_title(title)
    ax.legend()
    return save_figure(plt, fig, path)


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the suite's first configuration")
    p.add_argument("--config", choices=sorted(SHAPES), help="one configuration")
    p.add_argument("--tokens", type=int, default=8192, help="with --config")
    p.add_argument("--part", metavar="I/N",
                   help="the I-th of N contiguous chunks of the suite (one process per GPU); "
                        "the report's name gets a _partIofN suffix")
    p.add_argument("--merge", nargs="+", type=pathlib.Path, metavar="FILE.json",
                   help="write the suite's report from its --part reports (no GPU work)")
    p.add_argument("--sets", type=int, default=2, help="steps per timed call")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--einsum-gib", type=float, default=24.0,
                   help="largest dispatch + combine tensors the einsum form may use")
    p.add_argument("--out", type=pathlib.Path, default=None)
    p.add_argument("--commit", help="commit to record instead of `git rev-parse HEAD`")
    p.add_argument("--dry-run", action="store_true",
                   help="tiny sizes, 1 round; files only with --out; runs without a GPU")
    args = p.parse_args(argv)
    args.stem = "bench_moe_layer"
    if args.config:
        if args.tokens < 1:
            p.error(f"--tokens must be positive, got {args.tokens}")
        args.configs = [LayerConfig(args.config, *SHAPES[args.config], args.tokens)]
    else:
        args.configs = DRY_RUN if args.dry_run else SUITE[:1] if args.quick else SUITE
    if args.part is not None:
        index, count = parse_part(p, args.part, len(args.configs), "configurations")
        args.configs = part(args.configs, index, count)
        args.stem += f"_part{index}of{count}"
    if args.sets < 1:
        p.error(f"--sets must be positive, got {args.sets}")
    if args.dry_run:
        args.rounds, args.iterations = 1, 1
    return args


def merge(paths: list[pathlib.Path]) -> tuple[dict, list[dict], bool, dict]:
    """(environment, rows in the suite's order, whether every part finished, the parts' options)
    of the --part reports at `paths`: a ValueError where one is not such a report, they come
    from different runs (read_parts) or options, or hold a configuration twice."""
    env, payloads = read_parts(paths, "bench_moe_layer")
    options = {(p.get("dry_run"), p.get("sets")) for p in payloads}
    if len(options) != 1:
        raise ValueError(f"the parts ran with different --dry-run / --sets: {sorted(options)}")
    dry_run, sets = options.pop()
    rows = [row for payload in payloads for row in payload["rows"]]
    complete = all(payload.get("complete", False) for payload in payloads)
    keys = [(r["name"], r["tokens"]) for r in rows]
    if len(set(keys)) != len(keys):
        raise ValueError(f"a configuration appears twice among {keys}")
    order = [(c.name, c.tokens) for c in SUITE]
    rows.sort(key=lambda r: order.index((r["name"], r["tokens"]))
              if (r["name"], r["tokens"]) in order else len(order))
    return (env, rows, complete and [k for k in order if k in keys] == order,
            {"dry_run": dry_run, "sets": sets})


def _write(args, env: dict, rows: list[dict], done: int, total: int, stem: str,
           options: dict | None = None) -> None:
    options = options or {"dry_run": args.dry_run, "sets": args.sets}
    write_progress(args.out, env, stem, {"environment": env, **options, "rows": rows},
                   _table(rows, env), lambda path: _plot(rows, path, env["device"]),
                   done, total, "configurations")


def main(argv=None) -> int:
    args = _parse(argv)
    if args.merge:
        env, rows, complete, options = merge(args.merge)
        _write(args, env, rows, len(rows), len(rows) if complete else len(SUITE), "bench_moe_layer",
               options)
        print(_table(rows, env))
        return 0
    env = environment(args.commit)
    print(banner(env, "bf16"), flush=True)
    rows = []
    for i, cfg in enumerate(args.configs):
        print(f"[{i + 1}/{len(args.configs)}] {cfg.describe()} ...", file=sys.stderr, flush=True)
        rows.append(bench(cfg, args))
        if not args.dry_run or args.out is not None:
            _write(args, env, rows, i + 1, len(args.configs), args.stem)
    print(_table(rows, env))
    return 0


if __name__ == "__main__":
    sys.exit(main())
