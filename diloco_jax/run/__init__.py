"""A run's life, from the config to its last checkpoint: the set-up (:mod:`~diloco_jax.run.setup`),
devices and memory (:mod:`~diloco_jax.run.placement`), the kept traced step
(:mod:`~diloco_jax.run.programs`), resuming (:mod:`~diloco_jax.run.resume`), the loop's steps
(:mod:`~diloco_jax.run.loop`), several processes (:mod:`~diloco_jax.run.distributed`),
preemption and the launcher's death (:mod:`~diloco_jax.run.preemption`), and control over HTTP
(:mod:`~diloco_jax.run.live`). ``diloco_jax.train.train`` tells the story in these steps."""
