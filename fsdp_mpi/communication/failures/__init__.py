"""How failures are caught: a rank that raises ends the job, a rank that waits too long in a collective says
what it waits in, and starts that cannot work are refused before they fail.

Read in this order: abort -> liveness -> collective_log -> launcher.
"""
