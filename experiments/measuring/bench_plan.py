"""bench.py's ``--strategies``: each ``NAME[+OPTION...][:PRECISION][@RANKS]`` read into a ``Spec`` and checked
before anything is launched, and what the options mean, for bench.py and for the bench worker that reads them back
from its ``--overlap``. bench.py's docstring says what each option measures.

Importable without fsdp_mpi: bench.py launches the ranks and is not one, so it must not start MPI itself (some
clusters' MPI expects every MPI process to come from its launcher).
"""

from dataclasses import dataclass

from measuring.costmodel import SHARDING_STRATEGIES
from training.choices import BACKENDS, COMPRESSING, PRECISIONS, compression_formats

BENCHED = ("plain", "fsdp-mpi", "torch-fsdp", "ddp", "lightning-ddp")  # plain torch, training's but Lightning's FSDPs
REPLICATED = ("plain", "ddp", "lightning-ddp")  # every rank holds the whole model state
COMPILED = ("plain", "fsdp-mpi", "torch-fsdp")  # those that take +compile or +compile_whole
ON_TORCH_DISTRIBUTED = ("ddp", "torch-fsdp")  # those that take +backend= (lightning-ddp is timed on gloo)
CPU_ONLY = ("lightning-ddp",)  # those timed on the CPU alone

OVERLAP = ("forward_prefetch", "backward_prefetch", "async_reduce_scatter")  # any subset, each switched on
COMPILE = "compile"  # each GPT-2 block (BERT layer) compiled in place after wrapping: block.compile(), inductor
COMPILE_WHOLE = "compile_whole"  # the whole (wrapped) model: torch.compile(model), inductor
COMPILING = (COMPILE, COMPILE_WHOLE)  # one of them per strategy
THROUGH_MPI = "mpi"  # the node's ranks exchange through MPI, not the memory they share
FLAT = "flat"  # a group spanning nodes goes through one flat ring, not in two levels
OFFLOAD = "offload"  # shards, gradients and optimizer state in host memory: fsdp-mpi's CPUOffload, FSDP2's policy
STEP_IN_BACKWARD = "step_in_backward"  # fsdp-mpi's optimizer steps each unit inside backward (step_in_backward)
SYNC_COPIES = "sync_copies"  # offloaded, copies the host waits for instead of on streams of their own
SAMPLE_DROPOUT = "sample_dropout"  # dropout drawn per sample (fsdp_mpi.use_sample_dropout), as the experiments train
VARIABLES = {THROUGH_MPI: {"FSDP_MPI_NODE_TRANSPORT": "0"}, FLAT: {"FSDP_MPI_TWO_LEVEL": "0"},  # set for the run
             SYNC_COPIES: {"FSDP_MPI_OFFLOAD_STREAMS": "0"}}
# fsdp-mpi's alone; a sharding strategy (fsdp-mpi+NO_SHARD) replaces --sharding-strategy for that run
FSDP_MPI_SWITCHES = (*OVERLAP, *SHARDING_STRATEGIES, THROUGH_MPI, FLAT, OFFLOAD, STEP_IN_BACKWARD, SYNC_COPIES)
COMPRESSION = "comm="  # comm=WEIGHTS[/GRADIENTS]: --comm-compression's, for training's COMPRESSING strategies
BACKEND = "backend="  # backend=NAME: torch.distributed's, one of training's BACKENDS (auto: leave it out)


class PlanError(ValueError):
    """A --strategies entry that cannot run, with the reason; bench.py exits with it as a usage error."""


@dataclass(frozen=True)
class Spec:
    """One strategy of the plan, ``NAME[+OPTION...][:PRECISION]`` read into its parts."""

    name: str  # as given
    strategy: str  # NAME[+OPTION...]: the strategy's row
    base: str  # NAME
    options: tuple[str, ...]  # the +OPTIONs but backend=, as the worker's --overlap takes them
    backends: tuple[str, ...]  # the names after +backend= (one at the most)
    precision: str  # the experiments' --precision: after the colon, 32 without

    @property
    def backend(self) -> str:
        """The worker's --backend: the one +backend= names, auto without."""
        return self.backends[0] if self.backends else "auto"


def read_spec(name: str) -> Spec:
    """`name`, ``NAME[+OPTION...][:PRECISION]``, in its parts (unchecked: ``check_spec``)."""
    strategy, _, precision = name.partition(":")
    base, *tokens = strategy.split("+")
    options = tuple(token for token in tokens if not token.startswith(BACKEND))
    backends = tuple(token.removeprefix(BACKEND) for token in tokens if token.startswith(BACKEND))
    return Spec(name, strategy, base, options, backends, precision or "32")


