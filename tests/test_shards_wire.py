"""Syncer shards over the network (issue 62): a learner's ``train()`` against S syncer shards
served from this process (shard 0 deciding, the others following its decisions over gRPC as
the shards they are) trains the bits it trains against one syncer; the shards' calls are
refused to anyone else."""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time

import chex
import numpy as np
import pytest

from diloco_jax.learners import fanout, following, identity, payload, service, shards, wire
from diloco_jax.learners.command import make_syncer
from diloco_jax.run import local_learners
from tests.test_learners import TOKEN, _tiny

ONE = {"parallel.replicas": 1, "parallel.runtime": "sim"}
INT8_ANSWERS = {"compress.codec": "int8", "compress.min_size": 64, "compress.block": 32,
                "compress.error_feedback": True, "compress.answers": True}  # fmt: skip


def _served(tmp_path, keys: dict, count: int) -> list[service.Server]:
    """``count`` syncer shards of ``keys``' run on loopback (shard k in ``tmp_path/shardk``),
    the followers asking shard 0 as themselves."""
    servers = []
    for k in range(count):
        placeholder = ",".join(f"127.0.0.1:{i + 1}" for i in range(count))  # (not listened at)
        cfg = _tiny(**keys, **{"syncer.shards": count, "syncer.shard": k,
                               "syncer.address": placeholder})  # fmt: skip
        server = service.Server(make_syncer(cfg, tmp_path / f"shard{k}"), "127.0.0.1", 0,
                                secret=TOKEN, shards=count)  # fmt: skip
        servers.append(server.start())
    for k in range(1, count):
        leader = service.Client(f"127.0.0.1:{servers[0].port}",
                                identity.shard_credential(TOKEN, k), timeout=60.0)  # fmt: skip
        servers[k].follower = following.Follower(servers[k].syncer, leader, k).start()
    return servers


def _learn(tmp_path, monkeypatch, keys: dict, count: int, name: str):
    """``train()`` of the tiny preset with ``keys`` as the one learner of ``count`` shards;
    returns its result and the shards' syncers (stopped)."""
    from diloco_jax.train import train

    monkeypatch.setenv("DILOCO_SERVE_TOKEN", TOKEN)
    servers = _served(tmp_path / name, keys, count)
    address = ",".join(f"127.0.0.1:{s.port}" for s in servers)
    try:
        got = train(_tiny(**keys, **{"syncer.address": address, "syncer.shards": count}),
                    tmp_path / name / "learner", show_progress=False)  # fmt: skip
    finally:
        for server in servers:
            server.stop()
            server.syncer.close()
    return got, [s.syncer for s in servers]


STREAMING = {**ONE, "streaming.fragments": 2, "streaming.mix": 0.5, "model.num_layers": 2,
             "outer.sync_every": 10, "train.total_steps": 20}  # fmt: skip


# streaming: ~23 s, slow; its stand-in: test_shards.py's plan of fragments over shards
@pytest.mark.parametrize("keys", [ONE, {**ONE, **INT8_ANSWERS},
                                  pytest.param(STREAMING, marks=pytest.mark.slow)],
                         ids=["float32", "int8-answers", "streaming"])  # fmt: skip
