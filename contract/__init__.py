"""The engine-dir contract shared by builder and runtime (DESIGN.md, "The engine contract").

Only what both sides must agree on: the step's input/output names, dtypes and shapes (and the
CPU step model's extra ones), the host arrays of one step, the manifest schema and its trust
check, GPU targets, tensor-parallel head arithmetic, the Medusa acceptance arithmetic that
build-time planning and the runtime policy both use, and the ONNX Runtime session settings
(a small table: what the build's numerics check accepted is what the CPU runtime serves). The
checkpoint reader both sides use is a package of its own (checkpoint/).
Nothing here rewrites a graph or runs a step: the rewrites are builder passes, the backends are
the runtime's.
"""
