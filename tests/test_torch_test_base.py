"""torch's own tests of a process-group backend (``DistributedTest._DistTestBase``, shipped in the torch wheel)
against the fsdp_mpi backend, as torch ran them for its MPI backend: every rank of one mpiexec job runs every test
in the same order (workers/torch_test_base.py), every CPU test that torch opens to its MPI backend or to gloo
included. A test that hangs or ends its job is recorded as such, and a fresh job goes on after it
(harness/torch_test_jobs.py), as torch gives each test fresh processes.

What may not run is what this machine cannot give (CUDA, a GPU per rank) and what is listed with its reason in
workers/torch_test_base_skips.py; everything else must pass.
"""

import os
import re

import pytest
from torch_test_jobs import run_test_base

pytest.importorskip("expecttest")  # torch's test utilities import it (the test extra installs it)

# Why a test that torch's MPI or gloo test set opens may still be skipped: torch's own skip inside the test (a GPU
# per rank, CUDA, a world size not started) or ours ("here: ...", torch_test_base_skips.py).
MAY_SKIP = re.compile(r"CUDA|GPU|world size|^here: ")
# The collectives and messages themselves: what depends on the MPI library, run under every MPI of CI.
CORE = (r"test_(all_reduce|all_gather|reduce_scatter|reduce|broadcast|barrier|scatter|gather|all_to_all|send_recv|"
        r"isend|irecv|batch_isend_irecv)\w*")
SMALL_WORLD = "Skipped due to small world size."  # torch opens these to 8 ranks or more (or to its MPI backend)


def check(outcomes) -> None:
    assert outcomes.named("hung", "crashed", "error", "failed", "started") == {}
    opened = {name: why for name, why in outcomes.named("skipped").items() if outcomes.gate[name] != "closed"}
    assert {name: why for name, why in opened.items() if not MAY_SKIP.search(why)} == {}
    assert outcomes.counts()["passed"] > 0


def test_torchs_own_tests_of_a_backend_pass_on_fsdp_mpi(tmp_path):
    """On 3 ranks (a group of ranks 1 and 2 beside rank 0, as torch's group tests need); under a second MPI, the
    collectives and messages alone. Under the first, on 4 ranks as well (an even world: torch's tests split it
    otherwise), and the tests torch opens only to 8 ranks again on 8."""
    second_mpi = bool(os.environ.get("FSDP_MPI_SECOND_MPI"))
    outcomes = run_test_base("fsdp_mpi", 3, tmp_path / "3", [CORE] if second_mpi else [])
    check(outcomes)
    if second_mpi:
        return
    check(run_test_base("fsdp_mpi", 4, tmp_path / "4"))
    larger = [name for name, why in outcomes.named("skipped").items() if why == SMALL_WORLD]
    assert larger  # torch's group and timeout tests (it runs them for gloo on 8 ranks)
    check(run_test_base("fsdp_mpi", 8, tmp_path / "8", larger))
