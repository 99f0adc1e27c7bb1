"""``python -m sim``: run a preset as virtual workers on one device (see ``sim/__init__.py``)."""

import sys

from diloco_jax import train


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # First so that an explicit --config.parallel.runtime on the command line still wins.
    return train.main(["--config.parallel.runtime=sim", *argv], prog="python -m sim")


if __name__ == "__main__":
    sys.exit(main())
