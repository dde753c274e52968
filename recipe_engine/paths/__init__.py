"""Output-path safety: one rule for every path a command writes, the output directory, its lock."""
