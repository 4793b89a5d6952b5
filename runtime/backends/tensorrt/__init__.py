"""The TensorRT backend: the engine of one rank, a pipeline stage's, and which TensorRT runs it."""
