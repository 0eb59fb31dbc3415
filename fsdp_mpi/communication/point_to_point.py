"""Messages between two ranks: MPI's nonblocking send and receive of a tensor, logged and watched like the
collectives (``bookkeeping.py``). torch's send, recv, isend, irecv and batch_isend_irecv on the ``fsdp_mpi``
backend come here.

A message moves the tensor's bytes (``as_bits``: any dtype, bf16 included). MPI reads host memory in place, and
device memory where it is CUDA-aware (after waiting for the stream that produced it, ``direct.mpi_reads_in_place``);
otherwise a device tensor goes through a host copy, made when a send starts and copied back when a receive is
waited for.

Started, a message returns an ``InFlight`` at once, so a rank may start a receive before its send, or many
messages at once (batch_isend_irecv), and MPI moves them together; ``wait()`` completes it, and a receive's
``wait()`` returns the rank the message came from (any rank where none is named: MPI's ANY_SOURCE).

An object (``send_object``: a rank's whole training state, to a newcomer) goes as its pickle with the tensors
left out, then each tensor as a message of its own bytes, as above: no pickling of hundreds of megabytes.

Each message is checked as it arrives: its length must be the receiving tensor's (MPI itself refuses a longer
one). In verify mode a header goes ahead of each message with its length and dtype, which must be the
receiver's; a mismatch raises ``CollectiveMismatchError`` naming both sides.
"""

import io
import pickle
import zlib

import numpy
import torch
from mpi4py import MPI

from fsdp_mpi.communication.bookkeeping import CollectiveMismatchError, in_mpi, waiting_in_mpi
from fsdp_mpi.communication.transports.direct import mpi_reads_in_place
from fsdp_mpi.communication.machinery.in_flight import InFlight
from fsdp_mpi.communication.machinery.mpi_buffers import as_bits, wait_for_producer


def start_send(comm, tensor: torch.Tensor, peer: int, tag: int) -> InFlight:
    """Starts sending `tensor` to rank `peer` of `comm` (a ``Communicator``) under `tag`."""
    _check_peer(comm, peer)
    sent = _in_place_or_on_host(comm, tensor.detach())
    wait_for_producer(sent)  # on a device: the stream has produced it before MPI reads it
    header = _header(tensor)
    with in_mpi(comm, f"send to rank {peer}", tensor, finishes=False, collective=False) as record:
        requests = [comm.mpi_comm.Isend([header, MPI.INT64_T], dest=peer, tag=tag)] if comm.verify else []
        requests.append(comm.mpi_comm.Isend(as_bits(sent), dest=peer, tag=tag))

    def sent_out() -> None:
        with waiting_in_mpi(comm, record):
            MPI.Request.Waitall(requests)
    return InFlight(steps=(sent_out,), keep=(sent, tensor, header))


def start_receive(comm, tensor: torch.Tensor, peer: int | None, tag: int) -> InFlight:
    """Starts receiving into `tensor` from rank `peer` of `comm`, or from any rank (None), under `tag`; ``wait()``
    returns the rank it came from."""
    if peer is not None:
        _check_peer(comm, peer)
    source = MPI.ANY_SOURCE if peer is None else peer
    received = _in_place_or_on_host(comm, tensor, copy=False)
    if received.is_cuda:
        wait_for_producer(received)  # what the stream still does with this memory is done before MPI writes it
    header = numpy.empty(2, dtype=numpy.int64)
    whom = "any rank" if peer is None else f"rank {peer}"
    with in_mpi(comm, f"receive from {whom}", tensor, finishes=False, collective=False) as record:
        header_request = comm.mpi_comm.Irecv([header, MPI.INT64_T], source=source, tag=tag) if comm.verify else None
        # from any rank, with a header: the message is received from the header's sender, once it is known
        data_request = (None if header_request is not None and peer is None
                        else comm.mpi_comm.Irecv(as_bits(received), source=source, tag=tag))
    flight = InFlight(keep=(received, tensor))

    def arrived() -> None:
        nonlocal data_request
        status = MPI.Status()
        with waiting_in_mpi(comm, record):
            if header_request is not None:
                header_request.Wait(status)
                _check_header(comm, header, tensor, status.Get_source())
                if data_request is None:
                    data_request = comm.mpi_comm.Irecv(as_bits(received), source=status.Get_source(), tag=tag)
            data_request.Wait(status)
        if status.Get_count(MPI.BYTE) != received.nbytes:
            raise ValueError(f"rank {comm.rank} received {status.Get_count(MPI.BYTE)} bytes from rank "
                             f"{status.Get_source()} into a tensor of {received.nbytes} ({tuple(tensor.shape)} "
                             f"{tensor.dtype}): both sides must have the same number of bytes")
        if received is not tensor:
            tensor.copy_(received)
        flight.result = status.Get_source()
    return flight.then(arrived)


