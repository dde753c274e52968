"""Sources and outputs: text and model sources, the checkpoint writer, output directories, the report, GGUF export."""
