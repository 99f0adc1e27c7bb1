"""The syncer's shards (issue 62): which shard holds which leaf. Every leaf once, the same
assignment whatever order the leaves come in, and balanced by bytes within the bounds of the
longest-processing-time rule (checked against the best split, found by brute force)."""

from __future__ import annotations

import dataclasses
import itertools
import random
import time

import numpy as np
import pytest

from diloco_jax.algorithm import compress
from diloco_jax.learners import answers, payload, shards, wire
from diloco_jax.learners.syncer import Refused
from tests.helpers import tiny_model
from tests.test_learners import _algorithm, _Clock, _syncer


def _model_described() -> list[list]:
    _, params = tiny_model()
    return wire.describe(params)  # 12 leaves


def _random_described(rng: random.Random, count: int) -> list[list]:
    return [[f"leaf{i}", [rng.randint(1, 40), rng.choice([1, 3, 8])], rng.choice(
        ["float32", "bfloat16"])] for i in range(count)]  # fmt: skip


@pytest.mark.parametrize("count", [1, 2, 4, 16])
def test_every_leaf_goes_to_one_shard_and_the_order_of_the_leaves_does_not_matter(count):
    described = _model_described()
    owner = shards.assign(described, count)
    assert len(owner) == len(described) and all(0 <= s < count for s in owner)
    by_name = {name: s for (name, _, _), s in zip(described, owner, strict=True)}
    for seed in range(5):
        shuffled = described[:]
        random.Random(seed).shuffle(shuffled)
        again = shards.assign(shuffled, count)
        assert {n: s for (n, _, _), s in zip(shuffled, again, strict=True)} == by_name
    # no shard empty while there are leaves enough; beyond them, the extra shards hold none
    assert set(owner) == set(range(min(count, len(described))))


def test_the_busiest_shard_is_within_the_rules_bounds_of_the_best_split():
    """At most the mean share plus the largest leaf, and at most 4/3 of the busiest shard of
    the best split (brute force over every split of 9 leaves into 3 shards)."""
    rng = random.Random(0)
    for _ in range(20):
        described = _random_described(rng, 9)
        sizes = [shards.leaf_bytes(s, d) for _, s, d in described]
        held = shards.loads(described, shards.assign(described, 3), 3)
        assert sum(held) == sum(sizes)
        assert max(held) <= sum(sizes) / 3 + max(sizes)
        best = min(max(shards.loads(described, split, 3))
                   for split in itertools.product(range(3), repeat=len(described)))  # fmt: skip
        assert max(held) <= 4 / 3 * best


def test_equal_leaves_split_evenly_and_a_leaf_larger_than_a_share_stays_whole():
    equal = [[f"w{i}", [8, 8], "float32"] for i in range(8)]
    assert shards.loads(equal, shards.assign(equal, 4), 4) == [512] * 4
    assert shards.busiest(equal, 4) == 1.0
    lopsided = [["embed", [1000, 8], "float32"], *[[f"w{i}", [8, 8], "float32"]
                                                   for i in range(6)]]  # fmt: skip
    owner = shards.assign(lopsided, 4)
    assert owner.count(owner[0]) == 1  # the big leaf alone in its shard, whole
    assert shards.busiest(lopsided, 4) == pytest.approx(32000 * 4 / (32000 + 6 * 256))


def test_bad_shard_counts_and_duplicate_names_are_refused():
    with pytest.raises(ValueError, match="syncer.shards must be at least 1, not 0"):
        shards.assign(_model_described(), 0)
    with pytest.raises(ValueError, match="two leaves of one name"):
        shards.assign([["a", [2], "float32"], ["a", [3], "float32"]], 2)


# ---- shards that follow the deciding shard's rounds (issue 62 step 2, in one process) -------

KEYS = {"outer.sync_every": 3}
# a model of leaves of many sizes, so that 2 and 4 shards each hold several
MODEL = {f"w{i}": np.random.default_rng(i).standard_normal(size).astype(np.float32)
         for i, size in enumerate([700, 300, 260, 120, 90, 64, 33, 8, 3])}  # fmt: skip


