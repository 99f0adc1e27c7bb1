"""Sampling by definition (issue 54, item 15), on every data path: each input says where it came
from, and the tests check the definitions in the docstrings, never an expected batch computed by
the sampler itself.

The inputs: arrays whose value is the example's global index, a corpus whose token at position
``p`` is ``p``. The definitions (``R`` replicas, ``B`` rows, windows of ``L + 1`` tokens):

* arrays (:class:`~diloco_jax.ArrayTask`): replica ``r``'s shard is examples ``[r S, (r + 1) S)``,
  ``S = N // R`` (the last ``N mod R`` unused); its rows are drawn from it with replacement.
* corpus windows (:func:`~diloco_jax.data.corpus.replica_shards`,
  :func:`~diloco_jax.data.corpus.sample_batch`, inside the compiled step): replica ``r``'s shard
  is tokens ``[r S, (r + 1) S)``; a window is ``L + 1`` consecutive tokens of it, its start
  uniform over the shard's ``S - L`` starts.
* streamed corpus (:class:`~diloco_jax.data.stream.StreamedShards`): those windows, read on the
  host from a memory map.
* grain (:func:`~diloco_jax.replica_batches` through a :class:`~diloco_jax.GrainTask`'s
  stream): replica ``r`` reads examples ``r, r + R, r + 2R, ...``, each once per epoch.

The properties: (a) replicas draw independently (two replicas rarely take the same offset of
their shards at a step) and each step draws afresh; (b) a replica draws from its own shard only;
(c) no window crosses its shard's end, and every start is drawn (windows reach that end);
(d) the batch of ``(seed, replica, step)`` is the same on every layout (vmap on one device, 2
devices x 2 virtual replicas, each batch split over 2 data devices) and whatever the calls (a
run resumed mid-way, other call lengths, a process or a learner reading some replicas only).
"""

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from diloco_jax.algorithm import Local
from diloco_jax.base.axes import REPLICA
from diloco_jax.data.corpus import replica_shards
from diloco_jax.data.stream import make_stream
from diloco_jax.runtime import parallel
from diloco_jax.tasks import ArrayTask, GrainTask, Task, replica_batches
from diloco_jax.tasks.core import language_model
from tests import helpers

R, B, L = 4, 4, 3  # replicas, rows per batch, a window's L + 1 tokens
S = 12  # examples (tokens) per shard: few, so that every example (start) is drawn
N = R * S + 3  # the last 3 belong to no shard
SEED = 5
STEPS = 4  # the dense checks' steps, of DRAWS rows per replica each
DRAWS = 64
CALL = 2  # steps per compiled call in the layout checks (two calls: steps 0-3)
LAYOUTS = {
    "2 devices x 2 virtual": parallel.Layout("mesh", R, 2, 1),
    "2x2, batch split over data": parallel.Layout("mesh", R, 2, 2),
}


# --- the definitions, checked on what was drawn ------------------------------------------------


def assert_in_own_shard(position, replicas, shard_len: int = S):
    """``position`` ``[T, len(replicas), ...]``: every value lies in its replica's shard."""
    for i, r in enumerate(replicas):
        got = np.asarray(position[:, i])
        assert got.min() >= r * shard_len and got.max() < (r + 1) * shard_len, (
            f"replica {r} drew positions {sorted(set(got.ravel().tolist()))}, outside its "
            f"shard [{r * shard_len}, {(r + 1) * shard_len})"
        )


def assert_windows(tokens, replicas):
    """``tokens`` ``[T, len(replicas), B, L + 1]`` of positions: each window is L + 1
    consecutive tokens of its replica's shard, never past its end."""
    np.testing.assert_array_equal(np.diff(tokens, axis=-1), 1, err_msg="not consecutive tokens")
    assert_in_own_shard(tokens, replicas)  # the first and the last token: inside


def offsets(position, replicas, shard_len: int = S):
    """Where in its own shard each position is."""
    return np.asarray(position) - np.asarray(replicas).reshape(1, -1, *[1] * (position.ndim - 2)
                                                               ) * shard_len  # fmt: skip


def assert_independent(offset_TxRxB):
    """(a): two replicas take the same offset of their shards at a step about once in S (drawn
    independently), never in most rows; and a replica's rows at two steps differ as much."""
    first = offset_TxRxB.reshape(*offset_TxRxB.shape[:3], -1)[..., 0]  # a window: its start
    for r in range(1, first.shape[1]):
        share = float((first[:, r] == first[:, 0]).mean())
        assert share < 0.5, f"replicas 0 and {r} draw the same offsets in {share:.0%} of rows"
    for t in range(1, first.shape[0]):
        share = float((first[t] == first[0]).mean())
        assert share < 0.5, f"steps 0 and {t} draw the same offsets in {share:.0%} of rows"


