"""The single-file torch export loads back into BeliefLM with the same logits."""

import pytest
import sentencepiece as spm
import torch

from belief_lm.export import export
from belief_lm.export.torch_file import load_model, read
from belief_lm.inference.load import load_model as load_checkpoint


@pytest.mark.parametrize(
    "model",
    [{"attention": "belief_star"}, {"attention": "attention_bn_sh", "position_embedding": "rope"}],
)
def test_loads_back_with_equal_logits(make_checkpoint, small_tokenizer, tmp_path, model):
    checkpoint = make_checkpoint(seed=2, **model)
    path = export(checkpoint, "torch", tmp_path / "model.pt")
    ids = torch.randint(0, 400, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = load_checkpoint(checkpoint, device="cpu").model(ids)
        torch.testing.assert_close(load_model(path)(ids), expected, rtol=0, atol=0)
    exported = read(path)
    assert (
        exported["info"]["step"] == 1
        and exported["config"]["model"]["attention"] == model["attention"]
    )
    tokenizer = spm.SentencePieceProcessor(model_proto=exported["tokenizer_model"])
    assert tokenizer.encode("The for statement") == small_tokenizer.encode("The for statement")


def test_the_trained_checkpoint_round_trips(trained_checkpoint, tmp_path):
    path = export(trained_checkpoint, "torch", tmp_path / "trained.pt")
    ids = torch.randint(0, 400, (1, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = load_checkpoint(trained_checkpoint, device="cpu").model(ids)
        torch.testing.assert_close(load_model(path)(ids), expected, rtol=0, atol=0)


def test_a_file_that_is_not_an_export_is_refused(tmp_path):
    torch.save({"weights": torch.zeros(1)}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not a belief-lm torch export"):
        read(tmp_path / "other.pt")
