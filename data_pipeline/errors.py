"""The data pipeline's bad input: what its checks refuse before any work.

`BadDataInput` is a data config, source, tokenizer or saved data state that cannot be
used (the message names the key, file or value). The `belief-lm` command exits with 2 on
it (belief_lm.cli.exits); a data source that fails while a run reads it is something else
(data_pipeline.failures.DataFault). A ValueError that is not a BadDataInput comes from a
library or is a bug: a failure, not bad input.
"""


class BadDataInput(ValueError):
    """A data config, source, tokenizer or data state that the pipeline's checks refuse
    before any work (the message names what to change)."""
