"""belief_lm.train.validation: the validation loss weighted by tokens, as training's."""

import pytest

from belief_lm.model.gpt import BeliefLM
from belief_lm.train.validation import validation_loss
from tests.train.test_engine import VOCAB, config, unequal_step

pytestmark = pytest.mark.usefixtures("single_process_group")


def test_validation_weighs_every_label_alike():
    """Held-out micro-batches of 64 and 2 labels (a padded window and masked labels in the
    second): the loss is the mean over the 66 labels, as one forward of them all gives,
    and the count is theirs, not the 128 label slots'."""
    cfg = config()
    model = BeliefLM(cfg.model, VOCAB, seed=cfg.run.seed)
    tokens, labels = unequal_step()
    loss, count = validation_loss(
        model, [(tokens[:2], labels[:2]), (tokens[2:], labels[2:])], data_group=None
    )
    assert count == 66
    assert loss == pytest.approx(model(tokens, labels).item(), rel=1e-5)
