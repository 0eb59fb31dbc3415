"""What a training loop calls beside the sharded model: gradient clipping, fp16 loss scaling, uneven data,
dropout drawn per sample (the same masks on any number of ranks), and the optimizer's step inside backward.

Read in this order: clip -> grad_scaler -> even_batches -> sample_dropout -> step_in_backward. Imports the sharding
and communication layers (sample_dropout only torch).
"""
