"""N ranks against one process, step by step, at the same parameters (run under mpiexec).

Comparing whole training trajectories measures chaos, not sharding: Adam turns the
rounding noise of a gradient that is mathematically zero (an attention key bias)
into steps of size lr, so two correct runs drift apart by an amount that depends
on the CPU. Instead every step is checked where it starts, on the same parameters:

1. gradient: ours (reduce-scattered, gathered here) and one fp32 process on the
   whole global batch are both compared with a float64 process. Sharding must not
   be much less accurate than one process: ||ours - g64|| <= 4 ||fp32 - g64|| plus
   N ulps of ||g64|| (the extra summation over N ranks). Per tensor the same, with
   a floor of that tensor's share of the whole-model fp32 error (pure-noise tensors).
2. loss: |ours - L64| <= 4 max(|L32 - L64|, 16 u |L64|).
3. optimizer: the plain fp32 optimizer, given the same parameters and *our*
   gradients, must produce our next parameters element by element, up to a few
   ulps of the parameter and of its update (the updates are elementwise; only
   fused multiply-adds may round differently).
4. clipping (AdamW runs): fsdp_mpi.clip_grad_norm_ returns torch's norm of the
   same gradients up to the rounding of a float32 sum of n terms (n u relative),
   and scales every gradient by the same factor.

Mixed-precision runs (bf16) compare with one process applying the same policy: the
same fp32 master parameters cast to bf16, inputs cast, the whole global batch. Every
bound above then takes bf16's unit roundoff instead of float32's; the optimizer
check is unchanged (masters and their gradients are float32).

Dropout: our GPT-2 and BERT also train with dropout 0.2 everywhere, drawn per sample
(fsdp_mpi.use_sample_dropout): each process is told which samples of the step it computes,
so every model above draws the same masks, and the same bounds hold.

Each run is a model x optimizer x accumulation mode (x precision). Optimizers use parameter
groups chosen by name (nanoGPT's recipe: no weight decay on biases and norms,
and here a different learning rate per group).

Each run is checked here, on rank 0, as it ends (``check_run``): a run that fails ends the job at once
rather than after every later run (the mutants' runs of these tests stop at their first failed check); the
cheapest parts of a selection run first. The tests read the written report for which runs there were.
"""

import copy
import math
import os
import sys

import torch
from common import (NestedMLP, ResidualBlock, bert_batch, gpt_batch, local_part, mlp_batch, output_path,
                    take_device_argument, write_json)
from gradients import compare_gradients, full_gradients, reference_gradients
from late_arrivals import ArrivingLate
from torch import nn

from fsdp_mpi import (Communicator, CPUOffload, FullyShardedDataParallel, MixedPrecision, ModuleWrapPolicy,
                      SampleDropout, ShardingStrategy, clip_grad_norm_, full_state_dict, use_sample_dropout)

STEPS = 3
U = torch.finfo(torch.float32).eps / 2  # unit roundoff of float32
# FSDP_MPI_TEST_INDUCTOR=0: what would compile with inductor compiles with AOT autograd alone (dynamo, the traced
# collectives and the backward as before; torch's eager kernels). Inductor's kernels are torch's, the same on any
# Python: CI's pass for the oldest Python, whose torch another pass runs with inductor, compiles without them.
INDUCTOR = os.environ.get("FSDP_MPI_TEST_INDUCTOR", "1") != "0"


# ----------------------------------------------------------------- models, batches and losses

def our_gpt2():
    from fsdp_mpi_models.gpt2 import GPT2Block, GPT2LMHeadModel, gpt2_config
    model = GPT2LMHeadModel(gpt2_config("gpt2-tiny"))
    return model, {GPT2Block}, lambda step: gpt_batch(step, model.config.vocab_size), lambda m, *b: m(*b)[1]


