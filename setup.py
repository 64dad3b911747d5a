"""Build of the dspark package and its compiled kernels in cython_ext/: one folder per kernel
family (fused, llama, gemm_shim, pool, guard, probes), and common/ for what they share (CPU
features, the ISA dispatcher, the USDT probe macros)."""
import os
import platform
from pathlib import Path

import numpy
import scipy_openblas32
from Cython.Build import cythonize
from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).parent
# what dspark needs to serve and roll out, listed once (the image installs the same file);
# tritonserver's wheel is the "server" extra, for a machine that runs Triton otherwise
RUNTIME = [line.split("#", 1)[0].strip() for line in (HERE / "requirements-runtime.txt").read_text().splitlines()
           if line.split("#", 1)[0].strip()]
SERVER = "nvidia-pytriton"
# DSPARK_SANITIZE=1: build with AddressSanitizer + UndefinedBehaviorSanitizer (`make sanitize`,
# into its own build folder; the package's own build is never sanitized).
SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer", "-g"] \
    if os.environ.get("DSPARK_SANITIZE") == "1" else []


# Every C unit and header: an extension is relinked when any of them changes (a per-ISA unit
# reaches it through a static library, which build_ext does not look at).
C_DEPENDS = sorted(str(p) for pattern in ("*.c", "*.h", "*.inc") for p in Path("cython_ext").rglob(pattern))
COMMON = "cython_ext/common"


def family_includes(family: str) -> list[str]:
    """A family's headers and the shared ones (cpu_features.h, isa_dispatch.h)."""
    return list(dict.fromkeys([f"cython_ext/{family}", COMMON]))


def cython_extension(name: str, sources: list[str], **kwargs) -> Extension:
    """`dspark._ext.<name>` from cython_ext/ sources (paths relative to cython_ext/); the first
    source's folder is its family's."""
    return Extension(
        f"dspark._ext.{name}",
        [f"cython_ext/{source}" for source in sources],
        depends=C_DEPENDS,
        include_dirs=[*family_includes(Path(sources[0]).parent.name), numpy.get_include(),
                      *kwargs.pop("include_dirs", [])],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION"), *kwargs.pop("define_macros", [])],
        extra_compile_args=[*kwargs.pop("extra_compile_args", []), *SANITIZE],
        extra_link_args=[*kwargs.pop("extra_link_args", []), *SANITIZE],
        **kwargs,
    )


# The fused kernel's elementwise part, one translation unit per instruction set, each built as a
# static library with its own flags (build_clib) and linked into dspark._ext.fused; the run-time
# choice is the common dispatcher's (cython_ext/common/isa_dispatch.c; the family's rules:
# cython_ext/fused/simd_dispatch.c). Non-x86 machines get the scalar one only.
SIMD_FLAGS = {
    "scalar": ["-O2", "-fno-tree-vectorize"],
    "avx2": ["-O3", "-mavx2", "-mfma"],
    "avx512": ["-O3", "-mavx512f", "-mfma"],
}
X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")
SIMD_LIBRARIES = [
    (f"dspark_simd_{isa}", {"sources": [f"cython_ext/fused/simd_{isa}.c"], "include_dirs": family_includes("fused"),
                            "cflags": ["-fPIC", "-fvisibility=hidden", *flags, *SANITIZE]})
    for isa, flags in SIMD_FLAGS.items() if X86 or isa == "scalar"
]
# The llama decoder's kernels (docs/llm_kernels.md), the same scheme: one translation unit per
# instruction set, linked into dspark._ext.llama, chosen at run time by the same dispatcher (the
# family's rules: cython_ext/llama/llama_dispatch.c).
# -ffp-contract=off everywhere: every fused multiply-add is written out, so all paths and all
# row counts round alike.
LLAMA_FLAGS = {
    "scalar": ["-O2", "-fno-tree-vectorize"],
    "avx2": ["-O3", "-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mfma", "-mf16c"],
}
LLAMA_LIBRARIES = [
    (f"dspark_llama_{isa}", {"sources": [f"cython_ext/llama/llama_{isa}.c"], "include_dirs": family_includes("llama"),
                             "cflags": ["-fPIC", "-fvisibility=hidden", "-ffp-contract=off", *flags, *SANITIZE]})
    for isa, flags in LLAMA_FLAGS.items() if X86 or isa == "scalar"
]
# The GEMM: OpenBLAS from the scipy-openblas32 wheel (headers + .so), found at run time via rpath:
# the build environment's copy (an editable install), else the one installed beside dspark (a
# wheel, built in an environment that is gone by then).
OPENBLAS_RPATH = [scipy_openblas32.get_lib_dir(), "$ORIGIN/../../scipy_openblas32/lib"]
OPENBLAS = dict(
    include_dirs=[scipy_openblas32.get_include_dir()],
    library_dirs=[scipy_openblas32.get_lib_dir()],
    runtime_library_dirs=OPENBLAS_RPATH,
)