def assert_every_start_drawn(offset_TxRxB, count: int):
    """(c), the other side: each replica's offsets (a window's start) cover all ``count``
    starts of its shard: the windows reach its end."""
    first = offset_TxRxB.reshape(*offset_TxRxB.shape[:3], -1)[..., 0]
    for r in range(first.shape[1]):
        assert set(first[:, r].ravel().tolist()) == set(range(count)), (
            f"replica {r} drew the starts {sorted(set(first[:, r].ravel().tolist()))}, not "
            f"each of 0..{count - 1}"
        )


# --- the device paths: the compiled step's own batches -----------------------------------------


def _reporting_loss(params, batch, rng):
    """A loss that reports its whole batch as auxiliary metrics (``x0``, ``x1``, ...): the
    step returns what it trained on."""
    leaf = jax.tree.leaves(batch)[0]
    flat = leaf.reshape(-1).astype(jnp.float32)
    return params["w"] ** 2, {f"x{k}": flat[k] for k in range(flat.shape[0])}


PARAMS = {"w": np.zeros((), np.float32)}


def array_problem():
    data = {"i": np.arange(N, dtype=np.int32)}  # an example's value: its global index
    return ArrayTask(PARAMS, _reporting_loss, data).problem(R, B, seed=SEED)


def window_task() -> Task:
    """The built-in language model's sampler, with the reporting loss."""
    return Task(language_model(None, seq_len=L).sample, _reporting_loss, None, aux=True)


def positions_RxS() -> np.ndarray:
    return replica_shards(np.arange(N, dtype=np.int32), R, L)  # token p is p


def _batches(metrics, shape) -> np.ndarray:
    aux = jax.device_get(metrics["aux"])
    flat = np.stack([aux[f"x{k}"] for k in range(len(aux))], axis=-1)  # [CALL, R, rows]
    return np.rint(flat).astype(np.int64).reshape(*flat.shape[:2], *shape)


def stepped(task, shards, shape) -> dict[str, np.ndarray]:
    """The batches the compiled step trains on: on the simulator (two calls, steps 0-3), the
    simulator resumed at step 2 (one call), and each of :data:`LAYOUTS` (two calls)."""
    out = {}
    for name, layout in {"sim": helpers.sim(R), **LAYOUTS}.items():
        fn, args, _ = helpers.build(lambda axis: Local(optax.sgd(0.1)), layout, CALL,
                                    seed=SEED, batch=B, task=task, params=PARAMS,
                                    shards_RxS=shards)  # fmt: skip
        state, rest = args[0], args[1:]
        # a run resumed at step 2: the state a checkpoint restores (the step is its own input)
        resumed = jax.tree.map(jnp.array, state)._replace(step=jnp.int32(CALL))
        calls = []
        for _ in range(2):
            state, metrics = fn(state, *rest)
            calls.append(_batches(metrics, shape))
        out[name] = np.concatenate(calls)
        if name == "sim":
            out["sim resumed at step 2"] = _batches(fn(resumed, *rest)[1], shape)
    return out


@pytest.fixture(scope="module")
def arrays_stepped():
    problem = array_problem()
    return stepped(problem.task, problem.shards, (B,))


@pytest.fixture(scope="module")
def windows_stepped():
    return stepped(window_task(), positions_RxS(), (B, L + 1))


def _dense(sample, shards_RxS) -> np.ndarray:
    """``[STEPS, R, DRAWS, ...]``: what ``sample`` draws for each replica from its own shard
    (as the step gives it one) at steps 0.."""

    @jax.jit
    def draw(shards):
        def one(step, r):
            shard = jax.tree.map(lambda x: x[r], shards)
            return sample(shard, seed=jnp.int32(SEED), replica=r, step=step, batch_size=DRAWS)

        steps, replicas = jnp.arange(STEPS, dtype=jnp.int32), jnp.arange(R, dtype=jnp.int32)
        return jax.vmap(jax.vmap(one, (None, 0)), (0, None))(steps, replicas)

    return np.asarray(jax.tree.leaves(draw(shards_RxS))[0]).astype(np.int64)


