"""Numerics: ridge solves, Hadamard rotations, the quantization grid and small tensor ops (no engine imports)."""
