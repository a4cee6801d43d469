"""Bazel 4's built-in ProtoInfo, under another name so defs.bzl can export it as ProtoInfo."""

builtin_proto_info = ProtoInfo
