"""Which parameters a handle flattens, where each lives in the flat buffer, and which part of it a rank keeps.

One handle holding parameters ``a`` (6 elements) and ``b`` (3 elements) on 4 ranks::

    full_flat (padded_numel = 12):  a a a a a a b b b 0 0 0
    shards:                         [rank 0][rank 1][rank 2][rank 3]   (shard_numel = 3)
    sharded views on rank 1:        a = shard[0:3]  b = shard[0:0]     (rank 2: a = [0:0], b = [0:3])

Arithmetic only, and the places where each parameter attribute is shown: no
tensor is held here (``flat_param.py`` holds the shard and the gathered buffer).
Every rank must flatten the same parameters in the same order, or the all-gather
would silently mix up parameters; the unit checks this across ranks at wrap time.
"""

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

# Set on each original parameter once it is flattened, so that a second unit
# claiming the same (shared) parameter is caught instead of silently untying it.
OWNER_ATTRIBUTE = "_fsdp_mpi_owner"


@dataclass(frozen=True)
class ParamUse:
    """One place where a module uses a parameter: ``getattr(owner, attribute)``."""

    name: str  # relative to the unit's wrapped module, e.g. "fc1.weight"
    owner: nn.Module
    attribute: str


@dataclass(frozen=True)
class ParamSlot:
    """Where one original parameter lives inside the flat buffer, and which part of it this rank holds."""

    uses: tuple[ParamUse, ...]  # more than one for tied parameters
    shape: torch.Size
    offset: int  # into full_flat
    numel: int
    shard_start: int  # this rank's part: shard[shard_start:shard_stop] (empty if it holds none)
    shard_stop: int


def group_parameters(members: Iterable[tuple[str, nn.Module]]) -> list[list[tuple[nn.Parameter, list[ParamUse]]]]:
    """The parameters of a unit's `members` (its modules, named, not those of nested units), grouped by dtype and
    requires_grad: one handle each.

    A parameter used in several places (tied weights) appears once, with all its uses.
    Order follows module registration order, which is the same on every rank.
    """
    uses_by_param: dict[int, tuple[nn.Parameter, list[ParamUse]]] = {}
    for module_name, submodule in members:
        for attribute, param in submodule._parameters.items():
            if param is None:
                continue
            name = f"{module_name}.{attribute}" if module_name else attribute
            owner = getattr(param, OWNER_ATTRIBUTE, None)
            if owner is not None:
                raise ValueError(
                    f"parameter {name!r} is shared with a parameter already sharded by the unit "
                    f"wrapping a {owner}; shared (tied) parameters must belong to one unit: "
                    "change the wrap policy so that every use lies in the same unit"
                )
            uses_by_param.setdefault(id(param), (param, []))[1].append(ParamUse(name, submodule, attribute))
    groups: dict[tuple, list] = {}
    for param, uses in uses_by_param.values():
        groups.setdefault((param.dtype, param.requires_grad), []).append((param, uses))
    return list(groups.values())


class FlatLayout:
    """The layout of a handle's parameters, flattened in order and padded to a multiple of the rank count.

    Args:
        shapes_and_uses: each parameter's shape with every place it is used, in an order identical on every rank.
        world_size: the ranks the buffer is sharded over.
        rank: this rank, whose shard is ``[shard_offset, shard_offset + shard_numel)`` of the buffer.
    """

    def __init__(self, shapes_and_uses: list[tuple[torch.Size, list[ParamUse]]], world_size: int, rank: int):
        self.numel = sum(shape.numel() for shape, _ in shapes_and_uses)
        self.padded_numel = -(-self.numel // world_size) * world_size
        self.shard_numel = self.padded_numel // world_size
        self.shard_offset = rank * self.shard_numel
        self.slots: list[ParamSlot] = []
        offset = 0
        for shape, uses in shapes_and_uses:
            start = min(max(offset - self.shard_offset, 0), self.shard_numel)
            stop = min(max(offset + shape.numel() - self.shard_offset, 0), self.shard_numel)
            self.slots.append(ParamSlot(tuple(uses), shape, offset, shape.numel(), start, stop))
            offset += shape.numel()
        # Each place a parameter attribute is shown, as (its module, the attribute, the slot's index): showing
        # full or sharded views runs every forward and backward, so it is one flat loop.
        self._attribute_places = [(use.owner, use.attribute, index)
                                  for index, slot in enumerate(self.slots) for use in slot.uses]
        # The slots' parts of the shard lie end to end: one split gives every sharded view's piece, the padding last.
        held = [slot.shard_stop - slot.shard_start for slot in self.slots]
        self.shard_pieces = [*held, self.shard_numel - sum(held)]

    @property
    def shard_padding(self) -> int:
        """Elements of the shard after the last parameter's part: zeros, on the last ranks only."""
        return self.shard_pieces[-1]

    def part_held(self, slot: ParamSlot) -> tuple[int, int]:
        """[start, stop) of the flattened parameter that this rank's shard holds (start == stop if none)."""
        start = min(max(self.shard_offset + slot.shard_start - slot.offset, 0), slot.numel)
        return start, start + slot.shard_stop - slot.shard_start

    def split_full(self, full: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One full-shape view per parameter into a (padded_numel,) buffer, in slot order (no autograd)."""
        pieces = torch.split(full, [*(slot.numel for slot in self.slots), self.padded_numel - self.numel])
        return tuple(piece.view(slot.shape) for piece, slot in zip(pieces, self.slots))

    def install_full_views(self, views: list[torch.Tensor]) -> None:
        """Shadows each parameter attribute with the given full-shape view (one per slot), in the owner's
        ``__dict__`` (looked up each time: code that dynamo traces sees the module's attributes change only
        through it, not through a dict held elsewhere); ``use_sharded_views()`` removes them."""
        for owner, attribute, index in self._attribute_places:
            owner.__dict__[attribute] = views[index]

    def use_sharded_views(self) -> None:
        """Removes the full views: each attribute is its registered sharded view again."""
        for owner, attribute, _ in self._attribute_places:
            owner.__dict__.pop(attribute, None)

