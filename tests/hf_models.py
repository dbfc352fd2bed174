"""Small Hugging Face architectures with random weights, built from configs (no downloads).

Torch-only (no TVM import): the GPU benchmark rebuilds the same models on a machine that has
torch and transformers but no TVM compiler. Every parameter is re-drawn from a seeded generator,
so layer norms and biases are not the constant 1s and 0s of a fresh model (which an ONNX
exporter would deduplicate, and which would hide layout mistakes).
"""

from __future__ import annotations

from typing import Any

#: name -> transformers model class and config kwargs (2 layers, 4 heads of 64)
MODELS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "gpt2": (
        "GPT2Model",
        "GPT2Config",
        {"n_layer": 2, "n_embd": 256, "n_head": 4, "vocab_size": 1000, "n_positions": 512},
    ),
    "bert": (
        "BertModel",
        "BertConfig",
        {
            "num_hidden_layers": 2,
            "hidden_size": 256,
            "num_attention_heads": 4,
            "intermediate_size": 1024,
            "vocab_size": 1000,
            "max_position_embeddings": 512,
        },
    ),
    # GPT-NeoX packing (per-head interleaved q|k|v); rotary off: see docs/models.md
    "neox": (
        "GPTNeoXModel",
        "GPTNeoXConfig",
        {
            "num_hidden_layers": 2,
            "hidden_size": 256,
            "num_attention_heads": 4,
            "intermediate_size": 1024,
            "vocab_size": 1000,
            "max_position_embeddings": 512,
            "rope_parameters": {
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.0,
                "rope_type": "default",
            },
        },
    ),
    # the real GPT-NeoX default: a quarter of each head rotated (q, k are then computed)
    "neox_rotary": (
        "GPTNeoXModel",
        "GPTNeoXConfig",
        {
            "num_hidden_layers": 2,
            "hidden_size": 256,
            "num_attention_heads": 4,
            "intermediate_size": 1024,
            "vocab_size": 1000,
            "max_position_embeddings": 512,
        },
    ),
    # the other families (issue #35), each at 2 layers, hidden 256, 4 query heads of 64
    # Mistral: Llama's layer with a sliding window; 4096 is longer than any test, so the mask
    # folds to a plain causal one
    "mistral": (
        "MistralModel",
        "MistralConfig",
        {
            "num_hidden_layers": 2,
            "hidden_size": 256,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 512,
            "vocab_size": 1000,
            "max_position_embeddings": 1024,
            "sliding_window": 4096,
        },
    ),
    # ... and a window shorter than the tests' sequences (WINDOWED_SEQ): a banded mask
    "mistral_window": (
        "MistralModel",
        "MistralConfig",
        {
            "num_hidden_layers": 2,
            "hidden_size": 256,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 512,
            "vocab_size": 1000,
            "max_position_embeddings": 1024,
            "sliding_window": 32,
        },
    ),
    # Qwen2: Llama's layer with biases on q, k, v
    "qwen2": (
        "Qwen2Model",
        "Qwen2Config",
        {
            "num_hidden_layers": 2,
            "hidden_size": 256,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 512,
            "vocab_size": 1000,
            "max_position_embeddings": 1024,
        },
    ),
    # Phi-3: one qkv_proj and one gate_up_proj, GQA, rotary
    "phi3": (
        "Phi3Model",
        "Phi3Config",
        {
            "num_hidden_layers": 2,
            "hidden_size": 256,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 512,
            "vocab_size": 1000,
            "max_position_embeddings": 1024,
            "original_max_position_embeddings": 1024,
            "pad_token_id": 0,
        },
    ),
    # Bloom: fused per-head query_key_value, ALiBi position biases (no position embeddings)
    "bloom": (
        "BloomModel",
        "BloomConfig",
        {"n_layer": 2, "hidden_size": 256, "n_head": 4, "vocab_size": 1000},
    ),
    # GPTBigCode (StarCoder): multi-query, one c_attn giving q (4 heads), k and v (1 head)
    "gpt_bigcode": (
        "GPTBigCodeModel",
        "GPTBigCodeConfig",
        {
            "n_layer": 2,
            "n_embd": 256,
            "n_head": 4,
            "n_inner": 1024,
            "vocab_size": 1000,
            "n_positions": 1024,
            "multi_query": True,
        },
    ),
    # ViT: an encoder on 16x16 patches of a 256x256 image: 256 patches and the class token
    "vit": (
        "ViTModel",
        "ViTConfig",
        {
            "num_hidden_layers": 2,
            "hidden_size": 256,
            "num_attention_heads": 4,
            "intermediate_size": 1024,
            "image_size": 256,
            "patch_size": 16,
        },
    ),
    # real sizes, for the whole-model benchmark (benchmarks/models_gpu.py); vocabularies cut
    # to 8192 rows (the embedding is a lookup, not a GEMM, in these bodies)
    "gpt2_small": ("GPT2Model", "GPT2Config", {"vocab_size": 8192, "n_positions": 1024}),
    "bert_base": (
        "BertModel",
        "BertConfig",
        {"vocab_size": 8192, "max_position_embeddings": 512},
    ),
    # the Pythia-410m configuration (GPT-NeoX, rotary on a quarter of each head), vocabulary cut
    "pythia_410m": (
        "GPTNeoXModel",
        "GPTNeoXConfig",
        {
            "num_hidden_layers": 24,
            "hidden_size": 1024,
            "num_attention_heads": 16,
            "intermediate_size": 4096,
            "vocab_size": 8192,
            "max_position_embeddings": 2048,
            "rope_parameters": {
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.25,
                "rope_type": "default",
            },
        },
    ),
    # a Llama-style decoder: RoPE, GQA 32/8, SwiGLU, RMSNorm
    "llama": (
        "LlamaModel",
        "LlamaConfig",
        {
            "num_hidden_layers": 16,
            "hidden_size": 2048,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "intermediate_size": 5632,
            "vocab_size": 8192,
            "max_position_embeddings": 4096,
        },
    ),
    # the same architecture in 2 narrow layers (GQA 8/2), for the sm_80 GEMM numerics check
    "llama_small": (
        "LlamaModel",
        "LlamaConfig",
        {
            "num_hidden_layers": 2,
            "hidden_size": 512,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "intermediate_size": 1408,
            "vocab_size": 8192,
            "max_position_embeddings": 1024,
        },
    ),
}