def test_a_learner_of_two_shards_trains_the_bits_of_a_learner_of_one_syncer(
    tmp_path, monkeypatch, keys
):
    """Two rounds of the tiny preset: the learner's final anchor, parameters and evaluation
    against 2 shards equal those against one syncer, bit for bit; each shard closed both
    rounds, shard 1 as shard 0's decisions said, and the shards' anchors gathered are the one
    syncer's. int8 with compressed answers: each shard answers its part's change, rebuilt
    and checked on the learner. Streaming (two fragments, one a round): each fragment's
    leaves spread over both shards, a round's push and answer its fragment's."""
    want, (one,) = _learn(tmp_path, monkeypatch, keys, 1, "one")
    got, syncers = _learn(tmp_path, monkeypatch, keys, 2, "two")
    chex.assert_trees_all_equal(got["state"].anchor, want["state"].anchor)
    chex.assert_trees_all_equal(got["state"].params, want["state"].params)
    assert got["final_eval_loss"] == want["final_eval_loss"]
    rounds = 4 if keys is STREAMING else 2
    assert [s.round for s in syncers] == [rounds, rounds] and one.round == rounds
    assert syncers[0].decisions[1] == syncers[1].decisions[1]
    describe = [[n, list(a.shape), str(a.dtype)] for n, a in zip(one.names, one.anchor,
                                                                strict=True)]  # fmt: skip
    codec = syncers[0].codec
    fragments = one.assignment if keys is STREAMING else None
    parts = shards.plan(describe, 2, codec, fragments)
    if fragments is not None:  # each shard holds leaves of both fragments
        assert all({fragments[i] for i in part.leaves} == {0, 1} for part in parts)
    assert all(part.leaves or part.size for part in parts)  # each shard holds some
    pieces = [dict(zip(s.names, map(np.asarray, s.anchor), strict=True)) for s in syncers]
    gathered = shards.gather(pieces, describe, parts, codec)
    for name, leaf in zip(one.names, one.anchor, strict=True):
        assert gathered[name].tobytes() == np.asarray(leaf).tobytes(), name


def test_only_a_shard_asks_how_rounds_closed_and_a_follower_cannot_be_asked(tmp_path):
    """A learner's, the operator's, shard 0's and a shard beyond the run's are refused a
    Decision call; a following shard's is answered (null while the round is open); a
    following shard refuses to decide."""
    servers = _served(tmp_path, ONE, 2)
    try:
        address = f"127.0.0.1:{servers[0].port}"
        for credential in (identity.learner_credential(TOKEN, 0),
                           identity.operator_credential(TOKEN),
                           identity.shard_credential(TOKEN, 0),
                           identity.shard_credential(TOKEN, 2)):  # fmt: skip
            client = service.Client(address, credential, timeout=10.0)
            with pytest.raises(service.RefusedBySyncer, match="shards 1 to 1 only"):
                client.call("Decision", {"round": 0})
            client.close()
        servers[1].follower.stop()  # its lane free: asked as shard 1 here
        servers[0].decision_wait = 0.2
        client = service.Client(address, identity.shard_credential(TOKEN, 1), timeout=10.0)
        f, _ = client.call("Decision", {"round": 0})
        assert f["decision"] is None and f["round"] == 0  # round 0 is not closed
        with pytest.raises(service.RefusedBySyncer, match="round = -1 is not in"):
            client.call("Decision", {"round": -1})
        client.close()
        follower = service.Client(f"127.0.0.1:{servers[1].port}",
                                  identity.shard_credential(TOKEN, 1), timeout=10.0)  # fmt: skip
        with pytest.raises(service.RefusedBySyncer, match="does not decide rounds: ask shard 0"):
            follower.call("Decision", {"round": 0})
        follower.close()
    finally:
        for server in servers:
            server.stop()
            server.syncer.close()


def test_a_push_is_finite_when_its_leaves_and_block_scales_are():
    message = {"w": np.ones(3, np.float32), "codec/0": np.ones((2, 4), np.int8),
               "codec/1": np.ones((2, 1), np.float32)}  # fmt: skip
    assert fanout.finite(message)
    assert not fanout.finite({**message, "codec/1": np.array([[1.0], [np.inf]], np.float32)})
    assert not fanout.finite({**message, "w": np.array([0.0, np.nan, 1.0], np.float32)})


MODEL = {f"w{i}": np.random.default_rng(i).standard_normal(n).astype(np.float32)
         for i, n in enumerate([300, 200, 130, 70, 9, 3])}  # fmt: skip


