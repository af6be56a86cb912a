"""`csrc_library`: the cc_library of one subsystem of csrc/ (see BUILD)."""

load("@jaxodc_deps//:config.bzl", "WITH_CUDA")
load("//bazel:cuda.bzl", "cuda_objects")

COPTS = [
    "-Icsrc",
    "-O3",
    "-fvisibility=hidden",
    "-Wall",
    "-Wno-unused-function",
    "-fno-strict-aliasing",
]

CUDA_DEFINES = ["JAXODC_WITH_CUDA=1"] if WITH_CUDA else []

# csrc/odc/nvshmem/ is the separate nvshmem plugin, never part of _C.so.
NVSHMEM_PLUGIN_SRCS = ["csrc/odc/nvshmem/**"]

def csrc_hdrs(subsystem):
    return native.glob(["csrc/%s/**/*.h" % subsystem], exclude = NVSHMEM_PLUGIN_SRCS)

def csrc_library(name, deps = [], hdrs = [], cuda_hdrs = [], textual_hdrs = []):
    """csrc/<name>: its .cc files, and its .cu files compiled by nvcc into objects of its own.

    hdrs: headers besides csrc/<name>/**/*.h; cuda_hdrs: the headers of other subsystems its .cu
    files include (nvcc runs as a genrule, outside bazel's header tracking).
    """
    own_hdrs = csrc_hdrs(name) + hdrs
    cuda = cuda_objects(
        name = name + "_cuda",
        srcs = native.glob(["csrc/%s/*.cu" % name]),
        hdrs = own_hdrs + cuda_hdrs,
    )
    native.cc_library(
        name = name,
        srcs = native.glob(["csrc/%s/**/*.cc" % name], exclude = NVSHMEM_PLUGIN_SRCS) + cuda,
        hdrs = own_hdrs,
        textual_hdrs = textual_hdrs,
        copts = COPTS,
        local_defines = CUDA_DEFINES,
        deps = deps + (["@jaxodc_deps//:cudart_static"] if cuda else []),
        # Every object goes into _C.so, as setup.py links them: handlers are reached only through
        # the registrations() dict. No shared library of its own: Python's and nanobind's symbols
        # resolve only in _C.so.
        alwayslink = 1,
        linkstatic = 1,
    )
