"""A user's task on arrays in memory: their parameters, their loss, their data.

:class:`ArrayTask` is the shortest way from a JAX training job to the same job with DiLoCo::

    task = ArrayTask(params, loss, train_data={"x": x_NxD, "y": y_N}, eval_data=...)
    result = diloco_jax.fit(task, workdir="runs/mine")  # simulator, mesh, checkpoints, logs

The model can be anything that gives a pytree of parameters and a pure loss over it: Flax NNX
(``graphdef, params = nnx.split(model, nnx.Param)``; merge them in the loss), Linen
(``params = model.init(key, x)["params"]``; ``model.apply({"params": params}, x)``), or plain
functions. The training data is a pytree of arrays with a leading example axis; it is cut into
one contiguous shard per replica and each replica draws its batch with replacement from its
shard as a pure function of ``(seed, replica, step)``, so a resumed or re-laid-out run reads
exactly the batches an uninterrupted one would.

:meth:`ArrayTask.problem` checks the user's code on shapes (``jax.eval_shape``, nothing
compiled) and raises :class:`TaskError`, one line naming what is wrong, for: data whose leaves
disagree on the number of examples, fewer examples per replica than the batch, a loss that is
not a float scalar or cannot be differentiated, an evaluation without ``eval_loss``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from diloco_jax.data import DataError
from diloco_jax.data.images import example_indices
from diloco_jax.tasks.core import Problem, Task, _chunked


class TaskError(DataError):
    """A user's task (its parameters, loss, data or evaluation) cannot be trained."""


@dataclasses.dataclass(frozen=True)
class ArrayTask:
    """A task over arrays in memory: your parameters, your loss and your data.

    Train it with :func:`~diloco_jax.fit` (or compare settings with :func:`~diloco_jax.sweep`).
    The training data is cut into one contiguous shard per replica, and each replica draws its
    batch with replacement from its shard as a pure function of ``(seed, replica, step)``: of
    ``N`` examples and ``R`` replicas, replica ``r``'s shard is examples ``[r S, (r + 1) S)``
    with ``S = N // R`` (the last ``N mod R`` are not trained on).

    Args:
      params: the initial parameters, a pytree of float arrays (Flax NNX: the ``params`` of
        ``graphdef, params = nnx.split(model, nnx.Param)``, see :func:`flax.nnx.split`); or
        ``init(key) -> params``, called with ``jax.random.key(seed)`` (the run's ``seed``), so
        that a seed sweep varies the initialisation too.
      loss: ``loss(params, batch, rng) -> scalar``: the mean loss of a batch, ``batch`` being
        ``train_data``'s pytree with ``batch_size`` rows; ``rng`` is a key, a pure function of
        ``(seed, replica, step)`` (for dropout), and None in evaluation. It may return
        ``(scalar, {name: scalar})``: those metrics are logged as ``aux_<name>`` in each train
        event.
      train_data: a pytree of arrays ``[N, ...]`` (:class:`numpy.ndarray` or :class:`jax.Array`)
        that share their leading example axis.
      eval_data: a pytree of arrays ``[M, ...]`` to evaluate the outer parameters on (None: the
        training data).
      evaluate: ``evaluate(params, eval_data) -> {"eval_loss": scalar, ...}``, jit-able (None:
        the mean of ``loss`` over every evaluation example).
      eval_batch: examples per chunk of the default evaluation (which pads and masks the last).
      unit: what a batch row counts as in logs: ``"example"``, or ``"token"`` (with
        ``tokens_per_row``).
      tokens_per_row: tokens in one row, where ``unit`` is ``"token"``.
    """

    params: Any
    loss: Callable
    train_data: Any
    eval_data: Any = None
    evaluate: Callable | None = None
    eval_batch: int = 256
    unit: str = "example"
    tokens_per_row: int = 1

    def problem(self, replicas: int, batch_size: int, *, seed: int = 0) -> Problem:
        """Checks the task on shapes (``jax.eval_shape``: nothing is compiled) and builds what
        the training loop takes. :func:`~diloco_jax.fit` calls it.

        Args:
          replicas: how many replicas share the training data (one shard each).
          batch_size: rows per replica and inner step.
          seed: the seed of the initialisation where ``params`` is ``init(key)`` (the batches
            take the run's seed in the train step).

        Returns:
          The :class:`~diloco_jax.tasks.Problem`, with ``replicas`` shards of the training
          data, the evaluation data, the initial parameters and the task's loss and
          evaluation.

        Raises:
          TaskError: one line naming what is wrong: data whose leaves disagree on the number of
            examples, fewer examples per replica than ``batch_size``, parameters that are not
            floating point, a loss that is not a float scalar or cannot be differentiated, an
            evaluation without a scalar ``eval_loss``.
        """
        params = initial_params(self.params, seed)
        train = jax.tree.map(np.asarray, self.train_data)
        count = _examples(train, "train_data")
        per_replica = count // replicas
        if per_replica < batch_size:
            raise TaskError(
                f"train_data has {count} examples: {per_replica} per replica for {replicas} "
                f"replicas, fewer than data.batch_size = {batch_size}; give more data, fewer "
                "replicas or a smaller batch"
            )
        keep = per_replica * replicas
        shards = jax.tree.map(lambda x: x[:keep].reshape(replicas, per_replica, *x.shape[1:]),
                              train)  # fmt: skip
        eval_data = train if self.eval_data is None else jax.tree.map(np.asarray, self.eval_data)
        _examples(eval_data, "eval_data")
        first = jax.tree.map(lambda x: x[0], shards)
        batch = jax.eval_shape(lambda s: _sample(s, seed=0, replica=0, step=0,
                                                 batch_size=batch_size), first)  # fmt: skip
        aux = check_loss(self.loss, params, batch)
        task = Task(_sample, self.loss, self._eval_fn(aux), self.unit, self.tokens_per_row,
                    rng=True, aux=aux, eval_mean=self.evaluate is None)  # fmt: skip
        check_eval(task.eval_fn, params, eval_data, default=self.evaluate is None)
        return Problem(shards, eval_data, None, params, task, math.nan)

    def fingerprint(self) -> str:
        """A digest of the task: a sweep reuses a finished run only for the same task.

        Returns:
          16 hexadecimal digits of a hash of the parameters' and data's shapes and values and of
          the names of the loss and evaluation functions (and of ``init``).
        """
        init = (self.params,) if callable(self.params) else ()
        arrays = ((), self.train_data, self.eval_data) if init else (self.params,
                                                                     self.train_data,
                                                                     self.eval_data)  # fmt: skip
        return fingerprint(arrays, (self.loss, self.evaluate, *init))

    def _eval_fn(self, aux: bool) -> Callable:
        return eval_fn(self.loss, self.evaluate, aux=aux, chunk=self.eval_batch)


