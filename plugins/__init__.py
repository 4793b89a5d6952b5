"""trtbuild.plugins: ops with no standard ONNX form (domain ``trtbuild``).

Each plugin owns its op schema, a reference implementation ONNX Runtime can run on CPU and
its TensorRT side: the collectives of tensor-parallel sharding (``DistCollective``). Running
rank graphs cut at those collectives in ONNX Runtime is trtbuild.onnxruntime_cpu's job.
"""
