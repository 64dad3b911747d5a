"""Is an accelerator of a vendor really here? Each probe asks the vendor's own driver library
(loaded with ctypes, nothing imported) or the device nodes its kernel driver creates, and says
what it found in one phrase. Results are cached per process: devices do not come and go."""
from __future__ import annotations

import ctypes
import functools
import glob
import platform
from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceProbe:
    count: int
    detail: str  # what was found, or why nothing was

    @property
    def present(self) -> bool:
        return self.count > 0


def _load(*names: str):
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


@functools.lru_cache(maxsize=None)
def nvidia_gpus() -> DeviceProbe:
    """CUDA devices through the driver API (libcuda), as CUDA programs see them."""
    cuda = _load("libcuda.so.1", "libcuda.so", "nvcuda.dll")
    if cuda is None:
        return DeviceProbe(0, "no NVIDIA driver (libcuda.so.1 not found)")
    if cuda.cuInit(0) != 0:
        return DeviceProbe(0, "the NVIDIA driver found no usable GPU (cuInit failed)")
    count = ctypes.c_int(0)
    if cuda.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value == 0:
        return DeviceProbe(0, "the NVIDIA driver reports 0 GPUs")
    name = ctypes.create_string_buffer(128)
    cuda.cuDeviceGetName(name, len(name), 0)
    return DeviceProbe(count.value, f"{count.value} NVIDIA GPU(s): {name.value.decode(errors='replace')}")


@functools.lru_cache(maxsize=None)
def amd_gpus() -> DeviceProbe:
    """ROCm devices: the HIP runtime's count, else the KFD driver's device node."""
    hip = _load("libamdhip64.so", "libamdhip64.so.6", "libamdhip64.so.7")
    if hip is not None:
        count = ctypes.c_int(0)
        if hip.hipGetDeviceCount(ctypes.byref(count)) == 0 and count.value > 0:
            return DeviceProbe(count.value, f"{count.value} AMD GPU(s) (HIP)")
        return DeviceProbe(0, "the HIP runtime reports 0 GPUs")
    nodes = glob.glob("/dev/kfd")
    return DeviceProbe(1, "/dev/kfd present (ROCm driver)") if nodes else DeviceProbe(0, "no ROCm driver (/dev/kfd)")


@functools.lru_cache(maxsize=None)
def ascend_npus() -> DeviceProbe:
    """Huawei Ascend NPUs: the davinci device nodes of the Ascend driver."""
    nodes = [n for n in glob.glob("/dev/davinci*") if n[len("/dev/davinci"):].isdigit()]
    return DeviceProbe(len(nodes), f"{len(nodes)} Ascend NPU(s)" if nodes else "no Ascend driver (/dev/davinci*)")


@functools.lru_cache(maxsize=None)
def qualcomm_npus() -> DeviceProbe:
    """Qualcomm Hexagon NPUs: the FastRPC device nodes (Linux/Android), or Windows on Arm."""
    nodes = glob.glob("/dev/fastrpc-*") + glob.glob("/dev/adsprpc-smd")
    if nodes:
        return DeviceProbe(1, f"FastRPC device {nodes[0]}")
    if platform.system() == "Windows" and platform.machine().lower() in ("arm64", "aarch64"):
        return DeviceProbe(1, "Windows on Arm (Snapdragon)")
    return DeviceProbe(0, "no Qualcomm NPU (no FastRPC device, not Windows on Arm)")


def host_cpu() -> DeviceProbe:
    return DeviceProbe(1, f"host CPU ({platform.machine()})")


def windows_gpu() -> DeviceProbe:
    if platform.system() == "Windows":
        return DeviceProbe(1, "Windows (DirectX 12 adapter assumed)")
    return DeviceProbe(0, f"DirectML runs on Windows only, this is {platform.system()}")


def apple_device() -> DeviceProbe:
    if platform.system() == "Darwin":
        return DeviceProbe(1, f"macOS on {platform.machine()}")
    return DeviceProbe(0, f"Core ML runs on Apple platforms only, this is {platform.system()}")


# Device kinds a provider may need, by the name the registry uses.
PROBES = {
    "cpu": host_cpu,
    "nvidia": nvidia_gpus,
    "amd": amd_gpus,
    "ascend": ascend_npus,
    "qualcomm": qualcomm_npus,
    "windows": windows_gpu,
    "apple": apple_device,
}
