"""What builder and runtime must agree on (DESIGN.md, "The engine contract"), and nothing that
only one side runs: the step's input/output names, dtypes and shapes and the host arrays of one
step (the build's numerics check feeds a graph the arrays the runtime will), the manifest schema
and file hashing, GPU targets, the pipeline stages' layers, the speculation entry and Medusa's
acceptance arithmetic (`trtbuild plan` and the runtime policy agree), and three rules every
package follows: which file names lead inside a dir (paths), errors in one line (errors), child
processes that die with their parent (processes). It imports no other trtbuild package.

The runtime's trust check of an engine dir is runtime/engine_dir_check.py; running graphs in ONNX
Runtime is trtbuild.plugins.onnxruntime; the checkpoint reader is checkpoint/.
"""
