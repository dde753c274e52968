"""Execution: the calibration session, statistics, staged layers, weight streaming, data parallelism, resume."""
