"""Mixed precision on 3 ranks: what is in which dtype, the bytes each collective moves, fp16's loss scaler.

bf16 training against one process under the same policy is in test_equivalence.py.
"""

import json

import pytest
import torch
from mpi_launch import check_ok, run_mpi

from fsdp_mpi import MixedPrecision

# autocast, low-precision autograd and the loss scaler are torch's: CI runs the file on the newest torch too.
pytestmark = pytest.mark.torch_range


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("mixed_precision") / "report.json"
    check_ok(run_mpi("mixed_precision.py", 3, out))
    return json.loads(out.read_text())


def test_every_tensor_is_in_the_dtype_the_policy_names(report):
    expected = {"weight": "torch.bfloat16", "input": "torch.bfloat16", "logits": "torch.bfloat16",
                "loss": "torch.float32",  # the model's cross-entropy upcasts its logits
                "shard": ["torch.float32"], "grad": ["torch.float32"], "buffer": "torch.float16",
                "state_dict": ["torch.float32"], "summoned": "torch.float32"}
    assert report["dtypes"] == [expected] * 3


def test_state_dict_holds_the_fp32_masters_not_their_bf16_rounding(report):
    assert report["state_dict_is_the_masters"]


def test_bf16_gathers_move_half_the_bytes_and_gradients_are_summed_in_fp32(report):
    fp32, bf16 = report["bytes_fp32"], report["bytes_bf16"]
    assert fp32["all_gather"] > 0 and bf16["all_gather"] * 2 == fp32["all_gather"]
    # Gradients reduce in fp32 unless reduce_dtype says otherwise; a bf16 reduce_dtype sends bf16 through the node
    # transport (on one machine, the default), which sums it in fp32 (tests/workers/collectives.py, 16-bit sums).
    assert bf16["reduce_scatter"] == fp32["reduce_scatter"] == 2 * report["bytes_bf16_reduce_bf16"]["reduce_scatter"]


def test_an_inf_on_one_rank_skips_the_step_on_every_rank(report):
    history = report["scaler"]["history"]
    assert [step["changed"] for step in history] == [[True] * 3, [False] * 3, [True] * 3, [True] * 3]
    assert all(step["finite"] == [True] * 3 for step in history)
    # Halved after the overflow, doubled after growth_interval = 2 clean steps; the same on every rank.
    assert [step["scale"] for step in history] == [[1024.0] * 3, [512.0] * 3, [512.0] * 3, [1024.0] * 3]
    assert report["scaler"]["skipped"] == [1, 1, 1]


def test_policy_dtypes_must_be_floating_point():
    with pytest.raises(TypeError, match="param_dtype must be a floating-point torch.dtype"):
        MixedPrecision(param_dtype=torch.int8)
    with pytest.raises(TypeError, match="reduce_dtype must be a floating-point torch.dtype"):
        MixedPrecision(reduce_dtype="bf16")


@pytest.mark.one_rank
def test_inputs_and_outputs_keep_their_containers_types_under_mixed_precision():
    """A Hugging Face-like batch (a UserDict, a dict subclass with its own attributes, a dataclass, a named
    tuple) reaches a wrapped unit with its floating-point tensors cast to bf16 and every container's type kept;
    a ModelOutput-like dict subclass going out still gets the hooks that start the unit's backward."""
    import collections
    import dataclasses

    from fsdp_mpi import Communicator, FullyShardedDataParallel

    class Encoding(collections.UserDict):
        pass

    class Tagged(dict):
        def __init__(self, *args, tag=None, **kwargs):
            super().__init__(*args, **kwargs)
            self.tag = tag

    @dataclasses.dataclass
    class Extra:
        scale: torch.Tensor
        steps: int = 3

    Pair = collections.namedtuple("Pair", "values ids")

    class Output(dict):
        pass

    class Seen(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(2, 2)

        def forward(self, encoding, tagged, extra, pair):
            self.seen = (type(encoding), type(tagged), tagged.tag, type(extra), extra.steps, type(pair),
                         encoding["x"].dtype, tagged["y"].dtype, extra.scale.dtype, pair.values.dtype, pair.ids.dtype)
            return Output(out=self.linear(encoding["x"]).sum() * extra.scale.sum())

    model = FullyShardedDataParallel(Seen(), comm=Communicator(), mixed_precision=MixedPrecision(torch.bfloat16))
    output = model(Encoding(x=torch.ones(3, 2)), Tagged(y=torch.ones(1), tag="kept"), Extra(torch.ones(2)),
                   Pair(torch.ones(1), torch.ones(1, dtype=torch.long)))
    assert model.module.seen == (Encoding, Tagged, "kept", Extra, 3, Pair, torch.bfloat16, torch.bfloat16,
                                 torch.bfloat16, torch.bfloat16, torch.long)
    assert type(output) is Output
    output["out"].float().backward()
    assert all(p.grad is not None for p in model.parameters())  # the unit's backward ran: its reduction too
