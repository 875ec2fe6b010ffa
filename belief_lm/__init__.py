"""belief-lm: distributed pretraining of belief-attention language models.

The attention math is in `belief_lm.attention`; the model in `belief_lm.model`; the training
loop in `belief_lm.train.loop`; configuration in `belief_lm.config`.
"""

__version__ = "0.1.0"
