"""Sampling from wrapped models, and what a wrapped model looks like from outside (run under mpiexec).

Our GPT-2 goes through fsdp_mpi_models.gpt2.generate (which calls the wrapper); Hugging Face's
GPT2LMHeadModel through its own generate(), which calls the inner model directly,
reads its embeddings and its device: the hooks on the wrapped module must gather.
"""

import copy

import torch
from common import output_path, write_json

from fsdp_mpi import Communicator, FullyShardedDataParallel, ModuleWrapPolicy
from fsdp_mpi_models.gpt2 import GPT2Block, GPT2LMHeadModel, generate, gpt2_config


def views_report(plain, sharded, comm: Communicator) -> dict:
    """Names, and per name the elements every rank holds, against the plain model."""
    ours = list(sharded.named_parameters())
    numel_by_rank = comm.all_gather_object([p.numel() for _, p in ours])
    return {
        "same_names": [n for n, _ in ours] == [n for n, _ in plain.named_parameters()],
        "parts_add_up": [sum(column) for column in zip(*numel_by_rank)] == [p.numel() for p in plain.parameters()],
        "all_one_dimensional": all(p.dim() == 1 for _, p in ours),
    }


def gathered_anywhere(model) -> bool:
    return any(h.gathered_bytes for m in model.modules() if isinstance(m, FullyShardedDataParallel) for h in m.handles)


def hugging_face_generate(comm: Communicator) -> dict:
    import transformers
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=64,
                                     bos_token_id=0, eos_token_id=63, pad_token_id=0)
    plain = transformers.GPT2LMHeadModel(config).eval()
    block = type(plain.transformer.h[0])
    sharded = FullyShardedDataParallel(copy.deepcopy(plain), comm=comm, auto_wrap_policy=ModuleWrapPolicy({block}))
    prompt = torch.tensor([[5, 6, 7, 8]])
    options = dict(max_new_tokens=10, do_sample=False, min_new_tokens=10)
    from_sharded = sharded.generate(prompt, **options)  # the wrapper falls through to the model's generate()
    from_plain = plain.generate(prompt, **options)
    wte = sharded.transformer.wte.weight  # outside computation: this rank's sharded view
    return {
        "hf_matches_plain": torch.equal(from_sharded, from_plain),
        "hf_length": from_sharded.shape[1],
        "hf_resharded_after": not gathered_anywhere(sharded),
        "hf_wte_at_rest_is_view": isinstance(wte, torch.nn.Parameter) and wte.dim() == 1,
        "hf_lm_head_tied_to_wte": sharded.lm_head.weight is wte,
        **{f"hf_{key}": value for key, value in views_report(plain, sharded, comm).items()},
    }


if __name__ == "__main__":
    comm = Communicator()
    torch.manual_seed(0)
    plain = GPT2LMHeadModel(gpt2_config("gpt2-tiny"))
    sharded = FullyShardedDataParallel(copy.deepcopy(plain), comm=comm, auto_wrap_policy=ModuleWrapPolicy({GPT2Block}))
    prompt = torch.tensor([[1, 2, 3]])
    from_sharded = generate(sharded, prompt, 12, top_k=10, generator=torch.Generator().manual_seed(5))
    from_plain = generate(plain, prompt, 12, top_k=10, generator=torch.Generator().manual_seed(5))
    same_everywhere = comm.all_gather_object(from_sharded.tolist())
    write_json(output_path(), {
        "matches_plain": torch.equal(from_sharded, from_plain),
        "same_on_all_ranks": all(tokens == same_everywhere[0] for tokens in same_everywhere),
        "length": from_sharded.shape[1],
        **views_report(plain, sharded, comm),
        **hugging_face_generate(comm),
    })
