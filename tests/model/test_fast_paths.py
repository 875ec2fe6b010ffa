"""The opt-in fast paths against the plain path they replace: the same loss and the same
gradient of every parameter (fp32), from the same seed and tokens."""

import pytest
import torch

from belief_lm.model.gpt import BeliefLM
from belief_lm.model.loss import IGNORE_INDEX
from tests.models import assert_same, tiny_model

pytestmark = pytest.mark.usefixtures("single_process_group")

VOCAB, EOS = 256, 2


def rows(seed: int = 0) -> torch.Tensor:
    """[2, 33] token ids: inputs and next-token labels, an EOS every 9 tokens (documents,
    under model.attention_mask=document)."""
    tokens = torch.randint(0, VOCAB, (2, 33), generator=torch.Generator().manual_seed(seed))
    tokens[:, 4::9] = EOS
    return tokens


def loss_and_grads(model: torch.nn.Module, tokens: torch.Tensor) -> tuple[torch.Tensor, dict]:
    loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_fused_output_projection_is_two_gemms_and_an_add():
    """belief_star's [Δ, Δ^s] [W^o | W^s]^T as one GEMM: the same loss and gradients, the
    same separately named parameters (a checkpoint loads into either)."""
    plain = BeliefLM(tiny_model("belief_star"), VOCAB, seed=3)
    fused = BeliefLM(tiny_model("belief_star", fused_output_projection=True), VOCAB, seed=3)
    assert fused.layers[0].self_attention.linear_proj.fused
    assert plain.state_dict().keys() == fused.state_dict().keys()
    for (name, a), b in zip(plain.state_dict().items(), fused.state_dict().values(), strict=True):
        assert a is None or torch.equal(a, b), name
    assert_same(loss_and_grads(fused, rows()), loss_and_grads(plain, rows()))


@pytest.mark.parametrize(
    ("variant", "tied", "mask"),
    [("softmax", True, "causal"), ("belief_star", False, "causal"),
     ("attention_sh", True, "document")],
)  # fmt: skip
def test_chunked_loss_is_the_plain_loss(variant, tied, mask):
    """train.loss_chunk_tokens: the output GEMM and cross entropy a chunk at a time (a
    chunk that does not divide the 64 tokens, one that cuts a sequence position's batch
    rows apart), recomputed in backward; ignored labels stay ignored."""
    cfg = tiny_model(variant, tie_embeddings=tied, attention_mask=mask)
    tokens = rows()
    tokens[0, 20:] = IGNORE_INDEX  # labels from position 19 on: padding
    inputs = tokens.clamp_min(0)

    def run(chunk: int) -> tuple:
        model = BeliefLM(cfg, VOCAB, seed=3, loss_chunk_tokens=chunk, eos_id=EOS)
        loss = model(inputs[:, :-1], tokens[:, 1:])
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    reference = run(0)
    for chunk in (64, 23, 5):
        assert_same(run(chunk), reference)


def test_chunked_loss_under_zero3(single_process_group):
    """Inside DeepSpeed's ZeRO-3 engine, which gathers each module's weights for its own
    forward (and the tied embedding's where the output layer reads it) and frees them
    after: three steps of the chunked loss give the plain loss's losses; under the
    document mask too, whose first loss is the plain model's."""
    from belief_lm.config import load_config
    from tests.jobs import MICRO, ROOT
    from tests.models import trainee_for

    batches = [(r[:, :-1], r[:, 1:]) for r in (rows(seed) for seed in range(3))]
    losses = {}
    for chunk, mask in ((0, "causal"), (23, "causal"), (0, "document"), (23, "document")):
        overrides = ["model.num_layers=1", "parallel.zero_stage=3", "train.global_batch_size=2"]
        overrides += [f"train.loss_chunk_tokens={chunk}", f"model.attention_mask={mask}"]
        cfg = load_config(ROOT / MICRO, overrides)
        trainee = trainee_for(cfg, single_process_group, VOCAB, eos_id=EOS)
        losses[chunk, mask] = [trainee.train_step(iter([batch])).loss.item() for batch in batches]
        trainee.engine.destroy()
    for mask in ("causal", "document"):
        assert losses[23, mask] == pytest.approx(losses[0, mask], rel=1e-5)
        assert losses[0, mask][2] < losses[0, mask][0]  # the steps did something
    plain = BeliefLM(cfg.model, VOCAB, seed=cfg.run.seed, eos_id=EOS)
    assert losses[0, "document"][0] == pytest.approx(plain(*batches[0]).item(), rel=1e-6)
    assert losses[0, "document"][0] != pytest.approx(losses[0, "causal"][0], rel=1e-4)


@pytest.mark.slow  # Inductor on two CPU cores: 30-90 s a case with a cold compile cache
@pytest.mark.parametrize(
    ("variant", "recompute", "options"),
    # one case (CI time): the one with most inside the graph (the causal mask compiled:
    # tests/parallel, at TP=2 and in pipeline stages)
    [("belief_star", "selective", {"fused_output_projection": True, "attention_mask": "document"})],
)
def test_compiled_layers_are_the_eager_layers(variant, recompute, options):
    """model.compile=layer: each decoder layer's training forward and backward through
    torch.compile (one graph per layer: no graph break, the layers share it), with selective
    recompute (the checkpoint inside the compiled graph), the document mask (the documents
    derived from the EOS marks inside the graph) and the other fast paths inside it. Eval
    stays eager."""
    from torch._dynamo.utils import counters

    counters.clear()
    mask = {"attention_mask": options.get("attention_mask", "causal")}
    eager = BeliefLM(tiny_model(variant, **mask), VOCAB, seed=3, eos_id=EOS)
    compiled = BeliefLM(
        tiny_model(variant, compile="layer", **options), VOCAB, seed=3, recompute=recompute,
        eos_id=EOS,
    )  # fmt: skip
    assert_same(loss_and_grads(compiled, rows()), loss_and_grads(eager, rows()))
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    with torch.no_grad():
        torch.testing.assert_close(compiled.eval()(rows()), eager.eval()(rows()))
