"""Tasks and their models: what a replica samples, its loss, and the evaluation (``core``); the
Transformer LM (``model``) with text generation (``sample``); the ResNet (``vision``)."""

from diloco_jax.tasks.core import Task, image_classification, language_model

__all__ = ["Task", "image_classification", "language_model"]
