"""Build of the dspark package and its compiled kernels in cython_ext/."""
from pathlib import Path

import numpy
from Cython.Build import cythonize
from setuptools import Extension, find_packages, setup

HERE = Path(__file__).parent


def cython_extension(name: str, sources: list[str], **kwargs) -> Extension:
    """`dspark._ext.<name>` from cython_ext/ sources (paths relative to cython_ext/)."""
    return Extension(
        f"dspark._ext.{name}",
        [f"cython_ext/{source}" for source in sources],
        include_dirs=["cython_ext", numpy.get_include(), *kwargs.pop("include_dirs", [])],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION"), *kwargs.pop("define_macros", [])],
        **kwargs,
    )


EXTENSIONS = [
    cython_extension("cpu_features", ["cpu_features.pyx"]),
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
    ext_modules=cythonize(
        EXTENSIONS,
        build_dir="build/cython",
        compiler_directives={"language_level": "3", "boundscheck": False, "wraparound": False},
    ),
    install_requires=[
        "numpy>=1.24,<2",
        "onnxruntime>=1.18",
        "onnx>=1.16",
        "tritonclient[http,grpc]>=2.51",
        "protobuf>=4.24",
        "click>=8.1",
        "PyYAML>=6.0",
        "pydantic>=2.5",
    ],
    extras_require={
        "server": ["nvidia-pytriton==0.7.0"],
        "train": ["torch"],
    },
    entry_points={"console_scripts": ["dspark=dspark.cli.main:main"]},
)
