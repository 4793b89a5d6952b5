"""The spec's precisions (``model.dtype``) and their torch, numpy and ONNX element types."""
from __future__ import annotations

from enum import Enum

import numpy as np

from ...contract.dtypes import NUMPY_DTYPES


class DType(str, Enum):
    float32 = "float32"
    float16 = "float16"
    bfloat16 = "bfloat16"

    @property
    def torch(self):
        import torch
        return getattr(torch, self.value)  # torch names its dtypes as the spec does

    @property
    def numpy(self) -> np.dtype:
        return NUMPY_DTYPES[self.value]

    @property
    def onnx(self) -> int:
        """The ONNX TensorProto element type."""
        from onnx.helper import np_dtype_to_tensor_dtype
        return np_dtype_to_tensor_dtype(self.numpy)

    @property
    def short(self) -> str:
        """The precision's short name in plans and GPU tables (fp32, fp16, bf16)."""
        return {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}[self.value]
