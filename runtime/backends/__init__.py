"""Engine backends' own code (what only one backend needs); the Engine interface they satisfy
is runtime/core/engine.py, and runtime/engine_factory.py picks one."""
