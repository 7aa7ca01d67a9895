"""inductor.mm: the choices torch Inductor's max-autotune weighs for one mm site."""

from gpuwatchd.tuning.families import FamilySpec
from gpuwatchd.tuning.inductor_sites import FAMILY

SPECS = (
    FamilySpec(
        FAMILY,
        ("inductor.gemm",),
        ("max_choices", "seed"),
        needs=("torch", "triton"),  # max-autotune's GEMM templates are Triton kernels
    ),
)
