"""Train GPT-2 on Tiny Shakespeare under fsdp_mpi or a baseline; write one CSV row per epoch.

    mpiexec -n 2 python experiments/run_gpt2.py                 # gpt2-tiny, characters, under a minute
    mpiexec -n 2 python experiments/run_gpt2.py --model gpt2-seed --seq-len 256 --strategy lightning-ddp
"""

import math
import sys
from dataclasses import dataclass, replace

from corpora.datasets import shakespeare_windows
from corpora.files import default_data_dir
from corpora.tokenization import CharTokenizer, GPT2Tokenizer, save_description
from training.options import RunConfig, UsageError, argument_parser
from training.run import main

from fsdp_mpi_models.cross_entropy import cross_entropy
from fsdp_mpi_models.gpt2 import GPT2_CONFIGS, GPT2Block, GPT2LMHeadModel, gpt2_config


@dataclass(frozen=True, kw_only=True)
class GPT2RunConfig(RunConfig):
    tokenizer: str  # "char" (65 tokens) or "gpt2" (BPE, 50,257)


class GPT2Task:
    """Next-token prediction on Tiny Shakespeare; validation reports loss and perplexity."""

    block_class = GPT2Block

    def __init__(self, config: GPT2RunConfig, comm):
        data_dir = default_data_dir(config.data_dir)
        download = not config.no_download
        if config.tokenizer == "char":
            make_tokenizer = CharTokenizer.from_text
        else:
            make_tokenizer = lambda _text: GPT2Tokenizer(data_dir, download)  # noqa: E731
        dropout = {} if config.dropout is None else {"dropout": config.dropout}
        self.config = gpt2_config(config.model, gradient_checkpointing=config.gradient_checkpointing, **dropout)
        if config.seq_len > self.config.n_positions:
            raise UsageError(f"--seq-len {config.seq_len} exceeds {config.model}'s context of "
                             f"{self.config.n_positions}")
        self.tokenizer, self.train, self.val = shakespeare_windows(data_dir, make_tokenizer, config.seq_len, download)
        self.config = replace(self.config, vocab_size=self.tokenizer.vocab_size)
        self.seq_len = config.seq_len
        self.model_name = config.model

    def build_model(self) -> GPT2LMHeadModel:
        return GPT2LMHeadModel(self.config)

    def sample_losses(self, model, batch):
        inputs, targets = batch
        logits, _ = model(inputs)  # (B, T, vocab)
        token_losses = cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
        return token_losses.view(targets.shape).mean(dim=1)  # (B,)

    def eval_sums(self, model, batch) -> dict:
        losses = self.sample_losses(model, batch)
        return {"loss_sum": losses.sum().item(), "count": float(len(losses))}

    def val_columns(self, sums: dict) -> dict:
        loss = sums["loss_sum"] / sums["count"]
        return {"val_loss": round(loss, 5), "val_perplexity": round(math.exp(min(loss, 50)), 4)}

    def save_extras(self, directory) -> None:
        """The tokenizer, so that sample.py can turn text into tokens and back."""
        save_description(self.tokenizer, directory)


def parser():
    result = argument_parser(__doc__.splitlines()[0], list(GPT2_CONFIGS), {
        "model": "gpt2-tiny", "epochs": 3, "steps_per_epoch": 150, "batch_size": 16, "seq_len": 64, "lr": 3e-3})
    result.add_argument("--tokenizer", default="char", choices=("char", "gpt2"),
                        help="characters (65 tokens) or GPT-2's BPE (50,257)")
    return result


if __name__ == "__main__":
    sys.exit(main(GPT2Task, GPT2RunConfig, parser(), "gpt2"))