def our_bert():
    from fsdp_mpi_models.bert import BertForPreTraining, BertLayer, bert_config
    config = bert_config("bert-tiny", vocab_size=100, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return (BertForPreTraining(config), {BertLayer}, lambda step: bert_batch(step, config.vocab_size),
            lambda m, *b: m(*b)[-1])


def mlp():
    return NestedMLP(), {ResidualBlock}, mlp_batch, lambda m, *b: m(*b)[1]


class TorchEncoderClassifier(nn.Module):
    """nn.TransformerEncoder (which reads its first layer's attributes) under an embedding and a head."""

    def __init__(self, vocab: int = 50, width: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.attention_pool = nn.MultiheadAttention(width, num_heads=2, batch_first=True)
        self.head = nn.Linear(width, 3)

    def forward(self, tokens, labels):
        x = self.encoder(self.embed(tokens))
        pooled, _ = self.attention_pool(x[:, :1], x, x)
        return nn.functional.cross_entropy(self.head(pooled[:, 0]), labels)


def torch_encoder():
    def batch(step):
        generator = torch.Generator().manual_seed(4000 + step)
        return torch.randint(0, 50, (12, 10), generator=generator), torch.randint(0, 3, (12,), generator=generator)
    return (TorchEncoderClassifier(), {nn.TransformerEncoderLayer, nn.MultiheadAttention}, batch,
            lambda m, *b: m(*b))


def hf_gpt2():
    import transformers
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"  # named, or HF warns (and breaks a compiled graph) on every call
    block = type(model.transformer.h[0])
    return model, {block}, lambda step: gpt_batch(step, 64), lambda m, x, y: m(input_ids=x, labels=x).loss


def hf_bert(num_hidden_layers: int = 2):
    import transformers
    config = transformers.BertConfig(num_hidden_layers=num_hidden_layers, hidden_size=32, num_attention_heads=4,
                                     intermediate_size=64, vocab_size=100, max_position_embeddings=32,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = transformers.BertForPreTraining(config)
    layer = type(model.bert.encoder.layer[0])

    def loss(m, input_ids, token_type_ids, attention_mask, mlm_labels, nsp_labels):
        return m(input_ids=input_ids, token_type_ids=token_type_ids, attention_mask=attention_mask,
                 labels=mlm_labels, next_sentence_label=nsp_labels).loss
    return model, {layer}, lambda step: bert_batch(step, 100), loss


def with_dropout(model_kind: str, p: float = 0.2):
    """One of our models with dropout `p` everywhere (embeddings, attention probabilities, residuals), drawn per
    sample (fsdp_mpi.use_sample_dropout): one process draws the masks that N ranks draw for the same samples."""
    def build():
        model, wrap_classes, batch, loss = MODELS[model_kind]()
        for module in model.modules():
            if isinstance(module, nn.Dropout):
                module.p = p
        use_sample_dropout(model, seed=5)
        return model, wrap_classes, batch, loss
    return build


def set_dropout_samples(model: nn.Module, step: int, samples: range) -> None:
    """Tells `model`'s per-sample dropout (where it has one) which samples of step `step`'s batch it computes."""
    keys = next((module.keys for module in model.modules() if isinstance(module, SampleDropout)), None)
    if keys is not None:
        keys.set_batch(step, torch.tensor(samples))


MODELS = {"mlp": mlp, "gpt2": our_gpt2, "bert": our_bert, "torch_encoder": torch_encoder,
          "hf_gpt2": hf_gpt2, "hf_bert": hf_bert}
DROPOUT_MODELS = {"gpt2_dropout": with_dropout("gpt2"), "bert_dropout": with_dropout("bert")}


# ----------------------------------------------------------------- families with their own pitfalls

def hf_albert():
    """ALBERT shares one layer group across all its layers: one unit computes 4 times per forward, and its
    gradient is the sum of 4 uses (a reduction after the first use only would lose three quarters of it)."""
    import transformers
    config = transformers.AlbertConfig(embedding_size=16, hidden_size=32, num_hidden_layers=4, num_hidden_groups=1,
                                       num_attention_heads=4, intermediate_size=64, vocab_size=100,
                                       max_position_embeddings=32, hidden_dropout_prob=0.0,
                                       attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0)
    model = transformers.AlbertForPreTraining(config)
    group = type(model.albert.encoder.albert_layer_groups[0])

    def loss(m, input_ids, token_type_ids, attention_mask, mlm_labels, order_labels):
        return m(input_ids=input_ids, token_type_ids=token_type_ids, attention_mask=attention_mask,
                 labels=mlm_labels, sentence_order_label=order_labels).loss
    return model, {group}, lambda step: bert_batch(step, 100), loss


def hf_bert_frozen():
    """BERT with frozen parts, as fine-tuning recipes freeze them: whole units (the middle layer and the
    pooler, through both of which the gradient must still flow to the layers below) and parameters inside
    units that otherwise train (every layer's attention LayerNorm; the position and segment embeddings in
    the root, whose word embeddings, tied to the output layer, train)."""
    model, (layer,), batch, loss = hf_bert(num_hidden_layers=3)
    pooler = type(model.bert.pooler)
    model.bert.encoder.layer[1].requires_grad_(False)
    model.bert.pooler.requires_grad_(False)
    for block in model.bert.encoder.layer:
        block.attention.output.LayerNorm.requires_grad_(False)
    model.bert.embeddings.position_embeddings.requires_grad_(False)
    model.bert.embeddings.token_type_embeddings.requires_grad_(False)
    return model, {layer, pooler}, batch, loss


FAMILY_MODELS = {"hf_albert": hf_albert, "hf_bert_frozen": hf_bert_frozen}


# ----------------------------------------------------------------- optimizers

def parameter_groups(named_params, lr: float, weight_decay: float) -> list[dict]:
    """nanoGPT's split, by name: decay on weights, none on biases and norms (which also get half the lr)."""
    decay, no_decay = [], []
    for name, param in named_params:
        if not param.requires_grad:
            continue
        no = name.endswith("bias") or any(key in name.lower() for key in ("ln", "norm"))
        (no_decay if no else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay, "lr": lr},
            {"params": no_decay, "weight_decay": 0.0, "lr": lr / 2}]


def make_optimizer(kind: str, named_params):
    if kind == "sgd":
        return torch.optim.SGD(parameter_groups(named_params, 0.05, 0.0), lr=0.05, momentum=0.9)
    return torch.optim.AdamW(parameter_groups(named_params, 2e-3, 0.1), lr=2e-3)


def max_update_size(optimizer) -> float:
    """A bound on |parameter change| / lr per element for one step (SGD: none; AdamW: (1 - b1) / sqrt(1 - b2))."""
    group = optimizer.param_groups[0]
    if "betas" not in group:
        return math.inf
    beta1, beta2 = group["betas"]
    return max(1.0, (1 - beta1) / math.sqrt(1 - beta2)) / (1 - beta1)  # bias correction of the first step


# ----------------------------------------------------------------- one run

def run(model_kind: str, optimizer_kind: str, accumulation: str, comm: Communicator,
        param_dtype: torch.dtype | None = None, compiled: str | None = None,
        device: torch.device = torch.device("cpu"), **wrap) -> dict:
    """Steps of one training run, each checked against one process at the same parameters (eager, whatever
    `compiled` says); `compiled`: "units" compiles each wrapped unit's module in place (``module.compile()``),
    "whole" runs ``torch.compile(model)`` (with AOT autograd but no inductor: tracing around the hooks is
    what it checks, and inductor's kernels are the units' test); "one_rank_whole" compiles the whole model with
    inductor where one rank holds it (each rank alone, as bench.py's ``+compile_whole@1``); `wrap`: more
    FullyShardedDataParallel arguments (a sharding strategy). Ours and the one-process references compute on
    `device`; the comparisons are made on the CPU."""
    if compiled == "one_rank_whole":
        comm = comm.split(comm.rank)
    torch.manual_seed(0)
    initial, wrap_classes, batch_fn, loss_fn = {**MODELS, **DROPOUT_MODELS, **FAMILY_MODELS}[model_kind]()
    reference, reference64 = copy.deepcopy(initial).to(device), copy.deepcopy(initial).to(device, torch.float64)
    # One process with the same policy: computes in param_dtype from the same masters (fp32: `reference` itself).
    same_policy = copy.deepcopy(initial).to(device, param_dtype) if param_dtype else reference
    policy_dtype = param_dtype or torch.float32
    u = torch.finfo(policy_dtype).eps / 2
    if "cpu_offload" in wrap:  # built in host memory, and placed by the wrapper: buffers on `device` only
        wrap = {**wrap, "device": device}
    sharded = FullyShardedDataParallel(copy.deepcopy(initial).to("cpu" if "cpu_offload" in wrap else device),
                                       comm=comm, auto_wrap_policy=ModuleWrapPolicy(wrap_classes),
                                       mixed_precision=MixedPrecision(param_dtype=param_dtype), **wrap)
    calls = compile_model(sharded, wrap_classes, compiled)
    if compiled in WHOLE:
        torch._dynamo.utils.counters.clear()
    optimizer = make_optimizer(optimizer_kind, sharded.named_parameters())
    reference_optimizer = make_optimizer(optimizer_kind, reference.named_parameters())
    micro_batches = 2 if accumulation != "none" else 1
    checks = []
    for step in range(STEPS):
        start = full_state_dict(sharded, rank0_only=False)
        parts = micro_batches * comm.world_size  # the global batch: micro_batches x world_size equal parts
        batch = [t[:t.shape[0] // parts * parts].to(device) for t in batch_fn(step)]
        our_loss = 0.0
        for micro in range(micro_batches):
            part = micro * comm.world_size + comm.rank
            local = [local_part(t, part, parts) for t in batch]
            per_part = batch[0].shape[0] // parts
            set_dropout_samples(sharded, step, range(part * per_part, (part + 1) * per_part))
            syncing = accumulation != "no_sync" or micro == micro_batches - 1
            if syncing:
                loss = loss_fn(calls, *local) / micro_batches
                loss.backward()
            else:
                with sharded.no_sync():
                    loss = loss_fn(calls, *local) / micro_batches
                    loss.backward()
            our_loss += comm.all_reduce_sum_float(loss.item()) / comm.world_size
        if step == 0 and compiled in WHOLE:  # what dynamo made of the first step, wrapped and as one process
            graphs = dynamo_graphs()
        ours = full_gradients(sharded)
        ours_without_gradient = {name for name, p in sharded.named_parameters() if p.requires_grad and p.grad is None}

        losses, grads = {}, {}
        for name, model, dtype in (("policy", same_policy, policy_dtype), ("fp64", reference64, torch.float64)):
            model.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in start.items()})
            model.zero_grad(set_to_none=True)
            set_dropout_samples(model, step, range(batch[0].shape[0]))
            loss = loss_fn(model, *(t.to(dtype) if t.is_floating_point() else t for t in batch))
            loss.backward()
            losses[name], grads[name] = loss.item(), reference_gradients(model, torch.float64)
            if name == "policy":  # which parameters one process leaves without a gradient (our names only)
                reference_without_gradient = {n for n, p in model.named_parameters()
                                              if p.requires_grad and p.grad is None}
        check = compare_gradients(ours, grads["policy"], grads["fp64"], comm.world_size, u)
        check["same_parameters_without_gradient"] = ours_without_gradient == reference_without_gradient
        if "cpu_offload" in wrap:  # the shards and their gradients in host memory, pinned where units use a GPU
            held = [t for p in sharded.parameters() for t in (p, p.grad) if t is not None]
            pinned = device.type == "cuda"
            check["state_in_host_memory"] = all(t.device.type == "cpu" and (t.is_pinned() or not pinned) for t in held)
        check["loss_error"] = abs(our_loss - losses["fp64"])
        check["loss_bound"] = 4 * max(abs(losses["policy"] - losses["fp64"]), 16 * u * abs(losses["fp64"]))

        # The plain optimizer, fed our gradients at the same parameters, must land where ours does.
        if same_policy is not reference:
            reference.load_state_dict(start)
        for name, param in reference.named_parameters(remove_duplicate=False):
            if param.requires_grad:
                param.grad = None if name in ours_without_gradient else ours[name].to(device, copy=True)
        if optimizer_kind == "adamw":
            check.update(compare_clipping(sharded, reference, ours))
            for name, clipped in full_gradients(sharded).items():  # step from exactly our clipped gradients
                if name not in ours_without_gradient:
                    dict(reference.named_parameters(remove_duplicate=False))[name].grad = clipped.to(device)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        reference_optimizer.step()
        check.update(compare_parameters(full_state_dict(sharded, rank0_only=False), reference, start,
                                        reference_optimizer))
        checks.append(check)
    if compiled not in WHOLE:
        return {"steps": checks}
    # Where dynamo breaks a graph is dynamo's alone, whatever compiles the graphs: the unwrapped model is traced
    # for its breaks only (backend "eager"), not compiled again.
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    unwrapped = torch.compile(copy.deepcopy(initial).to(device), backend="eager")
    loss_fn(unwrapped, *[local_part(t.to(device), comm.rank, comm.world_size) for t in batch_fn(0)]).backward()
    return {"steps": checks, "graphs": graphs, "graphs_unwrapped": dynamo_graphs()}


WHOLE = ("whole", "whole_inductor", "one_rank_whole")  # the compiled forms of the whole model


def check_run(name: str, result: dict, comm: Communicator) -> dict:
    """Fails (on rank 0, which writes the report) where a step of run `name` is outside the bounds above, or,
    compiled whole, where dynamo breaks the wrapped model's graph otherwise than the same model's unwrapped: one
    graph per step, or two with no_sync (whether to reduce is a constant of the graph). Returns `result`."""
    if comm.rank != 0:
        return result
    for step, check in enumerate(result["steps"]):
        where = f"{name} step {step}: {check}"
        assert check["grad_error"] <= check["grad_bound"], where
        assert check["worst_tensor_ratio"] <= 1.0, where
        assert check["loss_error"] <= check["loss_bound"], where
        assert check["param_ratio"] <= 1.0, where
        assert check["same_parameters_without_gradient"], where
        assert check.get("state_in_host_memory", True), where
        if "clip_norm_error" in check:
            assert check["clip_norm_error"] <= check["clip_norm_bound"], where
            assert check["clip_scale_error"] <= check["clip_scale_bound"], where
            assert check["clip_inf_norm_equal"], where
    if "graphs" in result:
        wrapped, unwrapped = result["graphs"], result["graphs_unwrapped"]
        assert (wrapped["breaks"], wrapped["break_reasons"]) == (unwrapped["breaks"], unwrapped["break_reasons"]), name
        assert wrapped["graphs"] == unwrapped["graphs"] + ("no_sync" in name), (name, wrapped, unwrapped)
    return result


def dynamo_graphs() -> dict:
    """Dynamo's graph breaks (how many, and their reasons) and the graphs it compiled since its counters were last
    cleared."""
    counters = torch._dynamo.utils.counters
    return {"breaks": sum(counters["graph_break"].values()), "break_reasons": sorted(counters["graph_break"]),
            "graphs": counters["stats"]["unique_graphs"]}


class BlockThatPrints(nn.Module):
    """A block whose forward dynamo cannot trace whole: a print in the middle breaks the graph there."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        x = torch.tanh(self.first(x))
        print(end="")
        return self.second(x)


class PrintingBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks, self.head = nn.ModuleList(BlockThatPrints() for _ in range(2)), nn.Linear(8, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def breaks_inside_a_unit(comm: Communicator) -> dict:
    """Dynamo's breaks compiling (``aot_eager``) a model unwrapped and wrapped, forward and backward, where the
    model's own code breaks the graph inside a unit: two printing blocks and a head (one unit per block), with
    dynamo's defaults, under ``nested_graph_breaks``, and inside a compiled function that calls the model (the
    root traced inline, not around the graph); and HF's GPT-2 with its loss left unnamed (it warns through
    ``logging`` in the root's forward, a break), two steps, with the defaults. Fails (on rank 0) as soon as a case
    ends where wrapping added a break to the model's own, or where it broke nowhere (then it tests nothing)."""
    found = {}
    torch.manual_seed(0)
    printing = PrintingBlocks()
    hf_model, hf_blocks, hf_batch, hf_loss = hf_gpt2()
    hf_model.loss_type = None  # as HF leaves it
    cases = {"printing": (printing, {BlockThatPrints}, lambda m: m(torch.ones(2, 8)).sum(), 1),
             "hf_gpt2": (hf_model, hf_blocks, lambda m: hf_loss(m, *hf_batch(0)), 2)}
    for case, nested, in_function in (("printing", False, False), ("printing", True, False),
                                      ("printing", False, True), ("hf_gpt2", False, False)):
        model, wrap_classes, loss_of, steps = cases[case]
        wrapped = FullyShardedDataParallel(copy.deepcopy(model), comm=comm,
                                           auto_wrap_policy=ModuleWrapPolicy(wrap_classes))
        graphs = {}
        with torch._dynamo.config.patch(nested_graph_breaks=nested):
            for form, candidate in (("unwrapped", model), ("wrapped", wrapped)):
                torch._dynamo.reset()
                torch._dynamo.utils.counters.clear()
                step = (torch.compile(loss_of, backend="aot_eager") if in_function else
                        lambda m, compiled=torch.compile(candidate, backend="aot_eager"): loss_of(compiled))
                for _ in range(steps):
                    step(candidate).backward()
                graphs[form] = dynamo_graphs()
        name = case + ("/nested" if nested else "") + ("/function" if in_function else "")
        found[name] = graphs
        if comm.rank == 0:
            assert graphs["wrapped"]["breaks"] == graphs["unwrapped"]["breaks"] > 0, (name, graphs)
    return found


def compile_model(sharded: FullyShardedDataParallel, wrap_classes: set, compiled: str | None):
    """What the training loop calls: `sharded`, or a compiled form of it (see ``run``), compiled afresh (dynamo
    forgets the earlier runs' graphs: their guards would count as recompilations of the same code)."""
    if compiled is None:
        return sharded
    torch.use_deterministic_algorithms(True)  # inductor's kernels too (common.py sets the eager ones alone)
    torch._dynamo.reset()
    if compiled == "whole":  # dynamo and AOT autograd around the traced collectives; inductor's kernels below
        return torch.compile(sharded, backend="aot_eager")
    backend = {} if INDUCTOR else {"backend": "aot_eager"}
    if compiled in ("whole_inductor", "one_rank_whole"):  # and inductor's kernels, in the order it schedules them
        return torch.compile(sharded, **backend)
    if compiled == "units":
        for module in sharded.modules():
            if isinstance(module, tuple(wrap_classes)):
                module.compile(**backend)
    return sharded


def compare_clipping(sharded, reference, ours: dict) -> dict:
    """Clips ours and the reference's copy of our gradients at a norm below the current one."""
    numel = sum(g.numel() for g in ours.values())
    inf_norm = float(clip_grad_norm_(sharded, math.inf, norm_type=math.inf))  # max_norm inf: nothing scaled
    torch_inf = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), math.inf, norm_type=math.inf))
    torch_norm = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=math.inf))
    max_norm = 0.5 * torch_norm
    our_norm = float(clip_grad_norm_(sharded, max_norm))
    torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
    clipped = full_gradients(sharded)
    scale_error = max(float((clipped[n] - p.grad.cpu()).abs().max() / p.grad.abs().max().clamp(min=1e-30))
                      for n, p in reference.named_parameters(remove_duplicate=False) if p.grad is not None)
    return {"clip_norm_error": abs(our_norm - torch_norm) / torch_norm, "clip_norm_bound": numel * U,
            "clip_scale_error": scale_error, "clip_scale_bound": (numel + 4) * U,
            "clip_inf_norm_equal": inf_norm == torch_inf, "norm": torch_norm}


