"""How each kind of tensor travels between a communicator's ranks, chosen once, and on which thread a started
collective runs.

A group of one rank makes no MPI call at all (``comm.py``). Otherwise each kind of
tensor (host or device memory) takes one ``Route``, chosen at the communicator's
first collective on such a tensor and kept: through memory the node's ranks share
where every rank is on this node (``node_transport.py``), else MPI reads the tensor
where it is (direct), or, where MPI cannot read that memory or staging is forced,
through pinned host buffers in chunks (``staging.py``). Staging can be forced for
CPU tensors too, so that tests exercise that path without a GPU.
"""

from dataclasses import dataclass, field
from enum import Enum

import torch

from fsdp_mpi.communication.bookkeeping import in_mpi
from fsdp_mpi.communication.gpu_support import describe_device_path, intel_offload_note
from fsdp_mpi.communication.node_transport import NodeTransport, open_node_transport
from fsdp_mpi.communication.settings import FORCE_STAGING, NODE_TRANSPORT

# Staged messages move in chunks of this many bytes per rank, so that copies and MPI overlap.
STAGING_CHUNK_BYTES = 4 * 2**20


class Route(Enum):
    """How one kind of tensor (host or device memory) travels between a communicator's ranks, chosen once
    per communicator and device type, at its first collective on that kind of tensor."""

    NODE = "node"      # every rank on this node: through memory they share (node_transport.py); MPI synchronises
    DIRECT = "direct"  # MPI reads the tensor where it is (host memory, or device memory if CUDA-aware)
    STAGED = "staged"  # through pinned host buffers, in chunks (staging.py)


@dataclass
class Routes:
    """One communicator's routes so far, by device type ("cpu", "cuda"): each route, why it was chosen (for
    the run's log), and the node transport where that is the route."""

    chosen: dict[str, Route] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)
    node_transports: dict[str, NodeTransport] = field(default_factory=dict)

    def of(self, comm, device: torch.device) -> Route:
        """How tensors on `device` travel between `comm`'s ranks: chosen at the first collective on such a
        tensor (collective then: every rank is in the same first collective on this kind of tensor), then kept."""
        route = self.chosen.get(device.type)
        return route if route is not None else self._choose(comm, device)

    def _choose(self, comm, device: torch.device) -> Route:
        """Opens the node transport where it can, else MPI's route: direct, or staged where MPI cannot read
        the memory."""
        kind = device.type
        if comm.world_size > 1 and comm.node_transport and kind in ("cpu", "cuda"):
            with in_mpi(comm, "open_node_transport"):
                transport, why = open_node_transport(comm.mpi_comm, device, comm.node_exchange_bytes)
            if transport is not None:
                self.node_transports[kind] = transport
                self.chosen[kind], self.reasons[kind] = Route.NODE, why
                return Route.NODE
        elif comm.force_staging:
            why = f"{FORCE_STAGING.name}=1"
        elif not comm.node_transport:
            why = f"{NODE_TRANSPORT.name}=0"
        else:
            why = "one rank" if comm.world_size == 1 else f"no shared memory for {kind} tensors"
        staged = comm.force_staging or (kind != "cpu" and not comm.cuda_aware)
        self.chosen[kind], self.reasons[kind] = (Route.STAGED if staged else Route.DIRECT), why
        return self.chosen[kind]

    def reserve(self, comm, device: torch.device, nbytes: int) -> None:
        """Chooses `device`'s route (collective) and, where it is the node transport, grows its slots for a
        collective whose full buffer has `nbytes`."""
        if comm.world_size > 1 and self.of(comm, device) is Route.NODE:
            with in_mpi(comm, "reserve node memory"):
                self.node_transports[device.type].reserve(nbytes)

    def close(self, comm) -> None:
        """Gives back what the node transports hold (collective); a later collective chooses its route again."""
        for kind, transport in list(self.node_transports.items()):
            with in_mpi(comm, "close node transport"):
                transport.close()
            del self.node_transports[kind], self.chosen[kind], self.reasons[kind]

    def describe(self, comm, device: torch.device) -> str:
        """How `device`'s tensors travel between `comm`'s ranks, and why (for a run's log), with what Intel MPI's
        GPU offload is set to where that is the MPI. Collective: it chooses the route if no collective has yet."""
        if comm.world_size == 1:
            return ("one rank: no tensor reaches MPI (gathering is a copy or nothing, reducing leaves gradients as "
                    "they are)")
        route, why = self.of(comm, device), self.reasons[device.type]
        if route is not Route.NODE and device.type == "cuda":  # names the library and what would change it
            return f"{describe_device_path(comm.cuda_aware, comm.force_staging)}; not through shared memory: {why}"
        if route is Route.NODE:
            line = f"{why} ({NODE_TRANSPORT.name}=0: through MPI instead)"
        else:
            line = f"host buffers go to MPI; not through shared memory: {why}"
        note = intel_offload_note()
        return f"{line}; {note}" if note else line


def runs_on_the_communication_thread(route: Route | None, tensor: torch.Tensor) -> bool:
    """Whether a started collective on `tensor` runs on the communication thread, where there is one: host work
    that would otherwise hold the main thread. That is staging; queueing a node transfer's device copies behind
    a barrier; and handing device memory to a CUDA-aware MPI, before which the host waits for the stream that
    produced it: on the worker, the main thread goes on queueing the next units' kernels meanwhile.
    `route` is None for a group of one rank, which makes no MPI call."""
    return route is Route.STAGED or (tensor.is_cuda and route in (Route.NODE, Route.DIRECT))


def staging_chunk_numel(tensor: torch.Tensor, chunk_bytes: int, max_elements_per_message: int) -> int:
    """Elements per rank in one staged chunk of `tensor`: `chunk_bytes`, within MPI's count limit."""
    return max(1, min(chunk_bytes // tensor.element_size(), max_elements_per_message))
