"""A user's task on a grain pipeline: each replica reads its own batches on the host, and every
checkpoint saves each replica's iterator state, so a resumed run reads exactly the batches an
uninterrupted one would have read, on any layout and with any number of processes.

    def batches(*, replica, replicas, batch_size, seed):  # one pipeline per replica
        return replica_batches(grain.MapDataset.source(my_source), replica=replica,
                               replicas=replicas, batch_size=batch_size, seed=seed)

    task = GrainTask(params, loss, batches, eval_data=held_out)
    diloco_jax.fit(task, workdir="runs/mine")

``pipeline(replica=, replicas=, batch_size=, seed=)`` returns anything grain iterates with a
saveable state: a ``grain.MapDataset`` or ``grain.IterDataset`` of batches, or a
``grain.DataLoader`` (its sampler sharded by ``replica`` of ``replicas``). Its elements are
batches: pytrees of arrays with ``batch_size`` rows, the same shapes at every step and for every
replica. The train loop draws ``train.log_every`` batches per replica before each compiled call
(the streamed path of :mod:`diloco_jax.data.stream`: the step takes the batch as its argument).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Callable
from typing import Any, cast

import jax
import numpy as np

from diloco_jax.data.stream import _from_replicas
from diloco_jax.tasks.arrays import (
    TaskError,
    _examples,
    _where,
    check_eval,
    check_loss,
    eval_fn,
    fingerprint,
    initial_params,
)
from diloco_jax.tasks.core import Problem, Task


def replica_batches(dataset, *, replica: int, replicas: int, batch_size: int, seed: int):
    """The usual per-replica pipeline of a :class:`GrainTask`: one replica's share of a
    dataset of examples, shuffled, repeated and batched.

    Args:
      dataset: a :class:`grain.MapDataset` of examples (each a pytree of arrays).
      replica: which replica's pipeline, in ``[0, replicas)``: it reads every ``replicas``-th
        example, from the ``replica``-th.
      replicas: how many replicas share the dataset.
      batch_size: examples per batch (a partial last batch is dropped).
      seed: the run's seed; the replica's shuffle, done again each epoch, takes a seed of its
        own from ``(seed, replica)``, so the replicas' orders are independent.

    Returns:
      A :class:`grain.MapDataset` of batches that repeats without end.

    Raises:
      TaskError: the dataset has fewer than ``replicas * batch_size`` examples.
    """
    if len(dataset) < replicas * batch_size:
        raise TaskError(f"the dataset has {len(dataset)} examples, fewer than {replicas} "
                        f"replicas x data.batch_size {batch_size}")  # fmt: skip
    shard = dataset[replica::replicas]
    # one seed for every replica would shuffle equal shards alike: each step, every replica
    # would read the same offsets of its shard (neighbouring examples of an ordered dataset)
    own_seed = int(np.random.SeedSequence((seed, replica)).generate_state(1)[0])
    return shard.shuffle(seed=own_seed).repeat().batch(batch_size, drop_remainder=True)


@dataclasses.dataclass(frozen=True)
class GrainTask:
    """A task whose training data comes from a grain pipeline per replica.

    Each replica reads its own batches on the host, and every checkpoint saves each replica's
    iterator state, so a resumed run reads exactly the batches an uninterrupted one would have
    read, on any layout and with any number of processes.

    Args:
      params: the initial parameters, or ``init(key) -> params``, as in
        :class:`~diloco_jax.ArrayTask`.
      loss: ``loss(params, batch, rng) -> scalar`` (or ``(scalar, {name: scalar})``), as in
        :class:`~diloco_jax.ArrayTask`.
      pipeline: ``pipeline(*, replica, replicas, batch_size, seed)``: that replica's batches,
        as anything grain iterates with a saveable state: a :class:`grain.MapDataset` or
        :class:`grain.IterDataset` of batches, or a :class:`grain.DataLoader` (its sampler
        sharded by ``replica`` of ``replicas``). :func:`~diloco_jax.replica_batches` builds the
        usual one. A batch is a pytree of arrays with ``batch_size`` rows, of the same shapes at
        every step and for every replica; the pipeline must not end before the run does.
      eval_data: a pytree of arrays ``[M, ...]`` to evaluate the outer parameters on
        (required).
      evaluate: ``evaluate(params, eval_data) -> {"eval_loss": scalar, ...}``, as in
        :class:`~diloco_jax.ArrayTask` (None: the mean of ``loss``).
      eval_batch: examples per chunk of the default evaluation.
      unit: what a batch row counts as in logs: ``"example"``, or ``"token"``.
      tokens_per_row: tokens in one row, where ``unit`` is ``"token"``.
    """

    params: Any
    loss: Callable
    pipeline: Callable
    eval_data: Any
    evaluate: Callable | None = None
    eval_batch: int = 256
    unit: str = "example"
    tokens_per_row: int = 1

    def problem(self, replicas: int, batch_size: int, *, seed: int = 0) -> Problem:
        """Checks the task (replica 0's first batch, and the loss and evaluation on shapes) and
        builds what the training loop takes. :func:`~diloco_jax.fit` calls it.

        Args:
          replicas: how many replicas train, one pipeline each.
          batch_size: rows per replica and inner step: the pipelines' batch size.
          seed: the seed passed to each pipeline, and of the initialisation where ``params``
            is ``init(key)``.

        Returns:
          The :class:`~diloco_jax.tasks.Problem`, its batches streamed from the pipelines.

        Raises:
          TaskError: a pipeline that cannot be built or iterated with a saveable state, batches
            of another size than ``batch_size``, no ``eval_data``, and the loss and evaluation
            cases of :meth:`ArrayTask.problem <diloco_jax.ArrayTask.problem>`.
        """
        if not callable(self.pipeline):
            raise TaskError(
                "pipeline must be a function (replica=, replicas=, batch_size=, "
                f"seed=) -> a grain dataset, not {type(self.pipeline).__name__}"
            )
        if self.eval_data is None:
            raise TaskError("a GrainTask needs eval_data: arrays [M, ...] to evaluate on")
        eval_data = jax.tree.map(np.asarray, self.eval_data)
        _examples(eval_data, "eval_data")
        first = next(_open(self.pipeline, 0, replicas, batch_size, seed))
        spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype),
                            first)  # fmt: skip
        rows = {jax.tree_util.keystr(p) or "the batch": (x.shape[:1] or (None,))[0]
                for p, x in jax.tree_util.tree_leaves_with_path(spec)}  # fmt: skip
        if not rows or set(rows.values()) != {batch_size}:
            raise TaskError(f"{_where(self.pipeline)} gives batches whose arrays have {rows} "
                            f"rows, not data.batch_size = {batch_size} each")  # fmt: skip
        params = initial_params(self.params, seed)
        aux = check_loss(self.loss, params, spec)
        task = Task(_read_on_host, self.loss,
                    eval_fn(self.loss, self.evaluate, aux=aux, chunk=self.eval_batch),
                    self.unit, self.tokens_per_row, rng=True, aux=aux,
                    eval_mean=self.evaluate is None)  # fmt: skip
        check_eval(task.eval_fn, params, eval_data, default=self.evaluate is None)
        stream = functools.partial(PipelineStream, self.pipeline, replicas=replicas,
                                   batch_size=batch_size, seed=seed, spec=spec)  # fmt: skip
        return Problem(None, eval_data, None, params, task, math.nan, streamed=True,
                       stream=stream)  # fmt: skip

    def fingerprint(self) -> str:
        """A digest of the task: a sweep reuses a finished run only for the same task.

        Returns:
          16 hexadecimal digits of a hash of the parameters, the evaluation data and the names
          of the functions (the pipeline's data is not read: a sweep reuses a run of a
          same-named pipeline).
        """
        init = (self.params,) if callable(self.params) else ()
        arrays = ((), self.eval_data) if init else (self.params, self.eval_data)
        return fingerprint(arrays, (self.loss, self.evaluate, self.pipeline, *init))


def _read_on_host(*args, **kwargs):
    raise AssertionError("a GrainTask's batches are read on the host, not sampled in the step")


def _open(pipeline: Callable, replica: int, replicas: int, batch_size: int, seed: int):
    """An iterator over ``replica``'s pipeline; TaskError if it cannot be built or its
    iterator has no state to save."""
    try:
        dataset = pipeline(replica=replica, replicas=replicas, batch_size=batch_size, seed=seed)
        iterator = iter(dataset)
    except TaskError:
        raise
    except Exception as e:  # the user's code: any error is theirs to see, in one line
        raise TaskError(f"pipeline {_where(pipeline)} fails for replica {replica}: "
                        f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                        ) from None  # fmt: skip
    if not (hasattr(iterator, "get_state") and hasattr(iterator, "set_state")):
        raise TaskError(f"pipeline {_where(pipeline)} returned {type(dataset).__name__}, whose "
                        "iterator has no get_state/set_state: return a grain MapDataset, "
                        "IterDataset or DataLoader (a resume restores its state)")  # fmt: skip
    return iterator


def _encode(state) -> dict:
    if isinstance(state, bytes):  # grain.DataLoader: JSON as bytes
        return {"bytes": state.decode("latin-1")}
    return {"json": json.dumps(state)}


def _decode(saved: dict):
    return saved["bytes"].encode("latin-1") if "bytes" in saved else json.loads(saved["json"])


class PipelineStream:
    """The replicas' pipelines as the train loop's stream: each compiled call of ``num_steps``
    steps gets ``[N, R, B, ...]`` batches, each process reading only its own replicas'.
    ``position``: the step the iterators stand at; :meth:`states` and :meth:`restore` carry them
    through checkpoints. A learner's stream (:mod:`diloco_jax.learners`): its ``replicas`` are
    pipelines ``first_replica ..`` of ``pipelines`` in all (every learner's replicas), so it
    reads what those replicas of one run of every learner's would."""

    def __init__(self, pipeline: Callable, *, replicas: int, batch_size: int, seed: int, spec,
                 num_steps: int, first_replica: int = 0, pipelines: int = 0):  # fmt: skip
        self.pipeline, self.replicas, self.batch_size, self.seed = (pipeline, replicas,
                                                                     batch_size, seed)  # fmt: skip
        self.first_replica, self.pipelines = first_replica, pipelines or replicas
        self.spec, self.num_steps = spec, num_steps
        self.position = 0
        self._iterators: dict[int, Any] = {}
        self._saved: dict[str, dict] | None = {}  # per replica, for iterators not yet opened
        self._call: tuple[int, dict] | None = None  # the last call's batches

    def abstract(self):
        """A call's batches as shapes: ``[N, R, B, ...]`` per leaf."""
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct((self.num_steps, self.replicas, *x.shape), x.dtype),
            self.spec,
        )

    def on_devices(self, first_step: int, shardings):
        """The call from ``first_step``'s batches placed by ``shardings`` (one per leaf)."""
        shapes, treedef = jax.tree.flatten(self.abstract())
        treedef = cast(Any, treedef)  # jaxlib's PyTreeDef, which type checkers cannot see
        shardings = treedef.flatten_up_to(shardings)
        local = sorted({r for shape, sharding in zip(shapes, shardings, strict=True)
                        for index in sharding.addressable_devices_indices_map(shape.shape).values()
                        for r in range(*index[1].indices(self.replicas))})  # fmt: skip
        batches = self._read(first_step, local)

        def leaf(i: int, shape, sharding):
            def read(replicas: range):
                return np.stack([batches[r][i] for r in replicas], axis=1)

            return _from_replicas(shape, sharding, read)

        return treedef.unflatten([leaf(i, shape, sharding) for i, (shape, sharding)
                                  in enumerate(zip(shapes, shardings, strict=True))])  # fmt: skip

    def _iterator(self, replica: int):
        if replica not in self._iterators:
            it = _open(self.pipeline, self.first_replica + replica, self.pipelines,
                       self.batch_size, self.seed)  # fmt: skip
            if self.position and self._saved is not None:
                if str(replica) not in self._saved:
                    raise TaskError(f"the checkpoint holds no pipeline state for replica "
                                    f"{replica} at step {self.position}")  # fmt: skip
                it.set_state(_decode(self._saved[str(replica)]))
            self._iterators[replica] = it
        return self._iterators[replica]

    def _read(self, first_step: int, replicas: list[int]) -> dict[int, list[np.ndarray]]:
        """Each replica's ``num_steps`` batches from ``first_step``, leaf by leaf ``[N, B,
        ...]``; read once per call (several devices may hold one replica)."""
        if self._call is not None and self._call[0] == first_step:
            return self._call[1]
        if first_step != self.position:
            raise RuntimeError(f"the pipelines stand at step {self.position}, not {first_step}")
        spec, treedef = jax.tree.flatten(self.spec)
        out = {}
        for r in replicas:
            it, steps = self._iterator(r), []
            for step in range(first_step, first_step + self.num_steps):
                try:
                    batch = next(it)
                except StopIteration:
                    raise TaskError(f"the pipeline of replica {r} ended after {step} batches: "
                                    "repeat it (dataset.repeat()) to last train.total_steps"
                                    ) from None  # fmt: skip
                steps.append(_checked(batch, spec, treedef, replica=r, step=step))
            out[r] = [np.stack(leaf) for leaf in zip(*steps, strict=True)]
        self.position += self.num_steps
        self._call = (first_step, out)
        return out

    def states(self) -> dict[str, dict]:
        """This process's replicas' iterator states at :attr:`position` (JSON-able)."""
        saved = dict(self._saved or {})
        return {**saved, **{str(r): _encode(it.get_state()) for r, it in self._iterators.items()}}

    def restore(self, states: dict[str, dict] | None, step: int) -> None:
        """Stand at ``step`` with the saved ``states`` (None: every pipeline from its start)."""
        self._iterators, self._call, self.position, self._saved = {}, None, step, states


def _checked(batch, spec: list, treedef, *, replica: int, step: int) -> list[np.ndarray]:
    """``batch``'s leaves as NumPy arrays; TaskError if its structure, shapes or dtypes differ
    from the first batch's."""
    leaves, got = jax.tree.flatten(batch)
    arrays = [np.asarray(x) for x in leaves]
    if got != treedef or any(a.shape != s.shape or a.dtype != s.dtype
                             for a, s in zip(arrays, spec, strict=True)):  # fmt: skip
        shapes = jax.tree.map(lambda x: f"{np.asarray(x).dtype}{list(np.shape(x))}", batch)
        want = jax.tree.unflatten(treedef, [f"{s.dtype}{list(s.shape)}" for s in spec])
        raise TaskError(f"the pipeline's batch for replica {replica} at step {step} is {shapes}, "
                        f"not {want} as the first batch: batches must keep their shapes and "
                        "dtypes (batch(..., drop_remainder=True))")  # fmt: skip
    return arrays
