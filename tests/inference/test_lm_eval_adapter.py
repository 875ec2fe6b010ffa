"""The lm-eval model `belief-lm`: lm-eval's own command line runs local tasks with it, and
its log-likelihoods equal a direct computation with our model."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("lm_eval", reason="lm-eval is the eval extra (bash setup.sh --dev)")

from belief_lm.inference.generate import Sampling, generate
from belief_lm.inference.load import load_model

MC = [  # the first contexts are longer than the 16-token window: cropped from the left
    ("The keyword that defines a function in Python is", ["def", "banana", "seven"], 0),
    ("To import a module you write", ["import os", "the cat sat"], 0),
    ("A for", [" loop", "ever", "x"], 2),
]
MC = [{"question": q, "choices": c, "answer": a} for q, c, a in MC]
GEN = [{"prompt": "The return statement", "target": " is"}, {"prompt": "A class", "target": " x"}]
TASKS = {
    "tiny_mc": """output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list: [{metric: acc, aggregation: mean, higher_is_better: true}]""",
    "tiny_gen": """output_type: generate_until
doc_to_text: "{{prompt}}"
doc_to_target: "{{target}}"
generation_kwargs: {until: ["\\n", "."], max_gen_toks: 6, do_sample: false}
metric_list: [{metric: exact_match, aggregation: mean, higher_is_better: true}]""",
}


def write_tasks(root):
    """Task YAMLs reading local JSON lines (datasets' `json` builder: nothing downloaded)."""
    for name, rows in (("tiny_mc", MC), ("tiny_gen", GEN)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (root / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\n"
            f"dataset_kwargs: {{data_files: {{test: {root / name}.jsonl}}}}\n"
            f"test_split: test\n{TASKS[name]}\n"
        )


def direct_logprob(model, context: list[int], continuation: list[int], length: int) -> float:
    """log p(continuation | context), the last `length` tokens seen, one sequence at a time."""
    window = (context + continuation)[-(length + 1) :]
    with torch.no_grad():
        logp = model(torch.tensor([window[:-1]]))[:, 0].double().log_softmax(-1)
    targets = window[-len(continuation) :]
    return sum(float(logp[len(window) - 1 - len(targets) + i, t]) for i, t in enumerate(targets))


def split(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split: the whole text's ids, cut after the context's."""
    whole, head = tokenizer.encode(context + continuation), tokenizer.encode(context)
    return whole[: len(head)], whole[len(head) :]


def test_lm_eval_command_line_runs_local_tasks(make_checkpoint, tmp_path):
    checkpoint = make_checkpoint(seed=4, attention="belief_star")
    write_tasks(tmp_path)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    run = subprocess.run(
        [sys.executable, "-m", "belief_lm.inference.lm_eval_adapter", "--model", "belief-lm",
         "--model_args", f"checkpoint={checkpoint}", "--tasks", "tiny_mc,tiny_gen",
         "--include_path", str(tmp_path), "--batch_size", "4", "--device", "cpu",
         "--output_path", str(tmp_path / "out"), "--log_samples"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "tiny_mc" in run.stdout and "tiny_gen" in run.stdout  # lm-eval's results table

    loaded = load_model(checkpoint, device="cpu")
    samples = {}
    for task in ("tiny_mc", "tiny_gen"):
        log = next((tmp_path / "out").rglob(f"samples_{task}_*.jsonl"))
        samples[task] = [json.loads(line) for line in log.read_text().splitlines()]
    for sample in samples["tiny_mc"]:
        scores = []
        for args, (resp,) in zip(sample["arguments"].values(), sample["resps"], strict=True):
            context, continuation = split(loaded.tokenizer, args["arg_0"], args["arg_1"])
            expected = direct_logprob(loaded.model, context, continuation, 16)
            assert float(resp[0]) == pytest.approx(expected, abs=1e-4)
            scores.append(expected)
        assert sample["acc"] == float(scores.index(max(scores)) == sample["doc"]["answer"])
    assert len(loaded.tokenizer.encode(MC[0]["question"])) > 16  # cropping was exercised
    for sample in samples["tiny_gen"]:
        prompt = loaded.tokenizer.encode(sample["doc"]["prompt"])
        new = generate(loaded.model, prompt, 6, Sampling(temperature=0), context_length=16,
                       vocab_size=400, eos_id=2)  # fmt: skip
        text = loaded.tokenizer.decode(new).split("\n")[0].split(".")[0]
        assert sample["resps"] == [[text]]


@pytest.fixture
def adapter(make_checkpoint):
    from belief_lm.inference.lm_eval_adapter import BeliefLMEval

    return BeliefLMEval(make_checkpoint(seed=6, attention="attention_bn_sh"), batch_size=3)


def test_batched_log_likelihoods_equal_one_at_a_time(adapter):
    tokenizer = adapter.loaded.tokenizer
    texts = [("A for", " loop"), ("The import statement imports a module", " and"), ("x", " y z")]
    requests = [SimpleNamespace(args=pair) for pair in texts]
    batched = adapter.loglikelihood(requests, disable_tqdm=True)
    for (context, continuation), (score, _) in zip(texts, batched, strict=True):
        ids = split(tokenizer, context, continuation)
        assert score == pytest.approx(direct_logprob(adapter.loaded.model, *ids, 16), abs=1e-4)


def test_rolling_log_likelihood_scores_every_token_once(adapter):
    text = "The while statement is used for repeated execution as long as an expression is true."
    ids = adapter.loaded.tokenizer.encode(text)
    assert len(ids) > 32  # three windows of 16
    full = [2, *ids]  # EOS before the first token, as between documents in training
    expected = 0.0
    for end in range(16, len(ids) + 16, 16):  # each block of 16, the last maybe shorter
        end = min(end, len(ids))
        window = full[max(0, end - 16) : end + 1]
        block = ids[(end - 1) // 16 * 16 : end]
        expected += direct_logprob(adapter.loaded.model, window[: -len(block)], block, 16)
    (got,) = adapter.loglikelihood_rolling([SimpleNamespace(args=(text,))], disable_tqdm=True)
    assert got == pytest.approx(expected, abs=1e-3)


def test_a_continuation_longer_than_the_context_is_refused(adapter):
    with pytest.raises(ValueError, match="does not fit in the 16-token context"):
        adapter.score([([1], list(range(10, 30)))])


def test_a_document_masked_checkpoint_scores_each_document_alone(make_checkpoint):
    """model.attention_mask=document: batches (right-padded with EOS, documents of their
    own after each sequence) score as one request at a time, and a context after an
    earlier document and its EOS scores as the context alone."""
    from belief_lm.inference.lm_eval_adapter import BeliefLMEval

    checkpoint = make_checkpoint(seed=6, attention="attention_bn_sh", attention_mask="document")
    adapter = BeliefLMEval(checkpoint, batch_size=3)
    tokenizer = adapter.loaded.tokenizer
    texts = [("A for", " loop"), ("The import", " statement imports"), ("x", " y z")]
    pairs = [split(tokenizer, context, continuation) for context, continuation in texts]
    earlier = [*tokenizer.encode("The while"), tokenizer.eos_id]
    alone = adapter.score(pairs)
    after = adapter.score([(earlier + context, continuation) for context, continuation in pairs])
    for (context, continuation), score, later in zip(pairs, alone, after, strict=True):
        direct = direct_logprob(adapter.loaded.model, context, continuation, 16)
        assert score[0] == pytest.approx(direct, abs=1e-4)
        assert later[0] == pytest.approx(score[0], abs=1e-4) and later[1] == score[1]
