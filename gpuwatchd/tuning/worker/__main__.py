"""``python -m gpuwatchd.tuning.worker``: one tuning session in this process, then exit."""

from gpuwatchd.tuning.worker.main import run_and_exit

run_and_exit()
