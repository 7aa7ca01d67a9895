"""The tuning worker: the only package that imports torch or Triton.

It runs as its own process (``python -m gpuwatchd.tuning.worker``), one job per run."""
