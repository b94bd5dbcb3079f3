"""Writes safetensors files by hand (the format: u64 header length, JSON header, raw
little-endian data), for the golden-data scripts; no safetensors package is needed."""
import json
import struct

import numpy as np
import torch


def save_safetensors(path, tensors, metadata):
    """The safetensors format by hand: u64 header length, JSON header, raw little-endian data."""
    header = {"__metadata__": metadata}
    blobs, offset = [], 0
    for name, tensor in tensors.items():
        tensor = tensor.detach().contiguous()
        if tensor.dtype == torch.bfloat16:
            # numpy has no bfloat16: the upper 16 bits of the float32 (exact after rounding).
            bits = tensor.float().numpy().view(np.uint32) >> 16
            raw, code = bits.astype("<u2").tobytes(), "BF16"
        elif tensor.dtype == torch.float16:
            raw, code = tensor.numpy().astype("<f2").tobytes(), "F16"
        else:
            raw, code = tensor.float().numpy().astype("<f4").tobytes(), "F32"
        header[name] = {"dtype": code, "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for raw in blobs:
            f.write(raw)
