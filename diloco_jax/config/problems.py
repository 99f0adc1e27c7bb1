"""What a run learns: its data, model and task, chosen by ``data.corpus``."""

from __future__ import annotations

import dataclasses
import inspect
import json
from typing import Any

import numpy as np

from diloco_jax import tasks
from diloco_jax.base import extras
from diloco_jax.base.errors import ConfigError
from diloco_jax.config import schema as config_lib
from diloco_jax.config import user_code
from diloco_jax.data import (
    DataError,
    eval_windows,
    load_corpus,
    replica_shards,
    tfds_images,
    tfds_io,
    tfds_text,
    unigram_entropy,
)
from diloco_jax.data.images import image_shards
from diloco_jax.data.sources import is_image_data, load_images
from diloco_jax.tasks import model as model_lib
from diloco_jax.tasks import vision
from diloco_jax.tasks.core import Problem


def check_extras(cfg: config_lib.Config) -> None:
    """Raises ConfigError, one line naming ``data.corpus`` and the extra to install, when the
    data ``cfg`` names needs a package that is not installed: TFDS datasets need the tfds extra,
    their images Pillow (images), a dataset prepared with a SentencePiece tokenizer
    sentencepiece. Cheap (it reads a TFDS dataset's info, not its records), so entry points call
    it before any work."""
    d = cfg.data
    if not d.corpus.startswith(tfds_io.TFDS_PREFIX):
        return  # the shipped text and digits, text files: the default install
    feature = f"config key data.corpus = {d.corpus!r}"
    try:
        extras.check(feature, "tensorflow_datasets")
        if tfds_images.is_image_dataset(d.corpus, d.data_dir):
            extras.check(f"{feature} (images)", "PIL")
        else:
            extras.check(feature, "grain")
            name = d.corpus.removeprefix(tfds_io.TFDS_PREFIX)
            if (tfds_io.data_root(d.data_dir) / name / tfds_text.TOKENIZER_FILE).is_file():
                extras.check(f"{feature} (its SentencePiece tokenizer)", "sentencepiece")
    except extras.MissingExtra as e:
        raise ConfigError(str(e)) from None


def user_task(factory: str, args: str, seed: int = 0) -> tasks.UserTask:
    """Calls ``factory`` (``package.module:function``, imported with the working directory on
    the path) with the JSON keyword arguments ``args``, and ``seed=seed`` where it takes a
    ``seed`` that ``args`` do not give (the run's seed: a seed sweep varies what the factory
    builds); ConfigError naming ``task.factory`` if it does not resolve, is not callable or
    returns no ArrayTask or GrainTask."""
    where = f"config key task.factory = {factory!r}"
    fn = user_code.function(factory, "task.factory")
    kwargs = json.loads(args) if args else {}
    try:
        takes_seed = "seed" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C function: no signature to read
        takes_seed = False
    if takes_seed and "seed" not in kwargs:
        kwargs["seed"] = seed
    task = fn(**kwargs)
    if not isinstance(task, (tasks.ArrayTask, tasks.GrainTask)):
        raise ConfigError(f"{where} returned {type(task).__name__}, not a "
                          "diloco_jax.ArrayTask or GrainTask")  # fmt: skip
    return task


def load(cfg: config_lib.Config, replicas: int, task: tasks.UserTask | None = None, *,
         abstract: bool = False) -> Problem:  # fmt: skip
    """Loads the data ``cfg`` names and builds its model: text (or tokens) for the Transformer,
    images for the ResNet; or a user's ``task`` (else ``task.factory``'s), cut into
    ``replicas`` shards. Raises DataError (TaskError) for missing or unusable data or code.
    ``abstract``: the built-in models' parameters as shapes only (a user's task builds its own)."""
    if task is None and cfg.task.factory:
        task = user_task(cfg.task.factory, cfg.task.args, cfg.seed)
    if task is not None:
        return task.problem(replicas, cfg.data.batch_size, seed=cfg.seed)
    m, d = cfg.model, cfg.data
    where: dict[str, Any] = dict(val_fraction=d.val_fraction, data_dir=d.data_dir,
                                 train_split=d.train_split, eval_split=d.eval_split)  # fmt: skip
    if is_image_data(d):  # image classification with a ResNet
        budget = int(d.max_memory_mib * 2**20)
        imgs = load_images(d.corpus, **where, image_feature=d.image_feature,
                           label_feature=d.label_feature, image_size=d.image_size,
                           max_bytes=budget)  # fmt: skip  # the shipped digits ignore it
        streamed = isinstance(imgs.train_images, np.memmap)
        if budget and not streamed and imgs.train_images.nbytes > budget:
            raise DataError(f"{d.corpus}'s training images take {imgs.train_images.nbytes:,} "
                            f"bytes, more than data.max_memory_mib allows ({budget:,} bytes); "
                            "only tfds:NAME image datasets stream from disk")  # fmt: skip
        r = cfg.resnet
        graphdef, params = vision.init_model(
            cfg.seed, channels=imgs.train_images.shape[-1], num_classes=imgs.num_classes,
            width=r.width, stages=r.stages, depth=r.depth, abstract=abstract,
        )  # fmt: skip
        return Problem(image_shards(imgs.train_images, imgs.train_labels, replicas),
                       (imgs.val_images, imgs.val_labels), graphdef, params,
                       tasks.image_classification(graphdef),
                       float(np.log(imgs.num_classes)), streamed=streamed)  # fmt: skip
    corpus = load_corpus(d.corpus, **where, text_feature=d.text_feature,
                         max_bytes=int(d.max_memory_mib * 2**20))  # fmt: skip
    graphdef, params = model_lib.init_model(cfg.seed, vocab_size=corpus.vocab_size,
                                            seq_len=d.seq_len, abstract=abstract,
                                            **dataclasses.asdict(m))  # fmt: skip
    return Problem(
        replica_shards(corpus.train_N, replicas, d.seq_len),  # a view: nothing copied
        eval_windows(corpus.val_M, seq_len=d.seq_len, max_windows=d.eval_windows),
        graphdef, params, tasks.language_model(graphdef, seq_len=d.seq_len),
        unigram_entropy(corpus.val_M), corpus.tokenizer,
        isinstance(corpus.train_N, np.memmap),
    )  # fmt: skip
