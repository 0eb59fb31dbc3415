"""What a training loop calls beside the sharded model: gradient clipping, fp16 loss scaling, uneven data.

Read in this order: clip -> grad_scaler -> even_batches. Imports the sharding and communication layers.
"""
