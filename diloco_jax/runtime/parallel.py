"""Running the one replica step on many replicas: ``vmap`` (simulator) or ``shard_map`` (mesh).

* Simulator: ``jax.vmap(replica_step, axis_name=REPLICA)`` on one device; shared state (step,
  anchor, outer state) is unmapped, so 64 virtual workers hold one anchor.
* Mesh: ``jax.shard_map`` over a ``Mesh`` with axes ``(REPLICA, DATA)``. Each replica-device holds
  ``replicas / replica_devices`` virtual replicas, run by ``vmap`` over ``LOCAL_REPLICA`` inside
  the shard_map; each replica's batch is split over ``DATA``, an axis left to XLA's partitioner
  (the shard_map is manual over ``REPLICA`` alone where ``DATA`` has more than one device). DiLoCo's
  mean then runs over ``(LOCAL_REPLICA, REPLICA)``.

Both compile ``num_steps`` inner steps into one call (``lax.scan``).
"""

from __future__ import annotations

import os
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from diloco_jax.algorithm import state as state_lib
from diloco_jax.base.axes import DATA, LOCAL_REPLICA, REPLICA
from diloco_jax.runtime import fsdp
from diloco_jax.runtime.step import scan_steps


class Layout(NamedTuple):
    """How replicas map to devices. ``runtime`` is ``"sim"`` (vmap on one device) or ``"mesh"``."""

    runtime: str
    replicas: int
    replica_devices: int
    data_devices: int
    fsdp: bool = False  # each replica's state split over its DATA devices (runtime/fsdp.py)

    @property
    def replica_axis_names(self) -> str | tuple[str, ...]:
        """The axis (or axes, reduced in this order) that the DiLoCo mean runs over."""
        if self.runtime == "sim":
            return REPLICA
        if self.data_devices > 1 and self.replica_devices == 1:
            # XLA (jax 0.10) refuses a collective over a manual axis of size 1 when the other
            # axis is left to its partitioner; there is nothing to reduce over it anyway
            return LOCAL_REPLICA
        return (LOCAL_REPLICA, REPLICA)


def _largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


