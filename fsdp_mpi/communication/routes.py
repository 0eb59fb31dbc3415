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
forced, which tests use to run that path without a GPU). Each transport says
itself whether it accepts, and why not (``offer``); the routes ask them in this
order and keep the first that accepts, with the line made of their answers that
says what was chosen and why, printed once by the first model wrapped.
"""

import sys

import torch

from fsdp_mpi.communication.bookkeeping import in_mpi
from fsdp_mpi.communication.machinery.mpi_library import intel_offload_note
from fsdp_mpi.communication.machinery.placement import split_by_node
from fsdp_mpi.communication.settings import NODE_TRANSPORT
from fsdp_mpi.communication.transports.direct import Direct
from fsdp_mpi.communication.transports.node import NodeTransport
from fsdp_mpi.communication.transports.one_rank import OneRank
from fsdp_mpi.communication.transports.staged import Staged
from fsdp_mpi.communication.transports.transport import Offer, Transport
from fsdp_mpi.communication.transports.two_level import TwoLevel

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
        """Asks the transports in order (``offer``) and keeps the first that accepts; its line, and the refusals
        on the way that a user can act on, say why."""
        one_rank = OneRank.offer(comm)
        if one_rank.transport is not None:
            return one_rank.transport, one_rank.line
        with in_mpi(comm, "choose a route"):
            node_comm = split_by_node(comm.mpi_comm)
            self.mpi_comms.append(node_comm)
            if node_comm.Get_size() == comm.world_size:
                shared = NodeTransport.offer(comm, node_comm, device)
                refused = f"not through shared memory: {shared.line}"
                accepted = (f"the {comm.world_size} ranks of this node exchange through {shared.line} "
                            f"({NODE_TRANSPORT.name}=0: through MPI instead)")
            else:
                shared = TwoLevel.offer(comm, node_comm, device, lambda level: self._through_mpi(comm, level, device))
                refused = accepted = shared.line
            if shared.transport is not None:
                transport, line = shared.transport, accepted
            else:
                node_comm.Free()
                mpi = self._through_mpi(comm, comm.mpi_comm, device, owned=False)
                transport, line = mpi.transport, f"{mpi.line}; {refused}"
        note = intel_offload_note()  # where the line does not already say what device buffers would do
        if note and (device.type != "cuda" or transport.route == "node"):
            line = f"{line}; {note}"
        return transport, line

    def _through_mpi(self, comm, mpi_comm, device: torch.device, owned: bool = True) -> Offer:
        """MPI over `mpi_comm` (``mpi_transport``); `owned`: `mpi_comm` was made for it (a level of two), and is
        revoked with the communicator and freed with the transport."""
        offer = mpi_transport(comm, mpi_comm, device)
        offer.transport.owned_comm = mpi_comm if owned else None
        if owned and mpi_comm not in self.mpi_comms:
            self.mpi_comms.append(mpi_comm)
        return offer

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


def mpi_transport(comm, mpi_comm, device: torch.device) -> Offer:
    """MPI over `mpi_comm`, with `comm`'s settings: direct where it reads `device`'s memory in place, else staged
    through pinned host buffers, as it is when forced; and the line that says which, and why."""
    direct = Direct.offer(comm, mpi_comm, device)
    return direct if direct.transport is not None else Staged.offer(comm, mpi_comm, direct)


_route_reported = False


def report_route_once(line: str, rank: int) -> None:
    """Prints a route's line on rank 0, once per process, so that a run's log says which way its tensors took
    and why (the first model wrapped reports; later ones would repeat it)."""
    global _route_reported
    if rank == 0 and not _route_reported:
        print(f"fsdp_mpi: {line}", file=sys.stderr, flush=True)
    _route_reported = True
