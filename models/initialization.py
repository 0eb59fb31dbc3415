"""Construction that draws no random numbers until the model initialises itself, one module at a time.

Our models build their modules under ``torch.device("meta")`` (shapes only), then
``finish_construction`` materialises them where tensors are created now, re-ties
shared weights (``to_empty`` unties them) and calls ``model.init_module(m)`` for
every module ``m`` in ``model.modules()`` order. If the caller is itself building
on meta, the model stays there: fsdp_mpi's deferred initialisation later calls the
same ``init_module`` in the same order, one module at a time, straight into
shards, so the weights equal, bit for bit, a model built eagerly with the same
seed (and no random numbers are spent on defaults that are then overwritten).
"""

import torch
from torch import nn


def finish_construction(model: nn.Module, tie_weights) -> None:
    """Call at the end of `model`'s ``__init__``, after building its modules under ``torch.device("meta")``."""
    target = torch.empty(0).device  # "meta" inside the caller's `with torch.device("meta")`
    if target.type != "meta":
        model.to_empty(device=target)
    tie_weights()
    if target.type != "meta":
        for module in model.modules():
            model.init_module(module)


def embedding(num_embeddings: int, embedding_dim: int) -> nn.Embedding:
    """``nn.Embedding`` without its default initialisation, which ``init_module`` replaces anyway: on meta its
    ``normal_``, unlike the other default initialisers, runs torch's Python reference, whose first call
    imports the compiler (0.9 s of CPU), in a program that may never compile."""
    return nn.Embedding(num_embeddings, embedding_dim, _weight=torch.empty(num_embeddings, embedding_dim))