def resolve_layout(
    *,
    replicas: int,
    batch_size: int,
    runtime: str = "auto",
    replica_devices: int = 0,
    data_devices: int = 0,
    num_devices: int | None = None,
    fsdp: bool = False,
) -> Layout:
    """Chooses how to place ``replicas`` on the devices; 0 means "choose for me".

    ``auto`` uses the simulator on one device and the mesh otherwise, giving each replica as many
    devices as divide the count (replicas first, then the batch). Raises ValueError naming
    the config keys (the training application shows it as a config error).
    """
    num_devices = jax.device_count() if num_devices is None else num_devices
    if runtime == "auto":
        runtime = "mesh" if num_devices > 1 or replica_devices or data_devices else "sim"
    if runtime == "sim":
        if fsdp:
            raise ValueError("config key parallel.fsdp = True is invalid with the simulator: it "
                             "splits replicas over the data devices of a mesh (parallel.runtime "
                             "= mesh)")  # fmt: skip
        return Layout("sim", replicas, 1, 1)
    rdev = replica_devices or _largest_divisor(replicas, num_devices)
    if replicas % rdev:
        raise ValueError(
            f"config key parallel.replica_devices = {rdev} is invalid: must divide "
            f"parallel.replicas = {replicas}"
        )
    ddev = data_devices or _largest_divisor(batch_size, max(1, num_devices // rdev))
    if batch_size % ddev:
        raise ValueError(
            f"config key data.batch_size = {batch_size} is invalid: must be divisible by "
            f"parallel.data_devices = {ddev}"
        )
    if rdev * ddev > num_devices:
        raise ValueError(
            f"config keys parallel.replica_devices x parallel.data_devices = {rdev} x {ddev} "
            f"need {rdev * ddev} devices, but only {num_devices} exist"
        )
    return Layout("mesh", replicas, rdev, ddev, fsdp)


def cpu_devices_for(*, replicas: int, runtime: str, replica_devices: int = 0,
                    data_devices: int = 0, cores: int | None = None) -> int:  # fmt: skip
    """How many XLA devices to split the CPU into when nobody said: one per core, as many as
    divide ``replicas`` (or the devices the layout asks for), so the replicas run side by side.
    One for the simulator (``runtime="sim"``). On a CPU of 2 cores this runs the standard workload
    1.2x faster than one device (``docs/benchmarks.md``: XLA:CPU keeps 1.1 cores busy with one)."""
    if runtime == "sim":
        return 1
    if replica_devices or data_devices:
        return max(replica_devices, 1) * max(data_devices, 1)
    cores = len(os.sched_getaffinity(0)) if cores is None else cores
    return _largest_divisor(replicas, max(cores, 1))


def _count_set_by_user(environ) -> bool:
    flags = environ.get("XLA_FLAGS", "")
    return "JAX_NUM_CPU_DEVICES" in environ or bool(
        re.search(r"--xla_force_host_platform_device_count\b", flags)
    )


def split_cpu(devices: int, *, auto: int, environ=os.environ) -> int:
    """Splits the CPU into ``devices`` XLA devices (0: ``auto`` of them) before JAX starts;
    returns the count set, or 0 when it left JAX's as it was.

    Only an explicit ``devices`` overrides a count the user gave JAX (``XLA_FLAGS``'s
    ``--xla_force_host_platform_device_count``, ``JAX_NUM_CPU_DEVICES``); ``auto`` also stays out
    of a multi-process run. Once JAX has started its count cannot change: an explicit ``devices``
    that differs raises ValueError; ``auto`` is skipped. Accelerators are not affected."""
    if not devices and (auto <= 1 or _count_set_by_user(environ)
                        or jax.distributed.is_initialized()):  # fmt: skip
        return 0
    count = devices or auto
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:  # JAX has started
        running = len(jax.devices("cpu"))
        if devices and devices != running:
            raise ValueError(
                f"config key parallel.cpu_devices = {devices} is invalid here: JAX already runs "
                f"with {running} CPU devices (set it before JAX starts, e.g. on the command line)"
            ) from None
        return 0
    return count


GPU_DETERMINISTIC = "--xla_gpu_deterministic_ops"


def _backends_started() -> bool:
    from jax._src import xla_bridge  # no public way to ask; an older or newer JAX: assume not

    return bool(getattr(xla_bridge, "backends_are_initialized", lambda: False)())


def deterministic_gpu(enabled: bool, *, environ=os.environ) -> bool | None:
    """Asks XLA for GPU programs whose bits are equal run to run, before JAX starts: adds
    ``--xla_gpu_deterministic_ops=true`` to ``XLA_FLAGS`` (scatter-adds, such as an embedding's
    gradient, in a fixed order; no timing-dependent choice of matmul algorithm). Without it the
    same run twice on a GPU differs from the first steps on (seen on an H200). CPU programs are
    deterministic anyway; with ``JAX_PLATFORMS=cpu`` nothing is added.

    Returns whether the flag is in effect: the user's own ``XLA_FLAGS`` setting wins either way;
    None when ``enabled`` but JAX's backends had started, too late to ask."""
    flags = environ.get("XLA_FLAGS", "")
    own = re.search(rf"{GPU_DETERMINISTIC}(=(\S+))?", flags)
    if own:
        return (own.group(2) or "true").lower() not in ("false", "0")
    if not enabled or environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        return False
    if _backends_started():
        return None
    environ["XLA_FLAGS"] = f"{flags} {GPU_DETERMINISTIC}=true".strip()
    return True


def make_mesh(layout: Layout) -> Mesh:
    """A ``(REPLICA, DATA)`` mesh over the first ``replica_devices * data_devices`` devices.

    Axes are ``Auto`` (``jax.make_mesh`` would default to ``Explicit``); we place data ourselves.
    """
    count = layout.replica_devices * layout.data_devices
    devices = np.asarray(jax.devices()[:count]).reshape(layout.replica_devices, layout.data_devices)
    return Mesh(devices, (REPLICA, DATA), axis_types=(AxisType.Auto, AxisType.Auto))


def _shardings(mesh: Mesh, specs):
    return jax.tree.map(
        lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, P)
    )


def simulator_steps(replica_step, kinds, num_steps: int, *, per_step_data: bool = False):
    """``run(state, replicas_R, shards_RxS, control_NxR) -> (state, metrics_NxR)``:
    ``num_steps`` vmapped steps in one compiled call; ``kinds``: the algorithm's declaration of
    its state's per-replica and shared fields."""
    axes = state_lib.vmap_axes(kinds)
    step_R = jax.vmap(replica_step, in_axes=(axes, 0, 0, 0), out_axes=(axes, 0), axis_name=REPLICA)
    return jax.jit(scan_steps(step_R, num_steps, per_step_data=per_step_data), donate_argnums=0)


def mesh_steps(replica_step, kinds, mesh: Mesh, num_steps: int, *, per_step_data: bool = False,
               fsdp_specs=None):  # fmt: skip
    """Like :func:`simulator_steps`, on ``mesh`` with ``shard_map``. The metrics come back
    replicated on every device, so every process can read them (an all-gather of ``[N, R]``
    scalars per call).

    ``check_vma=False``: jax 0.10 cannot ``pmean`` over a ``vmap`` axis inside a ``shard_map``
    with vma checks on (an assertion in ``pvary``). The step differentiates only its own
    replica's (replica-varying) parameters, so nothing is summed over replicas behind its back.

    Where the mesh's ``DATA`` axis has more than one device, the ``shard_map`` is manual over
    ``REPLICA`` only and XLA partitions ``DATA`` (the step must be made with ``data_axis=DATA``:
    it constrains each batch's rows to it). The loss is then one function of the replica's
    whole batch on every layout, and so are the random bits it draws (see
    :func:`diloco_jax.runtime.step.make_replica_step`). ``fsdp_specs``
    (:func:`diloco_jax.runtime.fsdp.state_specs`): each replica's state split over ``DATA`` too,
    every leaf kept where these specs say; without them the state is whole on every ``DATA``
    device.
    """
    axes = state_lib.vmap_axes(kinds)
    step_R = jax.vmap(
        replica_step, in_axes=(axes, 0, 0, 0), out_axes=(axes, 0), axis_name=LOCAL_REPLICA
    )
    state_specs = state_lib.specs(kinds)
    manual = {REPLICA} if mesh.shape[DATA] > 1 else {REPLICA, DATA}
    if fsdp_specs is not None:
        local, inner_step = fsdp.local_specs(fsdp_specs), step_R

        def step_R(state, *args):
            state, metrics = inner_step(fsdp.constrain(state, local), *args)
            return fsdp.constrain(state, local), metrics

    data = P(None, REPLICA) if per_step_data else P(REPLICA)
    run = jax.shard_map(
        scan_steps(step_R, num_steps, per_step_data=per_step_data),
        mesh=mesh,
        in_specs=(state_specs, P(REPLICA), data, P(None, REPLICA)),
        out_specs=(state_specs, P(None, REPLICA)),
        axis_names=manual,
        check_vma=False,
    )
    placed = state_specs if fsdp_specs is None else fsdp_specs
    out_shardings = (_shardings(mesh, placed), NamedSharding(mesh, P()))
    return jax.jit(run, donate_argnums=0, out_shardings=out_shardings)


def mesh_map(fn, mesh: Mesh, in_specs, out_specs, placed=None):
    """``fn``, written for one replica-device's part (a ``vmap`` over its virtual replicas on
    ``LOCAL_REPLICA``), under ``shard_map`` on ``mesh`` and jitted, its outputs placed as
    ``out_specs`` say (or ``placed``, global specs with ``DATA`` too: an FSDP state's);
    manual axes and ``check_vma`` as in :func:`mesh_steps`. For the parts of a sync taken
    between calls (a learner's, :mod:`diloco_jax.learners.learner`)."""
    manual = {REPLICA} if mesh.shape[DATA] > 1 else {REPLICA, DATA}
    run = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                        axis_names=manual, check_vma=False)  # fmt: skip
    return jax.jit(run, out_shardings=_shardings(mesh, out_specs if placed is None else placed))


