"""The record of a benchmark run (device, driver, CUDA, jax, commit) and its report files: a
table (.md), the data (.json) and a plot (.png) under benchmarks/results/<device>/."""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import pathlib
import re
import subprocess
import time

import jax

import jax_tma
from jax_tma import _timing


def _run(cmd: list[str]) -> str | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=True,
                              timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def _cuda_versions() -> dict:
    """CUDA runtime and driver API versions as jax's CUDA plugin reports them ("13.0"), or
    None where there is no plugin."""
    found = {"cuda_runtime": None, "cuda_driver": None}
    for module in ("jax_cuda13_plugin._versions", "jax_cuda12_plugin._versions",
                   "jaxlib.cuda._versions"):
        try:
            versions = importlib.import_module(module)
        except ImportError:
            continue
        for key in found:
            try:
                v = int(getattr(versions, f"{key}_get_version")())
                found[key] = f"{v // 1000}.{v % 1000 // 10}"
            except Exception:  # noqa: BLE001 - an older plugin without this query
                pass
        break
    if found["cuda_driver"] is None:  # the "CUDA Version" of nvidia-smi's banner
        banner = _run(["nvidia-smi"]) or ""
        match = re.search(r"CUDA Version:\s*([\d.]+)", banner)
        found["cuda_driver"] = match.group(1) if match else None
    return found


def environment(commit: str | None = None) -> dict:
    """Device, driver, CUDA, jax and commit of this run (shared by the benchmarks here).

    ``commit`` overrides ``git rev-parse HEAD``: the checkout on a GPU machine may carry a stale
    .git while its working tree is another commit.
    """
    dev = jax.devices()[0]
    env = {"device": dev.device_kind, "platform": dev.platform,
           "device_count": jax.device_count(), "jax": jax.__version__,
           "jaxlib": jaxlib_version(), "timing": _timing.timing_method(),
           "date": time.strftime("%Y-%m-%d")}
    driver = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    env["driver"] = driver.splitlines()[0] if driver else None
    env.update(_cuda_versions())
    if commit:
        env["commit"], env["commit_source"] = commit, "--commit"
    else:
        env["commit"] = _run(["git", "rev-parse", "HEAD"])
        status = _run(["git", "status", "--porcelain", "--untracked-files=no"])
        env["commit_source"] = "git rev-parse HEAD" + (
            " (working tree has uncommitted changes)" if status else "")
    status = jax_tma.kernel_status()
    env["jax_tma_kernel"] = status.available
    if not status.available:
        env["jax_tma_kernel_reason"] = status.reason
    return env


def jaxlib_version() -> str | None:
    try:
        return importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        return None


def banner(env: dict, dtype: str) -> str:
    """One line naming the device, its software and the run's dtype, timing and kernel path."""
    return (f"{env['device']} | driver {env['driver']} | CUDA {env['cuda_runtime']} | "
            f"jax {env['jax']} | {dtype} | timing {env['timing']} | jax_tma kernel "
            f"{'on' if env['jax_tma_kernel'] else 'off (XLA path)'}")


def results_dir(out_root: pathlib.Path | None, env: dict) -> pathlib.Path:
    """`out_root` (default benchmarks/results) / the device's name, created."""
    out = (out_root or pathlib.Path("benchmarks/results")) / env["device"].lower().replace(" ", "-")
    out.mkdir(parents=True, exist_ok=True)
    return out


def write_report(out_root: pathlib.Path | None, env: dict, stem: str, payload: dict, table: str,
                 plot) -> None:
    """Writes <stem>.json (`payload`), <stem>.md (`table`) and, where `plot(path)` draws one,
    <stem>.png under results_dir(out_root, env)."""
    out = results_dir(out_root, env)
    (out / f"{stem}.json").write_text(json.dumps(payload, indent=1))
    (out / f"{stem}.md").write_text(table + "\n")
    plotted = plot(out / f"{stem}.png")
    print(f"wrote {out}/{stem}.json, .md" + (", .png" if plotted else ""))


def write_progress(out_root: pathlib.Path | None, env: dict, stem: str, payload: dict, table: str,
                   plot, done: int, total: int, unit: str) -> None:
    """write_report after `done` of a run's `total` units (cases, configurations), so that a run
    cut short keeps what it measured: the JSON's "complete" says whether the run finished, and
    an unfinished run's table says how far it got."""
    partial = "" if done == total else f"\n\nPartial: {done} of {total} {unit} measured so far."
    write_report(out_root, env, stem, {**payload, "complete": done == total}, table + partial,
                 plot)


# What the --part reports of one suite share (read_parts checks it).
SAME_RUN = ("device", "driver", "jax", "jaxlib", "commit", "timing")


def read_parts(paths: list[pathlib.Path], what: str) -> tuple[dict, list[dict]]:
    """(environment, payloads) of the JSON reports at `paths` (the --part runs of one `what`
    suite): a ValueError where one is not such a report or they come from different devices,
    drivers, jax versions, commits or timings."""
    env, payloads = None, []
    for path in paths:
        payload = json.loads(path.read_text())
        if not isinstance(payload, dict) or not {"environment", "rows"} <= payload.keys():
            raise ValueError(f"{path} is no {what} report")
        if env is None:
            env = payload["environment"]
        differ = [k for k in SAME_RUN if payload["environment"].get(k) != env.get(k)]
        if differ:
            raise ValueError(f"{path} comes from another run: its " + ", ".join(
                f"{k} {payload['environment'].get(k)!r} (first: {env.get(k)!r})" for k in differ))
        payloads.append(payload)
    return env, payloads


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend, or None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_figure(plt, fig, path: pathlib.Path) -> bool:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
