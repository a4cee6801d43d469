"""What every jax_tma op is built on: one way to define a primitive and its lowerings
(primitive.py), the sharding helpers its custom_partitioning rules share (sharding.py), the
tile-configuration base class and the heuristics' argmin (config.py), the device facts those
heuristics read (device.py), the persistent autotuning cache (tuning_cache.py) and the abstract
values of its results (aval.py). Nothing here knows an op; the op packages (jax_tma/ops/) import
from here, never from each other's private names."""
