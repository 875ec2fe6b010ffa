"""The data section of a run's configuration: sources, tokenizer, workers, skip limits.

Owned by the data pipeline (which imports nothing of the trainer); `belief_lm.config`
composes it into a whole run. `Section` is the strict base every config section shares:
unknown keys and bad values fail validation, naming the key.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from data_pipeline.documents import parse_filter

PositiveInt = Annotated[int, Field(gt=0)]


class Section(BaseModel):
    """Base of every config section: strict keys, checked assignment, docstrings as docs."""

    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, use_attribute_docstrings=True
    )


class SourceConfig(Section):
    """One document source of the training mixture."""

    uri: str
    """Where documents come from: 'embedded' (documentation shipped with Python);
    'hf:OWNER/NAME[:CONFIG]' (a Hugging Face hub dataset, streamed); a local path or glob of
    .parquet, .jsonl[.gz|.zst] or .txt[.gz|.zst] files; 'prepared:DIR' (`belief-lm prepare`)."""
    weight: float = Field(1.0, gt=0)
    """Relative share of training windows (tokens) drawn from this source."""
    name: str | None = None
    """Hub dataset config (e.g. sample-10BT); overrides the URI's :CONFIG part."""
    hub_split: str = "train"
    """Split of the hub dataset to stream."""
    hub_revision: str | None = None
    """Branch, tag or commit of the hub dataset (a commit pins its files); None: its main
    branch. 'refs/convert/parquet': the hub's own parquet copy, for a dataset that ships
    only a loading script (which `datasets` no longer runs); of a dataset over 5 GB that
    copy holds the first 5 GB."""
    format: Literal["auto", "parquet", "jsonl", "text"] = "auto"
    """Format of local files; auto: from the extension."""
    text_column: str = "text"
    """Column (or JSON key) holding the document text."""
    id_column: str | None = None
    """Column holding a stable document id; None: a hash of the text."""
    filters: list[str] = Field(default_factory=list)
    """Row filters 'COLUMN OP VALUE' (OP one of == != < <= > >=), all must hold,
    e.g. 'int_score >= 3'."""
    text_unit: Literal["document", "paragraph", "line"] = "document"
    """For text files: what one document is (a whole file, a blank-line paragraph, a line)."""

    @field_validator("filters")
    @classmethod
    def _filters_parse(cls, value: list[str]) -> list[str]:
        for text in value:
            parse_filter(text)
        return value


class TokenizerConfig(Section):
    """The sentencepiece tokenizer."""

    path: str | None = None
    """A trained sentencepiece .model file; None: train one on the data sources (cached)."""
    vocab_size: PositiveInt = 4096
    """Vocabulary size when training a tokenizer."""
    sample_documents: PositiveInt = 100_000
    """Training documents read (split over the sources by weight) to train a tokenizer."""


class DataConfig(Section):
    """Where training tokens come from and how they are cut into windows."""

    sources: list[SourceConfig] = Field(default_factory=lambda: [SourceConfig(uri="embedded")])
    """Document sources (a bare string is a source URI with weight 1)."""
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig)
    """Tokenizer settings."""
    validation_fraction: float = Field(0.02, ge=0, le=1)
    """Share of documents (by a hash of their id) held out for validation; 1 holds out
    everything (an evaluation-only source)."""
    seed: int = 1234
    """Seed of the document order and of the mixture."""
    num_workers: int = Field(1, ge=0)
    """DataLoader worker processes per rank that read and tokenize; 0: in the training
    process (may change on resume)."""
    readers: PositiveInt | None = None
    """Logical readers: independent positions in the data, R of them, each contributing
    global_batch_size / R sequences per step and served by whichever rank and worker the
    layout gives it; None: one per sequence of train.global_batch_size. Fixed for a run
    (a checkpoint records it): the data-parallel size of any later layout must divide it."""
    open_documents: PositiveInt = 8
    """Documents each logical reader's stream keeps open, drawing each window from one of
    them by a seeded choice (never the previous window's while another has tokens): a
    reader's consecutive windows come from different documents, and a document's windows
    are spread over many steps, as when samples are shuffled; 1 reads one document after
    another. Fixed for a run (a checkpoint records it)."""
    max_skipped_fraction: float = Field(0.01, ge=0, le=1)
    """Stop (saving the last step) when more than this share of a source's rows is
    unusable (corrupt, not UTF-8, empty, in a corrupt row group). Judged on the rows of all
    ranks: once skip_check_min_rows were read, when the share is above this with 3-sigma
    confidence (an early cluster of bad rows does not stop a clean source); once the
    source was read whole, on its exact share."""
    skip_check_min_rows: PositiveInt = 1000
    """Rows of a source read before its unusable share is judged (a fair sample: an early
    cluster of bad rows in a clean corpus does not stop a run)."""
    on_corrupt_row_group: Literal["skip", "stop"] = "skip"
    """A parquet row group (or a compressed file) that cannot be read: skip it, counting
    its rows as unusable, or stop the run (saving the last step)."""

    def readers_for(self, global_batch_size: int) -> int:
        """The run's logical readers: `readers`, or one per sequence of the global batch."""
        return self.readers or global_batch_size

    @field_validator("sources", mode="before")
    @classmethod
    def _uri_strings(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [value]
        if isinstance(value, list):
            return [{"uri": v} if isinstance(v, str) else v for v in value]
        return value

    @field_validator("sources")
    @classmethod
    def _not_empty(cls, value: list[SourceConfig]) -> list[SourceConfig]:
        if not value:
            raise ValueError("at least one source is required")
        return value
