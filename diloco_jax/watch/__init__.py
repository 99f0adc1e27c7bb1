"""Watching a run: logs and ``metrics.jsonl`` (:mod:`~diloco_jax.watch.reporting`), the run's
record, TensorBoard and W&B (:mod:`~diloco_jax.watch.records`), the HTTP server with its
status, Prometheus metrics and dashboard (:mod:`~diloco_jax.watch.serve`,
:mod:`~diloco_jax.watch.board`), and the figures (:mod:`~diloco_jax.watch.figures`)."""
