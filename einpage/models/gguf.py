"""GGUF checkpoints (llama.cpp's format): the config, the weights and the tokenizer of one file.

`from_gguf(path)` opens a `.gguf` with the `gguf` package's reader (its tensors are
memory-mapped, never read whole) and returns a `GGUFModel`:

* `config`: the family's config from the file's metadata (`general.architecture`
  "llama", "qwen2" or "mistral"; any other architecture is refused by name,
  `UnsupportedConfigError`). llama.cpp writes Mistral models as "llama", records no
  sliding window, and runs them as LLaMA with full attention: so does einpage (a fact is
  never read from a file's name); a file whose metadata says "mistral" is Mistral, with
  the window its `mistral.attention.sliding_window` gives, else full attention;
* `source()`: a checkpoint source (`einpage.models.checkpoint.Source`) under the Hugging
  Face tensor names, so the families' weight specs load from it as from safetensors
  (`weights(dtype)`): quantized tensors are dequantized there, one tensor at a time;
* `quantized(dtype)`: the quantized tensors as they are stored – integers, scales and
  minimums, the inputs of a program built with `quantization()` – so they stay
  quantized on the host and over the link and are dequantized on the device by tasks
  (`einpage.program.quantize.dequantized_weight`);
* `tokenizer()`: a `tokenizers.Tokenizer` built from the file's vocabulary
  (`einpage.models.gguf_tokenizer`: byte-level BPE "gpt2" and sentencepiece "llama";
  others are refused by name).

Tensor types (`TYPES`): F32, F16 and BF16 as they are; the block formats Q8_0, Q4_0,
Q4_1, Q4_K, Q5_K and Q6_K as a `Quantization` each (`BLOCK_FORMATS`: how a block's
bytes become the integers, the scale and the minimum of a group):

======  =========  ==================================================================
type    group      stored as (`Quantization`)
======  =========  ==================================================================
Q8_0    32         int8, a float16 scale per block
Q4_0    32         int4 (two a byte, biased by 8), a scale per block
Q4_1    32         uint4 with a minimum (a zero point) per block
Q4_K    32         uint4 with a minimum: a sub-block's 6-bit scale and minimum times
                   its super-block's (256) float16 scales
Q5_K    32         uint8 holding 5 bits, with a minimum, as Q4_K (5 bits move as 8)
Q6_K    16         int8 holding 6 bits (q - 32), an 8-bit scale times the super-block's
======  =========  ==================================================================

llama.cpp stores LLaMA's Q and K projections with the rows of each head interleaved
(its rotary embedding pairs neighbouring features); transformers' GGUF loader undoes
that, and so does `source()`/`quantized()`, on rows (whole blocks), for the "llama"
and "mistral" architectures (`INTERLEAVED`; Qwen2's rows are as Hugging Face's). Each
format's split is checked against `gguf.quants.dequantize` in the tests, and the
models' logits against transformers loading the same file (`gguf_file=`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from einpage.models import llama, mistral, qwen2
from einpage.models.base import ModelConfig, ModelFamily
from einpage.models.checkpoint import Part
from einpage.models.errors import CheckpointError, UnsupportedConfigError
from einpage.models.weights import load_weights
from einpage.program.quantize import Quantization
from taskgraph import dtypes

__all__ = [
    "from_gguf",
    "GGUFModel",
    "GGUFSource",
    "BlockFormat",
    "BLOCK_FORMATS",
    "FLOAT_TYPES",
    "TYPES",
    "ARCHITECTURES",
    "split_blocks",
    "dequantize_blocks",
    "is_gguf",
    "opened_gguf",
]

ARCHITECTURES: dict[str, ModelFamily] = {
    "llama": llama.FAMILY,
    "qwen2": qwen2.FAMILY,
    "mistral": mistral.FAMILY,
}
"""The GGUF architectures read (`general.architecture`), and their families. llama.cpp
writes Mistral models as "llama" (read as LLaMA, as llama.cpp runs them); only a file
whose metadata says "mistral" is read as Mistral."""

INTERLEAVED = frozenset({"llama", "mistral"})
"""The architectures whose Q/K rows llama.cpp interleaves per head (`GGUFSource._rows`)."""

REQUIRED = ("embedding_length", "block_count", "attention.head_count", "feed_forward_length")
"""The metadata keys (under the architecture's name) every file must have."""

FLOAT_TYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
"""Unquantized tensor types and the dtype each is read as."""


SPECIAL_TOKEN_IDS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}
"""The special tokens a chat template may read, and the metadata key (after
`tokenizer.ggml.`) of each one's id."""


