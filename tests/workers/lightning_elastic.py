"""A Lightning Trainer under ``fsdp_mpi.lightning_elastic.fit_elastic`` that loses a rank, goes on shrunk and grows
back into a host added to its hosts file, against plain torch in one process (tests/test_lightning.py).

    python lightning_elastic.py OUT STRATEGY KILL_RANKS KILL_STEP HOSTS_STEP HOSTS [REBUILD_KILL]

The module trains the same tiny regression as lightning_strategy.py, sharded by STRATEGY (FULL_SHARD,
HYBRID_SHARD: its shard groups the nodes), one optimizer step per epoch:
every step's global batch is the whole dataset of SAMPLES, each rank's part cut anew on the ranks of the moment
(SAMPLES // ranks in order, as Lightning's DistributedSampler without shuffling gives), so a resumed Trainer
continues at the same samples. A checkpoint is saved every 2 steps into OUT/checkpoints. The ranks of the job in
KILL_RANKS (a comma-separated list) send themselves SIGKILL as they start the training step KILL_STEP (the others
are in the root unit's all-gather), as a node that dies; newcomers started in their places do not. The rank
REBUILD_KILL then dies as the survivors build their Trainer again (the others are in the recovery). Rank 0
writes HOSTS into OUT/hosts (the run's hosts file) once HOSTS_STEP steps are taken. At the end, rank 0 of the
ranks left writes OUT/result.json: each step's loss over the global batch, its number of ranks and the size of
its shard groups (the last taking of a step taken again), when each taking began (step, ranks, time: the
recovery times in the docs), the recoveries, the final weights' largest difference from the reference's, and
the reference's gradient norms and weight scale (for the bound).
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from fsdp_mpi import Elastic, exit_without_finalize, full_state_dict
from fsdp_mpi.communication.failures.job import is_newcomer, job_rank
from fsdp_mpi.lightning import FSDPMPIStrategy
from fsdp_mpi.lightning_elastic import fit_elastic

from lightning_strategy import LR, MOMENTUM, WIDTH, dataset  # the same regression

SAMPLES, STEPS, EVERY = 12, 6, 2


def network() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()),
                         nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()), nn.Linear(WIDTH, 1))


class Regression(L.LightningModule):
    def __init__(self, record: dict, kill: tuple[set[int], int], hosts: tuple[int, Path, str]):
        super().__init__()
        self.net, self.record, self.kill, self.hosts = network(), record, kill, hosts

    def training_step(self, batch, _index):
        step, ranks = self.trainer.global_step, self.trainer.strategy.world_size
        self.record["starts"].append((step, ranks, time.time()))  # when each step was (last) begun, for the docs
        if job_rank() in self.kill[0] and step == self.kill[1] and not is_newcomer():
            os.kill(os.getpid(), signal.SIGKILL)
        inputs, targets = batch
        loss = nn.functional.mse_loss(self.net(inputs), targets)
        # the mean over the global batch: every rank's part has as many samples
        self.record["losses"][step] = self.trainer.strategy.reduce(loss.detach(), reduce_op="mean").item()
        self.record["ranks"][step] = ranks
        self.record["shard_group"][step] = self.trainer.strategy.model.groups.shard.world_size
        return loss

    def on_train_batch_end(self, outputs, batch, batch_index):
        step, path, hosts = self.hosts
        if self.trainer.global_step == step and self.trainer.strategy.global_rank == 0:
            path.write_text(f"# the hosts the job may grow into\n{hosts}\n")

    def train_dataloader(self):
        strategy = self.trainer.strategy
        sampler = DistributedSampler(dataset(SAMPLES), shuffle=False, **strategy.distributed_sampler_kwargs)
        return DataLoader(dataset(SAMPLES), batch_size=SAMPLES // strategy.world_size, sampler=sampler)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=MOMENTUM)


def reference() -> tuple[list[float], list[float], dict]:
    """Plain torch in one process on the whole dataset: each step's loss, gradient norm, and the final weights."""
    net, (inputs, targets) = network(), dataset(SAMPLES).tensors
    optimizer = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
    losses, norms = [], []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(net(inputs), targets)
        loss.backward()
        losses.append(loss.item())
        norms.append(torch.cat([p.grad.flatten() for p in net.parameters()]).norm().item())
        optimizer.step()
    return losses, norms, {f"net.{name}": value.detach() for name, value in net.state_dict().items()}


def main() -> None:
    out, strategy, kill_step, hosts_step, hosts = (Path(sys.argv[1]), sys.argv[2], int(sys.argv[4]),
                                                   int(sys.argv[5]), sys.argv[6])
    kill = ({int(rank) for rank in sys.argv[3].split(",")}, kill_step)
    rebuild_kill = int(sys.argv[7]) if len(sys.argv) > 7 else None
    record, elastic = {"losses": {}, "ranks": {}, "shard_group": {}, "starts": []}, Elastic()

    def build(comm):
        if job_rank() == rebuild_kill and comm.world_size < 4 and not is_newcomer():  # the first rebuild
            os.kill(os.getpid(), signal.SIGKILL)
        trainer = L.Trainer(strategy=FSDPMPIStrategy(comm=comm, auto_wrap_policy={nn.Sequential},
                                                     sharding_strategy=strategy),
                            accelerator="cpu", devices=comm.world_size, max_steps=STEPS, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        return trainer, Regression(record, kill, (hosts_step, out / "hosts", hosts))

    trainer = fit_elastic(build, out / "checkpoints", EVERY, grow_back=True, hosts_file=out / "hosts",
                          elastic=elastic)
    weights = full_state_dict(trainer.strategy.model)
    if trainer.strategy.global_rank == 0 and not elastic.newcomer:
        losses, norms, final = reference()
        difference = max((weights[name].float() - value).abs().max().item() for name, value in final.items())
        (out / "result.json").write_text(json.dumps({
            "losses": [record["losses"][step] for step in range(STEPS)],
            "ranks": [record["ranks"][step] for step in range(STEPS)], "recoveries": elastic.recoveries,
            "shard_groups": [record["shard_group"][step] for step in range(STEPS)],
            "starts": record["starts"],
            "lost_ranks": elastic.lost_ranks, "reference_losses": losses, "gradient_norms": norms,
            "weight_difference": difference,
            "scale": max(value.abs().max().item() for value in final.values())}))
    if elastic.lost_ranks:  # MPI's finalize may wait forever for the lost
        exit_without_finalize(0)


if __name__ == "__main__":
    main()
