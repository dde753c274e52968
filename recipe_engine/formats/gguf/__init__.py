"""llama.cpp's one-file format, as a source read once into a cached checkpoint and as an export: the source file and
its conversion (``source``), the vocabulary (``vocabulary``), the writer and its checks (``writer``) and each
architecture's tensor layout (``layout``). The format registry finds this package like any format module."""
from . import source, writer  # noqa: F401  (each registers its format)
