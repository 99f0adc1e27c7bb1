"""The simulated world a run trains in: which replicas are present, late or slow at each outer
step (:mod:`~diloco_jax.simulated.schedule`: stragglers, failures, quorum rounds, as pure
functions of the step), and what the network costs (:mod:`~diloco_jax.simulated.comms`: bytes
per sync and the clock of a reduce). The simulator's sweeps (``sim/``) and the runtimes use
the same functions."""