def eval_fn(loss: Callable, evaluate: Callable | None, *, aux: bool, chunk: int) -> Callable:
    """The jitted evaluation of a user's task: ``evaluate``, or the exact mean of ``loss`` over
    every evaluation example (``chunk`` rows at a time, the last chunk's padding masked)."""
    if evaluate is not None:
        return jax.jit(evaluate)
    scalar = (lambda *args: loss(*args)[0]) if aux else loss

    @jax.jit
    def mean_loss(params, data):
        def chunk_sum(*leaves_and_mask):
            *leaves, mask_K = leaves_and_mask
            rows = jax.tree.unflatten(treedef, leaves)
            one = jax.vmap(lambda row: scalar(params, jax.tree.map(lambda x: x[None], row), None))
            return (one(rows) * mask_K).sum()

        leaves, treedef = jax.tree.flatten(data)
        count = leaves[0].shape[0]
        return {"eval_loss": _chunked(chunk_sum, count, min(chunk, count), *leaves).sum()
                / count}  # fmt: skip

    return mean_loss


def fingerprint(arrays, functions) -> str:
    """A digest of the shapes and values of the pytrees ``arrays`` and the names of
    ``functions``: what a sweep compares to reuse a finished run."""
    digest = hashlib.sha256()
    for part in arrays:
        for path, x in jax.tree_util.tree_leaves_with_path(part):
            x = np.ascontiguousarray(x)
            digest.update(f"{jax.tree_util.keystr(path)}{x.dtype}{x.shape}".encode())
            digest.update(x.tobytes())
    for fn in functions:
        digest.update(getattr(fn, "__qualname__", repr(type(fn))).encode())
    return digest.hexdigest()[:16]


def _leaf_name(path) -> str:
    """``head/bias`` for the key path of ``params["head"]["bias"]`` (or an attribute's)."""
    parts = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
    return "/".join(parts) or "the parameters"


def initial_params(params: Any, seed: int) -> Any:
    """``params``, or ``params(jax.random.key(seed))`` where it is an ``init(key)`` function;
    :class:`TaskError` naming a leaf that is not floating point (DiLoCo differentiates,
    averages and moves every leaf)."""
    if callable(params):
        try:
            params = params(jax.random.key(seed))
        except Exception as e:
            raise TaskError(f"init {_where(params)} fails on a key: {type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''}") from None  # fmt: skip
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        dtype = jnp.result_type(x)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TaskError(f"parameter {_leaf_name(path)} is {dtype}: parameters must be "
                            "floating point (keep integer state out of params)")  # fmt: skip
    return params


