"""Running the algorithm on replicas: the step of one replica (``step``), its ``vmap`` or
``shard_map`` over replicas and the placement of the state (``parallel``), checkpoints
(``checkpoint``)."""
