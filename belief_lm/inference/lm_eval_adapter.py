"""lm-evaluation-harness on belief-lm checkpoints: the model type `belief-lm`.

Importing this module registers it with lm-eval, whose command line cannot find models
outside its own package; running the module is lm-eval's command line with it registered
(same arguments):

    python -m belief_lm.inference.lm_eval_adapter --model belief-lm \\
        --model_args checkpoint=runs/tiny/checkpoints/step_000300 --tasks hellaswag

(model_args `trust_checkpoint=true`: --trust-checkpoint, for a checkpoint you made yourself
whose files hold more than a checkpoint may: see belief_lm/checkpoint/loading.py.)

From Python: `import belief_lm.inference.lm_eval_adapter` and then
`lm_eval.simple_evaluate(model="belief-lm", model_args={"checkpoint": ...}, ...)`, or
`evaluate_tasks(checkpoint, tasks)` (what training's train.eval_tasks run).

Log-likelihoods are batched (right-padded: every variant is causal, so padding after a
sequence cannot change it) and use the model's full output distribution, as training's
loss does. Contexts longer than model.seq_length keep their last tokens. generate_until
decodes one request at a time with belief_lm.inference.generate (greedy unless the task
asks for sampling), stopping at EOS or at the task's stop strings.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import yaml
from tqdm import tqdm

from belief_lm.errors import BadInput

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.evaluator import simple_evaluate
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ModuleNotFoundError as err:  # lm-eval is an optional extra, not a runtime dependency
    if err.name != "lm_eval":
        raise
    raise ModuleNotFoundError(
        "belief_lm.inference.lm_eval_adapter needs lm-evaluation-harness, belief-lm's 'eval' "
        "extra: pip install -e '.[eval]' (bash setup.sh --dev installs it)",
        name=err.name,
    ) from err

from belief_lm.inference.generate import Sampling, generate
from belief_lm.inference.load import load_model

AUTO_BATCH_SIZE = 16
"""What batch_size=auto means here (no search for the largest batch that fits)."""


@register_model("belief-lm")
class BeliefLMEval(TemplateLM):
    """A belief-lm checkpoint (a step directory) as an lm-eval model."""

    def __init__(
        self,
        checkpoint: str | Path,
        batch_size: int | str = 1,
        device: str | None = None,
        seed: int = 1234,
        trust_checkpoint: bool | str = False,
        **unused,
    ):
        super().__init__()
        trust = str(trust_checkpoint).lower() in ("true", "1", "yes")  # model_args are text
        self.loaded = load_model(checkpoint, device or "auto", trust)
        self.max_length = self.loaded.context_length
        auto = isinstance(batch_size, str) and batch_size.startswith("auto")
        self.batch_size = AUTO_BATCH_SIZE if auto else int(batch_size)
        self.seed = seed

    @property
    def eot_token_id(self) -> int:
        return self.loaded.tokenizer.eos_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kw) -> list[int]:
        return self.loaded.tokenizer.encode(string)  # belief-lm adds no BOS/EOS to text

    def _loglikelihood_tokens(
        self, requests: list[tuple], disable_tqdm: bool = False, **unused
    ) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), whether greedy decoding gives it) for
        (key, context ids, continuation ids) requests, longest first in batches."""
        results: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
        order = sorted(range(len(requests)), key=lambda i: -sum(map(len, requests[i][1:])))
        batches = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        for batch in tqdm(batches, disable=disable_tqdm, desc="belief-lm log-likelihoods"):
            scores = self.score([requests[i][1:] for i in batch])
            for i, score in zip(batch, scores, strict=True):
                results[i] = score
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], score)
        return results

    @torch.no_grad()
    def score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """One forward pass over (context ids, continuation ids) pairs, each cropped to the
        last seq_length + 1 tokens (so a continuation must fit in the context length)."""
        windows = [(ctx + cont)[-(self.max_length + 1) :] for ctx, cont in pairs]
        if any(len(c) >= len(w) for (_, c), w in zip(pairs, windows, strict=True)):
            raise ValueError(f"a continuation does not fit in the {self.max_length}-token context")
        width = max(len(w) for w in windows) - 1
        inputs = torch.full((len(windows), width), self.eot_token_id, dtype=torch.long)
        for row, window in enumerate(windows):
            inputs[row, : len(window) - 1] = torch.tensor(window[:-1])
        device = next(self.loaded.model.parameters()).device
        logits = self.loaded.model(inputs.to(device)).transpose(0, 1).float()
        logprobs = logits.log_softmax(-1).cpu()
        out = []
        for row, ((_, continuation), window) in enumerate(zip(pairs, windows, strict=True)):
            end = len(window) - 1
            rows = logprobs[row, end - len(continuation) : end]
            target = torch.tensor(continuation)
            total = rows.gather(-1, target[:, None]).sum()
            out.append((float(total), bool((rows.argmax(-1) == target).all())))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole texts, in disjoint windows of the context length (the
        first conditioned on EOS, the document separator in training)."""
        totals = []
        for (text,) in tqdm([r.args for r in requests], disable=disable_tqdm):
            windows = get_rolling_token_windows(
                self.tok_encode(text), self.eot_token_id, self.max_length, context_len=1
            )
            pairs = [(None, *make_disjoint_window(w)) for w in windows]
            total = sum(score for score, _ in self._loglikelihood_tokens(pairs, disable_tqdm=True))
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            totals.append(total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Continue each context until EOS, a stop string or max_gen_toks tokens."""
        outputs = []
        for context, options in tqdm([r.args for r in requests], disable=disable_tqdm):
            outputs.append(self.continue_text(context, options))
            self.cache_hook.add_partial("generate_until", (context, options), outputs[-1])
        return outputs

    def continue_text(self, context: str, options: dict) -> str:
        """One generate_until request: lm-eval's generation options (until, max_gen_toks,
        do_sample, temperature, top_k, top_p)."""
        until = options.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        sampled = options.get("do_sample", False) and options.get("temperature", 1.0) > 0
        sampling = Sampling(
            temperature=options.get("temperature", 1.0) if sampled else 0.0,
            top_k=options.get("top_k") if sampled else None,
            top_p=options.get("top_p") if sampled else None,
        )
        decode = self.loaded.tokenizer.decode
        new = generate(
            self.loaded.model,
            self.tok_encode(context) or [self.eot_token_id],
            int(options.get("max_gen_toks", 256)),
            sampling,
            context_length=self.max_length,
            vocab_size=self.loaded.tokenizer.vocab_size,
            eos_id=self.eot_token_id,
            seed=self.seed,
            stop=lambda ids: any(s in decode(ids) for s in until),
        )
        text = decode(new)
        for stop in until:
            text = text.split(stop)[0]
        return text


