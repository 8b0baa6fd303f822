"""Flax NNX causal LMs (Llama family: llama/qwen2/mistral, and qwen3/phi3/gemma3_text; GPT-2) with HF safetensors
I/O and a KV cache.

    model = from_pretrained("path/to/hf_dir")            # or tiny_model("qwen2", vocab_size=256)
    logits = model(input_ids, attention_mask=mask)        # f32[B, T, V]
    cache = model.init_cache(B, S)
    logits, cache = model.decode(ids, positions, cache, cache_index, kv_mask)
    graphdef, params = nnx.split(model); nnx.merge(graphdef, params)(ids)
"""
from .attention import KVCache, SampleCache, attention, default_positions, make_mask
from .attention import resolve_impl as resolve_attention
from .checkpoint import check_tokenizer_fits, from_pretrained, hf_state_dict, read_config, save_pretrained
from .config import SUPPORTED_MODEL_TYPES, CheckpointError, ModelConfig
from .decoder import DecoderForCausalLM
from .factory import abstract_model, build_model, tiny_config, tiny_model
from .gpt2 import GPT2LMHeadModel
from .layers import CausalLM
from .slot_cache import SlotCache
from .llama import LlamaForCausalLM

__all__ = [
    "KVCache", "SampleCache", "SlotCache", "attention", "default_positions", "make_mask", "resolve_attention",
    "check_tokenizer_fits", "from_pretrained", "hf_state_dict", "read_config", "save_pretrained",
    "SUPPORTED_MODEL_TYPES", "CheckpointError", "ModelConfig",
    "abstract_model", "build_model", "tiny_config", "tiny_model",
    "DecoderForCausalLM", "GPT2LMHeadModel", "LlamaForCausalLM", "CausalLM",
]
