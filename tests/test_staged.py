"""The staging pipeline (fsdp_mpi/communication/transports/staged.py) on its own, without a GPU or MPI: its ring
of host slots, and its wait for the last collective's copies back. Its collectives under MPI, on every dtype,
are test_comm.py's (workers/collectives.py runs every route)."""

import pytest
import torch

from fsdp_mpi.communication.transports.staged import RING_SLOTS, StagedCollectives

pytestmark = pytest.mark.one_mpi  # no MPI in it: CI's second MPI would run it for nothing


class _CopiesBack:
    """Stands in for the CUDA event that a device collective's copies back record: whether the host waited."""

    def __init__(self):
        self.waited = False

    def synchronize(self):
        self.waited = True


@pytest.mark.one_rank  # in a child: on a machine with a GPU the host buffers are pinned, which starts CUDA
def test_a_cpu_collective_staged_after_a_device_one_waits_for_its_copies_back():
    """FSDP_MPI_FORCE_STAGING=1 on a GPU machine: the host buffers a CPU tensor is staged through may still be
    read by the last device collective's copies back, so the CPU one waits for them too (and only once)."""

    staged = StagedCollectives()
    staged._host_buffers_read = copies_back = _CopiesBack()
    tensor = torch.arange(6.0)
    staged.in_place(tensor, 4, lambda host: host.mul_(2))
    assert copies_back.waited and staged._host_buffers_read is None
    assert tensor.tolist() == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]


@pytest.mark.one_rank  # in a child: on a machine with a GPU the ring is pinned, which starts CUDA
def test_the_staging_ring_holds_three_chunks_whatever_the_message():
    """Every staged collective, its message 3 ranks x 1000 elements cut into chunks of 64, gives its closed form
    (MPI's part faked as 3 ranks holding the same values, output first), through host slots of 3 chunks each, not
    a message."""

    staged, world, numel, chunk = StagedCollectives(), 3, 1000, 64
    shard = torch.arange(numel, dtype=torch.float32)
    full = torch.empty(world * numel)
    staged.all_gather(full, shard, chunk, lambda out, chunk_in: out.copy_(chunk_in.repeat(world)))
    assert torch.equal(full, shard.repeat(world))
    summed = torch.empty(numel)
    staged.reduce_scatter(summed, full * 2, chunk, lambda out, chunk_in: out.copy_(chunk_in.view(world, -1).sum(0)))
    assert torch.equal(summed, shard * 2 * world)
    received = torch.empty(world * numel)
    staged.all_to_all(received, full + 1, world, chunk, lambda out, chunk_in: out.copy_(chunk_in))
    assert torch.equal(received, full + 1)
    staged.in_place(full, chunk, lambda host: host.mul_(3))
    assert torch.equal(full, shard.repeat(world) * 3)
    widest = {"all_gather_send": chunk, "all_gather_recv": world * chunk, "reduce_scatter_send": world * chunk,
              "reduce_scatter_recv": chunk, "all_to_all_send": world * chunk, "all_to_all_recv": world * chunk,
              "in_place": chunk}
    assert staged.buffers.slots == sorted(widest)
    for name in widest:
        assert staged.buffers.get(name, 1, torch.uint8).untyped_storage().nbytes() == RING_SLOTS * widest[name] * 4
