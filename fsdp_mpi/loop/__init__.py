"""What a training loop calls beside the sharded model: gradient clipping, fp16 loss scaling, uneven data, and
dropout drawn per sample (the same masks on any number of ranks).

Read in this order: clip -> grad_scaler -> even_batches -> sample_dropout. Imports the sharding and communication
layers (sample_dropout only torch).
"""
