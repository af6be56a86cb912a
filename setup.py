"""Builds the `jaxodc._C` extension with the host compiler and nanobind (no bazel).

Every `.cc` under csrc/ goes into one module; every `.cu` is compiled by nvcc when one is found
(PATH, $CUDA_HOME, or the pip wheel nvidia-cuda-nvcc) and linked with the static CUDA runtime, so the
module still imports on machines without a GPU. JAXODC_CUDA=0 disables, =1 requires CUDA.
"""
import glob
import os
import shutil
import subprocess
import sys
import sysconfig

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
CUDA_ARCHS = os.environ.get("JAXODC_CUDA_ARCHS", "80;90")


def _nanobind_paths():
    import nanobind
    src = nanobind.source_dir()
    return nanobind.include_dir(), os.path.join(src, "nb_combined.cpp"), os.path.join(
        os.path.dirname(src), "ext", "robin_map", "include")


def _ffi_include():
    import jax.ffi
    return jax.ffi.include_dir()


def find_cuda():
    """Returns (nvcc, cuda_root) or (None, None)."""
    if os.environ.get("JAXODC_CUDA") == "0":
        return None, None
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
            if glob.glob(os.path.join(root, "lib*", "libcudart_static.a")) or glob.glob(
                    os.path.join(root, "lib*", "*", "libcudart_static.a")):
                return nvcc, root
    if os.environ.get("JAXODC_CUDA") == "1":
        raise RuntimeError("JAXODC_CUDA=1 but no nvcc with libcudart_static.a was found")
    return None, None


def _cudart_static(root):
    hits = glob.glob(os.path.join(root, "lib*", "libcudart_static.a")) + glob.glob(
        os.path.join(root, "lib*", "*", "libcudart_static.a"))
    return hits[0]


class BuildExt(build_ext):
    def copy_file(self, src, dst, *args, **kwargs):
        """In-place builds replace the extension by rename: rewriting the file that running
        processes have mapped would crash them."""
        if not dst.endswith((".so", ".pyd")):
            return super().copy_file(src, dst, *args, **kwargs)
        tmp = f"{dst}.tmp{os.getpid()}"
        shutil.copyfile(src, tmp)
        shutil.copymode(src, tmp)
        os.replace(tmp, dst)
        return dst, True

    def build_extensions(self):
        nvcc, cuda_root = find_cuda()
        ext = self.extensions[0]
        if nvcc:
            objects = []
            build_dir = os.path.join(self.build_temp, "cuda")
            os.makedirs(build_dir, exist_ok=True)
            gencode = []
            for arch in CUDA_ARCHS.split(";"):
                gencode += [f"-gencode=arch=compute_{arch},code=sm_{arch}"]
            last = CUDA_ARCHS.split(";")[-1]
            gencode += [f"-gencode=arch=compute_{last},code=compute_{last}"]
            for cu in sorted(glob.glob(os.path.join(ROOT, "csrc", "**", "*.cu"), recursive=True)):
                obj = os.path.join(build_dir, os.path.relpath(cu, ROOT).replace(os.sep, "_") + ".o")
                cmd = [nvcc, "-c", cu, "-o", obj, "-std=c++17", "-O3", "-Xcompiler", "-fPIC",
                       "-DJAXODC_WITH_CUDA=1", "-I" + os.path.join(ROOT, "csrc"),
                       "-isystem", _ffi_include(), "-I" + os.path.join(cuda_root, "include")] + gencode
                print(" ".join(cmd), flush=True)
                subprocess.check_call(cmd)
                objects.append(obj)
            ext.extra_objects += objects + [_cudart_static(cuda_root)]
            ext.define_macros.append(("JAXODC_WITH_CUDA", "1"))
            ext.include_dirs.append(os.path.join(cuda_root, "include"))
            ext.extra_link_args += ["-ldl", "-lrt", "-lpthread"]
        else:
            print("jaxodc: nvcc not found, building without CUDA", flush=True)
        super().build_extensions()


def make_extension():
    nb_include, nb_combined, robin_map = _nanobind_paths()
    sources = sorted(glob.glob(os.path.join("csrc", "**", "*.cc"), recursive=True))
    return Extension(
        "jaxodc._C",
        sources=sources + [os.path.relpath(nb_combined, ROOT) if nb_combined.startswith(ROOT) else nb_combined],
        include_dirs=["csrc", nb_include, robin_map, sysconfig.get_paths()["include"]],
        define_macros=[("NB_COMPACT_ASSERTIONS", None)],
        extra_compile_args=["-std=c++17", "-O3", "-isystem", _ffi_include(), "-fvisibility=hidden", "-Wall", "-Wno-unused-function",
                            "-fno-strict-aliasing"],
        extra_link_args=["-lpthread", "-lrt"],
        language="c++",
    )


setup(ext_modules=[make_extension()], cmdclass={"build_ext": BuildExt})
