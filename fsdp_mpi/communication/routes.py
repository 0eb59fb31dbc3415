"""Which transport each kind of memory takes between a communicator's ranks: chosen once, with its reason.

The choice, at the communicator's first collective on a kind of tensor (host or
device memory; collective then, since every rank is in the same first collective
on that kind), and kept:

    one rank                                        one_rank: no MPI call
    every rank on this node                         node: memory the ranks share (unless the node transport is
                                                    off, or sharing is refused: then MPI)
    ranks on several nodes, the same number on      two-level: inside each node (the node transport, or MPI),
    each, in blocks or round robin                  across nodes MPI (unless FSDP_MPI_TWO_LEVEL=0)
    otherwise                                       MPI, one flat ring

and MPI is direct where it can read the memory (host memory; device memory if
CUDA-aware), else staged through pinned host buffers (also where staging is
forced, which tests use to run that path without a GPU). Each choice keeps the
line that says what was chosen and why, printed once by the first model wrapped.
"""

import sys

import torch

from fsdp_mpi.communication.bookkeeping import in_mpi
from fsdp_mpi.communication.settings import NODE_TRANSPORT, TWO_LEVEL
from fsdp_mpi.communication.transports.direct import Direct
from fsdp_mpi.communication.machinery.mpi_library import describe_device_path, intel_offload_note
from fsdp_mpi.communication.transports.node import open_node_transport
from fsdp_mpi.communication.transports.one_rank import OneRank
from fsdp_mpi.communication.machinery.placement import split_by_node, two_level_layout
from fsdp_mpi.communication.transports.staged import Staged
from fsdp_mpi.communication.transports.transport import Transport
from fsdp_mpi.communication.transports.two_level import BlocksOverMpi, TwoLevel


