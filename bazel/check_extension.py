"""Checks the bazel-built `_C.so`: usage check_extension.py PATH_TO__C.so EXPECT_CUDA(0|1) [PLUGIN].

Assembles a throwaway `jaxodc` package (the Python sources from runfiles plus the bazel-built
module), imports it with the configured interpreter, and checks what the Python side relies on:
`registrations()` is {name: {platform: capsule}} with non-null handler capsules, `with_cuda` says
whether the CUDA objects were linked, and jaxodc._native registers every target with JAX. With
PLUGIN (the bazel-built nvshmem plugin), the runtime must dlopen it (no GPU needed) and see NVSHMEM 3.
"""
import ctypes
import os
import shutil
import sys
import tempfile


def fail(msg):
    sys.stderr.write("FAIL: %s\n" % msg)
    sys.exit(1)


def capsule_pointer(capsule):
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype = ctypes.c_void_p
    get.argtypes = [ctypes.py_object, ctypes.c_char_p]
    name = ctypes.pythonapi.PyCapsule_GetName
    name.restype = ctypes.c_char_p
    name.argtypes = [ctypes.py_object]
    return get(capsule, name(capsule))


def main(so_path, expect_cuda, plugin=None):
    if not os.path.isfile(so_path):
        fail("no module at %s" % so_path)
    root = tempfile.mkdtemp(prefix="jaxodc_bazel_", dir=os.environ.get("TEST_TMPDIR"))
    try:
        shutil.copytree("jaxodc", os.path.join(root, "jaxodc"),
                        ignore=shutil.ignore_patterns("*.so", "__pycache__"))
        shutil.copy(so_path, os.path.join(root, "jaxodc", "_C.so"))
        sys.path.insert(0, root)
        from jaxodc import _C
        if os.path.dirname(os.path.realpath(_C.__file__)) != os.path.realpath(os.path.join(root, "jaxodc")):
            fail("imported %s instead of the bazel-built module" % _C.__file__)

        if bool(_C.with_cuda) != expect_cuda:
            fail("with_cuda is %r but the build %s nvcc" % (_C.with_cuda, "found" if expect_cuda else "did not find"))

        regs = _C.registrations()
        if not isinstance(regs, dict):
            fail("registrations() returned %s, not dict" % type(regs).__name__)
        for name, per_platform in regs.items():
            if not isinstance(name, str) or not isinstance(per_platform, dict) or not per_platform:
                fail("registrations()[%r] = %r is not a non-empty {platform: capsule} dict" % (name, per_platform))
            for platform, capsule in per_platform.items():
                if platform not in ("cpu", "CUDA"):
                    fail("target %s has unknown platform %r" % (name, platform))
                if platform == "CUDA" and not _C.with_cuda:
                    fail("target %s has a CUDA handler in a build without CUDA" % name)
                if type(capsule).__name__ != "PyCapsule":
                    fail("target %s/%s is %s, not a capsule" % (name, platform, type(capsule).__name__))
                if not capsule_pointer(capsule):
                    fail("target %s/%s has a null handler" % (name, platform))

        from jaxodc import _native
        registered = _native.register_targets()
        if registered != tuple(sorted(regs)):
            fail("register_targets() gave %r, registrations() has %r" % (registered, sorted(regs)))
        if plugin:
            status = _C.odc_nvshmem_load(os.path.realpath(plugin))
            if status or not _C.odc_nvshmem_version().startswith("NVSHMEM 3."):
                fail("the nvshmem plugin %s does not load: %r (version %r)" % (plugin, status,
                                                                                _C.odc_nvshmem_version()))
        print("ok: %s, %d targets (%s), with_cuda=%s, nvshmem plugin: %s" % (
            so_path, len(regs), ", ".join(sorted(regs)) or "none", _C.with_cuda, _C.odc_nvshmem_version() or "none"))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4) or sys.argv[2] not in ("0", "1"):
        fail("usage: check_extension.py PATH_TO__C.so 0|1 [PATH_TO__nvshmem_plugin.so]")
    main(sys.argv[1], sys.argv[2] == "1", sys.argv[3] if len(sys.argv) == 4 else None)