class _Sharded:
    """One syncer of the whole model beside ``count`` shards of it (shard 0 decides, the
    others follow its decisions), every one given the same pushes on the same test clock:
    each shard its part of the push a learner encodes whole (:func:`shards.cut`), as its
    piece of the anchor (:func:`shards.split`) holds, through ``codec`` (None: float32)."""

    def __init__(self, tmp_path, count: int, learners: int, codec=None, **kw):
        self.clock, self.codec = _Clock(), codec
        self.describe = wire.describe(MODEL)
        self.parts = shards.plan(self.describe, count, codec)
        self.one = _syncer(tmp_path / "one", _algorithm(), learners=learners, clock=self.clock,
                           codec=codec, **kw)  # fmt: skip
        self.shards = [_syncer(tmp_path / f"shard{k}", _algorithm(), learners=learners,
                               clock=self.clock, decides=k == 0, codec=codec, **kw)
                       for k in range(count)]  # fmt: skip
        pieces = shards.split(wire.named(MODEL), self.describe, self.parts, codec)
        for i in range(learners):
            self.one.join(i, self.describe, KEYS, wire.named(MODEL))
            for k, shard in enumerate(self.shards):
                mine = shards.described(self.describe, self.parts[k], codec)
                shard.join(i, mine, KEYS, pieces[k])

    def message(self, mean: dict) -> dict:
        """The push a learner sends for ``mean`` (by name), encoded whole."""
        named = wire.named(mean)
        if self.codec is None:
            return named
        names = [n for n, _, _ in self.describe]
        return payload.encode(names, [named[n] for n in names], self.codec)

    def cut(self, mean: dict, k: int) -> dict:
        """Shard ``k``'s part of the push of ``mean``."""
        return shards.cut(self.message(mean), self.describe, self.parts[k], self.codec)

    def push(self, learner: int, base: int, weight: float, mean: dict, push_id: str) -> None:
        """As a learner pushes: the shards that follow first, the deciding shard last, each
        told whether the whole mean is finite (it sees its own leaves only)."""
        self.one.push(learner, 1, base, weight, self.message(mean), push_id=push_id)
        finite = all(bool(np.isfinite(x).all()) for x in mean.values())
        for k in [*range(1, len(self.shards)), 0]:
            self.shards[k].push(learner, 1, base, weight, self.cut(mean, k), push_id=push_id,
                                whole_finite=finite)  # fmt: skip

    def follow(self) -> None:
        """Every decision shard 0 has taken, given to the others in order, their closes done."""
        self.shards[0].tick()
        for rnd in sorted(self.shards[0].decisions):
            for shard in self.shards[1:]:
                assert shard.follow(self.shards[0].decisions[rnd], timeout=5.0) == []
                _past(shard, rnd)

    def gathered(self, pieces: list[dict]) -> dict:
        return shards.gather(pieces, self.describe, self.parts, self.codec)

    def assert_same(self) -> None:
        """Every shard at the one syncer's round, its anchor's values to the last bit."""
        self.one.tick()
        for shard in self.shards:
            assert shard.round == self.one.round
        held = self.gathered([dict(zip(shard.names, shard.anchor, strict=True))
                              for shard in self.shards])  # fmt: skip
        mine = dict(zip(self.one.names, self.one.anchor, strict=True))
        assert held.keys() == mine.keys()
        for name, leaf in mine.items():
            np.testing.assert_array_equal(np.asarray(held[name]), np.asarray(leaf), err_msg=name)

    def close(self) -> None:
        for syncer in [self.one, *self.shards]:
            syncer.close()


def _past(shard, rnd: int) -> None:
    """Waits (real seconds, at most 30: the rules run on a test clock) for ``shard`` to close
    round ``rnd``; fails if it does not."""
    end = time.monotonic() + 30.0
    while shard.round <= rnd and time.monotonic() < end:
        time.sleep(0.01)
    shard.tick()
    assert shard.round > rnd, f"round {rnd} did not close on this shard"


def _mean(rng, scale=1.0) -> dict:
    return {n: (scale * rng.standard_normal(x.shape)).astype(np.float32) for n, x in MODEL.items()}


@pytest.mark.parametrize("count", [2, 4])
def test_shards_in_synchronous_rounds_hold_what_one_syncer_holds(tmp_path, count):
    """Three learners of unequal weights, four synchronous rounds: every shard's anchor equals
    the one syncer's leaves bitwise, round after round; a round closes on a following shard
    only once its decision comes."""
    rng = np.random.default_rng(0)
    s = _Sharded(tmp_path, count, learners=3)
    try:
        for rnd in range(4):
            for i in range(3):
                s.push(i, rnd, 1.0 + i, _mean(rng), f"r{rnd}l{i}")
            s.shards[1].tick()
            assert s.shards[1].round == rnd  # all its pushes in, but no decision yet
            s.follow()
            s.assert_same()
    finally:
        s.close()


