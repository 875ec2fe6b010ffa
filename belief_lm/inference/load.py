"""A checkpoint as a ready model in this process: BeliefLM at TP=1 plus its tokenizer."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from belief_lm.checkpoint.consolidate import Consolidated, consolidate
from belief_lm.errors import BadInput
from belief_lm.inference.generate import Sampling, generate
from belief_lm.model.gpt import BeliefLM
from belief_lm.parallel.grid import ProcessGrid
from belief_lm.runtime import select_device
from data_pipeline.tokenizer import Tokenizer


@dataclass(frozen=True)
class Completion:
    """A prompt's continuation and how long it took."""

    text: str
    """The prompt and its continuation, decoded."""
    new_tokens: int
    seconds: float
    stopped_at_eos: bool


@dataclass
class LoadedModel:
    """A trained model, its tokenizer and where it came from."""

    model: BeliefLM
    tokenizer: Tokenizer
    checkpoint: Consolidated

    @property
    def context_length(self) -> int:
        """Tokens the model sees at once (model.seq_length)."""
        return self.checkpoint.config.model.seq_length

    def complete(
        self,
        prompt: str,
        max_new_tokens: int,
        sampling: Sampling,
        seed: int = 0,
        use_cache: bool = True,
    ) -> Completion:
        """Continue the text `prompt` by at most `max_new_tokens` tokens (stopping at EOS);
        `use_cache=False` reruns the model over the whole context at every step."""
        if max_new_tokens < 0:
            raise BadInput(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        ids = self.tokenizer.encode(prompt)
        if not ids:
            raise BadInput("the prompt is empty")
        start = time.perf_counter()
        new = generate(
            self.model, ids, max_new_tokens, sampling, context_length=self.context_length,
            vocab_size=self.tokenizer.vocab_size, eos_id=self.tokenizer.eos_id, seed=seed,
            use_cache=use_cache,
        )  # fmt: skip
        seconds = time.perf_counter() - start
        text = self.tokenizer.decode(ids + new)
        return Completion(text, len(new), seconds, len(new) < max_new_tokens)


def load_model(checkpoint: str | Path, device: str = "auto", trust: bool = False) -> LoadedModel:
    """Consolidate `checkpoint` (a step directory) and build its model in eval mode (fp32)
    on `device` ('auto': the GPU if there is one). `trust`: see consolidate."""
    consolidated = consolidate(checkpoint, trust=trust)
    ProcessGrid.single_process()
    model = consolidated.build_model().to(select_device(device))
    return LoadedModel(model, Tokenizer(consolidated.tokenizer_path), consolidated)
