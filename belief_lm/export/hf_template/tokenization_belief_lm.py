"""belief-lm's sentencepiece tokenizer as a transformers tokenizer (trust_remote_code=True).

Encodes and decodes exactly as belief-lm does: the sentencepiece model's own pieces
(identity normalisation, no dummy prefix, byte fallback, so decode(encode(t)) == t), no
BOS/EOS added, and the text of special tokens ("</s>") encoded as plain text, not as the
special id. Ids 0-3 are unk, bos, eos, pad.
"""

import os
import shutil
from typing import ClassVar

import sentencepiece as spm
from transformers import PreTrainedTokenizer


class BeliefLMTokenizer(PreTrainedTokenizer):
    vocab_files_names: ClassVar[dict] = {"vocab_file": "tokenizer.model"}
    model_input_names: ClassVar[list] = ["input_ids", "attention_mask"]  # no token types

    def __init__(self, vocab_file: str, **kwargs):
        self.vocab_file = vocab_file
        self.sp = spm.SentencePieceProcessor(model_file=vocab_file)
        piece = self.sp.id_to_piece
        kwargs.setdefault("unk_token", piece(self.sp.unk_id()))
        kwargs.setdefault("bos_token", piece(self.sp.bos_id()))
        kwargs.setdefault("eos_token", piece(self.sp.eos_id()))
        kwargs.setdefault("pad_token", piece(self.sp.pad_id()))
        kwargs.setdefault("split_special_tokens", True)  # "</s>" in text is text
        kwargs.setdefault("clean_up_tokenization_spaces", False)
        super().__init__(**kwargs)

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def get_vocab(self) -> dict[str, int]:
        return {self.sp.id_to_piece(i): i for i in range(self.vocab_size)}

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        return self.sp.encode(text, out_type=str)

    def _convert_token_to_id(self, token: str) -> int:
        return self.sp.piece_to_id(token)

    def _convert_id_to_token(self, index: int) -> str:
        return self.sp.id_to_piece(index)

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return self.sp.decode_pieces(tokens)

    def _decode(self, token_ids, skip_special_tokens: bool = False, **kwargs) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.all_special_ids]
        return self.sp.decode(ids)  # sentencepiece's own decoding, byte fallback included

    def build_inputs_with_special_tokens(self, token_ids_0, token_ids_1=None) -> list[int]:
        return token_ids_0 + (token_ids_1 or [])  # belief-lm adds no BOS/EOS to text

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None):
        name = (filename_prefix + "-" if filename_prefix else "") + "tokenizer.model"
        path = os.path.join(save_directory, name)
        if os.path.abspath(path) != os.path.abspath(self.vocab_file):
            shutil.copyfile(self.vocab_file, path)
        return (path,)
