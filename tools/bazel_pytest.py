"""Runs the test suite against the Bazel-built extension (//:cpu_tests).

Started with ``python -S`` so that no .pth file runs: an editable pip install of jax_tma adds an
import hook that would otherwise load the pip-built extension instead of this one. The runfiles
tree goes first on sys.path, the interpreter's site-packages (jax, pytest, flax) after it, and the
run stops unless jax_tma and its extension come from the runfiles tree.

Usage: python -S tools/bazel_pytest.py RUNFILES_ROOT [pytest arguments]
"""

from __future__ import annotations

import os
import sys
import sysconfig


def main(argv: list[str]) -> int:
    root = os.path.abspath(argv[0])
    sys.path.insert(0, root)
    for key in ("purelib", "platlib"):
        path = sysconfig.get_paths()[key]
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
    return pytest.main(args + (argv[1:] or [os.path.join(root, "tests")]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
