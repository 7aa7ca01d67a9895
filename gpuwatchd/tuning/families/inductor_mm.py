"""inductor.mm: the choices torch Inductor's max-autotune weighs for one mm site."""

from gpuwatchd.tuning.families import FamilySpec

#: The family of Inductor GEMM sites.
FAMILY = "inductor.mm"

SPECS = (
    FamilySpec(
        FAMILY,
        ("inductor.gemm",),
        ("max_choices", "seed"),
        needs=("torch", "triton"),  # max-autotune's GEMM templates are Triton kernels
    ),
)