def _import_gguf() -> Any:
    try:
        import gguf
    except ImportError:
        raise CheckpointError(
            "reading a GGUF file needs the gguf package: pip install gguf "
            "(or pip install 'einpage[text]')"
        ) from None
    return gguf


# -- block formats --------------------------------------------------------------------


@dataclass(frozen=True)
class BlockFormat:
    """A GGUF block type: `block` weights in `nbytes` bytes, stored by einpage as
    `quant`, and `split(raw)`: raw blocks [rows, blocks, nbytes] (uint8) -> `(q, scale,
    minimum or None)` in `quant`'s stored layout (`einpage.program.quantize`) with
    scales and minimums in float32."""

    name: str
    block: int
    nbytes: int
    quant: Quantization
    split: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray | None]] = field(
        repr=False
    )


def _f16(raw: np.ndarray, start: int) -> np.ndarray:
    """The little-endian float16 at byte `start` of each block, as float32."""
    return np.ascontiguousarray(raw[..., start : start + 2]).view("<f2")[..., 0].astype(np.float32)


def _pack_nibbles(values: np.ndarray) -> np.ndarray:
    """Unsigned 4-bit `values` [..., G] two a byte as einpage packs them: byte `j` holds
    `values[j]` (low nibble) and `values[j + G/2]` (high nibble)."""
    half = values.shape[-1] // 2
    return (values[..., :half] | (values[..., half:] << 4)).astype(np.uint8)


