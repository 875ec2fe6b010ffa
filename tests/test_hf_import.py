"""`belief-lm import-hf`: a small random LlamaForCausalLM (saved by transformers) becomes a
run's step 0 that computes its logits and that `train` starts from."""

import json
import shutil
from pydoc_data.topics import topics

import pytest
import torch

from belief_lm.cli import main
from belief_lm.hf_import import import_hf
from tests.checkpoint.damage import Payload
from tests.jobs import MICRO, ROOT

LLAMA = {
    "vocab_size": 512, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 500.0,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "max_position_embeddings": 64,
}  # fmt: skip
RUN = [  # configs/test/micro.yaml (2 layers, 4 heads / 2 KV groups, RMSNorm, SwiGLU, RoPE)
    "model.attention=softmax", "model.hidden_size=32", "model.ffn_hidden_size=48",
    "model.rotary_base=500", "model.norm_epsilon=1e-5", "model.tie_embeddings=false",
    "train.micro_batch_size=4", "train.global_batch_size=4", "train.max_steps=2",
    "train.warmup_steps=1", "data.num_workers=0",
]  # fmt: skip


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A LlamaForCausalLM with random weights (norms included), saved by save_pretrained."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return perturbed_and_saved(LlamaForCausalLM(LlamaConfig(**LLAMA)), tmp_path_factory)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """A Qwen3ForCausalLM (a Llama with q_norm and k_norm per head, before RoPE) of the
    same shape, random weights (its norms' too), saved by save_pretrained."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(1)
    return perturbed_and_saved(Qwen3ForCausalLM(Qwen3Config(**LLAMA, head_dim=8)), tmp_path_factory)


def perturbed_and_saved(model, tmp_path_factory) -> tuple:
    """(folder, model): `model` with noise of std 0.2 on every weight (norms included, away
    from their ones), saved by save_pretrained into a new folder."""
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.2 * torch.randn_like(param))
    folder = tmp_path_factory.mktemp(type(model).__name__)
    model.save_pretrained(folder)
    return folder, model.eval()


@pytest.fixture
def run_config(tiny_config, small_tokenizer, tmp_path):
    """Factory: the run config (micro-sized, the small tokenizer, a local corpus)."""
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": topics[k]}) + "\n" for k in sorted(topics)))
    data = [f"data.sources=[{docs}]", f"data.tokenizer.path={small_tokenizer.path}"]
    return lambda *overrides: tiny_config(*RUN, *data, *overrides)


