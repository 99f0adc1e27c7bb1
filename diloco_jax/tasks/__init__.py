"""Tasks and their models: what a replica samples, its loss, and the evaluation (``core``); a
user's task on arrays in memory (``arrays``); the Transformer LM (``model``) with text generation
(``sample``); the ResNet (``vision``)."""

from diloco_jax.tasks.arrays import ArrayTask, TaskError
from diloco_jax.tasks.core import Problem, Task, image_classification, language_model

__all__ = ["ArrayTask", "Problem", "Task", "TaskError", "image_classification", "language_model"]
