"""@local_config_jax_tma: what the Bazel build takes from this machine, found the way the pip
build finds it.

- nvcc and its toolkit: tools/find_nvcc.py (CUDACXX, PATH, CUDA_HOME, CUDA_PATH, /usr/local/cuda).
- XLA FFI headers: `jax.ffi.include_dir()` of the Python that runs the tests, so the extension
  is built against the jaxlib that will load it (DESIGN.md: FFI headers).
- nanobind (its single-file source, src/nb_combined.cpp) and the Python headers: that Python's.

The Python is $JAX_TMA_PYTHON, else python3 on PATH; it needs jax and nanobind installed (and
pytest, flax, optax for the test target). Re-fetched when any of those variables change.
"""

_ENV = ["JAX_TMA_PYTHON", "CUDACXX", "CUDA_HOME", "CUDA_PATH", "PATH"]

def _run(ctx, args, what):
    result = ctx.execute(args)
    if result.return_code != 0:
        fail("jax_tma: %s failed (%s):\n%s%s" % (what, " ".join(args), result.stdout, result.stderr))
    return result.stdout.strip()

def _python_value(ctx, python, expression, what):
    return _run(ctx, [python, "-c", "print(%s)" % expression], what)

def _local_config_impl(ctx):
    python = ctx.os.environ.get("JAX_TMA_PYTHON", "") or ctx.which("python3")
    if not python:
        fail("jax_tma: no python3 on PATH and JAX_TMA_PYTHON is not set; Bazel needs the " +
             "Python that has jax and nanobind installed")
    # The interpreter itself, not a wrapper (pyenv shims, venv links), for the test target.
    python = _python_value(ctx, str(python), "__import__('sys').executable", "running " + str(python))
    find_nvcc = str(ctx.path(Label("//tools:find_nvcc.py")))
    nvcc = _run(ctx, [python, find_nvcc, "--explain"], "looking for nvcc (tools/find_nvcc.py)")
    cuda_root = _run(ctx, [python, find_nvcc, "--root"], "locating the CUDA toolkit of " + nvcc)
    ffi_include = _python_value(
        ctx,
        python,
        "__import__('jax').ffi.include_dir()",
        "locating the XLA FFI headers (is jax installed for %s?)" % python,
    )
    nanobind_dir = _python_value(
        ctx,
        python,
        "__import__('os').path.dirname(__import__('nanobind').__file__)",
        "locating nanobind (is it installed for %s?)" % python,
    )
    python_include = _python_value(
        ctx,
        python,
        "__import__('sysconfig').get_paths()['include']",
        "locating the Python headers",
    )
    cudart = cuda_root + "/lib64/libcudart_static.a"
    if not ctx.path(cudart).exists:
        fail("jax_tma: %s has no lib64/libcudart_static.a" % cuda_root)

    ctx.symlink(ffi_include, "xla_ffi_include")
    ctx.symlink(nanobind_dir, "nanobind")
    ctx.symlink(python_include, "python_include")
    ctx.symlink(cuda_root + "/include", "cuda_include")
    ctx.symlink(cudart, "cuda_lib/libcudart_static.a")
    ctx.file("defs.bzl", "\n".join([
        '"""Paths found by //third_party:local_config.bzl on this machine."""',
        "NVCC = %r" % nvcc,
        "PYTHON = %r" % python,
        "CUDA_ROOT = %r" % cuda_root,
        "",
    ]))
    ctx.template("BUILD.bazel", Label("//third_party:local_config.BUILD.tpl"), {})

local_config_jax_tma = repository_rule(
    implementation = _local_config_impl,
    environ = _ENV,
    local = True,
)
