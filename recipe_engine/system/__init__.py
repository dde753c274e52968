"""Process hygiene: our temporary directories and signal handling, progress bars."""
