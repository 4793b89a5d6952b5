"""trtbuild.plugins: ops with no standard ONNX form (domain ``trtbuild``).

Each plugin owns its op schema, a reference implementation ONNX Runtime can run on CPU and
its TensorRT side. The first one arrives with tensor-parallel sharding (the all-reduce
collective). ``fp4`` is a CPU reference only: standard NVFP4 ``DequantizeLinear`` chains,
which ONNX Runtime cannot run, folded into float weights (simulated quantization).
"""