def read_plan(strategies: str, ranks: int, device: str) -> list[tuple[str, int]]:
    """--strategies, comma-separated, checked: each ``NAME[+OPTION...][:PRECISION]`` with its rank count (after
    @, else one for plain and `ranks` for the others). Raises PlanError for an entry that cannot run."""
    plan = []
    for item in strategies.split(","):
        name, _, count = item.strip().partition("@")
        spec = read_spec(name)
        check_spec(spec, item, device)
        if count and not count.isdigit():
            raise PlanError(f"{item!r}: the rank count after @ must be a number")
        plan.append((name, int(count) if count else 1 if spec.base == "plain" else ranks))
    return plan


def check_spec(spec: Spec, item: str, device: str) -> None:
    """Raises PlanError, naming the spec or the whole `item` (with its @RANKS), for a spec that cannot run."""
    if not (spec.base in BENCHED and switches_fit(spec) and backend_fits(spec)
            and (spec.base in COMPRESSING or not compressions(spec.options))):
        raise PlanError(f"unknown strategy {spec.name!r}")
    for text in compressions(spec.options):
        try:
            compression_formats(text)
        except ValueError as error:
            raise PlanError(f"{item!r}: {error}") from None
    if spec.base in CPU_ONLY and device == "cuda":
        raise PlanError(f"{spec.base} is benchmarked on the CPU only; on a GPU compare plain, fsdp-mpi and torch-fsdp")
    if spec.precision not in PRECISIONS:
        raise PlanError(f"{item!r}: the precision after : must be one of {', '.join(PRECISIONS)}")
    if SYNC_COPIES in spec.options and OFFLOAD not in spec.options:
        raise PlanError(f"{item!r}: sync_copies changes the copies of an offloaded run; add +offload")
    if STEP_IN_BACKWARD in spec.options and spec.precision == "16-mixed":
        raise PlanError(f"{item!r}: fp16's loss scaling would have to skip steps taken inside backward already; "
                        "step_in_backward trains in 32 or bf16-mixed")


def switches_fit(spec: Spec) -> bool:
    """Whether every switch (the options but comm=) is known and fits the strategy: fsdp-mpi's own on
    fsdp-mpi alone (offload on torch-fsdp too), one sharding strategy and one way of compiling at the most,
    compiling where it is offered, per-sample dropout on all but Lightning's (whose loop is its own)."""
    switches = {option for option in spec.options if not option.startswith(COMPRESSION)}
    compiling = switches & set(COMPILING)
    shared = {SAMPLE_DROPOUT, *([OFFLOAD] if spec.base == "torch-fsdp" else [])}  # beyond fsdp-mpi
    return (switches <= {*FSDP_MPI_SWITCHES, *COMPILING, SAMPLE_DROPOUT}
            and (spec.base == "fsdp-mpi" or not switches - compiling - shared)
            and (spec.base not in CPU_ONLY or SAMPLE_DROPOUT not in switches)
            and len(switches & set(SHARDING_STRATEGIES)) <= 1 and len(compiling) <= 1
            and (spec.base in COMPILED or not compiling))


def backend_fits(spec: Spec) -> bool:
    """Whether +backend= is left out, or given once, naming a backend other than auto, to a strategy on
    torch.distributed."""
    return not spec.backends or (spec.base in ON_TORCH_DISTRIBUTED and len(spec.backends) == 1
                                 and spec.backends[0] in BACKENDS and spec.backends[0] != "auto")


def worker_options(overlap: str) -> tuple[str, ...]:
    """The options again, from the worker's --overlap."""
    return tuple(option for option in overlap.split("+") if option)


def compressions(options: tuple[str, ...]) -> list[str]:
    """--comm-compression's WEIGHTS[/GRADIENTS] as each comm= gives it."""
    return [option.removeprefix(COMPRESSION) for option in options if option.startswith(COMPRESSION)]


def sharding(options: tuple[str, ...]) -> str | None:
    """The sharding strategy that replaces --sharding-strategy for the run, if one is given."""
    return next((option for option in options if option in SHARDING_STRATEGIES), None)


def variables(options: tuple[str, ...]) -> dict[str, str]:
    """The environment variables that +mpi and +flat set for the run's ranks."""
    return {name: value for option in options for name, value in VARIABLES.get(option, {}).items()}
