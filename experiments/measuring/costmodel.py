"""A cost model of one fsdp-mpi training step: time and memory per rank, before anyone queues for a cluster.

A step is the units' computation plus the collectives the lifecycle issues for
them, which fsdp-mpi's strategies fix exactly (``collectives``): per unit of S
parameter bytes, with shard groups of g ranks and r = ranks / g replicas,

    forward    all-gather S within the group                      (if g > 1)
    backward   all-gather S again, unless the unit is the root     (if g > 1; never under SHARD_GRAD_OP,
               which keeps every unit gathered from forward to backward)
               reduce-scatter S within the group                   (if g > 1)
               all-reduce S / g over the replicas                  (if r > 1)
    end of backward: all-reduce 4 bytes per parameter tensor over all ranks, which of them got
               a gradient on some rank                                 (if ranks > 1)

Compressed communication (``fsdp_mpi.Compression``) changes the bytes, not the pattern: gathers
carry weights as bf16 or int8 codes with one fp32 scale per block; compressed gradients go by an
all-to-all of the group's chunks in place of the reduce-scatter, and over the replicas by an
all-to-all and an all-gather of chunks of S / (g r) in place of the all-reduce.

Computation comes from a ``Profile`` (measured on one rank, or computed from
FLOPs for hardware that is not here); communication from a ``Network`` that
prices one collective (``MeasuredNetwork``: measured here; ``RingNetwork``: a
cluster's links on paper). ``predict`` adds them up serially (no overlap, what
MPI without a progress thread does) or runs a two-lane timeline where
communication proceeds beside computation (prefetching one unit ahead, gradient
reductions left running), the bound that overlap can reach.
"""

from dataclasses import dataclass, field

# fsdp_mpi.ShardingStrategy's names, here for the launchers, which must not import fsdp_mpi (tests/test_bench.py
# keeps them equal)
SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD")
ADAM_STATE_BYTES_PER_PARAMETER = 16  # fp32 shard, its gradient, two Adam moments


@dataclass
class Unit:
    """One wrapped unit as the profile saw it, in forward order."""

    name: str
    numel: int  # parameters in its flat buffer
    forward_s: float  # its own computation (nested units excluded)
    backward_s: float
    is_root: bool = False
    tensors: int = 0  # trainable parameter tensors in it (one flag each at the end of backward)


@dataclass
class Profile:
    """What one rank computes in a step, at a fixed per-rank batch."""

    units: list[Unit]
    optimizer_s: float  # the optimizer step over all parameters on one rank; it scales with the shard
    activation_bytes: int  # saved for backward by one rank's batch
    tokens_per_rank: int  # per step
    param_bytes: int = 4  # per element gathered (2 under bf16 mixed precision)
    grad_bytes: int = 4  # per element reduced (fp32 by default, also under mixed precision)
    weight_format: str = "none"  # Compression's weights: none (param_bytes each), bf16 or int8
    gradient_format: str = "none"  # Compression's gradients
    block_size: int = 256  # elements per int8 scale
    baseline_bytes: int = 0  # resident before the model: the interpreter, torch, MPI (0 on paper)
    # what a step allocates beyond its state and saved activations, nothing sharded (measured; 0 on paper):
    # gradients as autograd hands them over and as units assemble them, the loss's temporaries, allocator slack
    transient_bytes: int = 0

    @property
    def parameters(self) -> int:
        return sum(unit.numel for unit in self.units)

    @property
    def step_s(self) -> float:
        """The profiled step without communication: every unit's forward and backward, and the optimizer."""
        return sum(unit.forward_s + unit.backward_s for unit in self.units) + self.optimizer_s


