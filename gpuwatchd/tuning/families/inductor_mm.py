"""inductor.mm: the choices torch Inductor's max-autotune weighs for one mm site."""

from gpuwatchd.tuning.families import FamilySpec

#: The family of Inductor GEMM sites.
FAMILY = "inductor.mm"
#: The template id of gpuwatchd's marker in a lookup table: "nothing beyond these
#: entries" (a site the table fully describes), never a choice of its own.
EXCLUSIVE_ID = "gpuwatchd::exclusive"

SPECS = (
    FamilySpec(
        FAMILY,
        ("inductor.gemm",),
        ("max_choices", "seed"),
        needs=("torch", "triton"),  # max-autotune's GEMM templates are Triton kernels
    ),
)
