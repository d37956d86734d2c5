"""stepops: cache ops for Step5 and Inkling hybrid-attention decoders.

Importing the package declares every ``torch.ops.stepops`` op.
"""

from stepops import ops  # noqa: F401  (declares the ops)
