"""CUDA IPC from Python: device memory that the other processes of a node can map, through the CUDA runtime
that torch loaded.

torch shares CUDA tensors between processes through its caching allocator and
reference-count files in ``/dev/shm`` (``torch.multiprocessing``), which a killed
rank leaves behind. The node transport needs less: one allocation per rank, made
once, mapped once by each peer. So it calls the runtime directly (as vLLM's
custom all-reduce does): ``cudaMalloc``, ``cudaIpcGetMemHandle`` and
``cudaIpcOpenMemHandle``. Nothing is written to the file system; the driver
drops every mapping when a process ends, however it ends.
"""

import ctypes
import ctypes.util
import os
from contextlib import contextmanager

import torch

_LAZY_ENABLE_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess: ranks on different GPUs copy over NVLink/PCIe
_OUT_OF_MEMORY = 2  # cudaErrorMemoryAllocation


class CudaIpcError(RuntimeError):
    """The CUDA runtime refused a call (say, IPC in a container that forbids it)."""


class CudaOutOfMemory(CudaIpcError):
    """``cudaMalloc`` found too little free device memory."""


class _IpcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_byte * 64)]


def _runtime_library_path() -> str:
    """The libcudart that this process already has loaded (torch's), else the one the linker would find."""
    torch.cuda.init()
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if os.path.basename(path).startswith("libcudart.so"):
                return path
    for candidate in (f"libcudart.so.{torch.version.cuda.split('.')[0]}", ctypes.util.find_library("cudart")):
        try:
            ctypes.CDLL(candidate)
            return candidate
        except (OSError, TypeError):
            continue
    raise CudaIpcError("no CUDA runtime library (libcudart) is loaded or installed")


class CudaRuntime:
    """The few runtime calls the node transport needs, each raising ``CudaIpcError`` with CUDA's message.

    Each call is made with its device current, and the calling thread's current
    device is restored after: which device is current is torch's business (a
    thread left on another GPU would make its next kernels there).
    """

    def __init__(self, library=None):
        library = library or ctypes.CDLL(_runtime_library_path())
        library.cudaGetErrorString.restype = ctypes.c_char_p
        library.cudaGetDevice.argtypes = [ctypes.POINTER(ctypes.c_int)]
        library.cudaSetDevice.argtypes = [ctypes.c_int]
        library.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
        library.cudaFree.argtypes = [ctypes.c_void_p]
        library.cudaIpcGetMemHandle.argtypes = [ctypes.POINTER(_IpcMemHandle), ctypes.c_void_p]
        library.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), _IpcMemHandle, ctypes.c_uint]
        library.cudaIpcCloseMemHandle.argtypes = [ctypes.c_void_p]
        self._library = library

    def _check(self, status: int, call: str) -> None:
        if status != 0:
            message = self._library.cudaGetErrorString(status).decode()
            error = CudaOutOfMemory if status == _OUT_OF_MEMORY else CudaIpcError
            raise error(f"{call} failed: {message} (cudaError {status})")

    @contextmanager
    def _on(self, device: torch.device):
        """`device` current inside, the caller's current device again after."""
        if device.index is None:
            raise CudaIpcError(f"{device} has no index: say which GPU (cuda:0, say)")
        previous = ctypes.c_int()
        self._check(self._library.cudaGetDevice(ctypes.byref(previous)), "cudaGetDevice")
        self._check(self._library.cudaSetDevice(device.index), "cudaSetDevice")
        try:
            yield
        finally:
            self._library.cudaSetDevice(previous.value)

    def allocate(self, device: torch.device, nbytes: int) -> int:
        """`nbytes` of device memory on `device`, outside torch's caching allocator; returns its address."""
        address = ctypes.c_void_p()
        with self._on(device):
            self._check(self._library.cudaMalloc(ctypes.byref(address), nbytes), "cudaMalloc")
        return address.value

    def free(self, device: torch.device, address: int) -> None:
        with self._on(device):
            self._check(self._library.cudaFree(address), "cudaFree")

    def export(self, address: int) -> bytes:
        """An IPC handle of the allocation at `address`, which another process of the node can open."""
        handle = _IpcMemHandle()
        self._check(self._library.cudaIpcGetMemHandle(ctypes.byref(handle), address), "cudaIpcGetMemHandle")
        return bytes(handle.reserved)

    def open(self, device: torch.device, handle: bytes) -> int:
        """Maps a peer's allocation into this process (on `device`'s context); returns its address here."""
        opened = _IpcMemHandle()
        ctypes.memmove(opened.reserved, handle, len(handle))
        address = ctypes.c_void_p()
        with self._on(device):
            self._check(self._library.cudaIpcOpenMemHandle(ctypes.byref(address), opened, _LAZY_ENABLE_PEER_ACCESS),
                        "cudaIpcOpenMemHandle")
        return address.value

    def close(self, device: torch.device, address: int) -> None:
        """Unmaps a peer's allocation that ``open`` mapped on `device`'s context."""
        with self._on(device):
            self._check(self._library.cudaIpcCloseMemHandle(address), "cudaIpcCloseMemHandle")


class _RawDeviceMemory:
    """An address and a length presented through the CUDA array interface, so torch can view it as a tensor."""

    def __init__(self, address: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False),
                                         "strides": None, "version": 3}


def bytes_at(address: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over `nbytes` of memory at `address`, on `device` whichever GPU holds the memory (it does
    not own the memory: the caller frees or closes it, after dropping the tensor).

    A peer's allocation, mapped here, may lie on another GPU of the node. A tensor
    on that GPU would make every copy from it switch to that GPU, and so make a
    CUDA context there (about 0.5 GiB, on every peer's GPU); on this rank's own
    device, the copy runs on its own stream and reads the peer's memory over
    NVLink or PCIe (peer access, which opening the handle enabled). Where torch
    lacks the call that says so, the tensor is on the GPU that holds the memory.
    """
    if hasattr(torch._C, "_construct_storage_from_data_pointer"):
        storage = torch._C._construct_storage_from_data_pointer(address, device, nbytes)
        return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
    return torch.as_tensor(_RawDeviceMemory(address, nbytes))
