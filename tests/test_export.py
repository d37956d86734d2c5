"""``torch.export`` of every op sample, without and with the ``errors`` counter: functionalized
(``run_decompositions``), the exported program declares exactly the arguments the schema writes as input
mutations, and running it writes the same bytes as eager.

``opcheck``'s ``test_aot_dispatch_dynamic`` covers functionalization under ``torch.compile``; export takes its
own path (non-strict tracing, ``auto_functionalized_v2``, then the mutations copied back into the inputs by
``ExportedProgram.module()``), which an ahead-of-time user of the ops goes through.
"""

import pytest
import torch
from torch.export.graph_signature import InputKind

from stepops._library import written_arguments
from stepops.testing import copy_as_views, op_samples, storage_bytes

_SAMPLES = list(op_samples(with_error_counters=True))


class _Call(torch.nn.Module):
    """``op(*args, **kwargs)`` as a module, the unit ``torch.export`` traces."""

    def __init__(self, op):
        super().__init__()
        self.op = op

    def forward(self, *args, **kwargs):
        return self.op(*args, **kwargs)


@pytest.mark.parametrize("sample", _SAMPLES, ids=[s.name for s in _SAMPLES])
def test_exported_program_writes_what_eager_writes(sample):
    op, args, kwargs = sample
    program = torch.export.export(_Call(op), tuple(args), kwargs).run_decompositions()
    signature = program.graph_signature
    inputs = [spec.arg.name for spec in signature.input_specs if spec.kind == InputKind.USER_INPUT]
    assert len(inputs) == len(args) + len(kwargs)
    names = [argument.name for argument in op._schema.arguments]
    # The user inputs: the positional arguments, then the keyword ones in the order they were passed.
    position = {**{names[i]: i for i in range(len(args))}, **{k: len(args) + j for j, k in enumerate(kwargs)}}
    written = {names[i] for i in written_arguments(op)} & position.keys()
    assert set(signature.user_inputs_to_mutate.values()) == {inputs[position[name]] for name in written}

    exported_call, eager_call = copy_as_views([*args, *kwargs.values()]), copy_as_views([*args, *kwargs.values()])
    split = len(args)
    exported_out = program.module()(*exported_call[:split], **dict(zip(kwargs, exported_call[split:])))
    eager_out = op(*eager_call[:split], **dict(zip(kwargs, eager_call[split:])))
    if isinstance(eager_out, torch.Tensor):
        assert torch.equal(exported_out.view(torch.uint8), eager_out.view(torch.uint8))
    else:
        assert exported_out is None and eager_out is None
    for name, exported, eager in zip([*names[:split], *kwargs], exported_call, eager_call):
        if isinstance(eager, torch.Tensor):
            assert torch.equal(storage_bytes(exported), storage_bytes(eager)), name
