"""How failures are caught: where MPI can report a lost rank (ULFM) the survivors are told instead of ended (and may
start newcomers in the lost ranks' places: the job renewed, ``job.py``), a rank that raises ends the job (even
where rank 0 is among the lost; after a loss, a rank ends itself: ``process_end.py``), a rank that waits too long
in a collective says what it waits in, and starts that cannot work are refused before they fail.

Read in this order: process_end -> job -> lost_ranks -> abort -> liveness -> collective_log -> launcher.
"""