def compare_parameters(our_state: dict, reference, start: dict, reference_optimizer) -> dict:
    """Elementwise: |ours - reference| <= 8 u (|p| + |update|) with |update| <= lr * (Adam's step bound)."""
    worst, worst_name = 0.0, None
    bound_per_lr = max_update_size(reference_optimizer)
    lr_of = {id(p): g["lr"] for g in reference_optimizer.param_groups for p in g["params"]}
    for name, param in reference.named_parameters(remove_duplicate=False):
        expected = param.detach().cpu()
        update = (expected - start[name]).abs()
        if math.isfinite(bound_per_lr):
            update = torch.maximum(update, torch.full_like(update, lr_of.get(id(param), 0.0) * bound_per_lr))
        bound = 8 * U * (expected.abs() + update) + torch.finfo(torch.float32).tiny
        ratio = float(((our_state[name] - expected).abs() / bound).max()) if expected.numel() else 0.0
        if ratio > worst:
            worst, worst_name = ratio, name
    return {"param_ratio": worst, "param_worst": worst_name}


# Every model with each optimizer, accumulation and bf16 on some (the main matrix); the families above; compiled
# training (the units compiled in place, and the whole model).
# Offloaded first (on a CPU the device is the host too: the same path, the copies free but their gradients
# landing as late as from a GPU, late_arrivals.py), with accumulation and bf16.
MAIN_RUNS = [("gpt2", "adamw", "no_sync", None, None, "offload"), ("bert", "adamw", "sharded", "bf16", None, "offload")]
MAIN_RUNS += [(m, o, "none", None) for m in MODELS for o in ("sgd", "adamw")]
MAIN_RUNS += [("gpt2", "adamw", "sharded", None), ("gpt2", "adamw", "no_sync", None), ("hf_gpt2", "sgd", "no_sync", None)]
MAIN_RUNS += [("gpt2_dropout", "adamw", "sharded", None), ("bert_dropout", "adamw", "none", None)]
MAIN_RUNS += [("mlp", "sgd", "none", "bf16"), ("gpt2", "adamw", "sharded", "bf16"), ("bert", "sgd", "none", "bf16"),
              ("torch_encoder", "adamw", "none", "bf16"), ("hf_gpt2", "adamw", "none", "bf16")]
