"""The engine-dir contract shared by builder and runtime (DESIGN.md, "The engine contract").

Nothing here knows about passes or schedulers: the step graph's input/output names, dtypes
and shapes, the host arrays of one step, the manifest schema version, the one ONNX Runtime
configuration every CPU path uses, the collective ops of tensor-parallel rank graphs, and the
Medusa acceptance arithmetic that build-time planning and the runtime policy both use.
"""