def test_shards_in_quorum_rounds_merge_a_late_push_where_one_syncer_does(tmp_path):
    """Quorum 2 of 3 on a test clock: learner 2's push of round 0 reaches the following shards
    before round 0's decision, yet it is merged in round 1, late, as on the one syncer; a
    non-finite push is left out alike."""
    rng = np.random.default_rng(1)
    s = _Sharded(tmp_path, 2, learners=3, quorum=2, grace=1.0, adaptive_grace=False,
                 max_late=2, late_weight=0.5)  # fmt: skip
    try:
        s.clock.t = 1.0
        s.push(0, 0, 1.0, _mean(rng), "a")
        s.push(1, 0, 2.0, _mean(rng), "b")  # the quorum: the grace runs to t = 2.0
        s.clock.t = 2.5
        s.shards[0].tick()
        s.one.tick()
        assert s.one.round == 1 and s.shards[0].round == 1
        # learner 2's round-0 push reached shard 1 first, before round 0's decision did
        late = _mean(rng)
        s.shards[1].push(2, 1, 0, 3.0, s.cut(late, 1), push_id="c",
                         whole_finite=True)  # fmt: skip
        s.follow()
        assert 2 in s.shards[1].pending  # left for the round the decision will put it in
        s.one.push(2, 1, 0, 3.0, wire.named(late), push_id="c")
        s.shards[0].push(2, 1, 0, 3.0, s.cut(late, 0), push_id="c",
                         whole_finite=True)  # fmt: skip
        bad = _mean(rng)
        bad["w3"][5] = np.nan
        s.push(0, 1, 1.0, bad, "d")
        s.push(1, 1, 2.0, _mean(rng), "e")
        s.clock.t = 4.0
        s.shards[0].tick()
        decision = s.shards[0].decisions[1]
        assert decision.learners == (0, 1, 2) and decision.late == (0, 0, 1)
        s.follow()
        s.assert_same()
    finally:
        s.close()


@pytest.mark.parametrize("count", [2, 4])
def test_shards_through_int8_with_compressed_answers_rebuild_one_syncers_anchor(tmp_path, count):
    """int8 pushes (blocks of 32, leaves of 64 values or more in one flat vector cut into
    block ranges) and compressed answers (each shard's change through the codec, its error
    kept on the shard): after each of three rounds, the anchor a learner rebuilds from its
    shards' answers, each checked by its own checksum, is the one syncer's answer bit for bit,
    and so are the shards' true anchors (every answer a change, each shard's of its part)."""
    codec = compress.Codec("int8", block=32, min_size=64)
    rng = np.random.default_rng(4)
    s = _Sharded(tmp_path, count, learners=2, codec=codec, compress_answers=True)
    try:
        assert sum(bool(p.size) for p in s.parts) == count  # every shard holds a block range
        one = answers.Held(codec)
        one.joined(0, s.one.held())
        held = [answers.Held(codec) for _ in s.shards]
        for h, shard in zip(held, s.shards, strict=True):
            h.joined(0, shard.held())
        for rnd in range(3):
            for i in range(2):
                s.push(i, rnd, 1.0 + i, _mean(rng, 0.1), f"r{rnd}l{i}")
            s.follow()
            s.assert_same()
            rnd_one, got, _, how = s.one.reply(rnd, 1.0, holds=one.round)
            want = one.took({**how, "round": rnd_one}, got)
            assert how["answer"] == "delta"  # the change from the round each learner holds
            pieces = []
            for h, shard in zip(held, s.shards, strict=True):
                rnd_k, arrays, _, how_k = shard.reply(rnd, 1.0, holds=h.round)
                assert rnd_k == rnd + 1 and how_k["answer"] == how["answer"]
                pieces.append(h.took({**how_k, "round": rnd_k}, arrays))
            rebuilt = s.gathered(pieces)
            assert rebuilt.keys() == want.keys()
            for name, leaf in want.items():
                assert rebuilt[name].tobytes() == leaf.tobytes(), name
    finally:
        s.close()


