"""Running rank graphs in ONNX Runtime, shared by the build's numerics check and the CPU runtime."""
