"""The syncer's answers through the run's codec (``compress.answers``): the anchor's change since
the learners' last answer, with the error feedback kept on the syncer.

The syncer keeps ``sent``: the anchor as the learners have reconstructed it (each leaf in the
anchor's dtype). When round ``r`` closes with the new anchor ``A_r``:

    delta_r = encode(A_r - sent_(r-1))            (the pushes' codec: :mod:`.payload`)
    sent_r  = sent_(r-1) + decode(delta_r)        (:func:`plus`: the learners' own sum)

so what encoding lost, the residual ``A_r - sent_r``, is in the next round's change: it is
sent later, never dropped, and ``sent`` does not drift from the anchor. The syncer's outer
step goes on from the true anchor ``A_r``; the learners restart their replicas from ``sent_r``,
the same on every learner, bit for bit (the decode runs on the host's CPU on both sides, and
the learner checks the SHA-256 of what it rebuilt). ``sent_0`` is the first anchor.

A push says which round's reconstruction its learner holds (``holds``); its answer is
``delta_r`` where that is ``r - 1``, else ``sent_r`` whole (the anchor's dtype): for a learner
that joined or joined again (a join gives ``sent`` whole too), a late push, a round the syncer
moved past since, and at a restarted syncer's first round (its checkpoint holds ``sent``, not
the change; one written without ``sent`` has the anchor stand for it, which is what its
learners were sent). A copy of a push gets the same bytes as long as the syncer has not moved
on (then ``sent`` whole, as a plain answer is the current anchor). Eager rounds (the answer is
a round's mean, which would need error feedback of its own) and streaming fragments (an
answer of one fragment's leaves) are refused.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np

from diloco_jax.algorithm.compress import Codec
from diloco_jax.learners import payload
from diloco_jax.learners.rounds import sha256
from diloco_jax.learners.wire import WireError


class Sent(NamedTuple):
    """What the learners hold of the anchor after round ``round`` (see the module's docstring)."""

    round: int
    leaves: list[np.ndarray]  # sent_round, each leaf in the anchor's dtype
    sha: str  # sha256(leaves): the whole answer's checksum
    delta: dict[str, np.ndarray] | None  # delta_round, a payload message (None: not kept)
    delta_sha: str = ""


def check(codec: Codec | None, answer_mean: bool, fragments: int = 1) -> None:
    """Raises ``ValueError`` where answers cannot go through ``codec`` (none: nothing to
    compress; an eager run's answers are means; streaming fragments' answers are parts)."""
    if codec is None or codec.name == "none":
        raise ValueError("compressed answers need a codec (bf16, int8, fp8, int4 or topk)")
    if answer_mean:
        raise ValueError("compressed answers are the anchor's; eager rounds answer with means")
    if fragments > 1:
        raise ValueError("compressed answers do not combine with streaming fragments yet")


def first(anchor: list, rnd: int) -> Sent:
    """``sent`` where the learners hold ``anchor`` (the first anchor; a checkpoint's ``sent``,
    or its anchor where it kept none), with no change kept: the first answers are whole."""
    leaves = [np.array(a) for a in anchor]
    return Sent(rnd, leaves, sha256(leaves), None)


def _wide(dtype: np.dtype) -> np.dtype:
    return np.promote_types(dtype, np.float32)


def plus(leaf: np.ndarray, change: np.ndarray) -> np.ndarray:
    """``leaf + change`` in ``leaf``'s dtype (added at float32 or wider): the syncer's and every
    learner's one sum."""
    wide = _wide(leaf.dtype)
    return (leaf.astype(wide) + change.astype(wide)).astype(leaf.dtype)


def _decoded(described: list[list], message: dict, codec: Codec) -> list[np.ndarray]:
    """The float32 change of a delta message, decoded on the CPU, as every side decodes it."""
    with jax.default_device(jax.devices("cpu")[0]):
        return payload.decode(described, message, codec)


def following(sent: Sent, anchor: list, names: list[str], codec: Codec) -> Sent:
    """``sent`` after the round whose new anchor is ``anchor`` (leaves in ``names``' order):
    its change encoded, ``sent`` moved by what the learners will decode of it."""
    host = [np.asarray(a) for a in anchor]
    change = [(a.astype(_wide(s.dtype)) - s.astype(_wide(s.dtype))).astype(np.float32)
              for a, s in zip(host, sent.leaves, strict=True)]  # fmt: skip
    message = payload.encode(names, change, codec)
    described = [[n, list(s.shape), str(s.dtype)]
                 for n, s in zip(names, sent.leaves, strict=True)]  # fmt: skip
    decoded = _decoded(described, message, codec)
    leaves = [plus(s, d) for s, d in zip(sent.leaves, decoded, strict=True)]
    return Sent(sent.round + 1, leaves, sha256(leaves), message, sha256(list(message.values())))


def reply(sent: Sent, names: list[str], holds: int | None) -> tuple[dict, str, dict]:
    """``(arrays, their SHA-256, the answer's fields)`` for a learner that holds round
    ``holds``'s reconstruction (None: none): ``delta`` from ``holds``, or ``sent`` whole."""
    fields = {"answer": "whole", "anchor_sha": sent.sha}
    if sent.delta is not None and holds == sent.round - 1:
        return sent.delta, sent.delta_sha, {**fields, "answer": "delta", "from": holds}
    return dict(zip(names, sent.leaves, strict=True)), sent.sha, fields


class Held:
    """A learner's side: the reconstruction it holds (host arrays by name) and its round.
    ``codec`` None: answers are the plain anchor, and nothing is kept."""

    def __init__(self, codec: Codec | None):
        self.codec = codec
        self.round: int | None = None
        self.arrays: dict[str, np.ndarray] = {}

    def asks(self) -> dict:
        """A push's field: the round whose reconstruction a delta may be added to."""
        return {} if self.codec is None or self.round is None else {"holds": self.round}

    def took(self, fields: dict, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The whole anchor of an answer (``fields``, ``arrays``): a delta added to what is
        held, its SHA-256 checked against the syncer's; kept as the next one's base. Raises
        :class:`WireError` for a delta from a round not held or a sum that differs."""
        if self.codec is None or "answer" not in fields:
            return arrays
        if fields["answer"] == "delta":
            if fields.get("from") != self.round:
                raise WireError(f"a change from round {fields.get('from')}, this learner holds "
                                f"round {self.round}'s anchor")  # fmt: skip
            described = [[n, list(a.shape), str(a.dtype)] for n, a in self.arrays.items()]
            decoded = _decoded(described, arrays, self.codec)
            arrays = {n: plus(a, d)
                      for (n, a), d in zip(self.arrays.items(), decoded, strict=True)}  # fmt: skip
        if sha256(list(arrays.values())) != fields["anchor_sha"]:
            raise WireError("the anchor rebuilt from the syncer's answer is not the syncer's")
        self.round, self.arrays = int(fields["round"]), arrays
        return arrays

    def joined(self, rnd: int, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A join's anchor (whole: the syncer's ``sent``), kept as the next answer's base."""
        if self.codec is not None:
            self.round, self.arrays = rnd, arrays
        return arrays
