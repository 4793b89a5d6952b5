"""The engine core and what it plans with: the scheduler, one step, slots, KV pools, prefix cache, sampling."""
