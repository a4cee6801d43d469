"""Compiler launcher for the sm_90a kernels: runs the nvcc command it is given with ptxas's
resource report turned on (-Xptxas=-v), writes that report next to the object (<object>.ptxas.txt)
and fails the compile when the report shows a slow kernel: "Potential Performance Loss" or
C7510/C7511 (serialized wgmma), which ptxas prints as information that -Werror does not catch, or
a non-zero stack frame, spill store or spill load.

CMake runs it as the kernel library's CUDA_COMPILER_LAUNCHER (cmake/kernels/CMakeLists.txt), the
Bazel build around nvcc in third_party/cuda_rules.bzl; tests/kernels/test_ptxas.py reads the
reports.

Usage: python3 tools/nvcc_ptxas_report.py [--no-check] NVCC [nvcc arguments ... -o OBJECT]
  --no-check  write the report but do not fail on it (the debug build: its bounded mbarrier
              waits print, which costs a stack frame and serialises wgmma on purpose).
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys

REPORT_SUFFIX = ".ptxas.txt"
# First line of every report: the source it describes, so a reader can find a source's report
# without knowing how the build lays out its object directory. Second line: whether the compile
# was failed on the report's problems ("no" in the debug build).
SOURCE_HEADER = "# source: "
CHECKED_HEADER = "# checked: "

_ENTRY = re.compile(r"Compiling entry function '(\w+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_SERIALIZED = re.compile(r"Potential Performance Loss|C751[01]")


@dataclasses.dataclass
class Report:
    """What ptxas says about one translation unit."""

    entries: list[str]
    # (stack frame, spill stores, spill loads) in bytes, one per function ptxas describes.
    frames: list[tuple[int, int, int]]
    # Lines that say wgmma was serialized (or any other "Potential Performance Loss").
    serialized: list[str]

    def problems(self) -> list[str]:
        """Why the kernels in this report are on a slow path; empty when they are not."""
        found = [f"serialized wgmma: {line.strip()}" for line in self.serialized]
        found += [
            f"{frame[0]} bytes stack frame, {frame[1]} bytes spill stores, {frame[2]} bytes spill "
            "loads (must all be 0)"
            for frame in self.frames
            if frame != (0, 0, 0)
        ]
        return found


def parse(text: str) -> Report:
    """The entry functions, stack frames and serialization notes in ptxas's -v output."""
    return Report(
        entries=_ENTRY.findall(text),
        frames=[tuple(int(x) for x in m) for m in _FRAME.findall(text)],
        serialized=[line for line in text.splitlines() if _SERIALIZED.search(line)],
    )


def _value_after(args: list[str], flag: str) -> str | None:
    """The last value given to `flag` as `flag VALUE` or `flag=VALUE`."""
    found = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            found = args[i + 1]
        elif arg.startswith(flag + "="):
            found = arg[len(flag) + 1:]
    return found


def _is_report_line(line: str) -> bool:
    """ptxas's -v chatter: kept in the report file, left out of the build log."""
    return line.startswith("ptxas info") or bool(re.match(r"\s+\d+ bytes stack frame", line))


def main(argv: list[str]) -> int:
    check = True
    if argv and argv[0] == "--no-check":
        check = False
        argv = argv[1:]
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    command = [*argv, "-Xptxas=-v"]
    obj = _value_after(argv, "-o")
    source = _value_after(argv, "-c")
    if obj is None:
        print(f"nvcc_ptxas_report: no -o OBJECT in {' '.join(argv)}", file=sys.stderr)
        return 2

    result = subprocess.run(command, capture_output=True, text=True, check=False)
    output = result.stdout + result.stderr
    # Compiler messages other than the resource report reach the build log as they would without
    # this launcher.
    passed_on = "".join(line for line in output.splitlines(keepends=True)
                        if not _is_report_line(line))
    sys.stderr.write(passed_on)

    path = obj + REPORT_SUFFIX
    header = (SOURCE_HEADER + (os.path.abspath(source) if source else "?") + "\n"
              + CHECKED_HEADER + ("yes" if check else "no") + "\n")
    with open(path, "w") as f:
        f.write(header + output)
    if result.returncode != 0:
        return result.returncode

    problems = parse(output).problems()
    if check and problems:
        # The object must not outlive a failed check, or a later build would link it.
        os.remove(obj)
        print(f"nvcc_ptxas_report: {source}: kernels on a slow path (full report: {path}):",
              file=sys.stderr)
        for problem in dict.fromkeys(problems):
            print(f"  {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
