"""``python -m diloco_jax.syncer``: the syncer of independent learners
(:mod:`diloco_jax.learners.command`)."""

from diloco_jax.learners.command import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())
