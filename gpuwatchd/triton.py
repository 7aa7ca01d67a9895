"""``gpuwatchd.triton.autotune``: ``triton.autotune`` that uses gpuwatchd's recorded winners.

Decorate a kernel exactly as with ``triton.autotune`` (same arguments, same semantics)::

    @gpuwatchd.triton.autotune(configs=[...], key=["n_cols"])
    @triton.jit
    def softmax_kernel(...): ...

    softmax_kernel[grid](x, y, n_cols)

On a key's first call the job looks up the winner gpuwatchd recorded for this kernel
(identity = hash of its source, config list and key names), these key values, this GPU
model and these driver/CUDA/Triton versions, in ``regime`` ("sustained" by default: what a
long-running job sees; "unthrottled"; "auto": decided from the daemon's view of the GPU
at the first call). A hit runs that config with no benchmarking at all; a miss (no
winner, no daemon, no store) autotunes exactly as Triton does and files a tuning request
(to the daemon's control socket, else the spool) so the next run hits.

``args_factory`` ("module:function", or a module-level function) builds the arguments
for given key values when random data would be invalid (indices, lengths): it is called
as ``factory(key_values: dict) -> dict[str, object]`` in the tuning worker.
``kernel.gpuwatchd_choice`` maps each Triton key to its :class:`Choice` (config, source
``winner``/``autotuned``/``single``, and why); each is logged once at INFO on the
``gpuwatchd.triton`` logger. ``context`` (:class:`TuneContext`) overrides where winners
come from and where requests go.

Triton is imported when a kernel is decorated, not when this module is imported.
"""

from gpuwatchd.jobside.autotune import REGIMES, Choice, GpuwatchdAutotuner, TuneContext, autotune
from gpuwatchd.jobside.requests import Submission, Submitter

__all__ = [
    "REGIMES",
    "Choice",
    "GpuwatchdAutotuner",
    "Submission",
    "Submitter",
    "TuneContext",
    "autotune",
]
