"""The single-host simulator: DiLoCo's replicas as ``vmap``-ped virtual workers on one device.

``python -m sim --config PRESET [--workdir DIR] [--config.KEY=VALUE ...]`` trains a preset
with every replica on one device (``parallel.runtime=sim``), whatever devices exist, using the
same train step as ``python -m diloco_jax.train``. A wheel installs this folder as
``diloco_jax.sim`` (``diloco-sim``); it imports itself relatively, so both names work.
"""
