"""Without lm-eval (the optional `eval` extra) the adapter says which extra to install."""

import importlib
import sys

import pytest


class NoLmEval:
    """A meta-path finder for which lm_eval does not exist, as where it is not installed."""

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "lm_eval":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


def test_missing_lm_eval_names_the_extra(monkeypatch):
    for name in [m for m in sys.modules if m.partition(".")[0] == "lm_eval"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.delitem(sys.modules, "belief_lm.inference.lm_eval_adapter", raising=False)
    monkeypatch.setattr(sys, "meta_path", [NoLmEval(), *sys.meta_path])
    with pytest.raises(ModuleNotFoundError, match=r"'eval'\s+extra: pip install -e '\.\[eval\]'"):
        importlib.import_module("belief_lm.inference.lm_eval_adapter")