def test_a_shard_restarted_mid_round_keeps_its_members_and_follows_the_decision(tmp_path):
    """A following shard closed while round 1 is open (its pushes in memory lost) and started
    again from its checkpoint: its members are back without a join, the pushes come again
    under their ids, and it closes round 1 as shard 0's decision says; a restarted shard 0
    still holds its recent decisions (in its checkpoints)."""
    rng = np.random.default_rng(5)
    s = _Sharded(tmp_path, 2, learners=2)
    try:
        for i in range(2):
            s.push(i, 0, 1.0 + i, _mean(rng), f"r0l{i}")
        s.follow()
        means = [_mean(rng) for _ in range(2)]
        for i in range(2):
            s.push(i, 1, 1.0 + i, means[i], f"r1l{i}")
        s.shards[0].tick()
        decision = s.shards[0].decisions[1]
        s.shards[1].close()
        s.shards[1] = _syncer(tmp_path / "shard1", _algorithm(), learners=2, clock=s.clock,
                              decides=False)  # fmt: skip
        assert s.shards[1].round == 1 and sorted(s.shards[1].members) == [0, 1]
        assert s.shards[1].follow(decision) == [0, 1]  # its pushes were lost with it
        for i in range(2):
            s.shards[1].push(i, 1, 1, 1.0 + i, s.cut(means[i], 1), push_id=f"r1l{i}",
                             whole_finite=True)  # fmt: skip
        s.follow()
        s.assert_same()
        s.shards[0].close()
        s.shards[0] = _syncer(tmp_path / "shard0", _algorithm(), learners=2, clock=s.clock)
        assert s.shards[0].decisions[1] == decision and sorted(s.shards[0].decisions) == [0, 1]
    finally:
        s.close()


def test_a_following_shard_names_the_pushes_it_lacks_and_refuses_a_decision_ahead(tmp_path):
    rng = np.random.default_rng(2)
    s = _Sharded(tmp_path, 2, learners=2)
    try:
        mean = _mean(rng)
        s.shards[0].push(0, 1, 0, 1.0, s.cut(mean, 0), push_id="x")
        s.shards[0].push(1, 1, 0, 1.0, s.cut(mean, 0), push_id="y")
        s.shards[1].push(0, 1, 0, 1.0, s.cut(mean, 1), push_id="x")
        s.shards[0].tick()
        decision = s.shards[0].decisions[0]
        assert s.shards[1].follow(decision) == [1]  # learner 1's slice has not come
        assert s.shards[1].round == 0
        ahead = dataclasses.replace(decision, round=1)
        with pytest.raises(Refused, match="a decision of round 1, but this shard is at round 0"):
            s.shards[1].follow(ahead)
        with pytest.raises(Refused, match="this shard decides its rounds"):
            s.shards[0].follow(decision)
        lying = {n: np.full_like(x, np.nan) for n, x in s.cut(mean, 1).items()}
        with pytest.raises(Refused, match="says its mean is finite, but its leaves on this"):
            s.shards[1].push(1, 1, 0, 1.0, lying, push_id="y", whole_finite=True)
        s.shards[1].push(1, 1, 0, 1.0, s.cut(mean, 1), push_id="y")
        assert s.shards[1].follow(decision) == []
        _past(s.shards[1], 0)
        assert s.shards[1].follow(decision) == []  # again: already closed, nothing more
        assert s.shards[1].round == 1
    finally:
        s.close()


# ---- a push through a blockwise codec, cut into shards by block ranges (step 3a) -----------


def _flat(described: list[list], decoded: list, codec) -> np.ndarray:
    """The flat vector of the large leaves, as the codec sees it."""
    sizes = [int(np.prod(s)) for _, s, _ in described]
    big = payload._big(sizes, codec)
    return np.concatenate([np.asarray(decoded[i]).reshape(-1) for i in big])


