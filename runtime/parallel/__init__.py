"""Ranks: tensor- and pipeline-parallel engines, the transports between stages, NCCL."""