def _round_of_two(tmp_path, count: int, keys: dict, means: list[dict]) -> list:
    """Two learners, each a client of ``count`` shards (:class:`fanout.Fanout`, or a plain
    client at 1), join with MODEL and push ``means`` for round 0 at once; returns the syncers
    (stopped) after the round."""
    from diloco_jax import config as config_lib
    from diloco_jax.config import recipe
    from diloco_jax.learners.learner import shared_keys

    servers = _served(tmp_path, {**ONE, **keys, "syncer.learners": 2}, count)
    cfg = _tiny(**ONE, **keys, **{"syncer.learners": 2, "syncer.shards": count})
    shared, codec = shared_keys(config_lib.keys(cfg)), recipe.push_codec_of(cfg)
    named = wire.named(MODEL)
    names = list(named)
    try:
        clients = []
        for i in range(2):
            each = [service.Client(f"127.0.0.1:{s.port}", identity.learner_credential(TOKEN, i),
                                   timeout=60.0) for s in servers]  # fmt: skip
            clients.append(fanout.Fanout(each, codec) if count > 1 else each[0])
        join = {"describe": wire.describe(MODEL), "keys": shared, "replicas": 1, "rows": 100}
        gens = [clients[i].call("Join", {**join, "learner": i}, named)[0]["generation"]
                for i in range(2)]  # fmt: skip
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            pushes = [pool.submit(clients[i].call, "Push", {
                "learner": i, "generation": gens[i], "round": 0, "weight": 1.0 + i,
                "push": f"p{i}"}, payload.encode(names, [means[i][n] for n in names], codec))
                for i in range(2)]  # fmt: skip
            answers = [p.result(timeout=120) for p in pushes]
        assert all(f["round"] == 1 for f, _ in answers)
        for c in clients:
            c.close()
    finally:
        for server in servers:
            server.stop()
            server.syncer.close()
    return [s.syncer for s in servers]


@pytest.mark.parametrize("keys", [{}, {"compress.codec": "int8", "compress.min_size": 64,
                                       "compress.block": 32}], ids=["float32", "int8"])  # fmt: skip
def test_two_learners_one_of_them_nan_merge_on_two_shards_as_on_one_syncer(tmp_path, keys):
    """Two learners' pushes over gRPC, learner 0's with a NaN in one leaf only (so one shard
    alone sees it): every shard leaves it out, as the one syncer does (the learner says its
    whole mean is not finite), and the anchors gathered are the one syncer's, bit for bit;
    the following shard closed the round as shard 0 decided it."""
    rng = np.random.default_rng(7)
    means = [{n: rng.standard_normal(x.shape).astype(np.float32) for n, x in
              wire.named(MODEL).items()} for _ in range(2)]  # fmt: skip
    means[0]["['w2']"][5] = np.nan
    (one,) = _round_of_two(tmp_path / "one", 1, keys, means)
    syncers = _round_of_two(tmp_path / "two", 2, keys, means)
    assert one.decisions[0].finite == (False, True)
    assert [s.decisions[0] for s in syncers] == [one.decisions[0]] * 2
    describe = wire.describe(MODEL)
    parts = shards.plan(describe, 2, one.codec)
    pieces = [dict(zip(s.names, map(np.asarray, s.anchor), strict=True)) for s in syncers]
    gathered = shards.gather(pieces, describe, parts, one.codec)
    for name, leaf in zip(one.names, one.anchor, strict=True):
        assert gathered[name].tobytes() == np.asarray(leaf).tobytes(), name
    tape = [json.loads(x) for x in (tmp_path / "two" / "shard1" / "syncer.jsonl").open()]
    assert [e["why"] for e in tape if e["event"] == "closed"] == ["decided"]


