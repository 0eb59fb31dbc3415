"""Print text sampled from a GPT-2 saved by ``run_gpt2.py --save-dir``.

    python experiments/sample.py runs/shakespeare --prompt "ROMEO:" --max-new-tokens 300
    mpiexec -n 2 python experiments/sample.py runs/shakespeare    # sharded: every rank samples, rank 0 prints
"""

import argparse
import json
import sys
from pathlib import Path

import torch
from corpora.files import DataError, default_data_dir
from corpora.tokenization import tokenizer_from_description
from training.startup import communicator_for_the_run

from fsdp_mpi import FullyShardedDataParallel, ModuleWrapPolicy
from fsdp_mpi_models.checkpoint import PretrainedCheckpointError
from fsdp_mpi_models.gpt2 import GPT2Block, GPT2LMHeadModel, generate


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", help="a directory written by run_gpt2.py --save-dir")
    parser.add_argument("--prompt", default="\n")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-dir", default=None, help="where the GPT-2 vocabulary is, for BPE models")
    args = parser.parse_args()
    comm = communicator_for_the_run(parser.prog)
    if comm is None:
        return 2
    torch.set_num_threads(1)
    try:
        if args.max_new_tokens < 1 or args.temperature <= 0:
            raise ValueError("--max-new-tokens must be positive and --temperature greater than 0")
        description = Path(args.model_dir) / "tokenizer.json"
        if not description.is_file():
            raise DataError(f"{description} is missing: is {args.model_dir} a run_gpt2.py --save-dir directory?")
        tokenizer = tokenizer_from_description(json.loads(description.read_text()), default_data_dir(args.data_dir))
        model = GPT2LMHeadModel.from_pretrained(args.model_dir, dropout=0.0)
        prompt = torch.tensor([tokenizer.encode(args.prompt)], dtype=torch.long)
    except (DataError, PretrainedCheckpointError, ValueError) as error:
        if comm.rank == 0:
            print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 2
    if comm.world_size > 1:
        model = FullyShardedDataParallel(model, comm=comm, auto_wrap_policy=ModuleWrapPolicy({GPT2Block}))
    tokens = generate(model, prompt, args.max_new_tokens, args.temperature, args.top_k,
                      torch.Generator().manual_seed(args.seed))
    if comm.rank == 0:
        print(tokenizer.decode(tokens[0].tolist()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
