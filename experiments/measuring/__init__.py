"""Measuring and predicting training steps. Read in this order: costmodel (a step's time and memory priced from
its parts) -> profiling (the parts: one rank's computation, fsdp-mpi's collectives timed here) -> bench_plan
(bench.py's strategies, read and checked) -> bench_worker (one strategy's timed steps on N ranks, for bench.py and
predict.py) -> launch (how those two start it under mpiexec) -> bench_report (bench.py's tables, figure and CSVs);
figures (readable whatever the labels) draws for bench.py and compare.py."""
