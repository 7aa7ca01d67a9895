"""The daemon side of tuning: which jobs to run (plan), when (scheduler), and how (runner).

Nothing here imports torch; the runner spawns ``python -m gpuwatchd.tuning.worker``."""
