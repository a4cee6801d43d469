"""@rules_cc//cc:defs.bzl for Bazel 4 offline: the C++ rules built into Bazel."""

def cc_binary(**kwargs):
    native.cc_binary(**kwargs)

def cc_library(**kwargs):
    native.cc_library(**kwargs)

def cc_test(**kwargs):
    native.cc_test(**kwargs)

def cc_toolchain(**kwargs):
    native.cc_toolchain(**kwargs)

def cc_toolchain_suite(**kwargs):
    native.cc_toolchain_suite(**kwargs)

def cc_proto_library(**kwargs):
    native.cc_proto_library(**kwargs)

def objc_library(**kwargs):
    native.objc_library(**kwargs)