def _split_q8_0(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
    # block: d (f16), 32 int8
    return raw[..., 2:34].view(np.int8), _f16(raw, 0), None


def _split_q4_0(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
    # block: d (f16), 16 bytes: element j in the low nibble of byte j, j + 16 in its high
    # nibble, each biased by 8 – einpage's int4 layout with groups of 32.
    return np.ascontiguousarray(raw[..., 2:18]), _f16(raw, 0), None


def _split_q4_1(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    # block: d (f16), m (f16), 16 bytes as Q4_0 but unbiased: w = d * q + m
    return np.ascontiguousarray(raw[..., 4:20]), _f16(raw, 0), _f16(raw, 2)


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 6-bit scales and minimums of the 8 sub-blocks of a Q4_K/Q5_K super-block from
    its 12 packed bytes [..., 12]: sub-blocks 0-3 in the low 6 bits of bytes 0-3 (scales)
    and 4-7 (minimums); sub-blocks 4-7 in the nibbles of bytes 8-11, with their top two
    bits in the top bits of bytes 0-3 (scales) and 4-7 (minimums)."""
    p = packed.astype(np.int32)
    low, high = p[..., 0:4], p[..., 4:8]
    last = p[..., 8:12]
    scales = np.concatenate([low & 63, (last & 15) | ((low >> 6) << 4)], axis=-1)
    minimums = np.concatenate([high & 63, (last >> 4) | ((high >> 6) << 4)], axis=-1)
    return scales, minimums


def _k_groups(raw: np.ndarray, scales_at: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-32 scales and minimums of Q4_K/Q5_K super-blocks [..., blocks, nbytes] as
    [..., blocks * 8]: `d * scale` and `-dmin * minimum` (exact in float32)."""
    d, dmin = _f16(raw, 0), _f16(raw, 2)
    scales, minimums = _k_scales(raw[..., scales_at : scales_at + 12])
    scale = d[..., None] * scales.astype(np.float32)
    minimum = -dmin[..., None] * minimums.astype(np.float32)
    lead = raw.shape[:-2]
    return scale.reshape(*lead, -1), minimum.reshape(*lead, -1)


def _q4_k_values(qs: np.ndarray) -> np.ndarray:
    """The 256 4-bit values of a super-block from its 128 bytes [..., 128]: four chunks of
    32 bytes, chunk c's low nibbles elements 64c .. 64c+31, its high nibbles the next 32."""
    chunks = qs.reshape(*qs.shape[:-1], 4, 32).astype(np.int16)
    values = np.stack([chunks & 15, chunks >> 4], axis=-2)  # [..., 4, 2, 32]
    return values.reshape(*qs.shape[:-1], 256)


def _split_q4_k(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    # super-block of 256: d, dmin (f16), 12 bytes of 6-bit scales/minimums, 128 bytes
    # of nibbles; w = d * scale_j * q - dmin * minimum_j for sub-block j of 32
    scale, minimum = _k_groups(raw, 4)
    values = _q4_k_values(raw[..., 16:144])
    groups = values.reshape(*raw.shape[:-2], -1, 32)
    return _pack_nibbles(groups), scale, minimum


def _split_q5_k(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    # as Q4_K, with a fifth bit per value: 32 bytes qh, bit c of qh[l] is the high bit of
    # element 32c + l
    scale, minimum = _k_groups(raw, 4)
    low = _q4_k_values(raw[..., 48:176])
    qh = raw[..., 16:48].astype(np.int16)  # [..., 32]
    bits = (qh[..., None, :] >> np.arange(8, dtype=np.int16)[:, None]) & 1  # [..., 8, 32]
    values = low + (bits.reshape(*raw.shape[:-1], 256) << 4)
    return values.reshape(*raw.shape[:-2], -1, 32).astype(np.uint8), scale, minimum


def _split_q6_k(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
    # super-block of 256: 128 bytes ql (low 4 bits), 64 bytes qh (high 2 bits), 16 int8
    # scales, d (f16); two halves of 128, half n from ql[64n:], qh[32n:]; in a half,
    # element 32i + l (i < 4, l < 32) has low bits from ql[l + 32 (i % 2)] (low nibble
    # for i < 2) and high bits (qh[l] >> 2i) & 3; w = d * scale[e // 16] * (q - 32)
    ql = raw[..., 0:128].astype(np.int16).reshape(*raw.shape[:-1], 2, 2, 32)
    qh = raw[..., 128:192].astype(np.int16).reshape(*raw.shape[:-1], 2, 1, 32)
    low = np.concatenate([ql & 15, ql >> 4], axis=-2)  # [..., half, i, l]
    high = (qh >> (2 * np.arange(4, dtype=np.int16))[:, None]) & 3
    values = (low | (high << 4)) - 32
    q = values.reshape(*raw.shape[:-2], -1, 16).astype(np.int8)
    scales = raw[..., 192:208].view(np.int8).astype(np.float32)
    scale = (_f16(raw, 208)[..., None] * scales).reshape(*raw.shape[:-2], -1)
    return q, scale, None


BLOCK_FORMATS: dict[str, BlockFormat] = {
    f.name: f
    for f in (
        BlockFormat("Q8_0", 32, 34, Quantization(8, 32), _split_q8_0),
        BlockFormat("Q4_0", 32, 18, Quantization(4, 32), _split_q4_0),
        BlockFormat("Q4_1", 32, 20, Quantization(4, 32, minimum=True), _split_q4_1),
        BlockFormat("Q4_K", 256, 144, Quantization(4, 32, minimum=True), _split_q4_k),
        BlockFormat("Q5_K", 256, 176, Quantization(8, 32, minimum=True), _split_q5_k),
        BlockFormat("Q6_K", 256, 210, Quantization(8, 16), _split_q6_k),
    )
}
"""The quantized GGUF types einpage reads, by llama.cpp's name."""

TYPES = (*FLOAT_TYPES, *BLOCK_FORMATS)
"""Every GGUF tensor type einpage reads."""


def split_blocks(
    raw: np.ndarray, type_name: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """`(q, scale, minimum or None)` of a block-quantized tensor's bytes `raw` [..., row
    bytes] (as `gguf.GGUFReader` maps them) of type `type_name`, in the stored layout of
    `BLOCK_FORMATS[type_name].quant`: groups along the rows' last axis."""
    fmt = _block_format(type_name)
    raw = np.asarray(raw, dtype=np.uint8)
    if raw.shape[-1] % fmt.nbytes:
        raise CheckpointError(
            f"a {type_name} row has {raw.shape[-1]} bytes, not a multiple of its "
            f"{fmt.nbytes}-byte blocks"
        )
    blocks = raw.reshape(*raw.shape[:-1], raw.shape[-1] // fmt.nbytes, fmt.nbytes)
    q, scale, minimum = fmt.split(blocks)
    groups = scale.shape[-1]
    q = q.reshape(*raw.shape[:-1], groups, q.shape[-1])
    return q, scale, minimum


def dequantize_blocks(raw: np.ndarray, type_name: str) -> np.ndarray:
    """The float32 values of a block-quantized tensor's bytes `raw` [..., row bytes]:
    `split_blocks`, then `einpage.program.quantize.dequantize` (one piece of arithmetic
    with the program's dequantization)."""
    from einpage.program.quantize import dequantize

    fmt = _block_format(type_name)
    q, scale, minimum = split_blocks(raw, type_name)
    return dequantize(q, scale, fmt.quant, "float32", minimum)


def _block_format(type_name: str) -> BlockFormat:
    if type_name not in BLOCK_FORMATS:
        raise UnsupportedConfigError(
            f"GGUF tensor type {type_name} is not supported; supported: {', '.join(TYPES)}"
        )
    return BLOCK_FORMATS[type_name]


# -- the file ---------------------------------------------------------------------------


def _tensor_names(layers: int, tied: bool) -> dict[str, str]:
    """GGUF tensor name -> Hugging Face key, for the LLaMA-like families."""
    names = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
    }
    if not tied:
        names["output.weight"] = "lm_head.weight"
    per_layer = {
        "attn_norm.weight": "input_layernorm.weight",
        "attn_q.weight": "self_attn.q_proj.weight",
        "attn_k.weight": "self_attn.k_proj.weight",
        "attn_v.weight": "self_attn.v_proj.weight",
        "attn_q.bias": "self_attn.q_proj.bias",
        "attn_k.bias": "self_attn.k_proj.bias",
        "attn_v.bias": "self_attn.v_proj.bias",
        "attn_output.weight": "self_attn.o_proj.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "ffn_gate.weight": "mlp.gate_proj.weight",
        "ffn_up.weight": "mlp.up_proj.weight",
        "ffn_down.weight": "mlp.down_proj.weight",
    }
    for i in range(layers):
        for ours, hf in per_layer.items():
            names[f"blk.{i}.{ours}"] = f"model.layers.{i}.{hf}"
    return names


def _open_reader(path: Path) -> Any:
    """`gguf.GGUFReader` of `path`, with a `CheckpointError` for a file that is not
    there, not a GGUF, or shorter than its header says (truncated)."""
    gguf = _import_gguf()
    if not path.is_file():
        raise CheckpointError(f"the GGUF file {str(path)!r} does not exist")
    try:
        reader = gguf.GGUFReader(str(path), "r")
    except Exception as err:  # the reader raises ValueError, IndexError, ... on bad bytes
        size = path.stat().st_size
        raise CheckpointError(
            f"cannot read the GGUF file {str(path)!r} ({size} bytes): it is not a GGUF file "
            f"or it is truncated ({type(err).__name__}: {err})"
        ) from None
    size = path.stat().st_size
    for tensor in reader.tensors:
        end = int(tensor.data_offset) + int(tensor.n_bytes)
        if end > size or tensor.data.nbytes != int(tensor.n_bytes):
            raise CheckpointError(
                f"the GGUF file {str(path)!r} is truncated: tensor {tensor.name!r} ends at "
                f"byte {end}, the file has {size}"
            )
    return reader


def _field(reader: Any, key: str, default: Any = None) -> Any:
    """A metadata value (a number, a string, or a list of them), or `default`."""
    found = reader.fields.get(key)
    if found is None:
        return default
    return found.contents()


class GGUFModel:
    """A GGUF file opened by `from_gguf`: its `family`, `config`, float `dtype` and the
    ways to read its weights and tokenizer (the module docstring). The file is memory-
    mapped; nothing is read until asked for."""

    def __init__(self, path: str | os.PathLike[str], name: str | None = None):
        self.path = Path(path)
        self.reader = _open_reader(self.path)
        self.architecture = str(_field(self.reader, "general.architecture", ""))
        self.family = self._family()
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.config: ModelConfig = self.family.config.from_hf(
            self._hf_config(), name=name or self.path.stem
        )
        self.keys = _tensor_names(self.config.num_layers, self.config.tie_embeddings)
        for gguf_name, tensor in self.tensors.items():
            kind = tensor.tensor_type.name
            if gguf_name in self.keys and kind not in TYPES:
                raise UnsupportedConfigError(
                    f"{self.where}: tensor {gguf_name!r} has type {kind}, which einpage does "
                    f"not read; supported: {', '.join(TYPES)}"
                )

    @property
    def where(self) -> str:
        return f"GGUF file {str(self.path)!r}"

    def __repr__(self) -> str:
        return f"<GGUFModel {self.path.name} {self.family.name} dtype={self.dtype}>"

    def _family(self) -> ModelFamily:
        arch = self.architecture
        if arch not in ARCHITECTURES:
            raise UnsupportedConfigError(
                f"{self.where} has architecture {arch!r}; supported: "
                + ", ".join(ARCHITECTURES)
            )
        return ARCHITECTURES[arch]

    def _hf_config(self) -> dict[str, Any]:
        """The file's metadata as the Hugging Face config the family reads (`from_hf`),
        with the keys transformers maps them to."""
        arch = self.architecture

        def get(key: str, default: Any = None) -> Any:
            return _field(self.reader, f"{arch}.{key}", default)

        for key in REQUIRED:
            if get(key) is None:
                raise CheckpointError(
                    f"{self.where} has no {arch + '.' + key!r} in its metadata (the model's "
                    f"sizes need {', '.join(REQUIRED)})"
                )
        scaling = get("rope.scaling.type")
        if scaling not in (None, "none"):
            raise UnsupportedConfigError(
                f"{self.where}: RoPE scaling {scaling!r} ({arch}.rope.scaling.type) is not "
                "supported; only unscaled rotary embeddings are read from GGUF files"
            )
        tokens = self.reader.fields.get("tokenizer.ggml.tokens")
        embed = self.tensors.get("token_embd.weight")
        vocab = get("vocab_size")
        if vocab is None and embed is not None:
            vocab = int(embed.shape[-1])
        if vocab is None and tokens is not None:
            vocab = len(tokens.data)
        heads = get("attention.head_count")
        config = {
            "model_type": self.family.config.model_type,
            "hidden_size": get("embedding_length"),
            "num_hidden_layers": get("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": get("attention.head_count_kv", heads),
            "intermediate_size": get("feed_forward_length"),
            "vocab_size": vocab,
            "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
            "rope_theta": get("rope.freq_base", 10000.0),
            "tie_word_embeddings": "output.weight" not in self.tensors,
        }
        if arch in INTERLEAVED and get("rope.dimension_count") is not None:
            config["head_dim"] = get("rope.dimension_count")
        if arch == "mistral":  # no window recorded: full attention, as llama.cpp runs it
            config["sliding_window"] = get("attention.sliding_window")
        return {k: (int(v) if isinstance(v, np.integer) else v) for k, v in config.items()}

    @cached_property
    def dtype(self) -> str:
        """The file's float dtype: that of its float matrices (the first 2-D float tensor:
        F16 -> float16, BF16 -> bfloat16, F32 -> float32); float32 when every matrix is
        quantized (scales are float16, dequantized values are computed in float32)."""
        for tensor in self.tensors.values():
            kind = tensor.tensor_type.name
            if kind in FLOAT_TYPES and len(tensor.shape) == 2:
                return FLOAT_TYPES[kind]
        return "float32"

    def tensor_types(self) -> dict[str, str]:
        """Every tensor's type by its GGUF name (`"blk.0.attn_q.weight": "Q4_K"`)."""
        return {name: t.tensor_type.name for name, t in self.tensors.items()}

    def source(self) -> GGUFSource:
        """The file's tensors under Hugging Face names (`GGUFSource`)."""
        return GGUFSource(self)

    def weights(self, dtype: str | None = None) -> dict[str, np.ndarray]:
        """Every program weight as an array of `dtype` (default: the file's), quantized
        tensors dequantized on the host (for programs that take float weights)."""
        specs = self.config.weight_specs()
        return load_weights(specs, self.source(), dtype or self.dtype)

    def quantization(self) -> dict[str, Quantization]:
        """Program weight name -> its `Quantization`, for each weight a matmul reads whose
        tensor is block-quantized in the file (`prefill_program(..., quant=...)`); a
        weight the program transposes is a `transposed` one (its groups run along the
        file's rows)."""
        chosen = {}
        by_key = {hf: name for name, hf in self.keys.items()}
        for spec in self.config.weight_specs():
            kind = self.tensors[by_key[spec.key]].tensor_type.name if spec.key in by_key else None
            if spec.quantize and kind in BLOCK_FORMATS:
                quant = BLOCK_FORMATS[kind].quant
                if spec.transpose:
                    quant = Quantization(quant.bits, quant.group, quant.minimum, transposed=True)
                chosen[spec.name] = quant
        return chosen

    def quantized(self, dtype: str | None = None) -> dict[str, np.ndarray]:
        """The inputs of a program built with `quant=self.quantization()` in `dtype`:
        `{name}.q`, `{name}.scale` (and `{name}.min`) for its quantized weights – the
        file's integers rearranged, not dequantized – and the other weights in `dtype`."""
        dtype = dtypes.canonical(dtype or self.dtype)
        chosen = self.quantization()
        specs = [s for s in self.config.weight_specs() if s.name not in chosen]
        out = load_weights(specs, self.source(), dtype)
        source = self.source()
        for spec in self.config.weight_specs():
            if spec.name not in chosen:
                continue
            q, scale, minimum = source.read_blocks(spec.key)
            quant = chosen[spec.name]
            want = quant.stored(spec.shape, dtype)
            out[f"{spec.name}.q"] = q.reshape(want["q"][0])
            out[f"{spec.name}.scale"] = scale.reshape(want["scale"][0]).astype(
                dtypes.numpy_dtype(dtype)
            )
            if minimum is not None:
                out[f"{spec.name}.min"] = minimum.reshape(want["min"][0]).astype(
                    dtypes.numpy_dtype(dtype)
                )
        return out

    def chat_template(self) -> str | None:
        """The file's chat template (`tokenizer.chat_template`, Jinja2 source), or None."""
        template = _field(self.reader, "tokenizer.chat_template")
        return None if template is None else str(template)

    def special_tokens(self) -> dict[str, str]:
        """The text of the special tokens the file names by id (`tokenizer.ggml.
        bos_token_id`, `eos_token_id`, `unknown_token_id`, `padding_token_id`), under the
        names a chat template reads them by (`bos_token`, `eos_token`, ...)."""
        tokens = _field(self.reader, "tokenizer.ggml.tokens", [])
        found = {}
        for name, key in SPECIAL_TOKEN_IDS.items():
            token_id = _field(self.reader, f"tokenizer.ggml.{key}")
            if token_id is not None and 0 <= int(token_id) < len(tokens):
                found[name] = str(tokens[int(token_id)])
        return found

    def eos_ids(self) -> tuple[int, ...]:
        """The end-of-sequence id the file names (`tokenizer.ggml.eos_token_id`; empty
        when it names none): where a generation stops by default, as transformers reads
        the file's."""
        eos = _field(self.reader, "tokenizer.ggml.eos_token_id")
        return () if eos is None else (int(eos),)

    def pad_id(self) -> int | None:
        """The padding id the file names (`tokenizer.ggml.padding_token_id`), or None."""
        pad = _field(self.reader, "tokenizer.ggml.padding_token_id")
        return None if pad is None else int(pad)

    def tokenizer(self) -> Any:
        """A `tokenizers.Tokenizer` from the file's vocabulary (`gguf_tokenizer`);
        `CheckpointError` when the file has none, `UnsupportedConfigError` for a
        tokenizer model other than "gpt2" (byte-level BPE) and "llama" (sentencepiece)."""
        from einpage.models.gguf_tokenizer import tokenizer_from_gguf

        return tokenizer_from_gguf(self.reader, self.where)


class GGUFSource:
    """A GGUF file's tensors as a checkpoint source (`einpage.models.checkpoint.Source`)
    under Hugging Face keys and shapes: float tensors as stored (memory-mapped views),
    block-quantized ones dequantized to float32, LLaMA's Q/K rows back in Hugging
    Face's order."""

    def __init__(self, model: GGUFModel):
        self.model = model
        self.where = model.where
        self._by_key = {hf: name for name, hf in model.keys.items() if name in model.tensors}

    def keys(self) -> list[str]:
        return list(self._by_key)

    def _tensor(self, key: str) -> Any:
        return self.model.tensors[self._by_key[key]]

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(self._tensor(key).shape.tolist()))

    def _rows(self, key: str, rows: np.ndarray) -> np.ndarray:
        """`rows` [out, ...] of tensor `key` in Hugging Face's order: llama.cpp interleaves
        the two halves of each head's Q and K rows for the "llama" and "mistral"
        architectures (`INTERLEAVED`)."""
        if self.model.architecture not in INTERLEAVED:
            return rows
        cfg = self.model.config
        if key.endswith("self_attn.q_proj.weight"):
            heads = cfg.num_heads
        elif key.endswith("self_attn.k_proj.weight"):
            heads = cfg.num_kv_heads
        else:
            return rows
        half = rows.shape[0] // heads // 2
        paired = rows.reshape(heads, half, 2, *rows.shape[1:])
        return paired.swapaxes(1, 2).reshape(rows.shape)

    def read(self, key: str, part: Part = None) -> np.ndarray:
        tensor = self._tensor(key)
        kind = tensor.tensor_type.name
        shape = self.shape(key)
        if kind in FLOAT_TYPES:
            data = tensor.data
            if kind == "BF16":
                data = np.asarray(data).view(dtypes.numpy_dtype("bfloat16"))
            array = np.asarray(data).reshape(shape)
        else:
            array = dequantize_blocks(tensor.data, kind).reshape(shape)
        array = self._rows(key, array)
        return array if part is None else array[..., part[0] : part[1]]

    def read_blocks(self, key: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """`split_blocks` of block-quantized tensor `key`, rows in Hugging Face's order
        (whole rows move: the integers, scales and minimums of a row stay together)."""
        tensor = self._tensor(key)
        q, scale, minimum = split_blocks(tensor.data, tensor.tensor_type.name)
        q, scale = self._rows(key, q), self._rows(key, scale)
        minimum = None if minimum is None else self._rows(key, minimum)
        return q, scale, minimum

    def close(self) -> None:
        """Nothing to release: the reader's memory map closes when dropped."""


def from_gguf(path: str | os.PathLike[str], name: str | None = None) -> GGUFModel:
    """Open the GGUF file at `path` (`GGUFModel`: its config, weights, tokenizer), named
    `name` (default: the file's stem). Raises `CheckpointError` for a file that is
    missing, not a GGUF or truncated, `UnsupportedConfigError` for an architecture or a
    tensor type einpage does not read (naming it and those it does)."""
    return GGUFModel(path, name)


@lru_cache(maxsize=4)
def _opened(path: str, mtime_ns: int, size: int) -> GGUFModel:
    return GGUFModel(path)


def opened_gguf(path: str | os.PathLike[str]) -> GGUFModel:
    """`from_gguf(path)`, opened once for as long as the file is unchanged (its path,
    modification time and size): `generate` reads a file's config, tokenizer and weights
    in three places, and parsing a large vocabulary's metadata takes seconds."""
    resolved = Path(path).resolve()
    if not resolved.is_file():
        return from_gguf(path)  # the error that names it
    stat = resolved.stat()
    return _opened(str(resolved), stat.st_mtime_ns, stat.st_size)


def is_gguf(path: Any) -> bool:
    """Whether `path` names a GGUF file (by its `.gguf` suffix)."""
    return isinstance(path, str | os.PathLike) and str(path).lower().endswith(".gguf")
