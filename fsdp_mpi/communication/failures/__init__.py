"""How failures are caught: a rank that raises ends the job, a rank that waits too long in a collective says
what it waits in, starts that cannot work are refused before they fail, and where MPI can report a lost rank
(ULFM) the survivors are told instead of ended.

Read in this order: abort -> liveness -> collective_log -> launcher -> lost_ranks.
"""
