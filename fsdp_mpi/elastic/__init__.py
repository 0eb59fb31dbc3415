"""Training that goes on after a lost rank, in the same job (Open MPI's ULFM): the protocol lives here, so that
any training loop (a user's own, the experiments') gets it in a few lines.

Read in this order: agreement -> recovery -> state -> runner. Imports the layers below it: communication (the
agreement, the shrink), sharding (the wrapped model's shard groups), loop (the loss scaler) and files (the
checkpoints a lost shard is reloaded from).
"""
