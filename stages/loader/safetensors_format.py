"""The safetensors format's vocabulary: its dtype names with their sizes, and one tensor's header entry
(shared by the reference header reader, `safetensors_reader`, and its fast path, `header_fast`)."""

from __future__ import annotations

from proto.loader_parts import TensorEntry

# Every dtype name of the format, with its item size; only the float ones map to a torch dtype we accept.
ITEM_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "F4": 1, "F6_E2M3": 1,
    "F6_E3M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "C64": 8,
    "F64": 8, "I64": 8, "U64": 8,
}  # fmt: skip
SUBBYTE = {"F4": 0.5, "F6_E2M3": 0.75, "F6_E3M2": 0.75}  # packed formats: bytes per element
ELEMENT_BYTES = {**ITEM_SIZES, **SUBBYTE}  # what one element of each dtype takes in the data section
FLOAT_TYPES = frozenset(("F16", "BF16", "F32", "F64"))  # the dtypes LoRA weights may have

# TensorEntry: the wire type
__all__ = ["ELEMENT_BYTES", "FLOAT_TYPES", "ITEM_SIZES", "SUBBYTE", "TensorEntry"]