@pytest.mark.parametrize("name", ["int8", "int4", "fp8", "bf16"])
@pytest.mark.parametrize(("count", "min_size"), [(1, 20), (2, 20), (3, 20), (4, 20), (4, 80)])
def test_a_push_cut_into_block_ranges_decodes_on_each_shard_to_the_whole_pushs_bits(
    name, count, min_size
):
    """A push of leaves of many sizes (small ones float32, large ones one flat vector encoded
    in blocks of 8 that span the leaves' ends), encoded whole as a learner encodes it: each
    shard's cut decodes to its whole leaves and its range of the flat vector, bit for bit what
    decoding the whole push gives; the ranges tile the vector, each at least min_size values
    (at min_size 80 the last of 4 would hold 43: it joins the one before it)."""
    codec = compress.Codec(name, block=8, min_size=min_size)
    rng = np.random.default_rng(3)
    tree = {f"w{i}": rng.standard_normal(n).astype(np.float32)
            for i, n in enumerate([203, 61, 45, 30, 21, 19, 7, 3])}  # fmt: skip
    described_all = wire.describe(tree)
    names = [n for n, _, _ in described_all]
    leaves = [tree[k] for k in sorted(tree)]  # the describe order: by name
    message = payload.encode(names, leaves, codec)
    whole = payload.decode(described_all, message, codec)
    flat = _flat(described_all, whole, codec)
    parts = shards.plan(described_all, count, codec)
    small = [i for i, (_, shape, _) in enumerate(described_all) if shape[0] < min_size]
    assert sorted(i for p in parts for i in p.leaves) == small  # whole, each in one shard
    assert parts[0].values[0] == 0 and parts[-1].values[1] == flat.size
    for before, after in zip(parts, parts[1:], strict=False):
        assert before.values[1] == after.values[0] and before.blocks[1] == after.blocks[0]
    for part in parts:
        assert part.size == 0 or part.size >= codec.min_size
        mine = shards.described(described_all, part, codec)
        got = payload.decode(mine, shards.cut(message, described_all, part, codec), codec)
        want = [whole[i] for i in part.leaves]
        if part.size:
            want.append(flat[part.values[0] : part.values[1]])
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(g).reshape(-1), np.asarray(w).reshape(-1))


def test_codecs_that_choose_over_the_whole_vector_cannot_be_cut():
    described = wire.describe({"w": np.zeros(100, np.float32)})
    with pytest.raises(ValueError, match="codec topk chooses what it sends over the whole"):
        shards.plan(described, 2, compress.Codec("topk", topk_fraction=0.1))
    assert shards.plan(described, 2, None) == shards.plan(described, 2, compress.Codec())


def test_an_anchor_split_into_pieces_gathers_back_and_a_bad_piece_is_named():
    codec = compress.Codec("int8", block=32, min_size=64)
    describe = wire.describe(MODEL)
    parts = shards.plan(describe, 3, codec)
    named = wire.named(MODEL)
    pieces = shards.split(named, describe, parts, codec)
    back = shards.gather(pieces, describe, parts, codec)
    assert list(back) == list(named)
    for name, leaf in named.items():
        assert back[name].tobytes() == leaf.tobytes() and back[name].shape == leaf.shape
    short = [dict(p) for p in pieces]
    short[1][shards.FLAT] = short[1][shards.FLAT][:-1]
    with pytest.raises(ValueError, match="syncer shard 1's answer holds"):
        shards.gather(short, describe, parts, codec)
    lacking = [dict(p) for p in pieces]
    lacking[2].pop(next(n for n in lacking[2] if n != shards.FLAT))
    with pytest.raises(ValueError, match="syncer shard 2's answer lacks"):
        shards.gather(lacking, describe, parts, codec)
    mixed = wire.describe({**MODEL, "w0": MODEL["w0"].astype(np.float16)})
    with pytest.raises(ValueError, match=r"large leaves are of several dtypes \(float16, float"):
        shards.plan(mixed, 2, codec)


def test_streaming_fragments_spread_over_every_shard_and_a_fragments_push_cuts_to_its_leaves():
    """With two fragments each shard holds leaves of both (each fragment assigned on its own,
    balanced), so a round's push of one fragment reaches every shard, each its own leaves of
    it; a fragment of fewer leaves than shards, and a codec with fragments, are refused."""
    describe = _model_described()
    fragments = [i % 2 for i in range(len(describe))]
    parts = shards.plan(describe, 3, None, fragments)
    assert sorted(i for p in parts for i in p.leaves) == list(range(len(describe)))
    for f in (0, 1):
        mine = [i for i in range(len(describe)) if fragments[i] == f]
        owner = shards.assign([describe[i] for i in mine], 3)
        for part, k in zip(parts, range(3), strict=True):
            assert (
                {i for i in part.leaves if fragments[i] == f}
                == {i for i, o in zip(mine, owner, strict=True) if o == k}
                != set()
            )
    push = {str(describe[i][0]): np.zeros(describe[i][1], np.float32)
            for i in range(len(describe)) if fragments[i] == 1}  # fmt: skip
    for part in parts:
        got = shards.cut(push, describe, part, None)
        assert set(got) == {str(describe[i][0]) for i in part.leaves if fragments[i] == 1}
    with pytest.raises(ValueError, match="streaming fragment 0 holds 2 leaves, fewer than"):
        shards.plan(describe[:4], 3, None, fragments[:4])
    with pytest.raises(ValueError, match="codec int8 with streaming fragments cannot be cut"):
        shards.plan(describe, 2, compress.Codec("int8"), fragments)