def test_softmax_computes_the_llamas_logits(llama, run_config, single_process_group):
    from belief_lm.inference.load import load_model

    folder, hf = llama
    path = import_hf(folder, run_config())
    assert (
        path.name == "step_000000" and json.loads((path / "run.json").read_text())["weights_only"]
    )
    ids = torch.randint(0, 400, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = load_model(path, device="cpu").model(ids).transpose(0, 1)
        theirs = hf(ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert theirs.abs().max() > 1  # logits far from zero: the comparison means something


@pytest.mark.parametrize(
    ("option", "fresh_weights"),
    [("model.attention=belief", 0), ("model.attention=belief_star", 2), ("model.qk_norm=true", 4)],
)
@pytest.mark.usefixtures("single_process_group")  # the fresh model's
def test_a_belief_variant_takes_the_llamas_weights(
    llama, run_config, tmp_path, option, fresh_weights
):
    """Every weight as softmax imports it; belief_star's W^s (one per layer) and the
    QK-norms (two per layer), which a Llama lacks, as a fresh model of run.seed
    initialises them."""
    from belief_lm.checkpoint.consolidate import consolidate
    from belief_lm.model.gpt import BeliefLM

    cfg = run_config(option)
    variant = consolidate(import_hf(llama[0], cfg)).state_dict
    plain = consolidate(import_hf(llama[0], run_config(f"run.output_dir={tmp_path}/b"))).state_dict
    fresh = BeliefLM(cfg.model, 512, seed=cfg.run.seed).state_dict()
    for name, tensor in variant.items():
        assert torch.equal(tensor, plain[name] if name in plain else fresh[name]), name
    assert len(variant.keys() - plain.keys()) == fresh_weights


def test_qk_norm_computes_a_qwen3s_logits(qwen3, run_config, tmp_path, single_process_group):
    """A Qwen3 into a run with model.qk_norm: its q_norm and k_norm are the QK-norms, and
    the model computes its logits; a run without QK-norm is refused, naming it."""
    from belief_lm.inference.load import load_model

    folder, hf = qwen3
    path = import_hf(folder, run_config("model.qk_norm=true"))
    ids = torch.randint(0, 400, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = load_model(path, device="cpu").model(ids).transpose(0, 1)
        theirs = hf(ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert theirs.abs().max() > 1
    with pytest.raises(ValueError, match=r"model\.qk_norm is False, a Qwen3 needs True"):
        import_hf(folder, run_config(f"run.output_dir={tmp_path / 'plain'}"))


def cli_import(folder, *overrides) -> int:
    return main(["import-hf", str(folder), "--config", str(ROOT / MICRO), *RUN, *overrides])


@pytest.mark.parametrize(
    ("change", "override", "message"),
    [
        ({"num_key_value_heads": 4}, None, "num_key_value_heads is 4, model.num_query_groups is 2"),
        ({"rope_parameters": {"rope_theta": 1e4, "rope_type": "default"}}, None,
         "rope_theta is 10000.0, model.rotary_base is 500.0"),
        ({"tie_word_embeddings": True}, None, "tie_word_embeddings is True, model.tie_embeddings"),
        ({"vocab_size": 32000}, None, "vocab_size is 32000, the run's vocabulary"),
        ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, None, "is not a Llama"),
        ({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "use_sliding_window": True},
         "model.qk_norm=true",
         "use_sliding_window: belief-lm attends to the whole context"),
        ({}, "model.normalization=LayerNorm", "model.normalization is 'LayerNorm', a Llama"),
        ({}, "model.num_layers=3", "num_hidden_layers is 2, model.num_layers is 3"),
    ],
    ids=["kv-heads", "rope-theta", "tied", "vocab", "not-llama", "sliding", "layernorm", "layers"],
)  # fmt: skip
def test_a_config_that_does_not_fit_exits_2_naming_the_field(
    llama, small_tokenizer, tmp_path, capsys, change, override, message
):
    folder = tmp_path / "llama"
    folder.mkdir()  # config.json alone: nothing else is read before the refusal
    config = json.loads((llama[0] / "config.json").read_text()) | change
    (folder / "config.json").write_text(json.dumps(config))
    run = [f"run.output_dir={tmp_path / 'run'}", f"data.tokenizer.path={small_tokenizer.path}"]
    assert cli_import(folder, *run, *([override] if override else [])) == 2
    err = capsys.readouterr().err
    assert message in err and str(folder / "config.json") in err, err
    assert not (tmp_path / "run").exists()


def test_only_safetensors_are_read(llama, small_tokenizer, tmp_path, capsys):
    """Pickled weights (pytorch_model.bin, here with a payload) are named and refused,
    never loaded; a corrupt safetensors file or index is exit 2 naming it."""
    folder = tmp_path / "llama"
    folder.mkdir()
    shutil.copyfile(llama[0] / "config.json", folder / "config.json")
    marker = tmp_path / "marker"
    torch.save({"payload": Payload(marker)}, folder / "pytorch_model.bin")
    run = [f"run.output_dir={tmp_path / 'run'}", f"data.tokenizer.path={small_tokenizer.path}"]
    assert cli_import(folder, *run) == 2
    assert "pytorch_model.bin is pickled weights" in capsys.readouterr().err
    (folder / "model.safetensors").write_bytes(b"\x10" + bytes(7) + b"{not a header")
    assert cli_import(folder, *run) == 2
    assert "model.safetensors: not a readable safetensors file" in capsys.readouterr().err
    index = {"weight_map": {"lm_head.weight": "../elsewhere.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    assert cli_import(folder, *run) == 2
    assert "names files outside" in capsys.readouterr().err
    assert not marker.exists() and not (tmp_path / "run").exists()


def test_the_tokenizer_is_the_runs_or_the_checkpoints(llama, small_tokenizer, tmp_path, capsys):
    """No data.tokenizer.path and no DIR/tokenizer.model: refused. DIR/tokenizer.model:
    taken, and named in the checkpoint's config, which a run must then name too."""
    from belief_lm.config import load_config
    from belief_lm.preflight import preflight

    folder = tmp_path / "llama"
    shutil.copytree(llama[0], folder)
    assert cli_import(folder, f"run.output_dir={tmp_path / 'a'}") == 2
    assert "data.tokenizer.path is not set and" in capsys.readouterr().err
    shutil.copyfile(small_tokenizer.path, folder / "tokenizer.model")
    assert cli_import(folder, f"run.output_dir={tmp_path / 'b'}") == 0
    step = tmp_path / "b" / "checkpoints" / "step_000000"
    assert capsys.readouterr().out.strip() == str(step)
    assert f"path: {folder / 'tokenizer.model'}" in (step / "config.yaml").read_text()
    resume = [*RUN, f"run.output_dir={tmp_path / 'b'}"]
    with pytest.raises(ValueError, match=r"different data config: data\.tokenizer"):
        preflight(load_config(ROOT / MICRO, resume), 1)
    tokenizer = f"data.tokenizer.path={folder / 'tokenizer.model'}"
    assert preflight(load_config(ROOT / MICRO, [*resume, tokenizer]), 1).resume.path == step
    assert cli_import(folder, f"run.output_dir={tmp_path / 'b'}") == 2  # not over a run
    assert "already holds checkpoints" in capsys.readouterr().err


def test_train_starts_from_the_imported_weights(llama, run_config, single_process_group):
    """`train` with checkpoint.resume=<import> (ZeRO-1, the run's own stage) trains from the
    imported weights with a fresh optimizer: after 2 steps every weight is within a few
    learning rates of the Llama's, while the seeded init is far from them."""
    from belief_lm.checkpoint.consolidate import consolidate
    from belief_lm.model.gpt import BeliefLM
    from belief_lm.train.loop import train

    imported = import_hf(llama[0], run_config())
    cfg = run_config(f"checkpoint.resume={imported}")
    result = train(cfg)
    assert list(result.losses) == [1, 2] and cfg.parallel.zero_stage == 1
    before = consolidate(imported).state_dict
    after = consolidate(imported.with_name("step_000002")).state_dict
    fresh = BeliefLM(cfg.model, 512, seed=cfg.run.seed).state_dict()
    moved = max((after[n] - before[n]).abs().max() for n in before)
    assert 0 < moved < 10 * cfg.train.lr
    assert min((fresh[n] - before[n]).abs().max() for n in before) > 100 * cfg.train.lr
