"""The benchmark models (bench/models) and the dummy-weight model dirs made of them
(bench/model_dirs.py): configs, tokenizer, the shapes they give each rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_serve.bench.experts.fp8 import FORMAT_SHAPES
from moe_serve.bench.experts.shapes import TUNED
from moe_serve.bench.model_dirs import decodable_ids, dummy_model_dir
from moe_serve.kernels.moe import quant_format
from moe_serve.kernels.tuning.model_shapes import moe_shapes, read_config
from moe_serve.loadtest.server_proc import REPO


REAL_VOCAB = {"mixtral-": 32000, "qwen3-": 151936, "deepseek-v3": 129280}   # each family's published config.json


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "bench" / "models").iterdir()))
def test_model_configs_carry_their_models_real_vocabulary(name: str) -> None:
    cfg = json.loads((REPO / "bench" / "models" / name / "config.json").read_text())
    (family,) = [f for f in REAL_VOCAB if name.startswith(f)]
    assert cfg["vocab_size"] == REAL_VOCAB[family]


def test_the_word_tokenizer_decodes_every_id_of_the_real_vocabulary(tmp_path: Path) -> None:
    """Qwen3's 151,936 ids: transformers loads the dir's tokenizer, every id decodes to a word that
    encodes back to that id, and vLLM's incremental detokenizer (tokenizers' DecodeStream) streams it."""
    from tokenizers.decoders import DecodeStream
    from transformers import AutoTokenizer

    d = dummy_model_dir("qwen3-30b-a3b", tmp_path)
    assert not (d / "tokenizer.model").exists() and decodable_ids(d, 151936) == 151936
    tok = AutoTokenizer.from_pretrained(d)
    assert len(tok) == 151936 and (tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (1, 2, 0)
    rust = tok.backend_tokenizer
    ids = list(range(151936))
    words = rust.decode_batch([[i] for i in ids], skip_special_tokens=False)
    assert [e.ids for e in rust.encode_batch(words, add_special_tokens=False)] == [[i] for i in ids]
    assert tok.decode([5, 151935, 70000]) == "w5 w151935 w70000"
    stream = DecodeStream(skip_special_tokens=True)
    assert "".join(stream.step(rust, i) or "" for i in (7, 1, 151935)) == "w7 w151935"
    assert "w3: w4" in tok.apply_chat_template([{"role": "w3", "content": "w4"}], tokenize=False)
    before = (d / "tokenizer.json").stat().st_mtime_ns
    assert dummy_model_dir("qwen3-30b-a3b", tmp_path) == d and (d / "tokenizer.json").stat().st_mtime_ns == before


def test_tp2_stand_in_gives_each_rank_the_tp8_rank_shapes() -> None:
    """At --tensor-parallel-size 2 each rank of mixtral-8x7b-tp8-rank-at-tp2 must run the MoE and
    attention shapes of one TP=8 rank (the shapes the tuned tables and routing are keyed by)."""
    def cfg(name: str) -> dict:
        return json.loads((REPO / "bench" / "models" / name / "config.json").read_text())

    rank, at_tp2 = cfg("mixtral-8x7b-tp8-rank"), cfg("mixtral-8x7b-tp8-rank-at-tp2")
    split = ("intermediate_size", "num_attention_heads", "num_key_value_heads")
    assert {k: at_tp2[k] // 2 for k in split} == {k: rank[k] for k in split}
    assert {k: v for k, v in at_tp2.items() if k not in split} == {k: v for k, v in rank.items() if k not in split}


def test_dummy_model_dir_writes_the_config_and_a_working_tokenizer(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    d = dummy_model_dir("mixtral-8x7b", tmp_path, layers=2, quantization="fp8-static")
    cfg = json.loads((d / "config.json").read_text())
    assert d.name == "mixtral-8x7b-2l-fp8-static" and cfg["num_hidden_layers"] == 2
    assert cfg["quantization_config"] == {"quant_method": "fp8", "activation_scheme": "static"}
    tok = AutoTokenizer.from_pretrained(d)
    assert len(tok) == 32000 and tok.encode("hello world")
    with pytest.raises(SystemExit, match="no model config"):
        dummy_model_dir("no-such-model", tmp_path)


@pytest.mark.parametrize(("rank_model", "whole", "shard"), [("mixtral-8x7b-tp8-rank", "mixtral-8x7b", "Mixtral-8x7B/TP8"),
                                                            ("qwen3-30b-a3b-tp8-rank", "qwen3-30b-a3b", "Qwen3-30B-A3B/TP8")])
def test_tp8_rank_models_run_one_tp8_rank_moe_shape(rank_model: str, whole: str, shard: str) -> None:
    """A '-tp8-rank' model at TP=1 runs the MoE shape one rank of the whole model runs at TP=8:
    the tuned shard of bench/experts/shapes.py, so a run of it exercises that shard's tables."""
    def key(name: str, tp: int) -> tuple:
        (shape,) = moe_shapes(read_config(REPO / "bench" / "models" / name), tp=tp)
        return shape.key

    assert key(rank_model, 1) == key(whole, 8) == TUNED[shard]


@pytest.mark.parametrize("name,key", [("qwen3-30b-a3b-fp8-block", "fp8_w8a8,block_shape=[128,128]"),
                                      ("qwen3-30b-a3b-fp8-dynamic", "fp8_w8a8,per_token")])
def test_fp8_stand_ins_are_the_bf16_model_with_a_checkpoints_format(name: str, key: str) -> None:
    """The FP8 bench models differ from qwen3-30b-a3b only by quantization_config, whose format our
    tables key on, and keep every MoE gate unquantized as the published checkpoints do."""
    base = json.loads((REPO / "bench" / "models" / "qwen3-30b-a3b" / "config.json").read_text())
    cfg = json.loads((REPO / "bench" / "models" / name / "config.json").read_text())
    qc = cfg.pop("quantization_config")
    assert cfg == base and quant_format.of_checkpoint(qc) == key
    ignored = qc.get("modules_to_not_convert") or qc.get("ignore")
    gates = [f"model.layers.{i}.mlp.gate" for i in range(base["num_hidden_layers"])]
    assert set(gates) <= set(ignored) or "re:.*mlp.gate$" in ignored


@pytest.mark.parametrize(("name", "shard"), [("deepseek-v3-fp8-block", "DeepSeek-V3/TP8"),
                                             ("qwen3-235b-a22b-fp8-block", "Qwen3-235B-A22B/TP8")])
def test_block_fp8_tp8_models_give_the_format_bench_shards(name: str, shard: str) -> None:
    """`moe-serve tune --model bench/models/<name> -tp 8` tunes the block-FP8 shard that
    `moe-serve bench kernels --fp8-formats` times (bench/experts/fp8.FORMAT_SHAPES), in block FP8."""
    (shape,) = moe_shapes(read_config(REPO / "bench" / "models" / name), tp=8)
    assert shape.key == FORMAT_SHAPES[shard]
    assert shape.dtype == quant_format.block_key(128, 128)
