"""Small models and helpers shared by the test workers (run under mpiexec)."""

import json
import os
import sys

# cuBLAS is deterministic only with a fixed workspace, set before its first handle (a no-op on the CPU).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402
from torch import nn  # noqa: E402

torch.set_num_threads(1)
# Deterministic kernels, as torch.use_deterministic_algorithms(True) sets them, without its import of inductor
# (for inductor's own flag) and so of dynamo: 0.9 s of each rank's start. Workers that compile call it
# (equivalence.compile_model).
torch._C._set_deterministic_algorithms(True)


def take_device_argument() -> torch.device:
    """Removes ``--device cpu|cuda`` from the arguments and returns that device (cpu without one). For cuda, the
    GPU of this rank's place on its node (ranks may share one), selected before anything else touches CUDA; TF32
    off (an fp32 run must compute in fp32 to be held to fp32's bounds); and a warning, not an error, from a CUDA
    kernel that has no deterministic form (the suite's checks say whether any result changed)."""
    if "--device" not in sys.argv:
        return torch.device("cpu")
    at = sys.argv.index("--device")
    kind = sys.argv[at + 1]
    del sys.argv[at:at + 2]
    if kind == "cpu":
        return torch.device("cpu")
    local_rank = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
    device = torch.device("cuda", local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.use_deterministic_algorithms(True, warn_only=True)
    return device


class ResidualBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


class NestedMLP(nn.Module):
    """An MLP with nested units, a frozen layer, a block run twice and a parameter that gets no gradient."""

    def __init__(self, width: int = 16, n_inputs: int = 8, n_classes: int = 3):
        super().__init__()
        self.embed = nn.Linear(n_inputs, width)
        self.frozen = nn.Linear(width, width)
        self.frozen.requires_grad_(False)
        self.blocks = nn.ModuleList(ResidualBlock(width) for _ in range(3))
        self.unused = nn.Linear(width, width)
        self.head = nn.Linear(width, n_classes)

    def forward(self, x, targets):
        x = self.frozen(torch.relu(self.embed(x)))
        x = self.blocks[0](x)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        return logits, nn.functional.cross_entropy(logits, targets)


def mlp_batch(step: int, global_batch: int = 12):
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randn(global_batch, 8, generator=generator), torch.randint(0, 3, (global_batch,), generator=generator)


def gpt_batch(step: int, vocab: int, global_batch: int = 12, seq: int = 16):
    generator = torch.Generator().manual_seed(2000 + step)
    tokens = torch.randint(0, vocab, (global_batch, seq + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def bert_batch(step: int, vocab: int, global_batch: int = 12, seq: int = 16):
    """Token ids with padding, segment ids, 3 masked-LM targets per sequence and NSP labels.

    Every sequence has the same number of masked-LM targets, so the mean loss of
    any equal split of the batch averages to the global mean.
    """
    generator = torch.Generator().manual_seed(3000 + step)
    input_ids = torch.randint(5, vocab, (global_batch, seq), generator=generator)
    token_type_ids = (torch.arange(seq) >= seq // 2).long().expand(global_batch, seq)
    lengths = torch.randint(seq // 2, seq + 1, (global_batch,), generator=generator)
    attention_mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    mlm_labels = torch.full((global_batch, seq), -100)
    for row in range(global_batch):
        positions = torch.randperm(int(lengths[row]), generator=generator)[:3]
        mlm_labels[row, positions] = input_ids[row, positions]
    nsp_labels = torch.randint(0, 2, (global_batch,), generator=generator)
    return input_ids, token_type_ids, attention_mask, mlm_labels, nsp_labels


def local_part(tensor: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's contiguous share of a global batch."""
    per_rank = tensor.shape[0] // world_size
    return tensor[rank * per_rank:(rank + 1) * per_rank]


def same_state(one, other) -> bool:
    """Bit for bit: every tensor of two (nested) state dicts."""
    if isinstance(one, dict):
        return one.keys() == other.keys() and all(same_state(one[key], other[key]) for key in one)
    if isinstance(one, (list, tuple)):
        return len(one) == len(other) and all(same_state(a, b) for a, b in zip(one, other))
    if isinstance(one, torch.Tensor):
        return torch.equal(one, other)
    return one == other


def everywhere(ok: bool, group=None) -> bool:
    """`ok` on every rank of torch.distributed's `group` (the default group if None): collective over it."""
    import torch.distributed as dist
    flags = [None] * dist.get_world_size(group)
    dist.all_gather_object(flags, bool(ok), group=group)
    return all(flags)


def write_json(path: str, payload) -> None:
    if MPI.COMM_WORLD.Get_rank() == 0:
        with open(path, "w") as f:
            json.dump(payload, f, indent=1)


def output_path() -> str:
    return sys.argv[1]


def cost_model_units(model) -> list:
    """The cost model's units (experiments/measuring/costmodel.py) for a wrapped model: each unit's flat
    elements and trainable tensors, in forward order, no timings."""
    from measuring.costmodel import Unit

    from fsdp_mpi.sharding.lifecycle import units_with_names
    return [Unit(name or "<root>", sum(h.numel for h in unit.handles), 0.0, 0.0, is_root=name == "",
                 tensors=sum(len(h.slots) for h in unit.handles)) for name, unit in units_with_names(model)]
