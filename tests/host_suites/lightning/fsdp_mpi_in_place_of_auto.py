"""A pytest plugin for Lightning's own test suite: wherever Lightning would choose its one-device strategy on
the CPU (``Trainer(strategy="auto")``, one device: most of its tests), it gets ``FSDPMPIStrategy()`` instead.

Loaded by run_lightning_tests.py (``pytest -p fsdp_mpi_in_place_of_auto``). Tests that name a strategy of
their own keep it; one rank (no mpiexec) shards over one process, so each of Lightning's checks meets the
strategy's every hook: wrapping, the step, checkpoints, restoring, teardown.
"""


def pytest_configure(config):
    from lightning.pytorch.strategies import SingleDeviceStrategy
    from lightning.pytorch.trainer.connectors import accelerator_connector

    from fsdp_mpi.lightning import FSDPMPIStrategy

    connector = accelerator_connector._AcceleratorConnector
    chosen_by_lightning = connector._choose_strategy

    def fsdp_mpi_in_place_of_one_cpu(self):
        strategy = chosen_by_lightning(self)
        if isinstance(strategy, SingleDeviceStrategy) and strategy.root_device.type == "cpu":
            return FSDPMPIStrategy()
        return strategy

    connector._choose_strategy = fsdp_mpi_in_place_of_one_cpu
