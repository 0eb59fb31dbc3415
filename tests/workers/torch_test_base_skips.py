"""What torch's test base (torch_test_base.py) does not run here, and why: one place, each with its reason.

torch's own skips (CUDA without a GPU, a world size not started, a feature only one backend has) are reported as
torch words them; these are the ones this project adds, for the backend under test or for any ("any").
"""

TORCH_NAMES_GLOO = "torch's own API accepts only gloo's groups here (it raises ValueError before any backend is asked)"

SKIPPED: dict[str, dict[str, str]] = {
    "test_get_backend": {"fsdp_mpi": "asserts that the backend's name is the gate's (mpi or gloo), torch's own names"},
    "test_monitored_barrier_gloo": {"fsdp_mpi": TORCH_NAMES_GLOO},
    "test_monitored_barrier_gloo_subgroup": {"fsdp_mpi": TORCH_NAMES_GLOO},
    "test_monitored_barrier_gloo_rank_0_timeout": {"fsdp_mpi": TORCH_NAMES_GLOO},
    "test_monitored_barrier_failure_order": {"fsdp_mpi": TORCH_NAMES_GLOO},
    "test_monitored_barrier_wait_all_ranks": {"fsdp_mpi": TORCH_NAMES_GLOO},
}


def skipped_here(name: str, backend: str) -> str | None:
    """Why `name` is not run for `backend`, or None."""
    reasons = SKIPPED.get(name, {})
    return reasons.get(backend) or reasons.get("any")
