"""A rank that goes silent at a chosen point, for the fault tests: Python imports this
module at the start of every process whose PYTHONPATH leads with this directory. In the
process whose RANK is SILENT_RANK, the first decoder layer's forward pass stops the
process (SIGSTOP) at its SILENT_AT-th call, after its tensor-parallel peers have entered
it: they wait for this rank in the layer's tensor-parallel all-reduce."""

import os
import signal
import warnings

if os.environ.get("SILENT_RANK") is not None and os.environ.get("SILENT_RANK") == os.environ.get(
    "RANK"
):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from belief_lm.model.gpt import DecoderLayer

    forward, calls = DecoderLayer.forward, []

    def stopping_forward(self, *args, **kwargs):
        if self.layer_number == 1:
            calls.append(None)
            if len(calls) == int(os.environ["SILENT_AT"]):
                os.kill(os.getpid(), signal.SIGSTOP)
        return forward(self, *args, **kwargs)

    DecoderLayer.forward = stopping_forward
