"""How a torch tensor is handed to MPI: its memory as an mpi4py buffer, in the MPI datatype the operation needs.

Tensors go to mpi4py detached and contiguous, without copies: a CPU tensor as
a raw buffer at its address (about 1 µs; through DLPack a torch tensor costs
about 20 µs a buffer, 10% of a 4 MiB all-gather here, and a numpy view would
pin the storage's size, which resharding frees). A device tensor goes straight
to a CUDA-aware MPI as its address (``DeviceBuffer``), once the host has waited
for the stream that produced it (``wait_for_producer``: an event, never the
whole device). Moving data needs only the bits, so every dtype travels as
unsigned integers of its width (``as_bits``); sums need the real type and its
operation (``summed``): every integer, complex and float type as itself, bool as a
logical or (what torch's ``+`` gives booleans, and the node transport's sums), and
16-bit floats, for which MPI has no type, as fp32 copies (``sums.py``).
"""

import torch
from mpi4py import MPI

# Moving data needs only the bits: every dtype travels as unsigned integers of its width.
BIT_TYPES = {1: MPI.UINT8_T, 2: MPI.INT16_T, 4: MPI.INT32_T, 8: MPI.INT64_T}
# Arithmetic needs the real type; 16-bit floats reach MPI's sums as fp32 copies (sums.py).
SUM_TYPES = {torch.float32: MPI.FLOAT, torch.float64: MPI.DOUBLE, torch.complex64: MPI.C_FLOAT_COMPLEX,
             torch.complex128: MPI.C_DOUBLE_COMPLEX, torch.int8: MPI.INT8_T, torch.uint8: MPI.UINT8_T,
             torch.int16: MPI.INT16_T, torch.int32: MPI.INT32_T, torch.int64: MPI.INT64_T, torch.bool: MPI.C_BOOL}


class DeviceBuffer:
    """A device tensor's bytes as mpi4py hands them to a CUDA-aware MPI: an address and a length,
    through the CUDA array interface. Like mpi4py's buffers it does not keep the tensor alive."""

    def __init__(self, tensor: torch.Tensor):
        self.address, self.nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.address, False), "strides": None,
                "version": 3}


def memory_of(tensor: torch.Tensor):
    """`tensor`'s memory as mpi4py should see it: a buffer at its address on the CPU, a ``DeviceBuffer`` on a device.

    Neither keeps the tensor alive: the caller holds it until MPI is done (``InFlight`` does).
    """
    if not tensor.is_cpu:
        return DeviceBuffer(tensor)
    return MPI.buffer.fromaddress(tensor.data_ptr(), tensor.nbytes)


def as_bits(tensor: torch.Tensor) -> list:
    """An mpi4py buffer spec that moves `tensor`'s bytes unchanged (made per call: no tensor is created)."""
    if tensor.element_size() not in BIT_TYPES:
        raise TypeError(f"cannot communicate tensors of dtype {tensor.dtype}")
    return [memory_of(tensor), BIT_TYPES[tensor.element_size()]]


def summed(tensor: torch.Tensor) -> tuple[list, MPI.Op]:
    """(an mpi4py buffer spec of `tensor`'s values, the MPI operation) that sums it: any dtype of ``SUM_TYPES``.
    Raises TypeError naming the dtype for any other (16-bit floats are widened before they get here)."""
    if tensor.dtype not in SUM_TYPES:
        raise TypeError(f"MPI cannot sum tensors of dtype {tensor.dtype}")
    return [memory_of(tensor), SUM_TYPES[tensor.dtype]], MPI.LOR if tensor.dtype == torch.bool else MPI.SUM


def wait_for_producer(tensor: torch.Tensor) -> None:
    """Before a CUDA-aware MPI reads or writes device memory: the host waits until the stream that
    produced `tensor` has got this far (an event on that stream, not the whole device)."""
    if tensor.is_cuda:
        produced = torch.cuda.Event()
        produced.record(torch.cuda.current_stream(tensor.device))
        produced.synchronize()
