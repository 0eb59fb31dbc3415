"""Wrapping policies: which submodules become sharding units of their own.

Each selected submodule is replaced, bottom-up, by a nested
``FullyShardedDataParallel`` unit; the root unit keeps whatever parameters are
left. Smaller units mean less gathered memory at any moment, at the cost of
more, smaller collectives. For transformers the natural unit is one block.

A policy written for torch's FSDP works as it is: any callable
``policy(module=, recurse=, nonwrapped_numel=) -> bool`` (torch's
``ModuleWrapPolicy``, ``functools.partial`` of ``transformer_auto_wrap_policy``
or ``size_based_auto_wrap_policy``) is asked, as torch asks it, whether to look
inside a module (``recurse=True``) and whether to wrap it (``recurse=False``).
"""

import inspect
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

    def should_descend(self, module: nn.Module, numel: int) -> bool:
        return True

    def should_wrap(self, module: nn.Module, unwrapped_numel: int) -> bool:
        return isinstance(module, self.module_classes)


class SizeBasedWrapPolicy:
    """Makes a submodule its own unit once it holds `min_num_params` parameters not yet in a unit."""

    def __init__(self, min_num_params: int = 100_000_000):
        if min_num_params < 1:
            raise ValueError(f"min_num_params must be positive, got {min_num_params}")
        self.min_num_params = min_num_params

    def should_descend(self, module: nn.Module, numel: int) -> bool:
        return True

    def should_wrap(self, module: nn.Module, unwrapped_numel: int) -> bool:
        return unwrapped_numel >= self.min_num_params


class TorchCallablePolicy:
    """A policy in torch FSDP's form, ``policy(module=, recurse=, nonwrapped_numel=) -> bool``: asked whether to
    look inside a module of `numel` parameters, then whether to wrap what is left unwrapped in it."""

    def __init__(self, policy: Callable[..., bool]):
        self.policy = policy

    def should_descend(self, module: nn.Module, numel: int) -> bool:
        return bool(self.policy(module=module, recurse=True, nonwrapped_numel=numel))

    def should_wrap(self, module: nn.Module, unwrapped_numel: int) -> bool:
        return bool(self.policy(module=module, recurse=False, nonwrapped_numel=unwrapped_numel))


WrapPolicy = ModuleWrapPolicy | SizeBasedWrapPolicy | TorchCallablePolicy


def as_wrap_policy(given) -> WrapPolicy:
    """`given` (``FullyShardedDataParallel``'s ``auto_wrap_policy``) as a policy ``apply_wrap_policy`` can ask;
    TypeError, before anything is wrapped, for what is neither ours nor a callable in torch's form."""
    if isinstance(given, (ModuleWrapPolicy, SizeBasedWrapPolicy)):
        return given
    if callable(given):
        try:
            inspect.signature(given).bind(module=None, recurse=True, nonwrapped_numel=0)
        except (TypeError, ValueError):  # ValueError: a callable whose signature Python cannot read
            pass
        else:
            return TorchCallablePolicy(given)
    raise TypeError(f"auto_wrap_policy must be ModuleWrapPolicy({{Class, ...}}), SizeBasedWrapPolicy(n), or a "
                    f"callable (module, recurse, nonwrapped_numel) -> bool as torch's FSDP takes "
                    f"(torch's ModuleWrapPolicy, functools.partial(transformer_auto_wrap_policy, ...)); "
                    f"got {given!r}")


def apply_wrap_policy(root: nn.Module, policy: WrapPolicy, wrap: Callable[[nn.Module], nn.Module],
                      unit_type: type) -> None:
    """Replaces, bottom-up, each descendant of `root` that `policy` selects by ``wrap(descendant)``, inside the
    modules it descends into.

    `root` itself is left to the caller. Existing units (`unit_type`) are left as they are.
    """

    def visit(module: nn.Module) -> int:
        """Wraps inside `module`; returns how many of its parameters are not in a unit yet."""
        unwrapped_numel = sum(p.numel() for p in module.parameters(recurse=False))
        for name, child in module.named_children():
            if isinstance(child, unit_type):
                continue
            numel = _numel(child)
            if not policy.should_descend(child, numel):  # torch's policies may keep a subtree whole
                unwrapped_numel += numel
                continue
            child_numel = visit(child)
            if child_numel and policy.should_wrap(child, child_numel):
                setattr(module, name, wrap(child))
            else:
                unwrapped_numel += child_numel
        return unwrapped_numel

    if policy.should_descend(root, _numel(root)):
        visit(root)


def _numel(module: nn.Module) -> int:
    """Parameters in `module` and below."""
    return sum(p.numel() for p in module.parameters())
