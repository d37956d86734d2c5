"""Whole Step5 and Inkling decoder layers on the stepops cache ops and a step runner.

- :mod:`stepops.models.step5`: :class:`Step5DecoderLayer` (sliding-window and CSA layers), :class:`Step5Model`
  (the stack) and :class:`Step5ForCausalLM` (with embedding and head), expert-parallel over a process group.
- :mod:`stepops.models.step5_config`: :class:`Step5Config` and the released model's numbers.
- :mod:`stepops.models.inkling`: :class:`InklingConfig`, :class:`InklingDecoderLayer`, :class:`InklingModel`
  (transformers 5.23.0's Inkling text decoder) and its tensor-parallel slicer ``shard_inkling_state_dict``.
- :mod:`stepops.models.inkling_checkpoint`: ``load_inkling`` (a transformers checkpoint directory).
- :mod:`stepops.models.checkpoint_files`: reading a checkpoint directory's JSON and safetensors files (headers
  first, tensors one at a time).
- :mod:`stepops.models.tensor_parallel`: a ``torch.distributed`` group as the layers see it (the
  collectives, the generic state-dict slicer, ``spawn_ranks``); imports no model.
- :mod:`stepops.models.metadata`: the step's fixed-size buffers and the on-device metadata builders.
- :mod:`stepops.models.runner`: :class:`StepRunner` (eager, compiled, CUDA graphs) and the scripted workload.
- :mod:`stepops.models.step5_weights`: loading a Step5 checkpoint in StepFun's reference names (fp8 experts),
  reading its ``config.json`` into a :class:`Step5Config`, and ``load_step5`` (a checkpoint directory).
- :mod:`stepops.models.paged_attention`: attention over the paged KV cache (full, sliding window, CSA
  regions) and the indexer's streaming top-k, with memory independent of the context length.
- :mod:`stepops.models.moe`: the step sizes at which both models' MoE blocks run only the chosen experts.

The no-cache recomputes and the dense attention oracle are test support, in :mod:`stepops.testing`.
"""

from stepops.models.inkling import InklingConfig, InklingDecoderLayer, InklingModel
from stepops.models.metadata import InklingStepMetadata, Step5StepMetadata, StepBuffers
from stepops.models.step5 import Step5DecoderLayer, Step5ForCausalLM, Step5Model
from stepops.models.step5_config import Step5Config

__all__ = [
    "InklingConfig",
    "InklingDecoderLayer",
    "InklingModel",
    "InklingStepMetadata",
    "Step5Config",
    "Step5DecoderLayer",
    "Step5ForCausalLM",
    "Step5Model",
    "Step5StepMetadata",
    "StepBuffers",
]