class Routes:
    """One communicator's transports so far, by device type ("cpu", "cuda"), and the line saying why each."""

    def __init__(self):
        self.transports: dict[str, Transport] = {}
        self.lines: dict[str, str] = {}
        self.mpi_comms: list = []  # every MPI communicator made for a transport: revoked with the communicator

    def of(self, comm, device: torch.device) -> Transport:
        """The transport of `device`'s tensors between `comm`'s ranks (collective the first time, then kept)."""
        transport = self.transports.get(device.type)
        if transport is None:
            transport, self.lines[device.type] = self._choose(comm, device)
            self.transports[device.type] = transport
        return transport

    def _choose(self, comm, device: torch.device) -> tuple[Transport, str]:
        if comm.world_size == 1:
            return OneRank(), ("one rank: no tensor reaches MPI (gathering is a copy or nothing, reducing leaves "
                               "gradients as they are)")
        with in_mpi(comm, "choose a route"):
            node_comm = split_by_node(comm.mpi_comm)
            self.mpi_comms.append(node_comm)
            if node_comm.Get_size() == comm.world_size:
                transport, line = self._one_node(comm, node_comm, device)
            else:
                transport, line = self._several_nodes(comm, node_comm, device)
        note = intel_offload_note()  # where the line does not already say what device buffers would do
        if note and (device.type != "cuda" or transport.route == "node"):
            line = f"{line}; {note}"
        return transport, line

    def _one_node(self, comm, node_comm, device: torch.device) -> tuple[Transport, str]:
        if not comm.node_transport:
            node_comm.Free()
            return self._mpi(comm, comm.mpi_comm, device, f"not through shared memory: {NODE_TRANSPORT.name}=0")
        transport, through = open_node_transport(node_comm, device, comm.node_exchange_bytes)
        if transport is None:
            node_comm.Free()
            return self._mpi(comm, comm.mpi_comm, device, f"not through shared memory: {through}")
        return transport, (f"the {comm.world_size} ranks of this node exchange through {through} "
                           f"({NODE_TRANSPORT.name}=0: through MPI instead)")

    def _several_nodes(self, comm, node_comm, device: torch.device) -> tuple[Transport, str]:
        layout, how = two_level_layout(comm.mpi_comm, node_comm)
        spanning = f"the ranks span several nodes ({node_comm.Get_size()} of {comm.world_size} on this one)"
        if layout is None or not comm.two_level:
            node_comm.Free()
            why = f"{TWO_LEVEL.name}=0" if layout is not None else how
            return self._mpi(comm, comm.mpi_comm, device, f"{spanning}, one flat ring: {why}")
        across_comm = comm.mpi_comm.Split(layout.local, comm.rank)
        self.mpi_comms.append(across_comm)
        across, across_line = self._mpi(comm, across_comm, device, "", owned=True)
        inside, inside_line = None, ""
        if comm.node_transport:
            inside, inside_line = open_node_transport(node_comm, device, comm.node_exchange_bytes)
        if inside is None:
            inside_line = (f"MPI ({NODE_TRANSPORT.name}=0)" if not comm.node_transport
                           else f"MPI (the node's memory could not be shared: {inside_line})")
            inside = BlocksOverMpi(self._mpi(comm, node_comm, device, "", owned=True)[0], node_comm.Get_size())
        return TwoLevel(layout, inside, across), (
            f"{spanning}: in two levels, {how}: inside each node through {inside_line}, across nodes "
            f"{across_line.split(';')[0]} ({TWO_LEVEL.name}=0: one flat ring instead)")

    def _mpi(self, comm, mpi_comm, device: torch.device, why: str, owned: bool = False) -> tuple[Transport, str]:
        """MPI over `mpi_comm` (``mpi_transport``), and its line; `owned`: `mpi_comm` was made for it, and goes
        with it."""
        transport = mpi_transport(comm, mpi_comm, device)
        transport.owned_comm = mpi_comm if owned else None
        through = (describe_device_path(comm.cuda_awareness, comm.force_staging) if device.type == "cuda"
                   else "host buffers go to MPI" + (" through staging buffers" if comm.force_staging else ""))
        return transport, f"{through}; {why}" if why else through

    def reserve(self, comm, device: torch.device, nbytes: int) -> None:
        """Chooses `device`'s transport (collective) and, where it has node memory, grows it for a collective
        whose full buffer has `nbytes`."""
        transport = self.of(comm, device)
        if transport.makes_mpi_calls:
            with in_mpi(comm, "reserve node memory"):
                transport.reserve(nbytes)

    def close(self, comm) -> None:
        """Gives back what the transports hold (collective); a later collective chooses again."""
        for kind, transport in list(self.transports.items()):
            if transport.makes_mpi_calls:
                with in_mpi(comm, "close a transport"):
                    transport.close()
            del self.transports[kind], self.lines[kind]
        self.mpi_comms.clear()


def mpi_reads_in_place(comm, device: torch.device) -> bool:
    """Whether MPI reads and writes `device`'s memory itself (host memory; device memory where MPI is
    CUDA-aware), unless `comm` forces staging: what collectives and messages alike go by."""
    return not comm.force_staging and (device.type == "cpu" or comm.cuda_aware)


def mpi_transport(comm, mpi_comm, device: torch.device) -> Direct | Staged:
    """MPI over `mpi_comm`, with `comm`'s settings: direct where it can read `device`'s memory, else staged
    through pinned host buffers, as it is when forced."""
    if not mpi_reads_in_place(comm, device):
        return Staged(mpi_comm, comm.staging_chunk_bytes, comm.max_elements_per_message)
    return Direct(mpi_comm, comm.max_elements_per_message, comm.device_reductions_in_background)


_route_reported = False


def report_route_once(line: str, rank: int) -> None:
    """Prints a route's line on rank 0, once per process, so that a run's log says which way its tensors took
    and why (the first model wrapped reports; later ones would repeat it)."""
    global _route_reported
    if rank == 0 and not _route_reported:
        print(f"fsdp_mpi: {line}", file=sys.stderr, flush=True)
    _route_reported = True
