"""Tasks and their models: what a replica samples, its loss, and the evaluation (``core``); a
user's task on arrays in memory (``arrays``) or on grain pipelines (``pipeline``); the
Transformer LM (``model``) with text generation (``sample``); the ResNet (``vision``)."""

from diloco_jax.tasks.arrays import ArrayTask, TaskError
from diloco_jax.tasks.core import Problem, Task, image_classification, language_model
from diloco_jax.tasks.pipeline import GrainTask, replica_batches

UserTask = ArrayTask | GrainTask  # what fit, sweep and task.factory take

__all__ = [
    "ArrayTask",
    "GrainTask",
    "Problem",
    "Task",
    "TaskError",
    "UserTask",
    "image_classification",
    "language_model",
    "replica_batches",
]
