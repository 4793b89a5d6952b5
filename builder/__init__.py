"""trtbuild.builder: spec → torch.export → ONNX passes → one TensorRT engine per rank."""
