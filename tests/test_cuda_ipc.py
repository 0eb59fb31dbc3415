"""CUDA IPC from Python (fsdp_mpi/communication/transports/cuda_ipc.py) on the CPU: the runtime's calls, faked and
recorded, made on the named GPU with the thread's current device left as it was; and views of memory at an address,
on the device they are told. The GPU lane (test_gpu.py, hpc/gpu_check.sh) runs the same code on a GPU."""

import pytest
import torch

from fsdp_mpi.communication.transports.cuda_ipc import CudaIpcError, CudaOutOfMemory, CudaRuntime, bytes_at

DEVICE = torch.device("cuda", 1)


class _Library:
    """libcudart's calls as the CudaRuntime makes them, recorded; the thread's current device starts at 3."""

    def __init__(self):
        self.calls, self.current = [], 3
        for name in ("cudaGetErrorString", "cudaIpcGetMemHandle", "cudaIpcOpenMemHandle", "cudaIpcCloseMemHandle"):
            setattr(self, name, self._recorder(name))

    def _recorder(self, name):
        def call(*args):
            self.calls.append(name)
            return b"no error" if name == "cudaGetErrorString" else 0
        return call

    def cudaGetDevice(self, device):
        device._obj.value = self.current  # device: ctypes.byref(a c_int)
        return 0

    def cudaSetDevice(self, index):
        self.calls.append(("cudaSetDevice", index))
        self.current = index
        return 0

    def cudaMalloc(self, address, nbytes):
        self.calls.append("cudaMalloc")
        return 2 if nbytes > 2**40 else 0  # cudaErrorMemoryAllocation

    def cudaFree(self, address):
        self.calls.append("cudaFree")
        return 0


class _Function:
    """A ctypes function's stand-in: the runtime sets argtypes and restype on it."""

    def __init__(self, call):
        self.call = call

    def __call__(self, *args):
        return self.call(*args)


def test_the_runtime_calls_on_the_named_gpu_and_leaves_the_threads_current_device_as_it_was():
    library = _Library()
    wrapped = type("Library", (), {})()
    for name in dir(library):
        if name.startswith("cuda"):
            setattr(wrapped, name, _Function(getattr(library, name)))
    runtime = CudaRuntime(wrapped)
    runtime.allocate(DEVICE, 64)
    runtime.open(DEVICE, bytes(64))
    runtime.close(DEVICE, 0x1000)
    runtime.free(DEVICE, 0x1000)
    for call in ("cudaMalloc", "cudaIpcOpenMemHandle", "cudaIpcCloseMemHandle", "cudaFree"):
        at = library.calls.index(call)
        assert library.calls[at - 1] == ("cudaSetDevice", 1) and library.calls[at + 1] == ("cudaSetDevice", 3)
    assert library.current == 3
    with pytest.raises(CudaOutOfMemory, match="cudaMalloc failed"):
        runtime.allocate(DEVICE, 2**41)
    assert library.current == 3
    with pytest.raises(CudaIpcError, match="has no index"):
        runtime.allocate(torch.device("cuda"), 64)


def test_bytes_at_views_memory_on_the_device_it_is_told_whatever_holds_it():
    """A peer's slot is viewed on this rank's own device, so that a copy from it runs there (on a GPU: over peer
    access, with no context made on the peer's GPU). On the CPU, the same call over host memory."""
    memory = torch.arange(16, dtype=torch.uint8)
    view = bytes_at(memory.data_ptr() + 4, 8, torch.device("cpu"))
    assert view.device == torch.device("cpu") and view.tolist() == list(range(4, 12))
    view.fill_(0)
    assert memory[4:12].tolist() == [0] * 8 and memory[12] == 12
    assert hasattr(torch._C, "_construct_storage_from_data_pointer"), \
        "torch lacks the call bytes_at uses: peers' slots would be placed on the GPU that holds them"
