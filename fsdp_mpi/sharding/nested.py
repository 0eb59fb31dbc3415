"""One walker over the values that flow into and out of a module's forward: tensors nested in containers.

A unit's inputs are cast under mixed precision and its outputs get the hooks that start its backward; both
walk the same containers the same way, here. Each container comes back with its own type (and, for a
mapping or a dataclass, its other attributes), so a Hugging Face ``BatchEncoding`` or ``ModelOutput``
stays one: tuples and named tuples, lists, mappings (``dict`` and its subclasses, ``UserDict``) and
dataclasses. Anything else is a leaf, returned as it is.
"""

import copy
import dataclasses
from collections.abc import Mapping, MutableMapping
from typing import Callable

import torch


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], value):
    """`value` with every tensor `t` nested in it replaced by ``fn(t)``, every container keeping its type."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(map_tensors(fn, item) for item in value))
    if isinstance(value, (tuple, list)):
        return type(value)(map_tensors(fn, item) for item in value)
    if type(value) is dict:  # the common case (keyword arguments), in a form that torch.compile traces
        return {key: map_tensors(fn, item) for key, item in value.items()}
    if isinstance(value, MutableMapping):  # a shallow copy keeps the type and whatever else the mapping holds
        mapped = copy.copy(value)
        for key, item in value.items():
            mapped[key] = map_tensors(fn, item)
        return mapped
    if isinstance(value, Mapping):
        return {key: map_tensors(fn, item) for key, item in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{field.name: map_tensors(fn, getattr(value, field.name))
                                            for field in dataclasses.fields(value) if field.init})
    return value


def for_each_tensor(fn: Callable[[torch.Tensor], None], value) -> None:
    """Calls ``fn(t)`` on every tensor `t` nested in `value` (the same containers, nothing rebuilt)."""
    if isinstance(value, torch.Tensor):
        fn(value)
        return
    if isinstance(value, (tuple, list)):
        items = value
    elif isinstance(value, Mapping):
        items = value.values()
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = [getattr(value, field.name) for field in dataclasses.fields(value)]
    else:
        return
    for item in items:
        for_each_tensor(fn, item)
