"""The checkpoint the engine reads and writes: tensor names, the reader (packed formats dequantized), the writer."""
