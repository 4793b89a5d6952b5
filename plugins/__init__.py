"""trtbuild.plugins: ops with no standard ONNX form (domain ``trtbuild``).

Each plugin owns its op schema, a reference implementation ONNX Runtime can run on CPU and
its TensorRT side. The first one arrives with tensor-parallel sharding (the all-reduce
collective); until then the IR uses standard opset-24 ops only.
"""
