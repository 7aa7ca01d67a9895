"""The daemon side of tuning: which jobs to run (plan), when (scheduler), how (runner), and
who hears that one ended (events).

Nothing here imports torch; the runner spawns ``python -m gpuwatchd.tuning.worker``."""
