"""Files on disk: sharded checkpoints, and Hugging Face checkpoints read into shards and exported.

Read in this order: safetensors_file -> durable -> checkpoint -> checkpoint_directory -> pretrained. Imports the sharding and communication layers.
"""
