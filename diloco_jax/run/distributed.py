"""One run over several processes: ``jax.distributed`` set-up, and the checks that keep the
processes in step (agreeing on when to stop, comparing the anchor).

Where the cluster comes from, first match wins:

1. flags ``--coordinator_address HOST:PORT --num_processes N --process_id I`` (``train``'s CLI);
2. the environment ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID`` (what
   ``python -m diloco_jax.launch`` sets);
3. a cluster JAX detects itself: SLURM (``srun``) and Open MPI (``mpirun``) jobs of more than one
   task are detected here, by the variables JAX reads; elsewhere (Cloud TPU pods, Kubernetes)
   pass ``--distributed on``.

Without any of these the run is one process. A SLURM allocation of several tasks entered without
``srun`` (an ``salloc`` shell, a batch script) is refused with a line saying to use ``srun`` or
``--distributed off``: JAX would stop with "coordinator_address should be defined". On CPU the
collectives go through gloo.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from diloco_jax.algorithm import state as state_lib
from diloco_jax.algorithm.state import PER_REPLICA
from diloco_jax.base.axes import DATA
from diloco_jax.base.errors import ConfigError
from diloco_jax.config.cli import Cluster
from diloco_jax.runtime import fsdp

MODES = ("auto", "on", "off")
# what jax._src.clusters.slurm_cluster.SlurmCluster.is_env_present requires; srun sets all of
# them, an salloc shell or a batch script only SLURM_JOB_ID (and SLURM_NTASKS)
SLURM_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID",
              "SLURM_LOCALID")  # fmt: skip
_ENV = {
    "coordinator_address": "JAX_COORDINATOR_ADDRESS",
    "num_processes": "JAX_NUM_PROCESSES",
    "process_id": "JAX_PROCESS_ID",
}


class ConsistencyError(RuntimeError):
    """Processes that should hold the same values do not."""


def _int(name: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{name} = {text!r} is not an integer") from None


def resolve(cluster: Cluster, environ=os.environ) -> Cluster:
    """``cluster`` with unset fields filled from ``environ``; raises :class:`ConfigError` (one
    line naming the value) for incomplete or impossible settings."""
    if cluster.mode not in MODES:
        raise ConfigError(f"--distributed = {cluster.mode!r} is invalid: must be one of {MODES}")
    values = {}
    for field, env in _ENV.items():
        value = getattr(cluster, field)
        if value is None and env in environ:
            value = environ[env] if field == "coordinator_address" else _int(env, environ[env])
        values[field] = value
    given = [f for f, v in values.items() if v is not None]
    if given and len(given) < len(values):
        missing = [f"--{f} (or {_ENV[f]})" for f, v in values.items() if v is None]
        raise ConfigError(f"distributed setup is incomplete: {', '.join(missing)} not set")
    address, count, pid = (
        values["coordinator_address"],
        values["num_processes"],
        values["process_id"],
    )
    if count is not None:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"coordinator address {address!r} is invalid: expected HOST:PORT")
        if count < 1:
            raise ConfigError(f"num_processes = {count} is invalid: must be >= 1")
        if not 0 <= pid < count:
            raise ConfigError(f"process_id = {pid} is invalid: must be in [0, {count})")
    elif cluster.mode != "off":
        _check_slurm(environ)
    return dataclasses.replace(cluster, **values)


def _tasks(environ, name: str) -> int:
    text = environ.get(name, "1")
    return int(text) if text.strip().isdigit() else 1


def _check_slurm(environ) -> None:
    """Refuses a SLURM allocation of several tasks that this process did not enter through
    ``srun`` (JAX cannot find the other tasks: none were started)."""
    if "SLURM_JOB_ID" not in environ or _tasks(environ, "SLURM_NTASKS") < 2:
        return
    missing = [v for v in SLURM_VARS if v not in environ]
    if missing:
        raise ConfigError(
            f"SLURM allocation found (SLURM_JOB_ID={environ['SLURM_JOB_ID']}, SLURM_NTASKS="
            f"{environ['SLURM_NTASKS']}) but this process was not started by srun ({missing[0]} "
            'is not set): run it as "srun python -m diloco_jax.train ..." (one task per host), '
            "or pass --distributed off to train in this process alone"
        )


def detected_cluster(environ=os.environ) -> str | None:
    """The multi-task job this process runs in, if JAX can set it up from the environment: the
    variables JAX's own cluster detection reads, and more than one task."""
    if all(v in environ for v in SLURM_VARS) and _tasks(environ, "SLURM_NTASKS") > 1:
        return "SLURM"
    if "OMPI_MCA_orte_hnp_uri" in environ and _tasks(environ, "OMPI_COMM_WORLD_SIZE") > 1:
        return "Open MPI"
    return None


