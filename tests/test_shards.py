"""The syncer's shards (issue 62): which shard holds which leaf. Every leaf once, the same
assignment whatever order the leaves come in, and balanced by bytes within the bounds of the
longest-processing-time rule (checked against the best split, found by brute force)."""

from __future__ import annotations

import itertools
import random

import pytest

from diloco_jax.learners import shards, wire
from tests.helpers import tiny_model


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
