"""Finds the CUDA compiler the way every jax_tma build and test does.

One rule, used by CMakeLists.txt (run as a script), tests/kernels/test_ptxas.py and
tests/kernels/test_sass.py (imported) and the Bazel repository rule in third_party/local_config.bzl
(run as a script):

1. ``CUDACXX`` if set (CMake's own variable for the CUDA compiler); it must name an executable.
2. ``nvcc`` on ``PATH``.
3. ``$CUDA_HOME/bin/nvcc``, then ``$CUDA_PATH/bin/nvcc``.
4. ``/usr/local/cuda/bin/nvcc``, where NVIDIA's installers put the toolkit without adding it to
   ``PATH``, then the newest ``/usr/local/cuda-<version>/bin/nvcc``.

As a script it prints the compiler's path and exits 0, or prints where it looked to stderr and
exits 1; ``--explain`` prints the rule that found it (or every place tried) to stderr as well,
``--root`` prints the toolkit's root directory instead (what nvcc itself reports, so a wrapper
script such as /usr/local/bin/nvcc leads to the real toolkit).
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence

DEFAULT_ROOTS = ("/usr/local/cuda",)
VERSIONED_ROOTS_GLOB = "/usr/local/cuda-*"


class NvccError(RuntimeError):
    """CUDACXX names something that is not an executable compiler."""


def _executable(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def _version_key(root: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", os.path.basename(root)))


def candidates(
    environ: Mapping[str, str] | None = None,
    default_roots: Sequence[str] = DEFAULT_ROOTS,
    versioned_glob: str | None = VERSIONED_ROOTS_GLOB,
) -> list[tuple[str, str | None]]:
    """(where, path) pairs in the order they are tried after CUDACXX; None: not on PATH."""
    env = os.environ if environ is None else environ
    found: list[tuple[str, str | None]] = []
    found.append(("PATH", shutil.which("nvcc", path=env.get("PATH", ""))))
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if env.get(var):
            found.append((var, os.path.join(env[var], "bin", "nvcc")))
    for root in default_roots:
        found.append((root, os.path.join(root, "bin", "nvcc")))
    if versioned_glob:
        for root in sorted(glob.glob(versioned_glob), key=_version_key, reverse=True):
            found.append((root, os.path.join(root, "bin", "nvcc")))
    return found


def find_nvcc(
    environ: Mapping[str, str] | None = None,
    default_roots: Sequence[str] = DEFAULT_ROOTS,
    versioned_glob: str | None = VERSIONED_ROOTS_GLOB,
) -> tuple[str | None, str]:
    """(path to nvcc or None, how it was found or every place tried).

    Raises NvccError when CUDACXX is set to something that is not an executable: a user who
    names a compiler means that one, so falling through to another would hide the mistake.
    """
    env = os.environ if environ is None else environ
    cudacxx = env.get("CUDACXX", "")
    if cudacxx:
        resolved = cudacxx if os.sep in cudacxx else shutil.which(cudacxx, path=env.get("PATH", ""))
        if resolved and _executable(resolved):
            return os.path.abspath(resolved), f"CUDACXX={cudacxx}"
        raise NvccError(f"CUDACXX={cudacxx} is not an executable CUDA compiler")
    tried = []
    for where, path in candidates(env, default_roots, versioned_glob):
        if path is not None and _executable(path):
            return os.path.abspath(path), f"{where}: {path}"
        tried.append(f"{where} ({path or 'no nvcc'})")
    return None, "no nvcc in CUDACXX, " + ", ".join(tried)


def toolkit_root(nvcc: str) -> str:
    """The CUDA toolkit directory nvcc belongs to (include/, lib64/), from its dry run."""
    result = subprocess.run(
        [nvcc, "--dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull],
        capture_output=True, text=True, check=False,
    )
    match = re.search(r"^#\$ TOP=(.*)$", result.stdout + result.stderr, re.MULTILINE)
    if match is None:
        raise NvccError(f"{nvcc} --dryrun did not report its toolkit directory (TOP=)")
    return os.path.realpath(match.group(1).strip())


def main(argv: Sequence[str]) -> int:
    explain = "--explain" in argv
    try:
        path, how = find_nvcc()
    except NvccError as err:
        print(f"find_nvcc: {err}", file=sys.stderr)
        return 2
    if explain or path is None:
        print(f"find_nvcc: {how}", file=sys.stderr)
    if path is None:
        return 1
    if "--root" in argv:
        try:
            print(toolkit_root(path))
        except NvccError as err:
            print(f"find_nvcc: {err}", file=sys.stderr)
            return 2
        return 0
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
