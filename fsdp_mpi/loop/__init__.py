"""What a training loop calls beside the sharded model: gradient clipping, fp16 loss scaling, uneven data,
dropout drawn per sample (the same masks on any number of ranks), the optimizer's step inside backward, and a stop
between optimizer steps when the scheduler's signal comes.

Read in this order: clip -> grad_scaler -> even_batches -> sample_dropout -> step_in_backward -> stop_signals. Imports
the sharding and communication layers (sample_dropout only torch, stop_signals nothing of ours).
"""
