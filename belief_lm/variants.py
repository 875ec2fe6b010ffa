"""The attention variants by name: the one list every part of belief-lm reads.

`model.attention` picks a name; each name is a way to compute the heads H (`mixing`) and
the signal fed to the output projection (`residual`). The math behind both is in
`attention.py`, which reads this table (torch-free, so configs validate without torch; it
also ships next to `attention.py` in Hugging Face exports).
"""

from typing import Literal, NamedTuple


class Variant(NamedTuple):
    """How a variant computes the heads H, and which signal feeds the output projection."""

    mixing: str
    """'softmax', 'bn' (recentred by the causal mean of keys), 'sh' (pooled keys) or 'bn_sh'."""
    residual: str
    """'mh' (MH itself), 'belief' (Δ), 'belief_star' ([Δ, Δ^s]) or 'attentionx' (Φ)."""

    @property
    def extra_projection(self) -> bool:
        """A second output projection W^s (d x d per layer) beside W^o: belief_star's."""
        return self.residual == "belief_star"

    @property
    def projects_onto_values(self) -> bool:
        """Its residual removes MH's component along V: an inner product over all heads,
        summed over tensor-parallel ranks."""
        return self.residual in ("belief", "belief_star")


VARIANTS: dict[str, Variant] = {
    "softmax": Variant("softmax", "mh"),
    "belief": Variant("softmax", "belief"),
    "belief_star": Variant("softmax", "belief_star"),
    "attentionx": Variant("softmax", "attentionx"),
    "attention_bn": Variant("bn", "mh"),
    "attention_sh": Variant("sh", "mh"),
    "attention_bn_sh": Variant("bn_sh", "mh"),
}
"""model.attention -> its Variant."""

AttentionVariant = Literal[tuple(VARIANTS)]  # type: ignore[valid-type]
"""The config type of model.attention: one of VARIANTS' names."""
