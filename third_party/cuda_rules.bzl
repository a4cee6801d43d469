"""nvcc compilation for Bazel without rules_cuda: one action per .cu file with the flags of
cmake/kernels/CMakeLists.txt (tests/tooling/test_packaging.py checks they agree), run through the same
launcher (tools/nvcc_ptxas_report.py: ptxas's report beside each object, the compile fails on a
spill or serialized wgmma), objects wrapped in a cc_library so cc_binary links them like any
other."""

load("@local_config_jax_tma//:defs.bzl", "PYTHON")

# The kernels' own flags: sm_90a only (wgmma, setmaxnreg); a spill or local memory is an error.
NVCC_FLAGS = [
    "-gencode=arch=compute_90a,code=sm_90a",
    "--expt-relaxed-constexpr",
    "-Xptxas=-warn-spills,-warn-lmem-usage,-Werror",
]

# What CMake adds for a position-independent Release object in C++17 (host code at -O1, as
# CMakeLists.txt sets it).
_BUILD_FLAGS = ["-O1", "-DNDEBUG", "-Xcompiler=-fPIC", "-std=c++17"]

# CMake's CUDA_COMPILER_LAUNCHER for the kernels: writes <object>.ptxas.txt and checks it.
_LAUNCHER = Label("//tools:nvcc_ptxas_report.py")

def cuda_objects(name, srcs, hdrs, nvcc, include_dir, deps = [], **kwargs):
    """A cc_library of the objects nvcc makes from `srcs` (.cu), one genrule per file.

    Args:
      name: the cc_library.
      srcs: .cu files, each compiled on its own (they compile in parallel).
      hdrs: headers they include (inputs of every compile).
      nvcc: absolute path of the CUDA compiler.
      include_dir: the directory their #includes are relative to.
      deps: libraries the objects need at link time (the CUDA runtime).
      **kwargs: passed to the cc_library.
    """
    objects = []
    for src in srcs:
        stem = src.rsplit("/", 1)[-1].replace(".cu", "")
        out = "%s_objs/%s.pic.o" % (name, stem)
        native.genrule(
            name = "%s_%s" % (name, stem),
            srcs = [src] + hdrs,
            outs = [out, out + ".ptxas.txt"],
            tools = [_LAUNCHER],
            # nvcc names its intermediate files after its process id, and every action in
            # Bazel's sandbox runs as the same pid of its own namespace while /tmp is shared:
            # two compiles at once overwrite or delete each other's .ptx. Each compile gets
            # its own temporary directory.
            cmd = " ".join([
                "tmp=$$(mktemp -d) && trap 'rm -rf \"$$tmp\"' EXIT && TMPDIR=$$tmp",
                PYTHON,
                "$(location %s)" % _LAUNCHER,
                nvcc,
            ] + _BUILD_FLAGS + NVCC_FLAGS + [
                "-I" + include_dir,
                "-x cu -c $(location %s)" % src,
                "-o $(location %s)" % out,
            ]),
            message = "nvcc %s" % src,
        )
        objects.append(out)
    native.cc_library(
        name = name,
        srcs = objects,
        linkstatic = True,
        deps = deps,
        **kwargs
    )
