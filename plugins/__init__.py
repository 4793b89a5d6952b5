"""trtbuild.plugins: ops with no standard ONNX form (domain ``trtbuild``), and how each executor
runs our graphs' ops where it lacks one.

Each plugin owns its op schema, a reference implementation ONNX Runtime can run on CPU and its
TensorRT side: the collectives of tensor-parallel sharding (``DistCollective``). plugins/onnxruntime/
runs rank graphs in ONNX Runtime: the one session configuration, graphs cut at their collectives,
NVFP4 weights folded to float (no FP4 kernel there). The build's numerics check and the CPU runtime
both run graphs through it, so what the check accepted is what the runtime serves.
"""