def test_under_mutual_tls_a_shard_asks_with_its_own_certificate_and_no_other(tmp_path):
    """``certs --shards 2``: shard 1's folder holds a certificate named shard-1 that serves
    and calls; with it and its credential shard 0 answers a Decision call under mutual TLS,
    and the same credential behind learner 0's certificate is refused."""
    from diloco_jax.learners import certs

    out = tmp_path / "credentials"
    certs.make(out, 1, list(certs.DEFAULT_HOSTS), log=lambda _: None, shards=2)
    secret = certs.token(out / "shard_1")
    cfg = _tiny(**ONE, **{"syncer.shards": 2, "syncer.address": "127.0.0.1:1,127.0.0.1:2"})
    server = service.Server(make_syncer(cfg, tmp_path / "shard0"), "127.0.0.1", 0,
                            secret=secret, tls=certs.read(out / "syncer"), mutual=True,
                            shards=2).start()  # fmt: skip
    server.decision_wait = 0.2
    address = f"127.0.0.1:{server.port}"
    try:
        for folder, ok in (("shard_1", True), ("learner_0", False)):
            client = service.Client(address, identity.shard_credential(secret, 1),
                                    tls=certs.read(out / folder), timeout=10.0)  # fmt: skip
            if ok:
                assert client.call("Decision", {"round": 0})[0]["decision"] is None
            else:
                with pytest.raises(service.RefusedBySyncer, match="UNAUTH|wrong credential"):
                    client.call("Decision", {"round": 0})
            client.close()
    finally:
        server.stop()
        server.syncer.close()


def test_a_shard_that_stays_down_is_named_by_its_index_and_address(tmp_path, caplog):
    """A learner of two shards, shard 1 never listening: its join retries, each line naming
    shard 1 and its address, then gives up in one line naming them."""
    import logging

    caplog.set_level(logging.INFO, logger="diloco_jax")
    servers = _served(tmp_path, ONE, 1)
    down = f"127.0.0.1:{local_learners.free_port()}"
    try:
        each = [service.Client(a, identity.learner_credential(TOKEN, 0), timeout=10.0,
                               patience=1.0)
                for a in (f"127.0.0.1:{servers[0].port}", down)]  # fmt: skip
        client = fanout.Fanout(each)
        keys = servers[0].syncer.keys
        join = {"learner": 0, "describe": wire.describe(MODEL), "keys": keys}
        with pytest.raises(service.SyncerUnreachable, match=f"syncer shard 1: nothing listens "
                           f"at {down}"):  # fmt: skip
            client.call("Join", join, wire.named(MODEL))
        client.close()
    finally:
        servers[0].stop()
        servers[0].syncer.close()
    lines = [r.getMessage() for r in dict.fromkeys(caplog.records)]
    assert any(line.startswith(f"syncer shard 1: nothing listens at {down}") for line in lines)


class _Stuck:
    """A client whose calls wait for ``free`` (a shard down, its client retrying); it counts
    the calls it got."""

    def __init__(self, blocked: bool):
        self.free, self.calls, self.address = threading.Event(), [], "127.0.0.1:1"
        self.timeout, self.patience, self.label = 10.0, 300.0, ""
        if not blocked:
            self.free.set()

    def call(self, name, fields, arrays=None, timeout=None, counts=None):
        self.calls.append((name, fields["generation"]))
        assert self.free.wait(10.0)
        return {"round": 3}, {}

    def close(self) -> None:
        self.free.set()


def test_a_shard_that_is_down_holds_up_no_heartbeat_of_shard_0():
    """Shard 1's client stuck: shard 0's heartbeats are answered at once, each time, each
    with shard 0's generation; shard 1 gets one heartbeat in flight at a time, with its own."""
    zero, one = _Stuck(False), _Stuck(True)
    client = fanout.Fanout([zero, one])
    client.generations = [4, 7]
    for _ in range(3):
        assert client.call("Heartbeat", {"learner": 0})[0] == {"round": 3}
    assert zero.calls == [("Heartbeat", 4)] * 3
    end = time.monotonic() + 10.0
    while not one.calls and time.monotonic() < end:  # its thread's call, in the background
        time.sleep(0.01)
    assert one.calls == [("Heartbeat", 7)]
    one.free.set()
    client.close()
