"""Model and text sources: resolving and loading models, package files, devices, sizes; text data and windows."""
