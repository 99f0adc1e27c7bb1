"""A user's own optax optimizers, inner and outer, through the whole training loop.

Two ways in:

* from Python, ``fit(task, inner=tx, outer=tx)`` (and ``sweep``): any
  ``optax.GradientTransformation``, schedules and chains included;
* from the command line, an import path: ``--config.inner.optimizer=mymodule:make_inner`` with
  ``--config.inner.args='{"lr": 1e-3}'`` (the function is called with those keyword arguments and
  returns the transform; the working directory is on the import path, as for ``task.factory``).

A run records which optimizer it trained with, so a resume with another one is refused like a
changed learning rate: an import path is its own config value (with its ``args``); a transform
given from Python is recorded as ``given:<fingerprint>``, the hash of what it does on a miniature
of the parameters (:func:`fingerprint`).

The inner transform sees the parameters' tree. The outer one sees what DiLoCo feeds it, the
replicas' mean pseudo-gradient as a list of the parameters' leaves (one list per streaming
fragment), so a transform keyed by the tree's names (``optax.masked`` with a dict,
``optax.multi_transform``) fails there, in one line before anything compiles.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from diloco_jax.base.errors import ConfigError
from diloco_jax.config import dotted, user_code
from diloco_jax.config import schema as config_lib

GIVEN = "given:"  # a config value recording a transform given from Python
PROBE_STEPS = 3
PROBE_AXIS = 4  # each axis of the miniature parameters at most this long


class Given(NamedTuple):
    """Transforms given from Python (None: the config's)."""

    inner: optax.GradientTransformation | None = None
    outer: optax.GradientTransformation | None = None


NONE = Given()  # the config's own optimizers


def is_import_path(name: str) -> bool:
    return ":" in name and not name.startswith(GIVEN)


def is_custom(name: str) -> bool:
    """Whether an ``inner.optimizer`` / ``outer.optimizer`` value names the user's optimizer."""
    return ":" in name


def check_transform(tx: Any, where: str) -> optax.GradientTransformation:
    """``tx`` if it is an optax transform (``init`` and ``update`` callables), else a one-line
    ConfigError naming ``where``."""
    if callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None)):
        return tx
    raise ConfigError(f"{where} is a {type(tx).__name__}, not an optax "
                      "GradientTransformation (init and update)")  # fmt: skip


def imported(path: str, args: str, key: str) -> optax.GradientTransformation:
    """The transform that ``path`` (``package.module:function``) returns when called with the
    JSON keyword arguments ``args``; ConfigError naming ``key`` if anything fails."""
    where = f"config key {key} = {path!r}"
    fn = user_code.function(path, key)
    try:
        tx = fn(**(json.loads(args) if args else {}))
    except Exception as e:
        raise ConfigError(f"{where} failed with {key.split('.')[0]}.args {args!r}: "
                          f"{type(e).__name__}: {e}") from None  # fmt: skip
    return check_transform(tx, f"what {where} returned")


def miniature(params: Any) -> Any:
    """``params`` with every axis cut to at most :data:`PROBE_AXIS` (same tree, ranks and
    dtypes), filled with fixed values: a cheap stand-in on which an optimizer behaves as on the
    real parameters (a matrix stays a matrix)."""

    def small(i, x):
        shape = tuple(min(int(n), PROBE_AXIS) for n in np.shape(x))
        values = np.sin(np.arange(1, np.prod(shape, dtype=int) + 1) * (0.37 + 0.01 * i))
        return jnp.asarray(values.reshape(shape), dtype=jnp.result_type(x))

    leaves, treedef = jax.tree.flatten(params)
    return jax.tree.unflatten(treedef, [small(i, x) for i, x in enumerate(leaves)])


def probe(tx: optax.GradientTransformation, params: Any) -> list[np.ndarray]:
    """The updates of :data:`PROBE_STEPS` steps of ``tx`` from ``params`` on fixed gradients."""
    state, out = tx.init(params), list[np.ndarray]()
    for step in range(PROBE_STEPS):
        grads = jax.tree.map(lambda x, s=step: jnp.cos(x * (s + 2)).astype(x.dtype), params)
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        out.extend(np.asarray(u, np.float64) for u in jax.tree.leaves(updates))
    return out


def fingerprint(tx: optax.GradientTransformation, params: Any) -> str:
    """12 hex digits of what ``tx`` does on :func:`miniature` ``params`` (:func:`probe`), each
    update rounded to 5 significant digits so that another machine's last bits agree. A change
    of learning rate, moments, clipping or a schedule's early steps changes it; one that first
    shows after :data:`PROBE_STEPS` steps does not."""
    text = ",".join(f"{v:.5g}" for u in probe(tx, params) for v in u.ravel())
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def check_on(tx: optax.GradientTransformation, params: Any, key: str) -> str:
    """:func:`fingerprint`, with a failure of ``tx`` on ``params`` as a one-line ConfigError."""
    try:
        return fingerprint(tx, params)
    except Exception as e:
        outer = key.startswith("outer")
        why = ("; DiLoCo's outer optimizer sees a list of the parameters' leaves, so a transform "
               "keyed by their names does not apply") if outer else ""  # fmt: skip
        raise ConfigError(
            f"the {key.split('.')[0]} optimizer fails on the parameters: "
            f"{type(e).__name__}: {str(e).strip().splitlines()[0]}{why}"
        ) from None


def recorded(cfg: config_lib.Config, given: Given, params: Any) -> config_lib.Config:
    """``cfg`` with each transform of ``given`` recorded as ``given:<fingerprint>`` in its
    ``optimizer`` key (checked on a miniature of ``params``: the inner on their tree, the outer
    on their leaves); import paths are checked the same way."""
    if given == NONE and not any(is_custom(getattr(cfg, part).optimizer)
                                 for part in ("inner", "outer")):  # fmt: skip
        return cfg  # the config's own optimizers: nothing to check or record
    small = miniature(params)
    probes = (("inner.optimizer", given.inner, small),
              ("outer.optimizer", given.outer, jax.tree.leaves(small)))  # fmt: skip
    for key, tx, probe_params in probes:
        section = key.split(".")[0]
        if tx is not None:
            tx = check_transform(tx, f"the {section} optimizer given")
            cfg = dotted.override(cfg, key, GIVEN + check_on(tx, probe_params, key))
        elif is_import_path(getattr(cfg, section).optimizer):
            c = getattr(cfg, section)
            check_on(imported(c.optimizer, c.args, key), probe_params, key)
        elif getattr(cfg, section).optimizer.startswith(GIVEN):
            raise ConfigError(
                f"config key {key} = {getattr(cfg, section).optimizer!r} records a transform "
                f"given from Python; pass it again (fit(..., {section}=...)) or name one by "
                "import path (package.module:function)"
            )
    return cfg
