"""Builds the `jaxodc._C` extension with the host compiler and nanobind (no bazel).

Every `.cc` under csrc/ goes into one module; every `.cu` is compiled by nvcc when one is found
(PATH, $CUDA_HOME, or the pip wheel nvidia-cuda-nvcc) and linked with the static CUDA runtime, so the
module still imports on machines without a GPU. JAXODC_CUDA=0 disables, =1 requires CUDA.
JAXODC_SANITIZE=1 builds the host code with AddressSanitizer and UndefinedBehaviorSanitizer (load it with
libasan preloaded; scripts/sanitize.sh builds such a copy aside and runs the listener fuzzer under it).
With CUDA and NVSHMEM (the nvidia-nvshmem-cu13 wheel), csrc/odc/nvshmem/ becomes the separate plugin
jaxodc/_nvshmem_plugin.so, which the runtime dlopen()s only for the nvshmem transport.
"""
import concurrent.futures
import glob
import os
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(ROOT, "bazel"))
import discover  # noqa: E402  (shared with the bazel build: one discovery of nanobind, jax FFI, nvcc)

INPUTS = discover.build_inputs()


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

    plugin = None  # the nvshmem plugin built by this command, if any

    def run(self):
        super().run()
        if self.inplace and self.plugin:  # setuptools copies only the extensions into the checkout
            self.copy_file(self.plugin, os.path.join(ROOT, "jaxodc", os.path.basename(self.plugin)))

    def build_extensions(self):
        cuda = discover.find_cuda()
        ext = self.extensions[0]
        # nanobind's own source joins here, not in setup()'s sources: those go into the egg-info
        # manifest, which setuptools refuses to hold an absolute path (a venv outside the tree).
        if INPUTS["nb_combined"] not in ext.sources:
            ext.sources.append(INPUTS["nb_combined"])
        if cuda:
            nvcc = cuda["nvcc"]
            objects = []
            build_dir = os.path.join(self.build_temp, "cuda")
            os.makedirs(build_dir, exist_ok=True)
            gencode = []
            for arch in INPUTS["cuda_archs"].split(";"):
                gencode += [f"-gencode=arch=compute_{arch},code=sm_{arch}"]
            last = INPUTS["cuda_archs"].split(";")[-1]
            gencode += [f"-gencode=arch=compute_{last},code=compute_{last}"]
            def compile_cu(cu, extra=()):
                obj = os.path.join(build_dir, os.path.relpath(cu, ROOT).replace(os.sep, "_") + ".o")
                cmd = [nvcc, "-c", cu, "-o", obj, "-std=c++17", "-O3", "-Xcompiler", "-fPIC",
                       "-DJAXODC_WITH_CUDA=1", "-I" + os.path.join(ROOT, "csrc"),
                       "-isystem", INPUTS["ffi_include"], "-I" + cuda["include"]] + list(extra) + gencode
                print(" ".join(cmd), flush=True)
                subprocess.check_call(cmd)
                return obj

            # nvcc runs one process per file: in parallel (-j), they dominate a CUDA build otherwise.
            with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, self.parallel or 1)) as pool:
                objects += list(pool.map(compile_cu, module_sources("*.cu")))
            ext.extra_objects += objects + [cuda["cudart_static"]]
            ext.define_macros.append(("JAXODC_WITH_CUDA", "1"))
            ext.include_dirs.append(cuda["include"])
            ext.extra_link_args += ["-ldl", "-lrt", "-lpthread"]
        else:
            print("jaxodc: nvcc not found, building without CUDA", flush=True)
        super().build_extensions()
        nvshmem = discover.find_nvshmem() if cuda else None
        if nvshmem:
            self.build_nvshmem_plugin(cuda, nvshmem, compile_cu)
        elif cuda:
            print("jaxodc: NVSHMEM (nvidia-nvshmem-cu13) not found, building without the nvshmem plugin", flush=True)

    def build_nvshmem_plugin(self, cuda, nvshmem, compile_cu):
        objs = [compile_cu(cu, ["-I" + nvshmem["include"], "-Xcompiler", "-fvisibility=hidden"])
                for cu in sorted(glob.glob(os.path.join(ROOT, discover.NVSHMEM_PLUGIN_DIR, "*.cu")))]
        dest = os.path.join(os.path.dirname(self.get_ext_fullpath("jaxodc._C")), "_nvshmem_plugin.so")
        tmp = f"{dest}.tmp{os.getpid()}"
        # rpath: the wheel next to an installed jaxodc, then the one found at build time.
        cmd = list(self.compiler.compiler_cxx) + ["-shared", "-o", tmp] + objs + [
            cuda["cudart_static"], nvshmem["host_lib"], "-Wl,-rpath,$ORIGIN/../nvidia/nvshmem/lib",
            "-Wl,-rpath," + nvshmem["lib_dir"], "-ldl", "-lrt", "-lpthread"]
        print(" ".join(cmd), flush=True)
        subprocess.check_call(cmd)
        os.replace(tmp, dest)  # by rename, like the module: running processes may have it mapped
        self.plugin = dest


def module_sources(pattern):
    """Sources of jaxodc._C: every `pattern` under csrc/ except the nvshmem plugin's."""
    plugin = os.path.join(ROOT, discover.NVSHMEM_PLUGIN_DIR) + os.sep
    return [p for p in sorted(glob.glob(os.path.join(ROOT, "csrc", "**", pattern), recursive=True))
            if not p.startswith(plugin)]


def sanitizer_flags():
    """-fsanitize=address,undefined (and what makes its reports readable) under JAXODC_SANITIZE=1."""
    if os.environ.get("JAXODC_SANITIZE", "0") in ("", "0"):
        return [], []
    flags = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer", "-g"]
    return flags + ["-O1"], flags


def make_extension():
    nb_include, robin_map = (INPUTS[k] for k in ("nanobind_include", "robin_map_include"))
    sources = [os.path.relpath(p, ROOT) for p in module_sources("*.cc")]
    san_compile, san_link = sanitizer_flags()
    return Extension(
        "jaxodc._C",
        sources=sources,  # + nanobind's nb_combined.cpp, added by BuildExt
        include_dirs=["csrc", nb_include, robin_map, INPUTS["python_include"]],
        define_macros=[("NB_COMPACT_ASSERTIONS", None)],
        extra_compile_args=["-std=c++17", "-O3", "-isystem", INPUTS["ffi_include"], "-fvisibility=hidden", "-Wall", "-Wno-unused-function",
                            "-fno-strict-aliasing"] + san_compile,
        extra_link_args=["-lpthread", "-lrt"] + san_link,
        language="c++",
    )


setup(ext_modules=[make_extension()], cmdclass={"build_ext": BuildExt})