@dataclass
class Layout:
    """Where the ranks are and how a strategy groups them."""

    strategy: str
    nodes: int
    ranks_per_node: int
    group_size: int | None = None  # HYBRID_SHARD's shard group (default: a node)
    two_level: bool = True  # a group of every rank spanning nodes goes in two levels (FSDP_MPI_TWO_LEVEL)

    @property
    def ranks(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def shard_group(self) -> int:
        if self.strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
            return self.ranks
        if self.strategy == "NO_SHARD":
            return 1
        return self.group_size or self.ranks_per_node

    @property
    def replicas(self) -> int:
        return self.ranks // self.shard_group

    def spans_nodes(self, group_size: int, stride: int = 1) -> bool:
        """Whether a group of `group_size` ranks, `stride` apart (replicas are one shard group apart), leaves a node."""
        return group_size * stride > self.ranks_per_node


@dataclass
class Collective:
    phase: str  # forward or backward
    operation: str  # all_gather, reduce_scatter or all_reduce
    unit: str
    bytes: int  # the full buffer: gathered, or reduced before scattering, or all-reduced
    group: int  # ranks taking part
    spans_nodes: bool
    widened: float = 1.0  # a sum of 16-bit values: 2, fp32 on the wire where two levels send partial sums
    levels: tuple[int, int] | None = None  # (n nodes, k ranks each) where it goes in two levels


def padded(unit: Unit, group: int) -> int:
    """Elements of the unit's flat buffer: padded to a multiple of the shard group."""
    return -(-unit.numel // group) * group


def wire_bytes(numel: int, form: str, uncompressed_bytes: int, block_size: int) -> int:
    """Bytes of `numel` elements as they travel: uncompressed, bf16, or int8 codes plus one fp32 scale per block."""
    if form == "bf16":
        return 2 * numel
    if form == "int8":
        return numel + 4 * -(-numel // block_size)
    return uncompressed_bytes * numel


def state_bytes(profile: Profile, layout: Layout) -> int:
    """The sharded parameters, gradients and Adam moments one rank holds (fp32)."""
    g = layout.shard_group
    return ADAM_STATE_BYTES_PER_PARAMETER * sum(padded(unit, g) // g for unit in profile.units)


def collectives(profile: Profile, layout: Layout) -> list[Collective]:
    """Every collective of one step on one rank, in the order the lifecycle issues them."""
    g, r = layout.shard_group, layout.replicas
    group_leaves = layout.spans_nodes(g)
    replicas_leave = layout.spans_nodes(r, stride=g)
    issued = []

    def levels(group: int, spans: bool) -> tuple[int, int] | None:
        """(n, k) where a collective over `group` ranks goes in two levels: every rank, across nodes of k > 1."""
        two_level = group == layout.ranks and spans and layout.two_level and layout.ranks_per_node > 1
        return (layout.nodes, layout.ranks_per_node) if two_level else None

    regathers = layout.strategy != "SHARD_GRAD_OP"

    def weights(elements: int) -> int:
        return wire_bytes(elements, profile.weight_format, profile.param_bytes, profile.block_size)

    def gradients(elements: int) -> int:
        return wire_bytes(elements, profile.gradient_format, profile.grad_bytes, profile.block_size)

    compressed_gradients = profile.gradient_format != "none"
    in_group, in_replicas = levels(g, group_leaves), levels(r, replicas_leave)
    for unit in profile.units:
        if g > 1:
            issued.append(Collective("forward", "all_gather", unit.name, g * weights(padded(unit, g) // g), g,
                                     group_leaves, levels=in_group))
    for unit in reversed(profile.units):
        shard = padded(unit, g) // g
        if g > 1 and regathers and not unit.is_root:
            issued.append(Collective("backward", "all_gather", unit.name, g * weights(shard), g, group_leaves,
                                     levels=in_group))
        if g > 1:
            issued.append(Collective("backward", "all_to_all" if compressed_gradients else "reduce_scatter",
                                     unit.name, g * gradients(shard), g, group_leaves,
                                     widened=1.0 if compressed_gradients else 4 / profile.grad_bytes,
                                     levels=in_group))
        if r > 1 and compressed_gradients:
            chunk = -(-shard // r)
            issued += [Collective("backward", operation, unit.name, r * gradients(chunk), r, replicas_leave,
                                  levels=in_replicas)
                       for operation in ("all_to_all", "all_gather")]
        elif r > 1:
            issued.append(Collective("backward", "all_reduce", unit.name, shard * profile.grad_bytes, r,
                                     replicas_leave, levels=in_replicas))
    if layout.ranks > 1:
        spans = layout.spans_nodes(layout.ranks)
        issued.append(Collective("backward", "all_reduce", "<which parameters got gradients>",
                                 4 * sum(unit.tensors for unit in profile.units), layout.ranks, spans,
                                 levels=levels(layout.ranks, spans)))
    return issued


def node_link_bytes(collective: Collective, layout: Layout) -> float:
    """Bytes each node sends over its link to the others (and receives: the traffic is symmetric) for
    `collective`, counting every group that issues it at once: one group of all the ranks, or, for
    HYBRID_SHARD's replicas, one group per place on a node (a rank on every node).

    A group of every rank on n nodes of k > 1 goes in two levels (fsdp_mpi's ``transports/two_level.py``):
    across the nodes only the k groups of one rank per node exchange, each 1/k of the buffer, so a node sends
    (n - 1) / n of it for an all-gather, a reduce-scatter (whose partial sums travel in fp32: ``widened``)
    and each half of an all-reduce (a reduce-scatter, then an all-gather, of the buffer padded to the ranks);
    an all-to-all moves what a flat one does, k (n - 1) / n.

    In one flat ring (``two_level=False``) it follows how MPICH moves the large buffers of a step, as counted
    on the emulated cluster's links (hpc/cluster, docs/clusters.md): a ring all-gather (one neighbour of each
    node's ranks is on the next node: (p - 1) / p of the buffer crosses each node's link once), a
    reduce-scatter by pairwise exchange (each rank sends its peers' blocks straight to them: k (p - k) / p of
    the buffer per node with k of the p ranks on it; an all-to-all likewise), and a node-aware all-reduce
    (reduced within the node, exchanged between the nodes' leaders, as a ring all-reduce of n nodes moves
    2 (n - 1) / n).
    """
    if not collective.spans_nodes:
        return 0.0
    size, n, k = collective.bytes, layout.nodes, layout.ranks_per_node
    if collective.levels is not None:
        p = layout.ranks
        if collective.operation == "all_reduce":  # of fp32 elements, padded to a multiple of the ranks
            size = -(-size // (4 * p)) * 4 * p
        return {"all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n * collective.widened,
                "all_to_all": k * (n - 1) / n, "all_reduce": 2 * (n - 1) / n}[collective.operation] * size
    if collective.group == layout.ranks:
        p = layout.ranks
        return {"all_gather": (p - 1) / p, "reduce_scatter": k * (p - k) / p, "all_to_all": k * (p - k) / p,
                "all_reduce": 2 * (n - 1) / n}[collective.operation] * size
    if collective.group == n and layout.shard_group == k:  # k replica groups, each one rank per node
        return k * {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n,
                    "all_to_all": (n - 1) / n}[collective.operation] * size
    raise ValueError(f"link bytes are modelled for groups of every rank or of one rank per node, "
                     f"not {collective.operation} over {collective.group} of {layout.ranks} ranks")


def step_link_bytes(profile: Profile, layout: Layout) -> float:
    """Bytes each node sends to the others in one training step (the sum of ``node_link_bytes``)."""
    return sum(node_link_bytes(c, layout) for c in collectives(profile, layout))


@dataclass
class MeasuredNetwork:
    """Collective times measured on this machine (``experiments/predict.py time-comm``), per (operation,
    world size, group size): a curve of (bytes, seconds) points, priced between them by the line through
    the two nearest, beyond them by the end segment's line.

    A line through all points (one latency, one bandwidth) misprices here: shared-memory
    bandwidth falls once a buffer leaves the caches (2 ranks: 5 GB/s at 4 MiB, 1.3 GB/s
    for a 64 MiB reduce-scatter), so each size range gets its own latency and bandwidth.
    """

    curves: dict[tuple[str, int, int], list[tuple[int, float]]]
    world: int

    def seconds(self, collective: Collective) -> float:
        key = (collective.operation, self.world, collective.group)
        if key not in self.curves:
            raise KeyError(f"no measured {collective.operation} over {collective.group} of {self.world} ranks")
        points = self.curves[key]
        right = next((i for i, (size, _) in enumerate(points) if size >= collective.bytes), len(points) - 1)
        (x0, y0), (x1, y1) = points[max(right - 1, 0)], points[max(right, 1)]
        return max(y0 + (collective.bytes - x0) * (y1 - y0) / (x1 - x0), 0.0)


@dataclass
class Link:
    latency_s: float  # per message step
    bytes_per_s: float  # what one rank can send and receive at once over it (bus bandwidth)


@dataclass
class RingNetwork:
    """A cluster on paper: ring algorithms over an intra-node link and an inter-node link.

    A ring of p ranks takes p - 1 steps per pass and moves (p - 1) / p of the
    buffer through each rank: all-gather and reduce-scatter make one pass,
    all-reduce two. A ring that leaves the node runs at the slower link's speed.
    A collective in two levels (``Collective.levels``: n nodes of k ranks) is a ring
    of k inside each node over the buffer, then one of n across the nodes over
    1/k of it (k rings at once, one per local rank; an all-to-all's across the
    nodes carries the whole buffer).
    """

    intra: Link
    inter: Link

    def seconds(self, collective: Collective) -> float:
        passes = 2 if collective.operation == "all_reduce" else 1
        if collective.levels is not None:  # a ring inside each node over the buffer, one across over 1/k of it
            n, k = collective.levels
            across = collective.bytes * collective.widened / (1 if collective.operation == "all_to_all" else k)
            return passes * (self._ring(self.intra, k, collective.bytes) + self._ring(self.inter, n, across))
        return passes * self._ring(self.inter if collective.spans_nodes else self.intra, collective.group,
                                   collective.bytes)

    @staticmethod
    def _ring(link: Link, ranks: int, size: float) -> float:
        return (ranks - 1) * link.latency_s + (ranks - 1) / ranks * size / link.bytes_per_s


@dataclass
class Prediction:
    step_s: float
    compute_s: float
    comm_s: float  # all collectives, end to end
    exposed_comm_s: float  # what the step waits for beyond its computation
    memory_bytes: int  # peak per rank: baseline, sharded state, gathered units, activations, transients
    bytes_moved: int  # by this rank's collectives per step (the full buffers, as comm.bytes_moved counts)
    seconds_by_operation: dict = field(default_factory=dict)


def predict(profile: Profile, network, layout: Layout, overlap: bool = False) -> Prediction:
    """One step's time and peak memory per rank.

    The profile's computation is taken as it is: for ranks that share a machine
    (more ranks than cores, or memory-bound work side by side), profile them
    under that load (``measure_profile`` under mpiexec).
    """
    issued = collectives(profile, layout)
    seconds = [network.seconds(c) for c in issued]
    lanes = []  # (gather_s, compute_s, reduce_s) per unit, forward then backward, in execution order
    for phase, units in (("forward", profile.units), ("backward", profile.units[::-1])):
        for unit in units:
            mine = [(c.operation, s) for c, s in zip(issued, seconds) if c.phase == phase and c.unit == unit.name]
            compute = unit.forward_s if phase == "forward" else unit.backward_s
            lanes.append((sum(s for op, s in mine if op == "all_gather"), compute,
                          sum(s for op, s in mine if op != "all_gather")))
    optimizer = profile.optimizer_s / layout.shard_group
    compute = sum(c for _, c, _ in lanes) + optimizer
    comm = sum(seconds)
    step = (_two_lanes(lanes) if overlap else compute - optimizer + comm) + optimizer
    return Prediction(step_s=step, compute_s=compute, comm_s=comm, exposed_comm_s=step - compute,
                      memory_bytes=peak_memory(profile, layout, overlap), bytes_moved=sum(c.bytes for c in issued),
                      seconds_by_operation={op: sum(s for c, s in zip(issued, seconds) if c.operation == op)
                                            for op in ("all_gather", "reduce_scatter", "all_reduce")})


def _two_lanes(lanes: list[tuple[float, float, float]]) -> float:
    """The passes' length when communication runs on its own lane beside computation.

    Each lane takes its work in issue order. A unit's computation waits for its
    all-gather; the next unit's all-gather is issued when this unit's computation
    starts (one unit ahead, as forward_prefetch and backward_prefetch do); its
    gradient reductions are issued when it ends and run while later units compute
    (async_reduce_scatter). The passes end when both lanes are idle.
    """
    compute_free = comm_free = 0.0
    gathered = [None] * (len(lanes) + 1)

    def issue(seconds: float, at: float) -> float:
        nonlocal comm_free
        comm_free = max(comm_free, at) + seconds
        return comm_free

    for index, (gather, compute, reduce) in enumerate(lanes):
        if gathered[index] is None:
            gathered[index] = issue(gather, compute_free)
        start = max(compute_free, gathered[index])
        if index + 1 < len(lanes):
            gathered[index + 1] = issue(lanes[index + 1][0], start)
        compute_free = start + compute
        issue(reduce, compute_free)
    return max(compute_free, comm_free)


def peak_memory(profile: Profile, layout: Layout, overlap: bool = False) -> int:
    """What the process held before the model (the profile's baseline), sharded state (fp32 parameters,
    gradients, Adam moments), the gathered root's weights kept from forward to backward (every unit's under
    SHARD_GRAD_OP), the largest other unit's (two with prefetching), the activations of one rank's batch,
    and the step's transient allocations as the profile measured them (assembled gradients among them)."""
    g = layout.shard_group
    state = state_bytes(profile, layout)
    if g == 1:
        gathered = 0
    elif layout.strategy == "SHARD_GRAD_OP":
        gathered = profile.parameters * profile.param_bytes
    else:
        root = sum(u.numel for u in profile.units if u.is_root)
        largest = max((u.numel for u in profile.units if not u.is_root), default=0)
        gathered = (root + (2 if overlap else 1) * largest) * profile.param_bytes
    return profile.baseline_bytes + state + gathered + profile.activation_bytes + profile.transient_bytes