class _TaskYaml(yaml.SafeLoader):
    """lm-eval task YAML: its `!function` tags (Python hooks) read as None."""


_TaskYaml.add_multi_constructor("!", lambda loader, suffix, node: None)


def resolve_tasks(tasks: list[str]) -> tuple[list[str], TaskManager]:
    """lm-eval's names for `tasks` (task names, or paths of local task YAML files, whose
    folders join lm-eval's search path) and a TaskManager that finds them. BadInput
    naming an unknown task or an unreadable task file."""
    names, folders = [], []
    for task in tasks:
        if not task.endswith((".yaml", ".yml")):
            names.append(task)
            continue
        try:
            config = yaml.load(Path(task).read_text(), _TaskYaml)  # a SafeLoader
        except (OSError, yaml.YAMLError) as err:
            raise BadInput(f"task file {task}: {err}") from None
        if not isinstance(config, dict) or not isinstance(config.get("task"), str):
            raise BadInput(f"task file {task} names no task (its `task:` key)")
        names.append(config["task"])
        folders.append(str(Path(task).resolve().parent))
    # lm-eval's own tasks are indexed (seconds) only when a name asks for them
    manager = TaskManager(include_path=folders or None, include_defaults=len(folders) < len(tasks))
    unknown = [name for name in names if not manager.match_tasks([name])]
    if unknown:
        raise BadInput(f"lm-eval knows no task {', '.join(map(repr, unknown))}")
    return names, manager


def evaluate_tasks(
    checkpoint: str | Path, tasks: list[str], device: str = "auto", batch_size: int = 8
) -> dict[str, dict]:
    """lm-eval's results of `tasks` (see resolve_tasks) on `checkpoint`: per task, each
    metric (with lm-eval's filter, e.g. 'acc,none') and its standard error."""
    names, manager = resolve_tasks(tasks)
    model = BeliefLMEval(checkpoint, batch_size=batch_size, device=device)
    results = simple_evaluate(model=model, tasks=names, task_manager=manager, log_samples=False)
    return results["results"]


def main() -> None:
    """lm-eval's command line, with `belief-lm` registered."""
    from lm_eval.__main__ import cli_evaluate

    sys.argv[0] = "lm_eval"
    cli_evaluate()


if __name__ == "__main__":
    main()
