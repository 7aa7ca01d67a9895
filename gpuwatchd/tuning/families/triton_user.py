"""triton.user: a job's own Triton kernel, tuned over the configs the job declared."""

from gpuwatchd.tuning.families import FamilySpec
from gpuwatchd.tuning.kernels import FAMILY

SPECS = (
    FamilySpec(
        FAMILY, ("triton.user",), ("allowed_modules",), needs=("torch", "triton"), user_code=True
    ),
)
