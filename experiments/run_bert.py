"""Pre-train BERT (masked-LM + next sentence) on Cornell movie dialogues; write one CSV row per epoch.

    mpiexec -n 2 python experiments/run_bert.py                 # bert-tiny, 60 epochs: 5-9 minutes on 2 cores
    mpiexec -n 2 python experiments/run_bert.py --model bert-seed --strategy torch-fsdp
"""

import sys

import torch
from corpora.datasets import IGNORE_INDEX, MASK_FRACTION, cornell_pairs
from corpora.files import default_data_dir
from corpora.tokenization import BertTokenizer
from training.options import RunConfig, UsageError, argument_parser
from training.run import main

from fsdp_mpi_models.bert import BERT_CONFIGS, BertForPreTraining, BertLayer, bert_config
from fsdp_mpi_models.cross_entropy import cross_entropy


class BertTask:
    """BERT pre-training on sentence pairs; validation reports masked-LM and NSP accuracy."""

    block_class = BertLayer

    def __init__(self, config: RunConfig, comm):
        data_dir = default_data_dir(config.data_dir)
        dropout = {} if config.dropout is None else {"hidden_dropout_prob": config.dropout,
                                                     "attention_probs_dropout_prob": config.dropout}
        self.config = bert_config(config.model, gradient_checkpointing=config.gradient_checkpointing, **dropout)
        if config.seq_len > self.config.max_position_embeddings:
            raise UsageError(f"--seq-len {config.seq_len} exceeds {config.model}'s "
                             f"{self.config.max_position_embeddings} positions")
        if config.seq_len < 8:
            raise UsageError("--seq-len must be at least 8 for sentence pairs")
        self.tokenizer = BertTokenizer(data_dir, not config.no_download)
        if self.tokenizer.vocab_size != self.config.vocab_size:
            raise UsageError(f"the vocabulary has {self.tokenizer.vocab_size} tokens, "
                             f"{config.model} expects {self.config.vocab_size}")
        self.train, self.val, corpus = cornell_pairs(data_dir, self.tokenizer, config.seq_len, config.seed,
                                                     not config.no_download)
        if comm.rank == 0:
            print(f"Cornell: {len(corpus.dialogues):,} of {corpus.total:,} conversations used "
                  f"({corpus.skipped:,} skipped: lines missing from movie_lines); "
                  f"{len(self.train):,} training and {len(self.val):,} validation sentence pairs", flush=True)
        self.seq_len = config.seq_len
        self.model_name = config.model

    def build_model(self) -> BertForPreTraining:
        return BertForPreTraining(self.config)

    def training_flops_per_token(self, model: BertForPreTraining) -> float:
        return model.training_flops_per_token(self.seq_len, predicted_fraction=MASK_FRACTION)

    def _forward(self, model, batch):
        """(masked-LM logits (positions, vocab) at the predicted positions only, NSP logits (B, 2), their labels,
        the predicted positions (B, T))."""
        input_ids, token_type_ids, attention_mask, mlm_labels, nsp_labels = batch
        predicted = mlm_labels != IGNORE_INDEX
        mlm_logits, nsp_logits, _ = model(input_ids, token_type_ids, attention_mask, predict_positions=predicted)
        return mlm_logits, nsp_logits, mlm_labels[predicted], nsp_labels, predicted

    def _sample_losses(self, mlm_logits, nsp_logits, mlm_labels, nsp_labels, predicted):
        token_losses = cross_entropy(mlm_logits, mlm_labels, reduction="none")  # (positions,)
        samples = predicted.nonzero()[:, 0]  # the sample each predicted position belongs to
        mlm_sums = torch.zeros(len(nsp_labels), device=token_losses.device).index_add(0, samples, token_losses)
        per_sample_mlm = mlm_sums / predicted.sum(dim=1).clamp(min=1)
        return per_sample_mlm + cross_entropy(nsp_logits, nsp_labels, reduction="none")

    def sample_losses(self, model, batch):
        """Per sample: mean masked-LM loss over its predicted tokens plus its NSP loss."""
        return self._sample_losses(*self._forward(model, batch))

    def eval_sums(self, model, batch) -> dict:
        outputs = self._forward(model, batch)
        mlm_logits, nsp_logits, mlm_labels, nsp_labels, _ = outputs
        losses = self._sample_losses(*outputs)
        return {
            "loss_sum": losses.sum().item(), "count": float(len(losses)),
            "mlm_correct": (mlm_logits.argmax(-1) == mlm_labels).sum().item(), "mlm_total": float(len(mlm_labels)),
            "nsp_correct": (nsp_logits.argmax(-1) == nsp_labels).sum().item(),
        }

    def val_columns(self, sums: dict) -> dict:
        return {
            "val_loss": round(sums["loss_sum"] / sums["count"], 5),
            "val_mlm_accuracy": round(sums["mlm_correct"] / max(sums["mlm_total"], 1), 5),
            "val_nsp_accuracy": round(sums["nsp_correct"] / sums["count"], 5),
        }


def parser():
    return argument_parser(__doc__.splitlines()[0], list(BERT_CONFIGS), {
        "model": "bert-tiny", "epochs": 60, "steps_per_epoch": 0, "batch_size": 16, "seq_len": 64, "lr": 1e-3})


if __name__ == "__main__":
    sys.exit(main(BertTask, RunConfig, parser(), "bert"))
