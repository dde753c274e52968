"""Scripts that diagnose or explore, run as ``python -m benchmarks.diagnosis.NAME``: ``flatten`` (which part of
FlattenGPT loses on held-out text), ``score_text`` and ``window_length`` (what the held-out scores depend on),
``gpu_gaps`` (a profile's idle GPU time by phase and host operation), ``host_samples`` (py-spy's samples by
thread and frame), ``gptq_host_work`` (GPTQ's launches and host reads on a MoE layer); ``common`` holds what
they share with ``linearpatch_diagnosis``. They print or write raw output (``benchmarks/results/raw/``), not
result rows."""