def initialize(cluster: Cluster) -> str:
    """Joins the run described by ``cluster`` (call before anything touches a device); returns
    what happened, in words. Raises :class:`ConfigError` for bad settings or a failed join (JAX
    aborts the process itself when the coordinator stays unreachable past the timeout; the line
    printed before joining says what it was waiting for)."""
    cluster = resolve(cluster)
    if cluster.mode == "off":
        return "one process (--distributed off)"
    if cluster.num_processes is not None:
        if cluster.num_processes == 1 and cluster.mode == "auto":
            return "one process"
        where = (f"as process {cluster.process_id} of {cluster.num_processes} through "
                 f"{cluster.coordinator_address}")  # fmt: skip
        _join(where, cluster.timeout_s, coordinator_address=cluster.coordinator_address,
              num_processes=cluster.num_processes, process_id=cluster.process_id)  # fmt: skip
        return f"process {cluster.process_id} of {cluster.num_processes}"
    detected = detected_cluster()
    if detected is None and cluster.mode == "auto":
        return "one process"
    where = f"of this {detected} job" if detected else "of a cluster JAX detects (--distributed on)"
    _join(where, cluster.timeout_s)  # JAX finds the rest
    return f"joined ({detected or 'JAX'})"  # not jax.process_index(): it would start JAX


def _join(where: str, timeout_s: int, **found: Any) -> None:
    print(f"joining the run {where} (waiting up to {timeout_s}s for every process)",
          file=sys.stderr, flush=True)  # fmt: skip
    try:
        jax.distributed.initialize(**found, initialization_timeout=timeout_s)
    except Exception as e:  # noqa: BLE001 - JAX raises several kinds; all mean: could not join
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise ConfigError(f"could not join the run {where}: {reason}") from None


def any_process(flag: bool) -> list[int]:
    """The indices of the processes whose ``flag`` is set (every process must call this)."""
    if jax.process_count() == 1:
        return [0] if flag else []
    from jax.experimental import multihost_utils

    flags = np.asarray(multihost_utils.process_allgather(np.asarray([flag], np.int32)))
    return [int(i) for i in np.flatnonzero(flags.reshape(-1))]


def merged(part: dict) -> dict:
    """The union of every process's ``part`` (a JSON-able dict, e.g. its replicas' pipeline
    states), on every process (every process must call this)."""
    if jax.process_count() == 1:
        return dict(part)
    from jax.experimental import multihost_utils

    text_B = np.frombuffer(json.dumps(part).encode(), np.uint8)
    lengths = np.asarray(multihost_utils.process_allgather(np.asarray([text_B.size], np.int32)))
    padded = np.zeros(int(lengths.max()), np.uint8)
    padded[: text_B.size] = text_B
    texts = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(lengths.ravel()), -1)
    out = {}
    for length, text in zip(lengths.ravel(), texts, strict=True):
        out.update(json.loads(text[:length].tobytes()))
    return out


def from_lead(values: list[int]) -> list[int]:
    """Process 0's ``values`` on every process (every process must call this, with a list of
    the same length)."""
    if jax.process_count() == 1:
        return list(values)
    from jax.experimental import multihost_utils

    out = multihost_utils.broadcast_one_to_all(np.asarray(values, np.int32))
    return [int(v) for v in np.asarray(out).reshape(-1)]


def fingerprint(tree) -> jax.Array:
    """A uint32 checksum of every bit of ``tree``: ``sum_i bits_i * (2i + 1) mod 2**32`` per leaf,
    combined over leaves. Any single flipped bit, and any swap of two different values, changes
    it. Cheap: one pass over the values."""
    total = jnp.uint32(0)
    for leaf in jax.tree.leaves(tree):
        leaf = jnp.asarray(leaf)
        if leaf.dtype == jnp.bool_:
            leaf = leaf.astype(jnp.uint8)
        # 8-byte values (float64) bitcast to pairs of uint32
        width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[leaf.dtype.itemsize]
        bits = lax.bitcast_convert_type(leaf, width).astype(jnp.uint32).reshape(-1)
        odd = jnp.arange(bits.size, dtype=jnp.uint32) * jnp.uint32(2) + jnp.uint32(1)
        total = total * jnp.uint32(0x01000193) + jnp.sum(bits * odd, dtype=jnp.uint32)
    return total


