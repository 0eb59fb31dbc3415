"""Dropout whose masks follow the sample, not the rank: N ranks draw what one process draws.

torch's dropout draws from the process's generator, so a sample gets another mask when its batch is split over
another number of ranks, or resumed on another number: with dropout on, N ranks never equal one process. Here,
as JAX draws random bits from a key and a position, whether an element is kept is a hash of the run's seed, the
optimizer step, the sample's index in the dataset, the dropout layer's name and the element's coordinates within
its sample. Nothing is carried from call to call, so any split of a batch over any ranks, any accumulation, a
resumption anywhere, and activation checkpointing's recomputation all draw the same masks.

    keys = use_sample_dropout(model, seed)   # before wrapping: every nn.Dropout becomes a SampleDropout
    for step, samples, batch in ...:         # samples: (B,) the micro-batch's indices in the dataset
        keys.set_batch(step, samples)        # before its forward; it holds until the next call
        loss(model(batch)).backward()

The micro-batch is not part of the key: how many micro-batches a step has depends on the ranks, while a sample's
index already names it within the step. Coordinates, not flat offsets, enter the hash, so a position keeps its
mask when its sample is padded to another length. Out of reach: dropout a model applies by function (``F.dropout``,
``nn.MultiheadAttention``'s ``dropout``, a fused attention kernel handed a dropout module's ``p``, as Hugging Face's
"sdpa" attention does); ``use_sample_dropout`` refuses the modules it can see, and the rest must be turned off
(Hugging Face: ``attn_implementation="eager"``). The models in ``models/`` hold every dropout as a module.
"""

import zlib

import torch
from torch import nn

_LOW32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9  # 2^32 / golden ratio: spreads consecutive integers over the 32 bits


def _mix(h):
    """Murmur3's 32-bit finalizer, on Python ints or int64 tensors holding 32-bit values: each input bit flips
    each output bit with probability about 1/2. A product may pass 2^63 and wrap; its low 32 bits stay exact."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _LOW32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _LOW32
    return h ^ (h >> 16)


def _combine(key, value):
    """A key for (key, value): the hash of key plus value spread over 32 bits. The spread value is cut to 32 bits
    before it meets `key`: as a Python int its product passes 2^63 for about one value in five (a layer's name's
    crc32), which older torch refuses to add to an int64 tensor ("Overflow when unpacking long")."""
    return _mix((key + ((value + 1) * _GOLDEN & _LOW32)) & _LOW32)


class SampleKeys:
    """One model's keys for its current micro-batch, shared by all of its SampleDropout layers."""

    def __init__(self, seed: int):
        self.seed = seed
        self.per_sample: torch.Tensor | None = None  # (B,) int64: one key per sample of the micro-batch

    def set_batch(self, step: int, samples: torch.Tensor) -> None:
        """The micro-batch of optimizer step `step` holds the dataset's samples `samples` (B,), in its order."""
        run = _combine(_combine(_mix(self.seed & _LOW32), self.seed >> 32), step)
        self.per_sample = _combine(run, torch.as_tensor(samples, dtype=torch.int64).flatten())


class SampleDropout(nn.Dropout):
    """``nn.Dropout`` (same p, same scaling by 1/(1-p)) whose mask for row i of its batch-first input is drawn from
    (the keys of sample i, this layer's name). Never in place: the keep/drop mask is all backward keeps."""

    def __init__(self, p: float, keys: SampleKeys, name: str):
        super().__init__(p)
        self.keys, self.name = keys, name
        self.layer = zlib.crc32(name.encode())  # the same on every rank and in every copy of the model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        per_sample = self.keys.per_sample
        if per_sample is None:
            raise RuntimeError(f"dropout layer {self.name!r}: no samples set; call set_batch(step, samples) on "
                               f"the model's SampleKeys (use_sample_dropout's result) before each forward")
        if x.dim() == 0 or x.shape[0] != per_sample.numel():
            raise ValueError(f"dropout layer {self.name!r}: its input {tuple(x.shape)} must be batch-first with one "
                             f"row per sample set by set_batch ({per_sample.numel()})")
        if per_sample.device != x.device:  # moved once per micro-batch, for every layer after this one
            self.keys.per_sample = per_sample = per_sample.to(x.device)
        keep = self.kept(per_sample, x.shape)
        return torch.where(keep, x * (1 / (1 - self.p) if self.p < 1 else 0.0), x.new_zeros(()))

    def kept(self, per_sample: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """(shape) bool: which elements are kept, one hash per element of the coordinates within its sample."""
        h = _combine(per_sample, self.layer).view(-1, *[1] * (len(shape) - 1))
        for dim in range(1, len(shape)):
            coordinate = torch.arange(shape[dim], device=per_sample.device, dtype=torch.int64)
            h = _combine(h, coordinate.view(-1, *[1] * (len(shape) - 1 - dim)))  # (B, d1, .., d_dim, 1, ..)
        return h >= round(self.p * 2 ** 32)  # P(kept) = 1 - p, to 2^-32


def use_sample_dropout(model: nn.Module, seed: int) -> SampleKeys:
    """Replaces every ``nn.Dropout`` of `model` by a SampleDropout named by its path in `model`, and returns the keys
    they share. Call it before wrapping, so that the names (the layers' keys) are those of the model itself.
    Refuses, naming them, the dropouts it cannot replace: they would keep drawing per rank."""
    if any(isinstance(module, SampleDropout) for module in model.modules()):
        raise ValueError("the model already draws dropout per sample: set the SampleKeys that use_sample_dropout "
                         "returned then")
    keys = SampleKeys(seed)
    unreachable = [f"{name} ({type(module).__name__})" for name, module in model.named_modules()
                   if (isinstance(module, nn.modules.dropout._DropoutNd) and type(module) not in (nn.Dropout, SampleDropout))
                   or (isinstance(module, nn.MultiheadAttention) and module.dropout > 0)]
    if unreachable:
        raise ValueError(f"dropout that would still draw per rank: {', '.join(unreachable)}; set its p to 0 or "
                         f"make it an nn.Dropout module")
    for name, module in list(model.named_modules()):
        for child_name, child in module.named_children():
            if type(child) is nn.Dropout:
                setattr(module, child_name, SampleDropout(child.p, keys, f"{name}.{child_name}".lstrip(".")))
    return keys
