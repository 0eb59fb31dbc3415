"""Talking to MPI: everything the layers above send or receive goes through ``comm.Communicator``.

Read in this order: settings -> timing_points -> abort -> liveness -> collective_log -> launcher -> gpu_support
-> host_memory -> mpi_buffers -> staging -> cuda_ipc -> shared_slots -> node_transport -> background -> bookkeeping
-> routes -> started -> comm -> compression.
Nothing here knows about modules, parameters or units.
"""

from fsdp_mpi.communication.launcher import refuse_offload_without_a_cuda_driver

refuse_offload_without_a_cuda_driver()  # before any module here imports mpi4py, which starts MPI
