"""Names of the parallel axes, in one place.

* ``REPLICA``: the DiLoCo replica axis. Under the simulator it is the ``jax.vmap`` axis; on a mesh
  it is the mesh axis whose devices each hold one group of replicas.
* ``LOCAL_REPLICA``: on a mesh, the ``vmap`` axis over the virtual replicas one replica-device
  holds (``replicas / replica_devices`` of them; size 1 when every replica has its own devices).
* ``DATA``: the mesh axis that splits one replica's batch; gradients are averaged over it every
  step.
"""

REPLICA = "replica"
LOCAL_REPLICA = "local_replica"
DATA = "data"
