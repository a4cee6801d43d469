# BUILD file of @local_config_jax_tma (written by //third_party:local_config.bzl): this
# machine's XLA FFI headers, nanobind, Python headers and CUDA runtime as libraries.
package(default_visibility = ["//visibility:public"])

exports_files(["defs.bzl"])

cc_library(
    name = "xla_ffi_headers",
    hdrs = glob(["xla_ffi_include/xla/ffi/api/*.h"]),
    includes = ["xla_ffi_include"],
)

cc_library(
    name = "python_headers",
    hdrs = glob(["python_include/**/*.h"]),
    includes = ["python_include"],
)

cc_library(
    name = "cuda_headers",
    hdrs = glob(["cuda_include/**"]),
    includes = ["cuda_include"],
)

# The static CUDA runtime, as CMake's CUDA::cudart_static links it.
cc_library(
    name = "cudart_static",
    srcs = ["cuda_lib/libcudart_static.a"],
    linkopts = ["-ldl", "-lpthread", "-lrt"],
    deps = [":cuda_headers"],
)

# nanobind's library from its one-file source, with the flags of its CMake build (Release).
cc_library(
    name = "nanobind",
    srcs = ["nanobind/src/nb_combined.cpp"],
    hdrs = glob([
        "nanobind/include/**/*.h",
        "nanobind/ext/robin_map/include/**/*.h",
    ]),
    copts = [
        "-std=c++17",
        "-O3",
        "-DNDEBUG",
        "-DNB_COMPACT_ASSERTIONS",
        "-fvisibility=hidden",
        "-fno-strict-aliasing",
        "-ffunction-sections",
        "-fdata-sections",
    ],
    includes = [
        "nanobind/ext/robin_map/include",
        "nanobind/include",
    ],
    textual_hdrs = glob(
        [
            "nanobind/src/*.h",
            "nanobind/src/*.cpp",
        ],
        exclude = ["nanobind/src/nb_combined.cpp"],
    ),
    deps = [":python_headers"],
)
