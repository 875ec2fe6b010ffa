"""The attention variants by name: the one list every part of belief-lm reads.

`model.attention` picks a name; each name is a way to compute the heads H (`mixing`) and
the signal fed to the output projection (`residual`). The math behind both is in
`attention.py`, which reads this table (torch-free, so configs validate without torch; it
also ships next to `attention.py` in Hugging Face exports).
"""

from typing import Literal

VARIANTS: dict[str, tuple[str, str]] = {
    "softmax": ("softmax", "mh"),
    "belief": ("softmax", "belief"),
    "belief_star": ("softmax", "belief_star"),
    "attentionx": ("softmax", "attentionx"),
    "attention_bn": ("bn", "mh"),
    "attention_sh": ("sh", "mh"),
    "attention_bn_sh": ("bn_sh", "mh"),
}
"""model.attention -> (how H is computed, which residual signal feeds the output projection)."""

AttentionVariant = Literal[tuple(VARIANTS)]  # type: ignore[valid-type]
"""The config type of model.attention: one of VARIANTS' names."""
