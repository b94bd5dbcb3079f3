// f16_build.hpp: whether this compiler builds the float16 products (isa/avx512_fp16-inl.h):
// x86-64 with GCC 12 or later, or clang 16 or later. Clang 14 declares the AVX512_FP16
// intrinsics (and _Float16 on x86) only when a whole file is compiled with -mavx512fp16, which
// one binary for every x86-64 cannot be; there the boundary says so (why_no_f16_products).
#pragma once

#if defined(__x86_64__) && ((defined(__clang__) && __clang_major__ >= 16) || \
                            (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 12))
#define ATTEND_F16_PRODUCTS_BUILT 1
#else
#define ATTEND_F16_PRODUCTS_BUILT 0
#endif
