"""A hostile learner for the slow test of robust merging (issue 63, item 5): ``python -m
tests.hostile_learner ARGS`` is ``python -m diloco_jax.train ARGS`` whose every push carries
its honest pseudo-gradient times ``$HOSTILE_SCALE`` (-1000 by default): a learner of the run,
with its own valid credential, sending harmful but finite values. Nothing of the library is
changed; the push is scaled between the learner's contribution and its encoding."""

import os

import numpy as np

from diloco_jax.learners import payload
from diloco_jax.watch import reporting

SCALE = float(os.environ.get("HOSTILE_SCALE", "-1000"))
_honest_encode = payload.encode


def _hostile_encode(names, mean, codec, replicas):
    scaled = [np.asarray(x) * np.asarray(SCALE, np.asarray(x).dtype) for x in mean]
    return _honest_encode(names, scaled, codec, replicas)


payload.encode = _hostile_encode  # the learner calls payload.encode at each push

if __name__ == "__main__":
    from diloco_jax.train import main

    reporting.exit_quickly(main())
