"""The ONNX Runtime (CPU) backend's own pieces: which graph of an engine dir a rank's session
loads, and how a plain decode step's inputs are filled. The session configuration itself is
shared with the build's numerics check (plugins/onnxruntime/session.py), so what the check accepted is
what the runtime serves."""
