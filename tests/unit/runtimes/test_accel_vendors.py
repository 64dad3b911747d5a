"""The GemmEx vendor names are written once (dspark.runtimes.accel.vendors): the C shim declares
and defines the same list, and the config parameters' choices are derived from it."""
from __future__ import annotations

import re
import typing

from dspark.paths import project_root
from dspark.runtimes.accel import gemm
from dspark.runtimes.accel.vendors import DEVICES, VENDORS
from dspark.triton.params import FusedTransformerParameters

SHIM = project_root() / "cython_ext" / "gemm_shim"


def test_the_c_shim_declares_and_defines_the_python_vendor_list_in_its_order():
    declared = re.findall(r"^HCBLAS_DECLARE_VENDOR\((\w+),", (SHIM / "hcblas.h").read_text(), re.MULTILINE)
    defined = re.findall(r"^DEFINE_VENDOR\((\w+)\)", (SHIM / "hcblas.c").read_text(), re.MULTILINE)
    assert tuple(declared) == VENDORS
    assert tuple(defined) == VENDORS


def test_the_parameters_and_the_binding_use_the_one_list():
    fields = FusedTransformerParameters.model_fields
    assert typing.get_args(fields["gemm_vendor"].annotation) == VENDORS
    assert typing.get_args(fields["gemm_device"].annotation) == DEVICES
    assert gemm.VENDORS is VENDORS and gemm.DEVICES is DEVICES
