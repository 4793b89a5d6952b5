"""The engine-dir format shared by builder and runtime (DESIGN.md, "The engine contract").

Only what both sides must agree on: the step's input/output names, dtypes and shapes (and the
CPU step model's extra ones), the host arrays of one step, the manifest schema and its trust
check, GPU targets and the pipeline stages' layers. Behaviour lives with its user: the
builder's tensor-parallel sharding arithmetic in trtbuild.builder.sharding; what both sides run
in small shared packages (trtbuild.onnxruntime_cpu: ONNX Runtime sessions and segments, so
what the build's numerics check accepted is what the CPU runtime serves; trtbuild.medusa_math:
the acceptance arithmetic of `trtbuild plan` and the runtime policy). The checkpoint reader
both sides use is a package of its own (checkpoint/).
"""
