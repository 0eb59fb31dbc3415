"""Wrapping policies: which submodules become sharding units of their own.

Each selected submodule is replaced, bottom-up, by a nested
``FullyShardedDataParallel`` unit; the root unit keeps whatever parameters are
left. Smaller units mean less gathered memory at any moment, at the cost of
more, smaller collectives. For transformers the natural unit is one block.
"""

from typing import Callable

from torch import nn


class ModuleWrapPolicy:
    """Makes every submodule that is an instance of one of `module_classes` its own unit.

    Example: ``ModuleWrapPolicy({GPT2Block})`` gives one unit per transformer layer.
    """

    def __init__(self, module_classes):
        self.module_classes = tuple(module_classes)
        if not self.module_classes or not all(isinstance(c, type) for c in self.module_classes):
            raise TypeError("ModuleWrapPolicy takes a non-empty collection of module classes")

    def should_wrap(self, module: nn.Module, unwrapped_numel: int) -> bool:
        return isinstance(module, self.module_classes)


class SizeBasedWrapPolicy:
    """Makes a submodule its own unit once it holds `min_num_params` parameters not yet in a unit."""

    def __init__(self, min_num_params: int = 100_000_000):
        if min_num_params < 1:
            raise ValueError(f"min_num_params must be positive, got {min_num_params}")
        self.min_num_params = min_num_params

    def should_wrap(self, module: nn.Module, unwrapped_numel: int) -> bool:
        return unwrapped_numel >= self.min_num_params


def apply_wrap_policy(root: nn.Module, policy, wrap: Callable[[nn.Module], nn.Module], unit_type: type) -> None:
    """Replaces, bottom-up, each descendant of `root` that `policy` selects by ``wrap(descendant)``.

    `root` itself is left to the caller. Existing units (`unit_type`) are left as they are.
    """

    def visit(module: nn.Module) -> int:
        """Wraps inside `module`; returns how many of its parameters are not in a unit yet."""
        unwrapped_numel = sum(p.numel() for p in module.parameters(recurse=False))
        for name, child in module.named_children():
            if isinstance(child, unit_type):
                continue
            child_numel = visit(child)
            if child_numel and policy.should_wrap(child, child_numel):
                setattr(module, name, wrap(child))
            else:
                unwrapped_numel += child_numel
        return unwrapped_numel

    visit(root)
