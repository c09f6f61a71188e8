"""pagedjax.hf_config: cases a review of config.json reading against transformers 5.24's
config classes (checked with them) found read or written differently: a null Qwen3
`head_dim`, a `model_type` HF would build another model from, and unset token ids that
HF's Llama and Mistral read back as 1 and 2."""

import dataclasses

import pytest
from hf_config_helpers import LLAMA31_8B

from pagedjax.config import PRESETS, ModelConfig

QWEN3 = {  # Qwen3-0.6B's shape: H * D = 2048 != E = 1024
    **LLAMA31_8B,
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "rope_scaling": None,
    "hidden_size": 1024, "num_attention_heads": 16, "head_dim": 128,
}  # fmt: skip


def test_null_head_dim_is_hidden_size_over_heads_in_qwen3_too():
    """Only an absent head_dim takes Qwen3Config's 128; a null one was read as 128 too,
    against from_hf's own rule (HF 5 refuses it, vLLM derives hidden_size // heads)."""
    assert ModelConfig.from_hf(QWEN3).head_dim == 128
    absent = {k: v for k, v in QWEN3.items() if k != "head_dim"}
    assert ModelConfig.from_hf(absent).head_dim == 128
    assert ModelConfig.from_hf(dict(QWEN3, head_dim=None)).head_dim == 1024 // 16


@pytest.mark.parametrize("model_type", ["granite", "qwen2_moe", "llava"])
def test_model_type_hf_would_build_another_model_from_is_refused(model_type):
    """HF's AutoModelForCausalLM picks the class from model_type's config, whatever
    architectures says: a Granite labelled LlamaForCausalLM has Llama's tensor names but
    scales embeddings, residuals and logits. It loaded as a Llama."""
    with pytest.raises(ValueError, match=f"unsupported model_type '{model_type}'"):
        ModelConfig.from_hf(dict(LLAMA31_8B, model_type=model_type))


def test_architectures_and_text_config_are_named():
    """A bare string was read letter by letter ("unsupported architecture ['L', 'l', ..."),
    and a wrapper's keys nested under text_config were only "missing"."""
    with pytest.raises(ValueError, match="architectures must be a list, got .*'LlamaForCausalLM'"):
        ModelConfig.from_hf(dict(LLAMA31_8B, architectures="LlamaForCausalLM"))
    assert ModelConfig.from_hf(dict(LLAMA31_8B, architectures=("LlamaForCausalLM",)))
    wrapper = {"text_config": dict(LLAMA31_8B), "model_type": None}
    with pytest.raises(ValueError, match=r"missing required keys: \[.*\] \(.*text_config"):
        ModelConfig.from_hf(wrapper)


@pytest.mark.parametrize("name", ["tiny", "mistral-7b-v0.1", "qwen3-0.6b"])
def test_to_hf_writes_unset_token_ids_as_null(name):
    """HF's LlamaConfig and MistralConfig read an absent bos/eos as 1/2, so a checkpoint
    saved without eos stopped transformers' generate at token 2; null is none to both."""
    cfg = dataclasses.replace(PRESETS[name], bos_token_id=None, eos_token_ids=())
    hf = cfg.to_hf()
    assert hf["bos_token_id"] is None and hf["eos_token_id"] is None
    assert ModelConfig.from_hf(hf) == cfg
    assert PRESETS[name].to_hf()["eos_token_id"] == PRESETS[name].eos_token_ids[0]


def test_architectures_and_model_type_of_two_families_are_refused():
    """transformers builds the model_type's model whatever architectures says: a
    MistralForCausalLM labelled "llama" is a Llama there (no window), a Mistral here."""
    mistral = dict(LLAMA31_8B, architectures=["MistralForCausalLM"], sliding_window=4096)
    with pytest.raises(ValueError, match=r"architectures \['MistralForCausalLM'\] are not "):
        ModelConfig.from_hf(mistral)
    assert ModelConfig.from_hf(dict(mistral, model_type="mistral")).sliding_window == 4096
    assert ModelConfig.from_hf({**mistral, "model_type": None}).sliding_window == 4096
