"""``stepops::csa_ring_update``: the Step5 CSA tail ring's per-step update (ring rows and region summaries).

Files: ``op.py`` declares the op and holds the public wrapper, ``validate.py`` the host validator,
``torch_kernel.py`` the CPU kernel (the specification), ``triton_kernel.py`` the CUDA kernel,
``metadata.py`` the per-step metadata builder, ``samples.py`` the sample and error inputs,
``reference.py`` the naive reference (test support; nothing here imports it).
"""

from stepops.ops.csa_ring_update.metadata import CSARingMetadata, build_csa_ring_metadata
from stepops.ops.csa_ring_update.op import csa_ring_update
from stepops.ops.csa_ring_update.validate import validate_csa_ring_update_inputs

__all__ = ["CSARingMetadata", "build_csa_ring_metadata", "csa_ring_update", "validate_csa_ring_update_inputs"]
