"""Talking to MPI: everything the layers above send or receive goes through ``comm.Communicator``.

Two stories, each a folder: how bytes travel (``transports/``: one class per way, behind one interface, built
of the pieces in ``machinery/``) and how failures are caught (``failures/``: abort, the collective log and its
watchdog, refused starts). The
communicator ties them: it checks a collective's buffers, logs and watches it, and hands it to the transport
that its routes chose for that kind of memory.

Read in this order: settings -> timing_points -> failures/ -> machinery/ -> transports/ -> bookkeeping -> routes ->
point_to_point -> comm -> compression.
Nothing here knows about modules, parameters or units.
"""

from fsdp_mpi.communication.failures.launcher import refuse_offload_without_a_cuda_driver

refuse_offload_without_a_cuda_driver()  # before any module here imports mpi4py, which starts MPI