def send_object(comm, obj, peer: int, tag: int) -> None:
    """Sends picklable `obj` to rank `peer` of `comm` under `tag`, its tensors as messages of their own."""
    tensors: list[torch.Tensor] = []

    class LeavingTensorsOut(pickle.Pickler):
        def persistent_id(self, thing):
            if not isinstance(thing, torch.Tensor):
                return None
            tensors.append(thing)
            return len(tensors) - 1, tuple(thing.shape), thing.dtype, str(thing.device)

    skeleton = io.BytesIO()
    LeavingTensorsOut(skeleton, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    with in_mpi(comm, f"send an object to rank {peer}", collective=False):
        comm.mpi_comm.send(skeleton.getvalue(), dest=peer, tag=tag)
    for flight in [start_send(comm, tensor, peer, tag) for tensor in tensors]:
        flight.wait()


def receive_object(comm, peer: int, tag: int):
    """The object rank `peer` of `comm` sends with ``send_object`` under `tag`."""
    with in_mpi(comm, f"receive an object from rank {peer}", collective=False):
        skeleton = comm.mpi_comm.recv(source=peer, tag=tag)
    tensors: dict[int, torch.Tensor] = {}

    class PuttingTensorsIn(pickle.Unpickler):
        def persistent_load(self, pid):
            index, shape, dtype, device = pid
            tensors[index] = torch.empty(shape, dtype=dtype, device=device)
            return tensors[index]

    obj = PuttingTensorsIn(io.BytesIO(skeleton)).load()
    for flight in [start_receive(comm, tensors[index], peer, tag) for index in range(len(tensors))]:
        flight.wait()
    return obj


def _in_place_or_on_host(comm, tensor: torch.Tensor, copy: bool = True) -> torch.Tensor:
    """`tensor` where MPI can read it as it is; else a contiguous host tensor like it (its values if `copy`)."""
    in_place = mpi_reads_in_place(comm, tensor.device)
    if tensor.is_contiguous() and in_place:
        return tensor
    device = tensor.device if in_place else torch.device("cpu")
    if copy:
        return tensor.to(device, memory_format=torch.contiguous_format, copy=True)
    return torch.empty(tensor.shape, dtype=tensor.dtype, device=device)


def _header(tensor: torch.Tensor) -> numpy.ndarray:
    """What verify mode sends ahead of a message: its length in bytes and its dtype, as a number."""
    return numpy.array([tensor.numel() * tensor.element_size(), zlib.crc32(str(tensor.dtype).encode())],
                       dtype=numpy.int64)


def _check_header(comm, header: numpy.ndarray, tensor: torch.Tensor, sender: int) -> None:
    if not numpy.array_equal(header, _header(tensor)):
        dtypes = {zlib.crc32(str(dtype).encode()): str(dtype) for dtype in _NAMED_DTYPES}
        raise CollectiveMismatchError(
            f"rank {sender} sent {int(header[0])} bytes of {dtypes.get(int(header[1]), 'another dtype')} to rank "
            f"{comm.rank}, which receives {tensor.numel() * tensor.element_size()} bytes of {tensor.dtype} "
            f"({tuple(tensor.shape)}): a send and its receive must agree")


def _check_peer(comm, peer: int) -> None:
    if not 0 <= peer < comm.world_size:
        raise ValueError(f"rank {peer} is not in a group of {comm.world_size} ranks")


_NAMED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
           torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
