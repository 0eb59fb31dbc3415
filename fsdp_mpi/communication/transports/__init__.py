"""How bytes travel: one class per way of moving a collective, behind the one interface of ``transport.py``,
built of the pieces in ``machinery/``.

Read in this order: transport -> one_rank -> direct -> staged -> cuda_ipc -> shared_slots -> node -> two_level.
"""
