"""What the transports are built of and share: a started collective, where a cut one's pieces lie, the rule
for sums, a tensor as MPI sees it, what the MPI library can do with device memory, the communication thread,
and which ranks share a node.

Read in this order: in_flight -> chunks -> sums -> mpi_buffers -> mpi_library -> worker -> placement.
"""
