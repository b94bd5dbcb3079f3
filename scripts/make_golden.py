#!/usr/bin/env python3
"""Golden data for tests/golden_test.cc: the seed's attention listing run in PyTorch.

Regenerate with:
    /usr/bin/python3 scripts/make_golden.py tests/data/golden

For every case NAME this writes NAME_query.npy, NAME_key.npy, NAME_value.npy, optionally
NAME_mask.npy and NAME_bias.npy (the inputs), and NAME_output.npy and NAME_weights.npy (what
the listing returns), all float32 except the masks. torch.manual_seed fixes the inputs.
"""
import math
import os
import sys

import numpy as np
import torch
from torch import nn


def attention(query, key, value, mask=None, dropout=None):
    """Listing 9.1 / 2.4 of the seed documents, literally."""
    d_k = query.size(-1)
    scores = torch.matmul(query,
                          key.transpose(-2, -1)) / math.sqrt(d_k)
    if mask is not None:
        scores = scores.masked_fill(mask == 0, -1e9)
    p_attn = nn.functional.softmax(scores, dim=-1)
    if dropout is not None:
        p_attn = dropout(p_attn)
    return torch.matmul(p_attn, value), p_attn


def attention_with_bias(query, key, value, bias, mask=None):
    """The listing with an additive bias: scores + bias, then the mask (attend's contract)."""
    d_k = query.size(-1)
    scores = torch.matmul(query, key.transpose(-2, -1)) / math.sqrt(d_k)
    scores = scores + bias
    if mask is not None:
        scores = scores.masked_fill(mask == 0, -1e9)
    p_attn = nn.functional.softmax(scores, dim=-1)
    return torch.matmul(p_attn, value), p_attn


def positional_encoding(length, width):
    """Sinusoidal positional encoding (length, width), added to the embeddings."""
    position = torch.arange(length, dtype=torch.float32)[:, None]
    frequency = torch.exp(torch.arange(0, width, 2, dtype=torch.float32) *
                          (-math.log(10000.0) / width))
    encoding = torch.zeros(length, width)
    encoding[:, 0::2] = torch.sin(position * frequency)
    encoding[:, 1::2] = torch.cos(position * frequency)
    return encoding


def save(out_dir, name, tensors):
    for part, tensor in tensors.items():
        array = tensor.detach().numpy()
        if array.dtype == np.float32:
            array = array.astype('<f4')
        np.save(os.path.join(out_dir, f'{name}_{part}.npy'), np.ascontiguousarray(array))


def phrase_case():
    """'How are you?': 4 tokens of width 256, projected, split into 8 heads of 32."""
    tokens, width, heads = 4, 256, 8
    embeddings = torch.randn(tokens, width) + positional_encoding(tokens, width)
    projections = [nn.Linear(width, width, bias=False) for _ in range(3)]
    with torch.no_grad():
        q, k, v = [p(embeddings).view(tokens, heads, width // heads).transpose(0, 1).contiguous()
                   for p in projections]  # each (8, 4, 32)
        output, weights = attention(q, k, v)
    return {'query': q, 'key': k, 'value': v, 'output': output, 'weights': weights}


def padding_case():
    """A batch of 3 sequences of lengths 6, 4 and 2 padded to 6: mask (3, 1, 6) bool."""
    q, k, v = torch.randn(3, 6, 16), torch.randn(3, 6, 16), torch.randn(3, 6, 16)
    lengths = torch.tensor([6, 4, 2])
    mask = (torch.arange(6)[None, :] < lengths[:, None])[:, None, :]
    output, weights = attention(q, k, v, mask)
    return {'query': q, 'key': k, 'value': v, 'mask': mask, 'output': output,
            'weights': weights}


def causal_case():
    """Lq = 3 new queries over Lk = 7 keys (a KV cache): tril with offset Lk - Lq."""
    lq, lk = 3, 7
    q, k, v = torch.randn(2, lq, 8), torch.randn(2, lk, 8), torch.randn(2, lk, 8)
    mask = torch.tril(torch.ones(lq, lk, dtype=torch.bool), diagonal=lk - lq)
    output, weights = attention(q, k, v, mask)
    return {'query': q, 'key': k, 'value': v, 'mask': mask, 'output': output,
            'weights': weights}


def fully_masked_case():
    """An int64 mask (2, 4, 5) where two query rows exclude every key: uniform weights."""
    q, k, v = torch.randn(2, 4, 8), torch.randn(2, 5, 8), torch.randn(2, 5, 6)
    mask = (torch.rand(2, 4, 5) > 0.3).to(torch.int64)
    mask[:, :, 0] = 1  # every other row keeps at least one key
    mask[0, 2, :] = 0
    mask[1, 3, :] = 0
    output, weights = attention(q, k, v, mask)
    return {'query': q, 'key': k, 'value': v, 'mask': mask, 'output': output,
            'weights': weights}


def bias_case():
    """Rank-4 (2, 3, 4, 8) with a bias (3, 4, 6) and a key padding mask (2, 1, 1, 6)."""
    q, k, v = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 6, 8), torch.randn(2, 3, 6, 8)
    bias = torch.randn(3, 4, 6)
    mask = torch.ones(2, 1, 1, 6, dtype=torch.bool)
    mask[1, 0, 0, 4:] = False
    output, weights = attention_with_bias(q, k, v, bias, mask)
    return {'query': q, 'key': k, 'value': v, 'bias': bias, 'mask': mask, 'output': output,
            'weights': weights}


def odd_dims_case():
    """No batch dimensions, E = 3, Ev = 5, Lq = 2, Lk = 7."""
    q, k, v = torch.randn(2, 3), torch.randn(7, 3), torch.randn(7, 5)
    output, weights = attention(q, k, v)
    return {'query': q, 'key': k, 'value': v, 'output': output, 'weights': weights}


def main(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(20240601)
    cases = {'phrase': phrase_case, 'padding': padding_case, 'causal': causal_case,
             'fully_masked': fully_masked_case, 'bias': bias_case, 'odd_dims': odd_dims_case}
    for name, make in cases.items():
        with torch.no_grad():
            save(out_dir, name, make())


if __name__ == '__main__':
    main(sys.argv[1] if len(sys.argv) > 1 else 'tests/data/golden')