def state_specs(state, kinds, layout: Layout):
    """The per-leaf ``PartitionSpec`` of a replica-stacked state under ``layout`` with FSDP
    (:func:`diloco_jax.runtime.fsdp.state_specs`); None without (the kinds' specs apply)."""
    if layout.runtime != "mesh" or not layout.fsdp:
        return None
    return fsdp.state_specs(state, kinds, layout.data_devices)


def shapes(tree, mesh: Mesh | None, spec: P | None = None, *, specs=None):
    """What :func:`put` (or, for the simulator, ``jnp.asarray``) would make of ``tree``, as
    ``jax.ShapeDtypeStruct`` with the same shardings, allocating nothing: for compiling and
    planning memory before any state exists."""
    if mesh is None:
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        shardings = jax.tree.map(lambda _: device, tree)
    else:
        specs = jax.tree.map(lambda _: spec, tree) if specs is None else specs
        shardings = _shardings(mesh, specs)
    return jax.tree.map(lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                                 sharding=sharding),
                        tree, shardings)  # fmt: skip


def put(tree, mesh: Mesh, spec: P | None = None, *, specs=None):
    """``tree`` as global arrays on ``mesh`` with partition ``spec`` (or a tree of ``specs``).

    Works with several processes: every process passes the same host values and each copies only
    the slices its own devices hold (``jax.make_array_from_callback``). Arrays that already span
    processes are resharded with ``device_put``."""
    specs = jax.tree.map(lambda _: spec, tree) if specs is None else specs

    def one(x, sharding):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return jax.device_put(x, sharding)
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])

    return jax.tree.map(one, tree, _shardings(mesh, specs))


