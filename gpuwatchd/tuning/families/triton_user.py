"""triton.user: a job's own Triton kernel, tuned over the configs the job declared."""

from gpuwatchd.tuning.families import FamilySpec

#: The family of a job's own Triton kernels.
FAMILY = "triton.user"

SPECS = (
    FamilySpec(
        FAMILY, ("triton.user",), ("allowed_modules",), needs=("torch", "triton"), user_code=True
    ),
)
