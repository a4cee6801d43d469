"""@rules_proto//proto:defs.bzl for Bazel 4 offline: the proto rules built into Bazel."""

load(":builtin.bzl", "builtin_proto_info")

ProtoInfo = builtin_proto_info

def proto_library(**kwargs):
    native.proto_library(**kwargs)

def proto_lang_toolchain(**kwargs):
    native.proto_lang_toolchain(**kwargs)

