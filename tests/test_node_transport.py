"""The node transport (fsdp_mpi/communication/transports/node.py) beyond the closed forms of test_comm.py: its
exchange protocol call by call, how it is chosen and how it falls back. What its memory leaves in /dev/shm, and
how fast a failed rank ends the job, is test_shared_slots.py's. Training on it is the equivalence suite's default
on one machine."""

import json

import torch
from mpi_launch import check_ok, run_mpi

from fsdp_mpi.communication.transports import node as node_transport
from fsdp_mpi.communication.transports.node import NodeTransport

START_UP_SECONDS = 30  # MPI start-up and importing torch on a loaded 2-core machine


class RankZeroOfTwo:
    """The node communicator as rank 0 of 2 sees it, alone in this process: collectives are recorded, not met.
    The peer's contribution to an allgather is this rank's own, or the error that `peer_error` says it reported."""

    def __init__(self, calls: list):
        self.calls, self.peer_error = calls, None

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 2

    def Barrier(self):
        self.calls.append("barrier")

    def allgather(self, value):
        self.calls.append("allgather")
        return [value, self.peer_error if self.peer_error is not None else value]


class _RecordingSlots:
    """Slots in plain memory, every call recorded; rank 1's slot s holds 100 + s when read (what it wrote)."""

    limit = 8  # bytes a rank writes per exchange: two fp32 values

    def __init__(self, calls: list):
        self.calls = calls
        self.memory = {(rank, slot): torch.zeros(8, dtype=torch.uint8) for rank in (0, 1) for slot in (0, 1)}

    def ensure(self, nbytes):
        assert nbytes <= self.limit

    def mine(self, slot):
        self.calls.append(("write", slot))
        return self.memory[0, slot]

    def peer(self, rank, slot):
        self.calls.append(("read", rank, slot))
        if rank == 1:
            self.memory[1, slot].view(torch.float32).fill_(100 + slot)
        return self.memory[rank, slot]

    def written(self, slot):
        self.calls.append(("mark written", slot))

    def wait_until_written(self, slot):
        self.calls.append(("wait for the peers' writes", slot))

    def read(self, slot):
        self.calls.append(("mark read", slot))

    def wait_until_read(self, slot):
        self.calls.append(("wait for the peers' reads", slot))


def test_an_exchange_waits_writes_marks_meets_waits_reads_marks_in_turn():
    """The protocol of node_transport.py's docstring, call by call, as the GPU's events follow it: the slots
    alternate, a rank writes a slot only after waiting for the peers' reads of it, and reads the peers' only
    after the barrier and after waiting for their writes."""
    calls = []
    transport = NodeTransport(RankZeroOfTwo(calls), _RecordingSlots(calls))
    full = torch.zeros(10)
    transport.all_gather(full, torch.arange(5.0))  # two values per exchange: 3 exchanges
    exchanges = [[("wait for the peers' reads", s), ("write", s), ("mark written", s), "barrier",
                  ("wait for the peers' writes", s), ("read", 1, s), ("mark read", s)] for s in (0, 1, 0)]
    assert calls == [call for exchange in exchanges for call in exchange]
    assert full.tolist() == [0, 1, 2, 3, 4, 100, 100, 101, 101, 100]

    calls.clear()
    shard = torch.zeros(2)
    transport.reduce_scatter(shard, torch.tensor([1.0, 2.0, 3.0, 4.0]))  # rows of 1 value: 2 exchanges
    assert [call for call in calls if call[0] in ("write", "read")] == [("write", 1), ("read", 1, 1),
                                                                         ("write", 0), ("read", 1, 0)]
    assert shard.tolist() == [1 + 101, 2 + 100]  # this rank's row, then rank 1's, summed in rank order


def node_edges_report(tmp_path, *device: str) -> dict:
    out = tmp_path / "node-edges.json"
    check_ok(run_mpi("node_edges.py", 4, out, *device, timeout=START_UP_SECONDS + 120))
    return json.loads(out.read_text())


def check_node_edges(report: dict, kind: str) -> None:
    """What workers/node_edges.py reports, on the CPU or (test_gpu.py) on a GPU: every check true, the node
    transport taken by three ranks and by both groups of HYBRID_SHARD, and where rank 1 refused to share memory,
    another route, the same on every rank, with the sum right."""
    three = report["three ranks"]
    assert three.pop("routes") == {kind: "node"}
    assert all(three.values()), three
    hybrid = report["hybrid"]
    assert hybrid["shard group"] == hybrid["replica group"] == {kind: "node"} and hybrid["replicas equal"]
    assert all(report["give back"].values()), report["give back"]
    refused = report["refused on rank 1"]
    assert len(set(refused["routes"])) == 1 and refused["routes"][0] != "node" and refused["sum"]


def test_three_ranks_hybrid_groups_giving_back_and_one_rank_refusing_on_the_node_transport(tmp_path):
    check_node_edges(node_edges_report(tmp_path, "--device", "cpu"), "cpu")


def test_a_gpu_named_without_an_index_takes_the_current_one_not_the_staged_route(monkeypatch):
    """`device="cuda"` used to fail inside the agreement step (cudaSetDevice(None)) and send every collective of
    the run through host memory, said only by the route line."""
    made = []

    class Node:
        def Get_size(self):
            return 2

        def Get_rank(self):
            return 0

    class World(Node):
        def Split_type(self, kind, key):
            return Node()

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(node_transport, "DeviceSlots", lambda node, device, limit: made.append(device) or object())
    transport, why = node_transport.open_node_transport(World(), torch.device("cuda"))
    assert made == [torch.device("cuda", 1)] and transport is not None and "CUDA IPC" in why