def place(tree, kinds, mesh: Mesh | None, *, abstract: bool = False, fsdp_split: bool = False):
    """Puts a replica-stacked state on ``mesh`` (per-replica fields split over ``REPLICA``,
    shared ones replicated, as ``kinds`` declare); a no-op for the simulator (``mesh is None``).
    ``abstract``: the placed shapes only (:func:`shapes`), for a state from ``jax.eval_shape``.
    ``fsdp_split``: every leaf also split over ``DATA`` (:func:`state_specs`)."""
    if mesh is None and not abstract:
        return tree
    specs = None
    if mesh is not None and fsdp_split:
        specs = fsdp.state_specs(tree, kinds, mesh.shape[DATA])
    elif mesh is not None:
        specs = jax.tree.map(lambda spec, sub: jax.tree.map(lambda _: spec, sub),
                             state_lib.specs(kinds), tree,
                             is_leaf=lambda x: isinstance(x, P))  # fmt: skip
    if abstract or mesh is None:  # the simulator's abstract state: its shapes alone
        return shapes(tree, mesh, specs=specs)
    return put(tree, mesh, specs=specs)


def on_devices(tree, mesh: Mesh | None, spec: P, *, abstract: bool = False):
    """Host values as device arrays: split or replicated over ``mesh`` as ``spec`` says, or on
    the one device of the simulator (``mesh is None``); ``abstract``: their :func:`shapes`."""
    if abstract:
        return shapes(tree, mesh, spec)
    return jax.tree.map(jnp.asarray, tree) if mesh is None else put(tree, mesh, spec)


def replicated_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def replicated(x, mesh: Mesh | None):
    """``x`` (a pytree) replicated on every device of ``mesh`` (unchanged for the simulator)."""
    return x if mesh is None else put(x, mesh, P())


def split_over_replicas(x, mesh: Mesh | None, *, axis: int = 0):
    """``x`` (a pytree) with its ``[R]`` axis number ``axis`` split over ``REPLICA``."""
    if mesh is None:
        return x
    return put(x, mesh, P(*([None] * axis), REPLICA))


def host_copy(tree):
    """A numpy copy of a tree of replicated arrays, readable by every process (each reads its
    own device's copy; no communication)."""
    return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), tree)


__all__ = [
    "Layout", "cpu_devices_for", "deterministic_gpu", "host_copy", "make_mesh", "mesh_map",
    "mesh_steps",
    "on_devices", "place", "put", "replicated", "resolve_layout", "simulator_steps", "shapes",
    "split_cpu", "split_over_replicas", "state_specs",
]  # fmt: skip