def make_device_fingerprints(mesh: Mesh, *, split: bool = False):
    """``fn(tree) -> uint32 [num_devices]``: the :func:`fingerprint` of each device's own copy of
    a replicated ``tree``, in ``mesh.devices.flat`` order, readable by every process. ``split``:
    each leaf is split over ``DATA`` as FSDP keeps it (:mod:`diloco_jax.runtime.fsdp`), and
    each device fingerprints its own part (equal only within a column of the mesh)."""
    axes = tuple(mesh.axis_names)

    def per_device(tree):
        return fingerprint(tree)[None]

    def fn(tree):
        specs = P()
        if split:
            specs = jax.tree.map(lambda x: fsdp.leaf_spec(x.shape, mesh.shape[DATA]), tree)
        return jax.shard_map(per_device, mesh=mesh, in_specs=(specs,), out_specs=P(axes),
                             check_vma=False)(tree)  # fmt: skip

    return jax.jit(fn, out_shardings=NamedSharding(mesh, P()))


def check_same(values, devices, what: str) -> None:
    """Raises :class:`ConsistencyError` naming the processes (and devices) whose entry of
    ``values`` differs from process 0's first device, if any does."""
    values = [int(v) for v in np.asarray(values).reshape(-1)]
    reference = values[0]
    bad = [(d, v) for d, v in zip(devices, values, strict=True) if v != reference]
    if not bad:
        return
    good = [d for d, v in zip(devices, values, strict=True) if v == reference]

    def names(devs):
        procs = sorted({d.process_index for d in devs})
        return ", ".join(
            f"process {p} (devices {[d.id for d in devs if d.process_index == p]})" for p in procs
        )

    raise ConsistencyError(
        f"{what} differs across processes: {names([d for d, _ in bad])} disagree with "
        f"{names(good)} (fingerprints {sorted({hex(v) for _, v in bad})} vs {hex(reference)})"
    )


def _compared(s, state) -> dict:
    """The shared fields :func:`check_replicated` compares: every one with
    ``train.check_replicated``, else the anchor when a sync plan moves a shared one."""
    if s.fingerprints is None:
        return {}
    kinds = s.algorithm.kinds
    shared = state_lib.shared_part(state, kinds)._asdict()
    if s.cfg.train.check_replicated:
        return shared
    if getattr(s.algorithm, "plan", None) is None or kinds.anchor == PER_REPLICA:
        return {}
    return {"anchor": shared["anchor"]}


def compile_checks(s, state) -> None:
    """Compiles (or loads from the persistent cache) the fingerprints that
    :func:`check_replicated` computes, ahead of its first call."""
    for value in _compared(s, state).values():
        if jax.tree.leaves(value):
            s.fingerprints.lower(value).compile()


def check_replicated(s, state, step: int) -> None:
    """Every device must hold bitwise the same copy of the shared state of ``s`` (a
    ``run_setup.Setup``) after ``step``; raises :class:`ConsistencyError` naming the field and the
    processes otherwise.

    By default (cheap) the anchor is compared after a call in which a sync started (streaming
    fragments' syncs included); with ``train.check_replicated`` every shared field (anchor,
    outer state, step, pending mean) after every call."""
    shared, n = _compared(s, state), s.cfg.train.log_every
    if not shared:
        return
    if not s.cfg.train.check_replicated and not s.algorithm.plan.sync_steps(step - n + 1, step):
        return
    devices = np.asarray(s.mesh.devices)
    # with FSDP a device holds one part of each leaf: compare the devices holding the same part
    columns = range(devices.shape[1]) if s.layout.fsdp else [slice(None)]
    for name, value in shared.items():
        if jax.tree.leaves(value):
            values = np.asarray(jax.device_get(s.fingerprints(value))).reshape(devices.shape)
            for c in columns:
                check_same(values[:, c], list(devices[:, c].flat),
                           f"the shared {name} after step {step}")  # fmt: skip