def test_arrays_rows_come_from_their_own_shard_independently():
    """(a), (b) on :class:`ArrayTask`'s sampler: rows of its own shard only, every example of it
    drawn over 256 draws, replicas and steps drawing independently."""
    problem = array_problem()
    drawn = _dense(problem.task.sample, problem.shards)
    assert drawn.shape == (STEPS, R, DRAWS)
    assert_in_own_shard(drawn, range(R))
    assert_independent(offsets(drawn, range(R)))
    assert_every_start_drawn(offsets(drawn, range(R)), S)


def test_corpus_windows_stay_in_their_shard_and_reach_its_end():
    """(a), (b), (c) on the built-in language model's sampler: L + 1 consecutive tokens of its
    own shard, every one of the S - L starts drawn and none past them."""
    drawn = _dense(window_task().sample, positions_RxS())
    assert drawn.shape == (STEPS, R, DRAWS, L + 1)
    assert_windows(drawn, range(R))
    assert_independent(offsets(drawn, range(R)))
    assert_every_start_drawn(offsets(drawn, range(R)), S - L)


@pytest.mark.parametrize("path", ["arrays", "windows"])
def test_the_step_trains_on_one_batch_per_seed_replica_step_on_every_layout(path, request):
    """(d), and (b) and (c) on what the compiled step trains on: the simulator's batches of
    steps 0-3 are its own shard's (windows: consecutive, inside it), and every layout, a run
    resumed at step 2 and the batch split over data devices train on the same ones."""
    got = request.getfixturevalue(f"{path}_stepped")
    sim = got["sim"]
    assert sim.shape[:3] == (2 * CALL, R, B)
    for name, batches in got.items():
        (assert_in_own_shard if path == "arrays" else assert_windows)(batches, range(R))
        want = sim[CALL:] if name == "sim resumed at step 2" else sim
        np.testing.assert_array_equal(batches, want, err_msg=name)
    assert len({tuple(sim[t, r].ravel()) for t in range(2 * CALL) for r in range(R)}) > 8


# --- the streamed corpus: read on the host from a memory map -----------------------------------


@pytest.fixture(scope="module")
def mapped_RxS(tmp_path_factory):
    path = tmp_path_factory.mktemp("stream") / "positions.bin"
    np.arange(N, dtype=np.int32).tofile(path)
    return replica_shards(np.memmap(path, dtype=np.int32, mode="r"), R, L)


def _stream(shards, *, batch_size=B, num_steps=CALL, first_replica=0):
    return make_stream(shards, seed=SEED, batch_size=batch_size, seq_len=L, num_steps=num_steps,
                       first_replica=first_replica)  # fmt: skip


def test_streamed_windows_stay_in_their_shard_and_reach_its_end(mapped_RxS):
    """(a), (b), (c) on the host's reads, for every replica and for a process holding replicas
    2 and 3 only (rows 2 and 3 of the memory map)."""
    stream = _stream(mapped_RxS, batch_size=DRAWS, num_steps=STEPS)
    drawn = stream.batches(0, range(R)).astype(np.int64)
    assert drawn.shape == (STEPS, R, DRAWS, L + 1)
    assert_windows(drawn, range(R))
    assert_independent(offsets(drawn, range(R)))
    assert_every_start_drawn(offsets(drawn, range(R)), S - L)
    later = stream.batches(STEPS, range(2, R)).astype(np.int64)  # steps 4-7, replicas 2-3
    assert_windows(later, range(2, R))
    assert_independent(np.concatenate([offsets(drawn[:, 2:], range(2, R)),
                                       offsets(later, range(2, R))]))  # fmt: skip


def test_streamed_batches_are_the_steps_batches_whatever_reads_them(mapped_RxS, windows_stepped):
    """(d): the host's windows of (seed, replica, step) are those the compiled step draws from
    the loaded corpus, whether read in one call of 4 steps or two of 2, by a process holding
    replicas 2-3, by a learner whose shards are replicas 2-3 of every learner's, or placed on
    each layout's devices."""
    want = windows_stepped["sim"]
    calls = _stream(mapped_RxS)
    np.testing.assert_array_equal(
        np.concatenate([calls.batches(0, range(R)), calls.batches(CALL, range(R))]), want
    )
    whole = _stream(mapped_RxS, num_steps=2 * CALL).batches(0, range(R))
    np.testing.assert_array_equal(whole, want)
    np.testing.assert_array_equal(calls.batches(CALL, range(2, R)), want[CALL:, 2:])
    learner = _stream(mapped_RxS[2:], num_steps=2 * CALL, first_replica=2)
    np.testing.assert_array_equal(learner.batches(0, range(2)), want[:, 2:])
    for name, layout in LAYOUTS.items():
        sharding = NamedSharding(parallel.make_mesh(layout), P(None, REPLICA))
        placed = [calls.on_devices(first, sharding) for first in (0, CALL)]
        np.testing.assert_array_equal(np.concatenate(jax.device_get(placed)), want,
                                      err_msg=name)  # fmt: skip


