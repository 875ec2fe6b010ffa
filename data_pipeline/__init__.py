"""Streaming tokenization: document sources -> sentencepiece ids -> packed windows."""
