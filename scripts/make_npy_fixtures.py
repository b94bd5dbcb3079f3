#!/usr/bin/env python3
"""Writes the small numpy-made .npy files that tests/npy_test.cc reads.

Regenerate with:
    /usr/bin/python3 scripts/make_npy_fixtures.py tests/data/npy

The values are closed-form (no random numbers), so the test states them independently.
"""
import os
import sys

import numpy as np


def main(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    # (2, 3) float32, C order: value = 10 * row + column + 0.5.
    c_order = (10 * np.arange(2)[:, None] + np.arange(3)[None, :] + 0.5).astype('<f4')
    np.save(os.path.join(out_dir, 'float32_c_2x3.npy'), c_order)
    # (2, 3, 4) float16 in Fortran order: value = 100 * i + 10 * j + k.
    i, j, k = np.meshgrid(np.arange(2), np.arange(3), np.arange(4), indexing='ij')
    fortran = np.asfortranarray((100 * i + 10 * j + k).astype('<f2'))
    np.save(os.path.join(out_dir, 'float16_fortran_2x3x4.npy'), fortran)
    # (3, 4) bool, True where column <= row (a causal mask); and its int64 version.
    causal = np.tril(np.ones((3, 4), dtype=bool))
    np.save(os.path.join(out_dir, 'bool_tril_3x4.npy'), causal)
    np.save(os.path.join(out_dir, 'int64_tril_3x4.npy'), causal.astype('<i8'))


if __name__ == '__main__':
    main(sys.argv[1] if len(sys.argv) > 1 else 'tests/data/npy')