# --- grain: a pipeline per replica, read on the host -------------------------------------------

GRAIN_N = 50  # shards of 13, 13, 12 and 12 examples


def _examples(*, replica, replicas, batch_size, seed):
    """:func:`replica_batches` of examples ``{"i": index}``, read without threads: grain's
    default iterator reads 500 batches ahead, 5 ms an example (its index shuffle) on a CPU."""
    dataset = grain.MapDataset.range(GRAIN_N).map(lambda i: {"i": np.int32(i)})
    batches = replica_batches(dataset, replica=replica, replicas=replicas,
                              batch_size=batch_size, seed=seed)  # fmt: skip
    return batches.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))


@pytest.fixture(scope="module")
def grain_problem():
    eval_data = {"i": np.arange(8, dtype=np.int32)}
    return GrainTask(PARAMS, _reporting_loss, _examples, eval_data).problem(R, B, seed=SEED)


ONE_DEVICE = SingleDeviceSharding(jax.devices()[0])


def _read(stream, first: int, calls: int, sharding=ONE_DEVICE) -> np.ndarray:
    """``[calls * num_steps, R', B]``: the examples of ``calls`` calls from step ``first``."""
    out = []
    for c in range(calls):
        placed = stream.on_devices(first + c * stream.num_steps, {"i": sharding})
        out.append(np.asarray(jax.device_get(placed["i"])))
    return np.concatenate(out).astype(np.int64)


def test_grain_replicas_read_their_own_shard_independently_each_epoch(grain_problem):
    """(a), (b) on :func:`replica_batches`: replica r reads examples r, r + R, ... only, each
    once per epoch of its shard, and the replicas' orders are their own (with one shuffle
    for all, every replica read the same offsets of its shard at every step: neighbouring
    examples of an ordered dataset)."""
    drawn = _read(grain_problem.stream(num_steps=STEPS), 0, 2)  # 8 steps: 2 epochs and more
    assert drawn.shape == (2 * STEPS, R, B)
    for r in range(R):
        rows = drawn[:, r].ravel()
        assert set((rows % R).tolist()) == {r}, f"replica {r} read {sorted(set(rows))}"
        shard = list(range(r, GRAIN_N, R))
        for e in range(len(rows) // len(shard)):  # each epoch: every example of it, once
            epoch = rows[e * len(shard) : (e + 1) * len(shard)]
            assert sorted(epoch.tolist()) == shard, f"replica {r}'s epoch {e}: {epoch}"
    assert_independent(drawn // R)  # the offsets in each replica's shard


def test_grain_batches_are_the_same_on_every_layout_and_resume(grain_problem):
    """(d): the batches of (seed, replica, step) read in calls of 2 steps, of 4, on each
    layout's devices, resumed at step 2 from the saved iterator states, and by a learner
    whose pipelines are replicas 2-3 of 4."""
    want = _read(grain_problem.stream(num_steps=CALL), 0, 2)  # steps 0-3
    np.testing.assert_array_equal(_read(grain_problem.stream(num_steps=2 * CALL), 0, 1), want)
    for name, layout in LAYOUTS.items():
        sharding = NamedSharding(parallel.make_mesh(layout), P(None, REPLICA))
        got = _read(grain_problem.stream(num_steps=2 * CALL), 0, 1, sharding)
        np.testing.assert_array_equal(got, want, err_msg=name)
    cut = grain_problem.stream(num_steps=CALL)
    _read(cut, 0, 1)
    resumed = grain_problem.stream(num_steps=CALL)
    resumed.restore(cut.states(), CALL)
    np.testing.assert_array_equal(_read(resumed, CALL, 1), want[CALL:])
    learner = grain_problem.stream(num_steps=2 * CALL, replicas=2, first_replica=2, pipelines=R)
    np.testing.assert_array_equal(_read(learner, 0, 1), want[:, 2:])
