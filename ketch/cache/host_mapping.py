"""A pinned host tensor seen from the GPU: a CUDA tensor over the same memory (zero-copy).

The host tier's "kernel" IO backend (layer_loader.py, host_saver.py) has the SMs read and write
the pinned host pool directly, over PCIe (ketch/kernels/page_copy.py). A kernel needs a device
address for that memory, and torch and Triton need a tensor whose device is the GPU:

    pinned CPU tensor ── cuPointerGetAttribute(DEVICE_POINTER) ──▶ device address of the same bytes
                      ── __cuda_array_interface__ + torch.as_tensor(device=cuda) ──▶ CUDA tensor

Why ask the driver rather than reuse `data_ptr()`: under unified virtual addressing (every 64-bit
platform CUDA still supports) memory from cudaHostAlloc (torch's pinned allocator) is mapped into
every device's address space at the host address, so the two are equal there. Memory pinned by
cudaHostRegister (torch's `pinned_use_cuda_host_register` option, or another library's buffer)
is mapped at the host address only where the device reports
`CanUseHostPointerForRegisteredMem`; elsewhere its device address differs. The driver's answer
is right in every case, for an address inside an allocation too (a tensor view, a block of
torch's caching host allocator; cuMemHostGetDevicePointer is specified for the allocation's own
start), and it fails for memory that is not pinned and mapped, where `data_ptr()` would fault
inside a kernel. Triton's launcher asks the same question of every pointer argument. The driver
API (libcuda, always present where CUDA runs) rather than the runtime's
`cudaHostGetDevicePointer`: torch may link its own libcudart
statically or under a versioned name, while libcuda.so.1 is one library per machine.

The CUDA tensor keeps the CPU tensor alive (the interface object holds it, and torch holds the
interface object until the CUDA tensor's storage dies). Ordering between host-side and
device-side accesses is the caller's: nothing here synchronizes.
"""
from __future__ import annotations

import ctypes
import functools

import torch


CU_POINTER_ATTRIBUTE_DEVICE_POINTER = 3  # cuda.h: the address kernels of the current context use


class HostMappingError(RuntimeError):
    """The driver refused to map pinned memory for the device."""


@functools.cache
def _libcuda() -> ctypes.CDLL:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise HostMappingError(f"map_pinned: no CUDA driver library (libcuda.so.1): {e}") from None


def _check(cu: ctypes.CDLL, rc: int, what: str) -> None:
    if rc != 0:
        msg = ctypes.c_char_p()
        cu.cuGetErrorString(rc, ctypes.byref(msg))
        raise HostMappingError(f"map_pinned: {what} failed: CUDA driver error {rc} "
                               f"({(msg.value or b'?').decode()})")


def device_pointer(host_ptr: int, device: torch.device) -> int:
    """The device address of pinned host memory at host_ptr, in `device`'s primary context (the
    one torch's runtime uses), pushed current for the call so any thread may ask."""
    cu = _libcuda()
    dev, ctx, out = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
    _check(cu, cu.cuInit(0), "cuInit")
    _check(cu, cu.cuDeviceGet(ctypes.byref(dev), device.index or 0), "cuDeviceGet")
    _check(cu, cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    try:
        _check(cu, cu.cuCtxPushCurrent_v2(ctx), "cuCtxPushCurrent")
        try:
            rc = cu.cuPointerGetAttribute(ctypes.byref(out), CU_POINTER_ATTRIBUTE_DEVICE_POINTER,
                                          ctypes.c_uint64(host_ptr))
        finally:
            cu.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
        _check(cu, rc, "cuPointerGetAttribute(DEVICE_POINTER) (is the memory pinned and mapped?)")
    finally:
        cu.cuDevicePrimaryCtxRelease_v2(dev)
    return out.value


class _DeviceBytes:
    """`nbytes` bytes at a device address, as __cuda_array_interface__ describes them to torch."""

    def __init__(self, owner: torch.Tensor, ptr: int, nbytes: int) -> None:
        self.owner = owner  # the pinned tensor: alive as long as the CUDA view is
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "strides": None, "version": 3}  # no "stream": no sync on import


def check_pinned(t: torch.Tensor) -> None:
    """ValueError unless `t` can be mapped: a contiguous, non-empty, pinned CPU tensor."""
    if t.device.type != "cpu":
        raise ValueError(f"map_pinned: the tensor must be on the CPU (pinned), got {t.device}")
    if not t.is_contiguous() or t.numel() == 0:
        raise ValueError(f"map_pinned: the tensor must be contiguous and non-empty, got shape {tuple(t.shape)} "
                         f"strides {t.stride()}")
    if not t.is_pinned():
        raise ValueError("map_pinned: the tensor is not pinned (allocate it with pin_memory=True): the GPU "
                         "can only address page-locked host memory")


def map_pinned(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor on `device` (CUDA) over the same bytes as the pinned CPU tensor `t`, same dtype and
    shape: a kernel reading it reads host memory over PCIe, one writing it writes host memory."""
    check_pinned(t)
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"map_pinned: device must be a CUDA device, got {device}")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    nbytes = t.numel() * t.element_size()
    ptr = device_pointer(t.data_ptr(), device)
    raw = torch.as_tensor(_DeviceBytes(t, ptr, nbytes), device=device)
    if raw.data_ptr() != ptr:  # torch copies when the pointer's device is not `device`: no alias then
        raise HostMappingError(f"map_pinned: torch copied the memory instead of aliasing it (pinned for "
                               f"another device than {device}?)")
    return raw.view(t.dtype).view(t.shape)


def map_layers(layers: list[dict[str, torch.Tensor]], device: torch.device) -> list[dict[str, torch.Tensor]]:
    """Every tensor of a pinned pool's layers mapped onto `device` (once, at init: the driver calls
    are not for a step loop)."""
    return [{name: map_pinned(t, device) for name, t in tensors.items()} for tensors in layers]
