"""How bytes travel: one class per way of moving a collective, behind the one interface of ``transport.py``.

Read in this order: in_flight -> chunks -> sums -> mpi_buffers -> gpu_support -> worker -> transport -> one_rank
-> direct -> staged -> cuda_ipc -> shared_slots -> node -> placement -> two_level.
"""
