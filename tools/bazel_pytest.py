"""Runs the tests against the Bazel-built extension (//:smoke_tests: those marked `smoke`).

Started with ``python -S`` so that no .pth file runs: an editable pip install of jax_tma adds an
import hook that would otherwise load the pip-built extension instead of this one. The runfiles
tree goes first on sys.path, the interpreter's site-packages (jax, pytest, flax) after it, and the
run stops unless jax_tma and its extension come from the runfiles tree.

Usage: python -S tools/bazel_pytest.py RUNFILES_ROOT [pytest options, e.g. -m smoke]
(the runfiles tree's tests/ directory is always the one collected).
"""

from __future__ import annotations

import os
import sys
import sysconfig


def site_packages() -> list[str]:
    """The interpreter's site-packages as ``site`` would add them. Under -S a virtual
    environment's Python reports its base installation's prefix, so the environment (the
    directory above bin/ holding pyvenv.cfg) is found here: its own packages first, the base's
    only where pyvenv.cfg includes the system site-packages. The suite's subprocesses (benchmark
    dry runs, export round trips) run sys.executable without -S and see the same packages."""
    env = os.path.dirname(os.path.dirname(os.path.abspath(sys.executable)))
    cfg = os.path.join(env, "pyvenv.cfg")
    schemes = [None]
    if os.path.isfile(cfg):
        with open(cfg) as f:
            settings = dict(line.split("=", 1) for line in f if "=" in line)
        settings = {k.strip(): v.strip().lower() for k, v in settings.items()}
        schemes = [{"base": env, "platbase": env}]
        if settings.get("include-system-site-packages") == "true":
            schemes.append(None)
    paths = []
    for scheme in schemes:
        for key in ("purelib", "platlib"):
            path = sysconfig.get_paths(vars=scheme)[key]
            if path not in paths:
                paths.append(path)
    return paths


def main(argv: list[str]) -> int:
    root = os.path.abspath(argv[0])
    sys.path.insert(0, root)
    for path in site_packages():
        if path not in sys.path:
            sys.path.append(path)

    from jax_tma import _ext

    where = os.path.dirname(os.path.abspath(_ext.__file__))
    if where != os.path.join(root, "jax_tma"):
        print(f"bazel_pytest: jax_tma was imported from {where}, not from {root}", file=sys.stderr)
        return 2
    if _ext._C is None:
        print(f"bazel_pytest: {_ext.extension_error()}", file=sys.stderr)
        return 2
    print(f"bazel_pytest: extension {_ext._C.__file__}")

    import pytest

    scratch = os.environ.get("TEST_TMPDIR", "/tmp")
    args = ["-q", "-p", "no:cacheprovider", f"--basetemp={scratch}/pytest", "--rootdir", root]
    return pytest.main(args + argv[1:] + [os.path.join(root, "tests")])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