def _sample(shard, *, seed, replica, step, batch_size: int):
    """The ``batch_size`` rows ``replica`` trains on at ``step``: drawn with replacement from
    its shard (a pytree of ``[S, ...]`` arrays) by :func:`example_indices`."""
    shard_len = jax.tree.leaves(shard)[0].shape[0]
    idx_B = example_indices(seed=seed, replica=replica, step=step, batch_size=batch_size,
                            shard_len=shard_len)  # fmt: skip
    return jax.tree.map(lambda x: x[idx_B], shard)


def _examples(data, name: str) -> int:
    """The number of examples of ``data`` (every leaf's leading axis)."""
    leaves = jax.tree_util.tree_leaves_with_path(data)
    if not leaves:
        raise TaskError(f"{name} holds no arrays")
    counts = {jax.tree_util.keystr(path) or "the array": (x.shape[0] if x.ndim else None)
              for path, x in leaves}  # fmt: skip
    if len(set(counts.values())) != 1 or None in counts.values():
        raise TaskError(f"{name}'s arrays must share their leading (example) axis: {counts}")
    return int(next(iter(counts.values())) or 0)  # one count, not None (checked above)


def _where(fn: Callable) -> str:
    code = getattr(fn, "__code__", None)
    name = getattr(fn, "__qualname__", type(fn).__name__)
    return f"{name} ({code.co_filename}:{code.co_firstlineno})" if code else name


def _float_scalar(x) -> bool:
    return (isinstance(x, jax.ShapeDtypeStruct) and x.shape == ()
            and bool(jnp.issubdtype(x.dtype, jnp.floating)))  # fmt: skip


def check_loss(loss: Callable, params, batch) -> bool:
    """The loss's output is a float scalar, or ``(scalar, {name: scalar})`` (then True: the
    auxiliary metrics), and its gradient has the parameters' structure."""
    if not callable(loss):
        raise TaskError(f"loss must be a function (params, batch, rng) -> scalar, not "
                        f"{type(loss).__name__}")  # fmt: skip
    key = jax.random.key(0)
    try:
        out = jax.eval_shape(loss, params, batch, key)
    except Exception as e:  # the user's code: any error is theirs to see, in one line
        raise TaskError(f"loss {_where(loss)} fails on a batch of shapes "
                        f"{jax.tree.map(lambda x: x.shape, batch)}: {type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}") from None  # fmt: skip
    aux = isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict)
    value, metrics = out if aux else (out, {})
    if not (_float_scalar(value) and all(_float_scalar(m) for m in metrics.values())):
        got = jax.tree.map(lambda x: f"{x.dtype}{list(x.shape)}", out)
        raise TaskError(f"loss {_where(loss)} must return a float scalar (the batch's mean "
                        f"loss), or (that scalar, {{name: float scalar}}), not {got}")  # fmt: skip
    try:
        grads = jax.eval_shape(jax.grad(loss, has_aux=aux), params, batch, key)
    except Exception as e:
        raise TaskError(f"loss {_where(loss)} cannot be differentiated with respect to params: "
                        f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                        ) from None  # fmt: skip
    if aux:
        grads = grads[0]
    if cast(Any, jax.tree.structure(grads)) != jax.tree.structure(params):  # jaxlib's PyTreeDef
        raise TaskError(f"the gradients of loss {_where(loss)} do not have the params' "
                        "structure")  # fmt: skip
    return aux


NO_RNG_HINT = (
    "; the default evaluation calls loss(params, batch, rng=None) (no dropout when "
    "evaluating): draw from rng only when it is not None, or pass evaluate="
)


def check_eval(eval_fn: Callable, params, eval_data, *, default: bool = False) -> None:
    """The evaluation runs on ``eval_data`` (on shapes) and returns a scalar ``eval_loss``;
    ``default``: it is the mean of the loss (called with ``rng=None``), which the error says."""
    try:
        out = jax.eval_shape(eval_fn, params, eval_data)
    except Exception as e:
        hint = NO_RNG_HINT if default else ""
        raise TaskError(f"the evaluation fails on eval_data: {type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}{hint}") from None  # fmt: skip
    if not isinstance(out, dict) or "eval_loss" not in out or out["eval_loss"].shape != ():
        raise TaskError("evaluate(params, eval_data) must return a dict with a scalar "
                        f"'eval_loss'; got {jax.tree.map(lambda x: x.shape, out)}")  # fmt: skip
