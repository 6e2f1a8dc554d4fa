"""Tensor element types known to tenplex, by their safetensors-style names.

May import: only the standard library. Pure. Names follow PyTorch's
(``torch.float32`` -> ``"float32"``). bfloat16 has no numpy type; shards of it
are carried as ``uint16`` arrays of the raw bits (see ``numpy_storage``).
"""

ITEMSIZE: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
    "uint16": 2, "uint32": 4, "uint64": 8,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
}

# The numpy dtype name that holds each type's bits unchanged.
NUMPY_STORAGE: dict[str, str] = {
    **{name: name for name in ITEMSIZE},
    "bfloat16": "uint16", "float8_e4m3fn": "uint8", "float8_e5m2": "uint8",
}


def itemsize(dtype: str) -> int:
    try:
        return ITEMSIZE[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(sorted(ITEMSIZE))}") from None


def numpy_storage(dtype: str) -> str:
    """Name of the numpy dtype used to hold ``dtype`` values bit-for-bit."""
    itemsize(dtype)
    return NUMPY_STORAGE[dtype]