#: weight scale of the real-size models (their configs' initializer_range); the small ones
#: keep 0.05, which their tests' tolerances were set with
INIT_STD: dict[str, float] = {
    "gpt2_small": 0.02,
    "bert_base": 0.02,
    "llama": 0.02,
    "llama_small": 0.02,
    "pythia_410m": 0.02,
}


def build(name: str, seed: int = 0, **overrides: Any) -> Any:
    """The model ``name`` in eval mode, returning ``last_hidden_state`` only (a tensor); called
    with the token ids, and optionally the ``attention_mask`` (``example_mask``)."""
    import torch
    import transformers

    model_cls, config_cls, kwargs = MODELS[name]
    config = getattr(transformers, config_cls)(**{**kwargs, **overrides}, use_cache=False)
    if model_cls in ("BertModel", "ViTModel"):
        inner = getattr(transformers, model_cls)(config, add_pooling_layer=False)
    else:
        inner = getattr(transformers, model_cls)(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in inner.named_parameters():
            base = 1.0 if pname.endswith("weight") and p.ndim == 1 else 0.0
            p.copy_(base + INIT_STD.get(name, 0.05) * torch.randn(p.shape, generator=gen))

    class Wrapper(torch.nn.Module):
        def __init__(self, m: Any) -> None:
            super().__init__()
            self.m = m

        def forward(self, ids: Any, attention_mask: Any = None) -> Any:
            if attention_mask is None:
                return self.m(ids).last_hidden_state
            return self.m(ids, attention_mask=attention_mask).last_hidden_state

    return Wrapper(inner).eval()


#: models whose input is an image, not token ids (``example_ids`` gives pixels for them)
PIXEL_MODELS = frozenset({"vit"})


def example_ids(name: str, batch: int, seq: int, seed: int = 1) -> Any:
    """The model's input: token ids ``[batch, seq]``, or for an image model (PIXEL_MODELS)
    float32 pixels ``[batch, 3, side, side]`` whose ``seq`` 16x16 patches fill its configured
    image (``seq`` must be that image's patch count; the class token makes ``seq + 1`` tokens)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    kwargs = MODELS[name][2]
    if name in PIXEL_MODELS:
        side, patch = kwargs["image_size"], kwargs["patch_size"]
        if seq != (side // patch) ** 2:
            raise ValueError(f"{name} takes {(side // patch) ** 2} patches, not {seq}")
        return torch.randn((batch, 3, side, side), generator=gen)
    return torch.randint(0, kwargs["vocab_size"], (batch, seq), generator=gen)


def example_mask(batch: int, seq: int, dtype: str = "int64") -> Any:
    """A key-padding ``attention_mask`` ``[batch, seq]`` (1 or True: a token, 0 or False:
    padding): entry i of the batch padded on the right by ``i * seq // 4`` tokens (the first
    entry not at all), so every row keeps a token and each query sees one."""
    import torch

    mask = torch.ones((batch, seq), dtype=torch.bool)
    for i in range(batch):
        pad = (i * seq // 4) % seq
        if pad:
            mask[i, seq - pad :] = False
    return mask.to(getattr(torch, dtype))
