"""Medusa heads: the public checkpoint format, training (Medusa-1), and the default tree."""
