"""Files on disk: sharded checkpoints, the optimizer's state whole or in pieces, and Hugging Face checkpoints
read into shards and exported.

Read in this order: safetensors_file -> durable -> optimizer_state -> checkpoint -> checkpoint_directory ->
pretrained. Imports the sharding and communication layers.
"""
