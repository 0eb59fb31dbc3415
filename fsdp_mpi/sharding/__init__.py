"""The sharded state and its lifecycle: flat shards of a module's parameters, gathered while it computes.

Read in this order: strategy -> offload -> collectives -> host_allocator -> host_memory -> flat_layout
-> full_views -> flat_gradient -> flat_param -> nested -> mixed_precision -> traced -> execution_order
-> root_context -> in_place -> lifecycle -> state_dict -> validation -> deferred_init -> wrap
-> torch_options -> fully_sharded.
Imports only ``fsdp_mpi.communication``.
"""
