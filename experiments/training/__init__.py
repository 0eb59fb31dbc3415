"""One training run, the same for every strategy the experiments compare. Read in this order:
choices (the names the options accept) -> options (the command line, one frozen RunConfig) -> sampling (which
samples each rank takes in each step) -> strategies (one model under fsdp-mpi, DDP or FSDP2) -> recipe (AdamW and
its schedule) -> evaluation (validation summed over the ranks) -> results and recorder (the CSV rows) -> resume
(stopping and checkpoints) -> saved_run (--save-dir) -> loop (our training loop) and lightning_runner
(Lightning's) -> startup and run (from the command line to the exit code)."""
