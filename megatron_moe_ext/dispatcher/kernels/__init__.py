"""Triton kernels of the dispatcher's fixed-shape permutation (`gather_triton`), apart from
`experts/kernels` so the dispatcher does not depend on the expert MLPs."""
