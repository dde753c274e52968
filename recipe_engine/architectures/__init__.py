"""Architectures: the adapters (where each decoder family keeps its parts) and the symbolic model shape."""
