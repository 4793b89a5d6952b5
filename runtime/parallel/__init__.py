"""Ranks: tensor- and pipeline-parallel engines, the transports between stages, the TensorRT
engine as a pipeline stage, NCCL."""