# The GemmEx shim (docs/accelerators.md): its bf16/int8 kernels, one translation unit per
# instruction set with its own flags, linked with cython_ext/gemm_shim/hcblas.c into a plain C shared
# library, dspark/_ext/libhcblas.so (C programs link it; dspark.runtimes.accel.gemm loads it with ctypes).
HCBLAS_FLAGS = {
    "avx512bf16": ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni", "-mfma"],
    "amx": ["-O3", "-mavx512f", "-mavx512bw", "-mamx-tile", "-mamx-bf16", "-mamx-int8"],
}
HCBLAS_LIBRARIES = [
    (f"dspark_hcblas_{isa}", {"sources": [f"cython_ext/gemm_shim/hcblas_{isa}.c"],
                              "include_dirs": family_includes("gemm_shim"),
                              "cflags": ["-fPIC", "-fvisibility=hidden", *flags]})
    for isa, flags in HCBLAS_FLAGS.items() if X86
]


class BuildExtAndSharedLibrary(build_ext):
    """build_ext, then libhcblas.so and libserverguard.so next to the extensions (in place for
    editable installs)."""

    def run(self) -> None:
        super().run()
        objects = self.compiler.compile(
            ["cython_ext/gemm_shim/hcblas.c", f"{COMMON}/isa_dispatch.c"], output_dir=self.build_temp,
            extra_postargs=["-O3", "-fPIC"],
            include_dirs=[*family_includes("gemm_shim"), scipy_openblas32.get_include_dir()])
        target = Path(self.get_ext_fullpath("dspark._ext.fused")).parent / "libhcblas.so"
        self.compiler.link_shared_object(
            objects, str(target),
            libraries=[name for name, _ in HCBLAS_LIBRARIES] + [scipy_openblas32.get_library(), "m", "pthread"],
            library_dirs=[self.get_finalized_command("build_clib").build_clib, scipy_openblas32.get_lib_dir()],
            runtime_library_dirs=OPENBLAS_RPATH)
        # Preloaded into tritonserver: the API key from a pipe, owner-only /dev/shm regions
        # (cython_ext/guard/server_guard.c, dspark/server/launcher.py).
        objects = self.compiler.compile(["cython_ext/guard/server_guard.c"], output_dir=self.build_temp,
                                        extra_postargs=["-O2", "-fPIC", "-Wall"])
        self.compiler.link_shared_object(objects, str(target.parent / "libserverguard.so"), libraries=["dl"])


EXTENSIONS = [
    cython_extension("cpu_features", ["common/cpu_features.pyx"]),
    cython_extension("fused", ["fused/fused.pyx", "fused/simd_dispatch.c", "fused/fused_layer.c",
                               "common/isa_dispatch.c"],
                     libraries=[name for name, _ in SIMD_LIBRARIES] + [scipy_openblas32.get_library()],
                     extra_compile_args=["-O3"], **OPENBLAS),
    cython_extension("pool", ["pool/pool.pyx", "pool/bfc_pool.c"], extra_compile_args=["-O3"]),
    # USDT probes of the decode loop and serving (cython_ext/common/dspark_probes.h, docs/trace.md)
    cython_extension("probes", ["probes/probes.pyx"], extra_compile_args=["-O2"]),
    cython_extension("llama", ["llama/llama.pyx", "llama/llama_forward.c", "llama/llama_dispatch.c",
                               "common/isa_dispatch.c"],
                     libraries=[name for name, _ in LLAMA_LIBRARIES],
                     extra_compile_args=["-O3", "-ffp-contract=off", "-pthread"],
                     extra_link_args=["-pthread"]),
]

setup(
    name="dspark",
    version="0.1.0",
    description="Triton Inference Server plugins: ONNX, speculative decoding, fused CPU kernels, QoS routing",
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.9",
    packages=find_packages(include=["dspark", "dspark.*"]),
    libraries=SIMD_LIBRARIES + HCBLAS_LIBRARIES + LLAMA_LIBRARIES,
    cmdclass={"build_ext": BuildExtAndSharedLibrary},
    ext_modules=cythonize(
        EXTENSIONS,
        build_dir="build/cython",
        include_path=[COMMON],  # isa_dispatch.pxi
        compiler_directives={"language_level": "3", "boundscheck": False, "wraparound": False},
    ),
    install_requires=[r for r in RUNTIME if not r.startswith(SERVER)],
    extras_require={
        "server": [r for r in RUNTIME if r.startswith(SERVER)],
        "train": ["torch"],
    },
    entry_points={"console_scripts": ["dspark=dspark.cli.main:main"]},
)
