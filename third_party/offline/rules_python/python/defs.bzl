"""@rules_python//python:defs.bzl for Bazel 4 offline: py_runtime_pair from @bazel_tools."""

load("@bazel_tools//tools/python:toolchain.bzl", _py_runtime_pair = "py_runtime_pair")

py_runtime_pair = _py_runtime_pair
