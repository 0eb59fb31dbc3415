"""Offload's copies behind a GPU kept busy, on one rank (the GPU lane; argv: the output path).

``torch.cuda._sleep`` keeps the compute stream busy for about a second. Then a
shard goes to the device (``offload.on_device``) and a gradient made behind the
sleep comes home (``CPUOffload.copy_home``): on streams of their own the host
returns while the compute stream is still busy, and the values are those copied
once the copy is waited for. Under ``FSDP_MPI_OFFLOAD_STREAMS=0`` the host waits
for the compute stream in each call.
"""

import torch
from common import output_path, write_json

from fsdp_mpi import CPUOffload
from fsdp_mpi.sharding.offload import on_device

BUSY_CYCLES = 2_000_000_000  # about a second at the clocks of recent GPUs


def report() -> dict:
    device = torch.device("cuda", 0)
    compute = torch.cuda.current_stream(device)
    shard = torch.arange(1 << 20, dtype=torch.float32).pin_memory()
    found = {}

    torch.cuda._sleep(BUSY_CYCLES)
    moved = on_device(shard, device, torch.bfloat16)
    found["to_the_device_left_the_host_free"] = not compute.query()
    found["to_the_device_copied"] = torch.equal(moved.cpu(), shard.to(torch.bfloat16))

    reduced = torch.randn(1 << 20, device=device, dtype=torch.bfloat16)
    expected = reduced.float().cpu() * 2
    torch.cuda._sleep(BUSY_CYCLES)
    home, wait = CPUOffload(offload_params=True).copy_home(reduced * 2, shard)  # made behind the sleep
    found["home_left_the_host_free"] = not compute.query()
    wait()
    found["home_copied"] = torch.equal(home, expected)
    found["home_pinned"] = home.is_pinned()
    return found


if __name__ == "__main__":
    write_json(output_path(), report())