FAMILY_RUNS = [("hf_albert", "adamw", "none", None), ("hf_albert", "sgd", "no_sync", None),
               ("hf_bert_frozen", "adamw", "none", None), ("hf_bert_frozen", "sgd", "none", "bf16")]
# Compiled whole (dynamo and AOT autograd, eager kernels) with no_sync, with bf16 and every overlap switch, on 3
# ranks (uneven shards). On 2 ranks each unit compiled, HF's GPT-2 whole, inductor whole, and inductor whole
# where each rank holds the whole model alone.
WHOLE_RUNS = [("gpt2", "sgd", "no_sync", None, "whole"), ("bert", "sgd", "none", None, "whole"),
              ("gpt2", "adamw", "sharded", "bf16", "whole", "overlap")]
COMPILED_RUNS = [("gpt2", "adamw", "none", None, "one_rank_whole"), ("gpt2", "adamw", "none", None, "units"),
                 ("hf_gpt2", "sgd", "none", None, "whole"), ("gpt2", "adamw", "none", None, "whole_inductor")]
# On a GPU (``--device cuda``): one model in fp32 (TF32 off) and in bf16, against one process on the same GPU.
GPU_RUNS = [("gpt2", "adamw", "none", None), ("gpt2", "adamw", "sharded", "bf16"),
            ("gpt2", "adamw", "no_sync", "bf16", None, "offload")]
