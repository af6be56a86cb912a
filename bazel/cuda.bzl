"""nvcc compilation of every .cu under csrc/, mirroring setup.py's BuildExt.

One genrule per .cu (so a change to one file recompiles only it) producing a position-independent
object that cc_library links like any other. nvcc and the include dirs are absolute paths found by
//bazel:configure.bzl; genrules are not subject to bazel's header-inclusion check.
"""

load("@jaxodc_deps//:config.bzl", "CUDA_ARCHS", "CUDA_INCLUDE", "FFI_INCLUDE", "NVCC", "WITH_CUDA")

def _gencode():
    flags = ["-gencode=arch=compute_%s,code=sm_%s" % (a, a) for a in CUDA_ARCHS]
    last = CUDA_ARCHS[-1]
    flags.append("-gencode=arch=compute_%s,code=compute_%s" % (last, last))
    return flags

def cuda_objects(name, srcs, hdrs, extra_flags = []):
    """Compiles each of `srcs` (.cu) with nvcc (plus `extra_flags`); returns the list of object
    labels (empty without CUDA)."""
    if not WITH_CUDA or not srcs:
        return []
    flags = ["-std=c++17", "-O3", "-Xcompiler", "-fPIC", "-DJAXODC_WITH_CUDA=1", "-Icsrc",
             "-isystem", FFI_INCLUDE, "-I" + CUDA_INCLUDE] + extra_flags + _gencode()
    objs = []
    for src in srcs:
        out = "_cuda_objs/" + src[:-len(".cu")] + ".pic.o"
        rule = "%s_%s" % (name, src.replace("/", "_").replace(".", "_"))
        native.genrule(
            name = rule,
            srcs = [src] + hdrs,
            outs = [out],
            cmd = "'%s' -c $(location %s) -o $@ %s" % (NVCC, src, " ".join(flags)),
            message = "nvcc " + src,
        )
        objs.append(out)
    return objs
