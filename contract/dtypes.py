"""The model dtypes an engine dir names (the spec's model.dtype, recorded in the manifest) as
numpy types: one table for the build's passes, the step's host arrays and the runtime's buffers.
ONNX's element types follow from these (onnx.helper.np_dtype_to_tensor_dtype), torch's by name."""
from __future__ import annotations

import ml_dtypes
import numpy as np

# To compute with: bfloat16 through ml_dtypes, the type ONNX's numpy helpers read and write.
NUMPY_DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
                "bfloat16": np.dtype(ml_dtypes.bfloat16)}

# To hold a tensor's bytes without computing on them (TensorRT's KV pools, hidden states between
# pipeline stages): the same widths, bfloat16 as its uint16 bits, which torch and ctypes also take.
HOST_DTYPES = {**NUMPY_DTYPES, "bfloat16": np.dtype(np.uint16)}

# What the CPU runtime (ONNX Runtime) runs; a bfloat16 engine dir runs on TensorRT.
CPU_DTYPES = ("float32", "float16")
