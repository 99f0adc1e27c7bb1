"""Test setup: 8 fake CPU devices so the mesh runtime can be checked against the simulator."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
