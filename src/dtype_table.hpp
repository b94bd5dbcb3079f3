// dtype_table.hpp: attend's element types in one table. For each DType: the type its elements
// are stored as (float16, bfloat16 and the float8 formats as their bits), its name (NumPy's,
// where NumPy has the type), its kind, its .npy descr (null where .npy has none), and its
// conversion to and from double (rounding to nearest even for the narrow floats, C++'s
// conversions for the integers). visit_dtype(d, f) calls f with the row of DType d, so that a
// function over every dtype is written once instead of as a switch.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>

#include "attend/tensor.hpp"
#include "float8.hpp"
#include "half.hpp"

namespace attend::detail {

enum class DTypeKind : uint8_t { kFloat, kBFloat, kFloat8, kBool, kInt, kUInt };

template <DType D>
struct DTypeRow;

// One row: Storage, name, kind, npy descr; to_double(Storage), from_double(double).
#define ATTEND_DTYPE_ROW(DTYPE, STORAGE, NAME, KIND, NPY, TO_DOUBLE, FROM_DOUBLE)         \
  template <>                                                                            \
  struct DTypeRow<DType::DTYPE> {                                                        \
    using Storage = STORAGE;                                                             \
    static constexpr DType dtype = DType::DTYPE;                                         \
    static constexpr const char* name = NAME;                                            \
    static constexpr DTypeKind kind = DTypeKind::KIND;                                   \
    static constexpr const char* npy_descr = NPY;                                        \
    static double to_double(Storage v) { return TO_DOUBLE; }                             \
    static Storage from_double(double value) { return FROM_DOUBLE; }                     \
  };

ATTEND_DTYPE_ROW(kFloat32, float, "float32", kFloat, "<f4", v, static_cast<float>(value))
ATTEND_DTYPE_ROW(kFloat16, uint16_t, "float16", kFloat, "<f2", f32_from_f16(v),
                 f16_from_f32(static_cast<float>(value)))
ATTEND_DTYPE_ROW(kBFloat16, uint16_t, "bfloat16", kBFloat, nullptr, f32_from_bf16(v),
                 bf16_from_f32(static_cast<float>(value)))
ATTEND_DTYPE_ROW(kFloat64, double, "float64", kFloat, "<f8", v, value)
ATTEND_DTYPE_ROW(kBool, uint8_t, "bool", kBool, "|b1", v != 0 ? 1.0 : 0.0,
                 static_cast<uint8_t>(value != 0))
ATTEND_DTYPE_ROW(kInt8, int8_t, "int8", kInt, "|i1", v, static_cast<int8_t>(value))
ATTEND_DTYPE_ROW(kInt16, int16_t, "int16", kInt, "<i2", v, static_cast<int16_t>(value))
ATTEND_DTYPE_ROW(kInt32, int32_t, "int32", kInt, "<i4", v, static_cast<int32_t>(value))
ATTEND_DTYPE_ROW(kInt64, int64_t, "int64", kInt, "<i8", static_cast<double>(v),
                 static_cast<int64_t>(value))
ATTEND_DTYPE_ROW(kUInt8, uint8_t, "uint8", kUInt, "|u1", v, static_cast<uint8_t>(value))
ATTEND_DTYPE_ROW(kUInt16, uint16_t, "uint16", kUInt, "<u2", v, static_cast<uint16_t>(value))
ATTEND_DTYPE_ROW(kUInt32, uint32_t, "uint32", kUInt, "<u4", v, static_cast<uint32_t>(value))
ATTEND_DTYPE_ROW(kUInt64, uint64_t, "uint64", kUInt, "<u8", static_cast<double>(v),
                 static_cast<uint64_t>(value))
ATTEND_DTYPE_ROW(kFloat8E4M3, uint8_t, "float8_e4m3", kFloat8, nullptr, f32_from_e4m3(v),
                 e4m3_from_f32(static_cast<float>(value)))
ATTEND_DTYPE_ROW(kFloat8E5M2, uint8_t, "float8_e5m2", kFloat8, nullptr, f32_from_e5m2(v),
                 e5m2_from_f32(static_cast<float>(value)))
#undef ATTEND_DTYPE_ROW

// f(DTypeRow<d>{}): the one switch over the dtypes.
template <class F>
decltype(auto) visit_dtype(DType d, F&& f) {
  switch (d) {
    case DType::kFloat32: return f(DTypeRow<DType::kFloat32>{});
    case DType::kFloat16: return f(DTypeRow<DType::kFloat16>{});
    case DType::kBFloat16: return f(DTypeRow<DType::kBFloat16>{});
    case DType::kFloat64: return f(DTypeRow<DType::kFloat64>{});
    case DType::kBool: return f(DTypeRow<DType::kBool>{});
    case DType::kInt8: return f(DTypeRow<DType::kInt8>{});
    case DType::kInt16: return f(DTypeRow<DType::kInt16>{});
    case DType::kInt32: return f(DTypeRow<DType::kInt32>{});
    case DType::kInt64: return f(DTypeRow<DType::kInt64>{});
    case DType::kUInt8: return f(DTypeRow<DType::kUInt8>{});
    case DType::kUInt16: return f(DTypeRow<DType::kUInt16>{});
    case DType::kUInt32: return f(DTypeRow<DType::kUInt32>{});
    case DType::kUInt64: return f(DTypeRow<DType::kUInt64>{});
    case DType::kFloat8E4M3: return f(DTypeRow<DType::kFloat8E4M3>{});
    case DType::kFloat8E5M2: return f(DTypeRow<DType::kFloat8E5M2>{});
  }
  return f(DTypeRow<DType::kUInt8>{});  // not a DType: read as bytes
}

// The dtype of `kind` whose elements take `bytes` bytes, if attend has one (kFloat: float16,
// float32, float64; kInt and kUInt: 1, 2, 4 or 8 bytes; kBool: 1): what a .npy descr, a
// NumPy buffer format or a DLPack type names by kind and size.
inline std::optional<DType> dtype_of_kind(DTypeKind kind, size_t bytes) {
  for (int d = 0; d <= static_cast<int>(DType::kFloat8E5M2); ++d) {
    const auto dtype = static_cast<DType>(d);
    const bool match = visit_dtype(dtype, [&](auto row) {
      return row.kind == kind && sizeof(typename decltype(row)::Storage) == bytes;
    });
    if (match) return dtype;
  }
  return std::nullopt;
}

}  // namespace attend::detail
