"""What every jax_tma op is built on: one way to define a primitive and its lowerings
(primitive.py), the sharding helpers its custom_partitioning rules share (sharding.py), the
device facts its configuration heuristic reads (device.py), and the abstract values of its
results (aval.py). Nothing here knows an op; the op modules import from here, never from
each other's private names."""
