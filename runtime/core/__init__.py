"""What the engine core (runtime/engine_core.py) plans with and what every engine runs: the
Engine interface, the scheduler, one step and its speculation tree, slots, KV pools, prefix cache,
sampling. Imports no other runtime package but structured/ (backends/, parallel/ and
speculation/ sit above it)."""
