"""Prints, as JSON, where the build's Python-side inputs live for the interpreter running it.

Run by the `jaxodc_configure` repository rule (bazel/configure.bzl) and imported by setup.py, so
both builds find the same inputs. CUDA: JAXODC_CUDA=0 disables, =1 requires; candidates are
$CUDA_HOME/bin/nvcc, nvcc on PATH, /usr/local/cuda/bin/nvcc, then the pip wheel's
nvidia/cu13/bin/nvcc; the first one whose root has libcudart_static.a wins. NVSHMEM (the optional
plugin of the nvshmem transport, built only with CUDA): $NVSHMEM_HOME, then the pip wheel
nvidia-nvshmem-cu13 (nvidia/nvshmem); JAXODC_NVSHMEM=0 disables, =1 requires.
"""
import glob
import json
import os
import shutil
import sys
import sysconfig


def fail(msg):
    sys.stderr.write("jaxodc bazel configure: %s (interpreter %s)\n" % (msg, sys.executable))
    sys.exit(1)


def cudart_static(root):
    hits = sorted(glob.glob(os.path.join(root, "lib*", "libcudart_static.a")) +
                  glob.glob(os.path.join(root, "lib*", "*", "libcudart_static.a")))
    return hits[0] if hits else None


def find_cuda():
    mode = os.environ.get("JAXODC_CUDA", "")
    if mode == "0":
        return None
    candidates = []
    if os.environ.get("CUDA_HOME"):
        candidates.append(os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc"))
    if shutil.which("nvcc"):
        candidates.append(shutil.which("nvcc"))
    candidates.append("/usr/local/cuda/bin/nvcc")
    try:
        import nvidia
        for base in nvidia.__path__:
            candidates.append(os.path.join(base, "cu13", "bin", "nvcc"))
    except ImportError:
        pass
    for nvcc in candidates:
        if os.path.isfile(nvcc) and os.access(nvcc, os.X_OK):
            root = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
            lib = cudart_static(root)
            if lib:
                return {"nvcc": os.path.realpath(nvcc), "root": root, "cudart_static": lib,
                        "include": os.path.join(root, "include")}
    if mode == "1":
        fail("JAXODC_CUDA=1 but no nvcc with libcudart_static.a was found")
    return None


# The plugin's sources: built into jaxodc/_nvshmem_plugin.so, never into the main module.
NVSHMEM_PLUGIN_DIR = "csrc/odc/nvshmem"


def find_nvshmem():
    """{"root", "include", "lib_dir", "host_lib"} of an NVSHMEM with the host library, or None."""
    mode = os.environ.get("JAXODC_NVSHMEM", "")
    if mode == "0":
        return None
    roots = [os.environ["NVSHMEM_HOME"]] if os.environ.get("NVSHMEM_HOME") else []
    try:
        import nvidia
        roots += [os.path.join(base, "nvshmem") for base in nvidia.__path__]
    except ImportError:
        pass
    for root in roots:
        include = os.path.join(root, "include")
        libs = sorted(glob.glob(os.path.join(root, "lib", "libnvshmem_host.so*")))
        if os.path.isfile(os.path.join(include, "nvshmem_host.h")) and libs:
            root = os.path.realpath(root)
            host_lib = os.path.join(root, "lib", os.path.basename(libs[-1]))
            return {"root": root, "include": os.path.join(root, "include"), "lib_dir": os.path.join(root, "lib"),
                    "host_lib": host_lib}
    if mode == "1":
        fail("JAXODC_NVSHMEM=1 but no NVSHMEM (nvshmem_host.h and libnvshmem_host.so*) was found")
    return None


def build_inputs():
    """Everything but CUDA: the dict main() prints (fails with a message when something is missing)."""
    try:
        import nanobind
    except ImportError:
        fail("nanobind is not installed")
    try:
        import jax.ffi
    except ImportError:
        fail("jax is not installed")
    py_include = sysconfig.get_paths()["include"]
    if not os.path.isfile(os.path.join(py_include, "Python.h")):
        fail("Python.h not found in %s (install the Python development headers)" % py_include)
    nb_src = nanobind.source_dir()
    info = {
        "python": sys.executable,
        "version": "%d.%d" % sys.version_info[:2],
        "python_include": py_include,
        "nanobind_root": os.path.dirname(nb_src),
        "nanobind_include": nanobind.include_dir(),
        "nb_combined": os.path.join(nb_src, "nb_combined.cpp"),
        "robin_map_include": os.path.join(os.path.dirname(nb_src), "ext", "robin_map", "include"),
        "ffi_include": jax.ffi.include_dir(),
        "ext_suffix": sysconfig.get_config_var("EXT_SUFFIX"),
        "cuda_archs": os.environ.get("JAXODC_CUDA_ARCHS", "80;90"),
    }
    for key in ("nanobind_include", "nb_combined", "robin_map_include", "ffi_include"):
        if not os.path.exists(info[key]):
            fail("%s not found at %s" % (key, info[key]))
    return info


def main():
    cuda = find_cuda()
    print(json.dumps(dict(build_inputs(), cuda=cuda, nvshmem=find_nvshmem() if cuda else None)))


if __name__ == "__main__":
    main()
