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
    """The model ``name`` in eval mode, returning ``last_hidden_state`` only (a tensor)."""
    import torch
    import transformers

    model_cls, config_cls, kwargs = MODELS[name]
    config = getattr(transformers, config_cls)(**{**kwargs, **overrides}, use_cache=False)
    if model_cls == "BertModel":
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

        def forward(self, ids: Any) -> Any:
            return self.m(ids).last_hidden_state

    return Wrapper(inner).eval()


def example_ids(name: str, batch: int, seq: int, seed: int = 1) -> Any:
    import torch

    vocab = MODELS[name][2]["vocab_size"]
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))
