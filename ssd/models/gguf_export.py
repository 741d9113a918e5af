"""Write a transformers Qwen2ForCausalLM to a GGUF file llama.cpp loads (issue 31).

Architecture `qwen2`; weights in F32 (default) or F16 (1-D tensors, the norms
and biases, stay F32 as llama.cpp's converter keeps them), or q4_k_m's mix of
Q4_K and Q6_K blocks for matrices whose rows come in blocks of 256 (the GGUF
kernels' tests; plain rounding, see ssd.models.kernels.kquants). Every
hyperparameter llama.cpp's qwen2 loader reads comes from the HF config:
context length, embedding and feed-forward sizes, block count, head counts,
RMS eps, rope theta.

The tokenizer is a minimal one llama.cpp accepts: tokenizer.ggml.model
"gpt2" (byte-level BPE) with V tokens and a single dummy merge (llama.cpp
needs a merges array, gguf cannot write an empty one). The engines feed token
ids and never ask llama.cpp to tokenize, so the strings only need to be
distinct: token i is the GPT-2 byte-to-unicode character of byte i (a
single printable character) for i < 256, "<|t{i}|>" past that.

Tensor names come from gguf's own map for qwen2 (gguf.get_tensor_name_map),
the one llama.cpp's convert_hf_to_gguf.py uses; a tensor the map does not
know is an error, never silently dropped.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

ARCH = "qwen2"
FTYPES = ("f32", "f16", "q4_k_m")
# q4_k_m as llama.cpp mixes it: Q6_K for these, Q4_K for the other matrices (inputs in blocks of 256).
Q6_K_TENSORS = ("attn_v.weight", "ffn_down.weight", "output.weight")


def byte_tokens(vocab_size: int) -> list[str]:
    """Distinct token strings for a vocabulary of `vocab_size` ids (see the module doc)."""
    chars = _bytes_to_unicode()
    return [chars[i] if i < 256 else f"<|t{i}|>" for i in range(vocab_size)]


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte-to-unicode map, in byte order (every byte a printable character)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


def _rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise ValueError("the config names no rope theta")
    rope_type = params.get("rope_type", "default")
    if rope_type not in ("default", None):
        raise NotImplementedError(f"rope scaling {rope_type!r} is not exported")
    return float(theta)


def export_gguf(model: torch.nn.Module, path: str | Path, ftype: str = "f32") -> Path:
    """Write `model` (a Qwen2ForCausalLM) to `path` as GGUF; returns the path."""
    import gguf

    if ftype not in FTYPES:
        raise ValueError(f"ftype {ftype!r}: one of {FTYPES}")
    config = model.config
    if config.model_type != ARCH:
        raise NotImplementedError(f"model_type {config.model_type!r}: only {ARCH} is exported")
    if getattr(config, "use_sliding_window", False):
        raise NotImplementedError("sliding-window attention is not exported")
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if head_dim * heads != config.hidden_size:
        raise NotImplementedError("head_dim * heads != hidden_size: not a layout llama.cpp's qwen2 reads")
    vocab = config.vocab_size
    path = Path(path)

    writer = gguf.GGUFWriter(str(path), ARCH)
    writer.add_name("ssd-export")
    writer.add_context_length(int(config.max_position_embeddings))
    writer.add_embedding_length(int(config.hidden_size))
    writer.add_feed_forward_length(int(config.intermediate_size))
    writer.add_block_count(int(config.num_hidden_layers))
    writer.add_head_count(int(heads))
    writer.add_head_count_kv(int(kv_heads))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_rope_freq_base(_rope_theta(config))
    writer.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                          "q4_k_m": gguf.LlamaFileType.MOSTLY_Q4_K_M}[ftype])

    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    tokens = byte_tokens(vocab)
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * vocab)
    # llama.cpp refuses a gpt2 tokenizer without a merges array, and gguf
    # refuses to write an empty array: one merge whose result is no token
    # (only text tokenization would ever read it; the engines feed ids).
    writer.add_token_merges([f"{tokens[0]} {tokens[0]}"])
    writer.add_add_bos_token(False)
    if getattr(config, "eos_token_id", None) is not None:
        eos = config.eos_token_id
        writer.add_eos_token_id(int(eos[0] if isinstance(eos, (list, tuple)) else eos))

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, config.num_hidden_layers)
    state = model.state_dict()
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # llama.cpp reuses token_embd when `output` is absent
    for hf_name, tensor in state.items():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"no GGUF name for {hf_name}")
        data = tensor.detach().to(device="cpu", dtype=torch.float32).numpy()
        if ftype == "q4_k_m" and data.ndim > 1 and name != "token_embd.weight" and data.shape[1] % 256 == 0:
            _add_k_quant(writer, name, data)
            continue
        if ftype == "f16" and data.ndim > 1:
            data = data.astype(np.float16)
        writer.add_tensor(name, np.ascontiguousarray(data))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_k_quant(writer, name: str, data: np.ndarray) -> None:
    """A matrix as Q6_K or Q4_K blocks (ssd.models.kernels.kquants), as q4_k_m assigns them."""
    from gguf import GGMLQuantizationType

    from ssd.models.kernels.kquants import quantize_q4_k, quantize_q6_k

    six = name.endswith(Q6_K_TENSORS)
    blocks = quantize_q6_k(data) if six else quantize_q4_k(data)
    writer.add_tensor(name, blocks, raw_dtype=GGMLQuantizationType.Q6_K if six else GGMLQuantizationType.Q4_K)
