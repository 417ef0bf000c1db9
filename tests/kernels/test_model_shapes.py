"""moe_serve.kernels.tuning.model_shapes: per-rank MoE shapes from HF config.json fields of each family."""
from __future__ import annotations

import json

import pytest

from moe_serve.kernels.tuning.model_shapes import ModelConfigError, moe_shapes, read_config

CONFIGS = {  # architecture: (config fields, tp, expected (E, N, K, topk, dtype))
    "mixtral": ({"architectures": ["MixtralForCausalLM"], "num_local_experts": 8,
                 "intermediate_size": 14336, "hidden_size": 4096, "num_experts_per_tok": 2,
                 "torch_dtype": "bfloat16"}, 8, (8, 1792, 4096, 2, "bf16")),
    "qwen3-moe": ({"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 128,
                   "moe_intermediate_size": 768, "intermediate_size": 6144, "hidden_size": 2048,
                   "num_experts_per_tok": 8}, 1, (128, 768, 2048, 8, "bf16")),
    "deepseek-v3-fp8": ({"architectures": ["DeepseekV3ForCausalLM"], "n_routed_experts": 256,
                         "moe_intermediate_size": 2048, "intermediate_size": 18432,
                         "hidden_size": 7168, "num_experts_per_tok": 8,
                         "quantization_config": {"quant_method": "fp8"}}, 8,
                        (256, 256, 7168, 8, "fp8")),
    "deepseek-v3-block-fp8": ({"architectures": ["DeepseekV3ForCausalLM"], "n_routed_experts": 256,
                               "moe_intermediate_size": 2048, "hidden_size": 7168,
                               "num_experts_per_tok": 8, "quantization_config": {
                                   "quant_method": "fp8", "activation_scheme": "dynamic",
                                   "weight_block_size": [128, 128]}}, 8,
                              (256, 256, 7168, 8, "fp8_w8a8,block_shape=[128,128]")),
    "qwen3-fp8-dynamic": ({"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 128,
                           "moe_intermediate_size": 768, "hidden_size": 2048,
                           "num_experts_per_tok": 8, "quantization_config": {
                               "quant_method": "compressed-tensors", "config_groups": {"group_0": {
                                   "weights": {"type": "float", "num_bits": 8,
                                               "strategy": "channel"},
                                   "input_activations": {"type": "float", "num_bits": 8,
                                                         "strategy": "token", "dynamic": True}}}}},
                          1, (128, 768, 2048, 8, "fp8_w8a8,per_token")),
    "llama4-nested": ({"architectures": ["Llama4ForConditionalGeneration"],
                       "text_config": {"num_local_experts": 16, "intermediate_size": 8192,
                                       "hidden_size": 5120, "num_experts_per_tok": 1,
                                       "torch_dtype": "bfloat16"}}, 4, (16, 2048, 5120, 1, "bf16")),
    "dbrx-ffn-config": ({"architectures": ["DbrxForCausalLM"], "d_model": 6144,
                         "ffn_config": {"moe_num_experts": 16, "ffn_hidden_size": 10752,
                                        "moe_top_k": 4}, "torch_dtype": "float16"}, 8,
                        (16, 1344, 6144, 4, "fp16")),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_families(name):
    cfg, tp, want = CONFIGS[name]
    (shape,) = moe_shapes(cfg, tp)
    assert (shape.E, shape.N, shape.K, shape.topk, shape.dtype) == want


def test_quantization_flag_names_the_method():
    """--quantization fp8 on an unquantized checkpoint: vLLM's online per-tensor FP8."""
    (shape,) = moe_shapes(CONFIGS["mixtral"][0], 8, "fp8")
    assert shape.dtype == "fp8"
    (shape,) = moe_shapes(CONFIGS["deepseek-v3-block-fp8"][0], 8, "fp8")
    assert shape.dtype == "fp8_w8a8,block_shape=[128,128]"


def test_dense_model_has_no_moe_shape():
    assert moe_shapes({"architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
                       "intermediate_size": 11008}) == []


def test_errors_name_what_is_missing_or_unsupported(tmp_path):
    with pytest.raises(ModelConfigError, match="hidden"):
        moe_shapes({"architectures": ["X"], "num_experts": 8, "num_experts_per_tok": 2,
                    "moe_intermediate_size": 64})
    with pytest.raises(ModelConfigError, match="divisible"):
        moe_shapes(CONFIGS["mixtral"][0], 3)
    with pytest.raises(ModelConfigError, match="SiLU"):
        moe_shapes({"architectures": ["GptOssForCausalLM"], "num_local_experts": 32})
    with pytest.raises(ModelConfigError, match="quantization"):
        moe_shapes({**CONFIGS["mixtral"][0], "quantization_config": {"quant_method": "awq"}})
    with pytest.raises(ModelConfigError, match="no config.json"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(CONFIGS["mixtral"][0]))
    assert read_config(tmp_path)["num_local_experts"] == 8


def test_per_layer_lists_give_one_shape_per_distinct_layer_with_its_layer_count():
    # Hunyuan-MoE style: top-k and intermediate size per layer; a dense layer says 0 experts.
    cfg = {"architectures": ["HunYuanMoEV1ForCausalLM"], "hidden_size": 4096, "num_hidden_layers": 5,
           "num_experts": [0, 64, 64, 64, 32], "moe_topk": [0, 8, 8, 8, 4],
           "moe_intermediate_size": [0, 3072, 3072, 1536, 3072], "torch_dtype": "bfloat16"}
    shapes = moe_shapes(cfg, tp=2, name="hy")
    assert [(s.E, s.N, s.K, s.topk, s.layers) for s in shapes] == [
        (32, 1536, 4096, 4, 1), (64, 768, 4096, 8, 1), (64, 1536, 4096, 8, 2)]
    assert len({s.name for s in shapes}) == 3 and all(s.name.startswith("hy/TP2/") for s in shapes)
    # one list among int fields: the ints hold for every layer
    (one,) = moe_shapes({**CONFIGS["mixtral"][0], "num_hidden_layers": 3, "num_experts_per_tok": [2, 2, 2]}, 8)
    assert (one.E, one.N, one.topk, one.layers, one.name) == (8, 1792, 2, 3, "model/TP8")


def test_lists_not_one_per_layer_are_expert_groups_run_by_every_layer():
    # ERNIE-4.5-VL style: one entry per expert group (text, vision), every layer runs both.
    cfg = {"architectures": ["Ernie4_5_VLMoeForConditionalGeneration"], "hidden_size": 2560, "num_hidden_layers": 28,
           "moe_num_experts": [64, 64], "moe_intermediate_size": [1536, 512], "moe_k": 6}
    assert [(s.E, s.N, s.topk, s.layers) for s in moe_shapes(cfg)] == [(64, 512, 6, 28), (64, 1536, 6, 28)]


def test_per_layer_lists_that_disagree_or_do_not_divide_are_errors():
    cfg = {"architectures": ["X"], "hidden_size": 1024, "num_hidden_layers": 3, "num_experts": [8, 8, 8],
           "moe_topk": [2, 2], "moe_intermediate_size": 512}
    with pytest.raises(ModelConfigError, match=r"different lengths: num_experts \(3\), moe_topk \(2\)"):
        moe_shapes(cfg)
    with pytest.raises(ModelConfigError, match="intermediate size 100 is not divisible"):
        moe_shapes({**cfg, "moe_topk": 2, "moe_intermediate_size": [512, 512, 100]}, tp=8)
    assert moe_shapes({**cfg, "num_experts": [0, 0, 0], "moe_topk": 2}) == []  # every layer dense