# Across (emulated) nodes, in two levels: the main runs of two models, and SHARD_GRAD_OP's (no backward gather).
NODE_RUNS = [run_ for run_ in MAIN_RUNS if run_[0] in ("mlp", "gpt2") and "offload" not in run_]
NODE_RUNS += [("gpt2", "adamw", "none", None, None, "SHARD_GRAD_OP")]

# More FullyShardedDataParallel arguments for a run, by name.
WRAP_OPTIONS = {"SHARD_GRAD_OP": {"sharding_strategy": ShardingStrategy.SHARD_GRAD_OP},
                "overlap": {"forward_prefetch": True, "backward_prefetch": True, "async_reduce_scatter": True},
                "offload": {"cpu_offload": CPUOffload(offload_params=True)}}

if __name__ == "__main__":
    # argv: output path, then optionally a name in `named` (those runs; "breaks": none, where dynamo breaks the
    # graph inside a unit), or model names (their main runs); --device cuda anywhere: on the GPU.
    device = take_device_argument()
    comm = Communicator()
    selected = sys.argv[2].split(",") if len(sys.argv) > 2 else None
    named = {"families": FAMILY_RUNS, "breaks": [], "compiled": COMPILED_RUNS, "compiled_whole": WHOLE_RUNS, "gpu": GPU_RUNS,
             "nodes": NODE_RUNS}
    if selected is None:
        runs = MAIN_RUNS
    elif len(selected) == 1 and selected[0] in named:
        runs = named[selected[0]]
    else:
        runs = [run_ for run_ in MAIN_RUNS if run_[0] in selected]
    results = {}
    if selected == ["breaks"]:
        results["breaks_inside_a_unit"] = breaks_inside_a_unit(comm)
    for m, o, a, p, *more in runs:  # more: compiled, then WRAP_OPTIONS' name
        compiled, options = (more + [None, None])[:2]
        wrap = WRAP_OPTIONS[options] if options else {}
        if options == "offload" and device.type == "cpu":  # gradients coming home as late as from a GPU
            wrap = {"cpu_offload": ArrivingLate()}
        name = "/".join(filter(None, (m, o, a, p, compiled, options)))
        results[name] = check_run(name, run(m, o, a, comm, p and torch.bfloat16, compiled, device=device, **wrap),
                                  comm)
    write_json(output_path(), results)
