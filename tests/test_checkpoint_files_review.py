"""What a converted checkpoint keeps of its HF directory, and the tied-head check on
bitwise-equal matrices (pagedjax.weights, pagedjax.orbax_checkpoint,
scripts/convert_checkpoint.py)."""

import numpy as np
from test_weights import VARIANTS, hf_tensors, load_cli, make_config, write_hf

from pagedjax import model, weights
from pagedjax.resources import byte_tokenizer
from pagedjax.tokenizer import Tokenizer

DEFAULT = "D{% for m in messages %}{{ m['content'] }}{% endfor %}"
TOOL_USE = "T{% for m in messages %}{{ m['content'] }}{% endfor %}"


def test_convert_keeps_the_named_chat_templates(tmp_path, capsys):
    """transformers saves a list-form template's entries other than "default" as
    additional_chat_templates/NAME.jinja, where `Tokenizer.from_dir` finds the tool_use
    one; convert_checkpoint.py copied chat_template.jinja alone, so the converted
    checkpoint rendered tool calls with the default template."""
    c = make_config(**VARIANTS["llama_tied"])
    hf = write_hf(tmp_path / "hf", c, hf_tensors(c))
    byte_tokenizer().tokenizer.save(str(hf / "tokenizer.json"))
    (hf / "chat_template.jinja").write_text(DEFAULT)
    (hf / "additional_chat_templates").mkdir()
    (hf / "additional_chat_templates" / "tool_use.jinja").write_text(TOOL_USE)
    assert Tokenizer.from_dir(hf).tool_use_template == TOOL_USE
    out = tmp_path / "out"
    assert load_cli().main([str(hf), str(out)]) == 0
    tok = Tokenizer.from_dir(out)
    assert (tok.chat_template, tok.tool_use_template) == (DEFAULT, TOOL_USE)
    assert "additional_chat_templates" in capsys.readouterr().out
    # --overwrite replaces the directory with the new checkpoint's.
    (hf / "additional_chat_templates" / "tool_use.jinja").write_text(TOOL_USE + "!")
    assert load_cli().main([str(hf), str(out), "--overwrite"]) == 0
    assert Tokenizer.from_dir(out).tool_use_template == TOOL_USE + "!"


def test_save_params_copies_a_directory_of_extra_files(tmp_path):
    from pagedjax.config import PRESETS

    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "a.jinja").write_text("a")
    params = model.init_params(PRESETS["tiny"], seed=0)
    weights.save_params(params, tmp_path / "ckpt", extra_files=[src / "sub"])
    assert (tmp_path / "ckpt" / "sub" / "a.jinja").read_text() == "a"


def test_a_tied_head_equal_to_the_embedding_with_nans_loads(tmp_path):
    """The tied head is compared with the embedding value by value: NaN != NaN refused
    a head that is a byte-for-byte copy of an embedding holding a NaN (an unused row)."""
    c = make_config(tie_word_embeddings=True)
    t = hf_tensors(c)
    t["model.embed_tokens.weight"][5] = np.nan
    t["lm_head.weight"] = t["model.embed_tokens.weight"].copy()
    write_hf(tmp_path / "ckpt", c, t)
    for dtype in ("float32", "bfloat16"):
        cfg, _ = weights.load_hf_checkpoint(tmp_path / "ckpt", dtype=dtype)
        assert cfg.tie_embeddings


def test_a_converted_checkpoint_adds_the_bos_its_config_json_named(tmp_path):
    """A tokenizer_config without bos_token takes BOS from config.json's bos_token_id,
    which convert_checkpoint.py does not copy (the model's config is in the orbax
    meta file): the converted checkpoint encoded "hi" without the BOS the HF directory
    (and HF's tokenizer, whose post-processor adds it) puts first."""
    import tokenizers

    c = make_config(**VARIANTS["llama_tied"], bos_token_id=1)
    hf = write_hf(tmp_path / "hf", c, hf_tensors(c))
    tok = byte_tokenizer().tokenizer
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="\u0101 $A", special_tokens=[("\u0101", 1)]
    )  # (byte 1's character in the byte tokenizer: ByteLevel's 256 + 1)
    tok.save(str(hf / "tokenizer.json"))
    assert Tokenizer.from_dir(hf).encode("hi") == [1, *b"hi"]
    out = tmp_path / "out"
    assert load_cli().main([str(hf), str(out)]) == 0
    assert not (out / "config.json").exists()
    assert Tokenizer.from_dir(out).encode("hi") == [1, *b"hi"]
