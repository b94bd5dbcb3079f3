// tensor.cpp: Shape, TensorView, Tensor and dtype conversion.
#include "attend/tensor.hpp"

#include <omp.h>

#include <cstdlib>
#include <cstring>
#if defined(__linux__)
#include <sys/mman.h>
#endif
#include <new>
#include <utility>

#include "attend/error.hpp"
#include "convert_rows.hpp"
#include "dtype_table.hpp"
#include "float8.hpp"
#include "half.hpp"
#include "work_size.hpp"

namespace attend {

size_t dtype_size(DType dtype) {
  return detail::visit_dtype(dtype,
                             [](auto row) { return sizeof(typename decltype(row)::Storage); });
}

const char* dtype_name(DType dtype) {
  if (static_cast<uint8_t>(dtype) > static_cast<uint8_t>(DType::kFloat8E5M2)) return "unknown";
  return detail::visit_dtype(dtype, [](auto row) { return row.name; });
}

bool is_floating(DType dtype) {
  using detail::DTypeKind;
  const DTypeKind kind = detail::visit_dtype(dtype, [](auto row) { return row.kind; });
  return kind == DTypeKind::kFloat || kind == DTypeKind::kBFloat || kind == DTypeKind::kFloat8;
}

// ---------------------------------------------------------------------------------------
// Shape

Shape::Shape(std::initializer_list<int64_t> dims) {
  for (int64_t d : dims) push_back(d);
}

namespace {
// The one rule on a shape's rank, however the Shape is built.
void require_rank_fits(int rank) {
  if (rank > Shape::kMaxRank) {
    throw Error("shape: rank " + std::to_string(rank) + " exceeds the maximum of " +
                std::to_string(Shape::kMaxRank));
  }
}
}  // namespace

Shape Shape::from(const int64_t* dims, int rank) {
  Shape shape;
  require_rank_fits(rank);
  for (int i = 0; i < rank; ++i) shape.dims_[static_cast<size_t>(i)] = dims[i];
  shape.rank_ = rank > 0 ? rank : 0;
  return shape;
}

void Shape::push_back(int64_t d) {
  require_rank_fits(rank_ + 1);
  dims_[static_cast<size_t>(rank_++)] = d;
}

int64_t Shape::numel() const {
  int64_t n = 1;
  for (int i = 0; i < rank_; ++i) {
    const int64_t d = dims_[static_cast<size_t>(i)];
    if (d < 0) throw Error("shape " + str() + " has a negative dimension");
    if (__builtin_mul_overflow(n, d, &n))
      throw Error("element count of shape " + str() + " overflows");
  }
  return n;
}

bool Shape::operator==(const Shape& other) const {
  if (rank_ != other.rank_) return false;
  for (int i = 0; i < rank_; ++i) {
    if ((*this)[i] != other[i]) return false;
  }
  return true;
}

std::string Shape::str() const {
  std::string s = "(";
  for (int i = 0; i < rank_; ++i) {
    if (i) s += ", ";
    s += std::to_string((*this)[i]);
  }
  if (rank_ == 1) s += ",";
  return s + ")";
}

Shape contiguous_strides(const Shape& shape) {
  Shape strides = shape;
  int64_t stride = 1;
  for (int i = shape.rank() - 1; i >= 0; --i) {
    strides[i] = stride;
    // Saturates instead of overflowing: only a shape whose element count overflows (refused
    // by numel() wherever the view is used) or an empty one gets here.
    if (__builtin_mul_overflow(stride, shape[i] > 0 ? shape[i] : 1, &stride)) {
      stride = INT64_MAX;
    }
  }
  return strides;
}

// ---------------------------------------------------------------------------------------
// TensorView

TensorView::TensorView(void* data, DType dtype, const Shape& shape)
    : data(data), dtype(dtype), shape(shape), strides(contiguous_strides(shape)) {}

TensorView::TensorView(void* data, DType dtype, const Shape& shape, const Shape& strides)
    : data(data), dtype(dtype), shape(shape), strides(strides) {
  if (strides.rank() != shape.rank()) {
    throw Error("tensor view: strides " + strides.str() + " do not match the rank of shape " +
                shape.str());
  }
}

TensorView::TensorView(float* data, const Shape& shape)
    : TensorView(static_cast<void*>(data), DType::kFloat32, shape) {}

TensorView::TensorView(const float* data, const Shape& shape)
    : TensorView(const_cast<float*>(data), shape) {}

bool TensorView::is_contiguous() const { return strides == contiguous_strides(shape); }

// ---------------------------------------------------------------------------------------
// Tensor

namespace {
constexpr size_t kAlignment = 64;
// Tensors of at least this many bytes (KV caches, long sequences' K and V) start on a 2 MiB
// boundary and ask Linux for transparent huge pages: a decode step walks a cache of many
// MiB, where 4 KiB pages would cost a TLB miss every few KiB read (the kernel's "madvise"
// mode, Debian's default, gives huge pages only where asked). Elsewhere, or where the kernel
// declines, the pages stay 4 KiB: only speed depends on it.
constexpr size_t kHugePage = size_t{2} << 20;

void* allocate_aligned(size_t nbytes, const Shape& shape, DType dtype) {
  if (nbytes == 0) return nullptr;
  const bool huge = nbytes >= 2 * kHugePage;
  const size_t alignment = huge ? kHugePage : kAlignment;
  const size_t rounded = (nbytes + alignment - 1) / alignment * alignment;
  void* p = std::aligned_alloc(alignment, rounded);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (p != nullptr && huge) madvise(p, rounded, MADV_HUGEPAGE);
#endif
  if (p == nullptr) {
    throw Error("out of memory: cannot allocate " + std::to_string(nbytes) + " bytes for a " +
                dtype_name(dtype) + " tensor of shape " + shape.str());
  }
  return p;
}
}  // namespace

Tensor::Tensor(DType dtype, const Shape& shape) : dtype_(dtype), shape_(shape) {
  const int64_t n = shape.numel();  // >= 0; throws on overflow
  const auto size = static_cast<int64_t>(dtype_size(dtype));
  int64_t bytes;
  if (__builtin_mul_overflow(n, size, &bytes)) {
    throw Error("tensor byte size overflows: " + std::to_string(n) + " * " + std::to_string(size));
  }
  nbytes_ = static_cast<size_t>(bytes);
  data_ = allocate_aligned(nbytes_, shape, dtype);
}

Tensor Tensor::zeros(DType dtype, const Shape& shape) {
  Tensor t(dtype, shape);
  if (t.nbytes_) std::memset(t.data_, 0, t.nbytes_);
  return t;
}

Tensor Tensor::copy_of(const TensorView& view) {
  Tensor t(view.dtype, view.shape);
  convert(view, t.view());
  return t;
}

Tensor::Tensor(Tensor&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      nbytes_(std::exchange(other.nbytes_, 0)),
      dtype_(other.dtype_),
      shape_(std::exchange(other.shape_, Shape{})) {}

Tensor& Tensor::operator=(Tensor&& other) noexcept {
  if (this != &other) {
    std::free(data_);
    data_ = std::exchange(other.data_, nullptr);
    nbytes_ = std::exchange(other.nbytes_, 0);
    dtype_ = other.dtype_;
    shape_ = std::exchange(other.shape_, Shape{});
  }
  return *this;
}

Tensor::~Tensor() { std::free(data_); }

Tensor Tensor::clone() const {
  Tensor t(dtype_, shape_);
  if (nbytes_) std::memcpy(t.data_, data_, nbytes_);
  return t;
}

TensorView Tensor::view() const { return TensorView(data_, dtype_, shape_); }

// ---------------------------------------------------------------------------------------
// convert

namespace {

double load_as_double(const void* p, DType dtype) {
  return detail::visit_dtype(dtype, [p](auto row) {
    using Row = decltype(row);
    return Row::to_double(*static_cast<const typename Row::Storage*>(p));
  });
}

void store_from_double(void* p, DType dtype, double value) {
  detail::visit_dtype(dtype, [p, value](auto row) {
    using Row = decltype(row);
    *static_cast<typename Row::Storage*>(p) = Row::from_double(value);
  });
}

}  // namespace

namespace {

bool is_float_format(DType d) {
  return d == DType::kFloat32 || d == DType::kFloat16 || d == DType::kBFloat16;
}

float load_float(const void* p, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kFloat16:
      return detail::f32_from_f16(static_cast<const uint16_t*>(p)[i]);
    case DType::kBFloat16:
      return detail::f32_from_bf16(static_cast<const uint16_t*>(p)[i]);
    default:
      return static_cast<const float*>(p)[i];
  }
}

// One row of n elements between float32, float16 and bfloat16 (both contiguous): the same
// rounding as store_from_double (a float32 value converts exactly to double), in a loop the
// compiler can vectorize for the common pairs.
void convert_float_row(const void* from, DType from_dtype, void* to, DType to_dtype, int64_t n) {
  if (from_dtype == to_dtype) {  // a copy, bit for bit (a signaling NaN stays one)
    std::memcpy(to, from, static_cast<size_t>(n) * dtype_size(from_dtype));
    return;
  }
  if (from_dtype == DType::kBFloat16 && to_dtype == DType::kFloat32) {
    const auto* src = static_cast<const uint16_t*>(from);
    auto* dst = static_cast<float*>(to);
    for (int64_t i = 0; i < n; ++i) dst[i] = detail::f32_from_bf16(src[i]);
    return;
  }
  if (from_dtype == DType::kFloat16 && to_dtype == DType::kFloat32) {
    detail::f16_to_f32_row(static_cast<const uint16_t*>(from), static_cast<float*>(to), n);
    return;
  }
  if (from_dtype == DType::kFloat32 && to_dtype == DType::kFloat16) {
    detail::f32_to_f16_row(static_cast<const float*>(from), static_cast<uint16_t*>(to), n);
    return;
  }
  if (from_dtype == DType::kFloat32 && to_dtype == DType::kBFloat16) {
    const auto* src = static_cast<const float*>(from);
    auto* dst = static_cast<uint16_t*>(to);
    for (int64_t i = 0; i < n; ++i) dst[i] = detail::bf16_from_f32(src[i]);
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    const float v = load_float(from, from_dtype, i);
    switch (to_dtype) {
      case DType::kFloat16:
        static_cast<uint16_t*>(to)[i] = detail::f16_from_f32(v);
        break;
      case DType::kBFloat16:
        static_cast<uint16_t*>(to)[i] = detail::bf16_from_f32(v);
        break;
      default:
        static_cast<float*>(to)[i] = v;
        break;
    }
  }
}

// The rows of two views of one shape whose last dimension is contiguous, between float
// formats: the fast path of convert (the kernels' conversions of float16 and bfloat16
// operands and results).
bool convert_float_rows(const TensorView& from, const TensorView& to) {
  const int rank = from.rank();
  if (rank == 0 || !is_float_format(from.dtype) || !is_float_format(to.dtype)) return false;
  const int64_t n = from.shape.back(0);
  if (n > 1 && (from.strides.back(0) != 1 || to.strides.back(0) != 1)) return false;
  const int64_t rows = from.numel() / n;
  const auto from_size = static_cast<int64_t>(dtype_size(from.dtype));
  const auto to_size = static_cast<int64_t>(dtype_size(to.dtype));
  // Rows are independent: large conversions (the kernels' staging copies, whose first touch
  // of fresh pages costs as much as the conversion) run on every thread.
  // Smaller ones (a decoding step's appends to a cache) stay inline, without a parallel region.
  const bool parallel = rows > 1 && rows * n >= (int64_t{1} << 20);
  detail::parallel_for(parallel ? omp_get_max_threads() : 1, rows, [&](int64_t r) {
    int64_t from_offset = 0, to_offset = 0, rest = r;
    for (int d = rank - 2; d >= 0; --d) {
      const int64_t i = rest % from.shape[d];
      rest /= from.shape[d];
      from_offset += i * from.strides[d];
      to_offset += i * to.strides[d];
    }
    convert_float_row(static_cast<const char*>(from.data) + from_offset * from_size, from.dtype,
                      static_cast<char*>(to.data) + to_offset * to_size, to.dtype, n);
  });
  return true;
}

}  // namespace

void convert(const TensorView& from, const TensorView& to) {
  if (from.shape != to.shape) {
    throw Error("convert: shape " + from.shape.str() + " does not match " + to.shape.str());
  }
  const int64_t n = from.numel();
  if (n == 0) return;
  if (convert_float_rows(from, to)) return;
  const int rank = from.rank();
  const size_t from_size = dtype_size(from.dtype), to_size = dtype_size(to.dtype);
  const bool same_plain_copy = from.dtype == to.dtype;
  int64_t index[Shape::kMaxRank] = {};
  for (int64_t i = 0; i < n; ++i) {
    int64_t from_offset = 0, to_offset = 0;
    for (int d = 0; d < rank; ++d) {
      from_offset += index[d] * from.strides[d];
      to_offset += index[d] * to.strides[d];
    }
    const char* src =
        static_cast<const char*>(from.data) + from_offset * static_cast<int64_t>(from_size);
    char* dst = static_cast<char*>(to.data) + to_offset * static_cast<int64_t>(to_size);
    if (same_plain_copy) {
      std::memcpy(dst, src, from_size);
    } else {
      store_from_double(dst, to.dtype, load_as_double(src, from.dtype));
    }
    for (int d = rank - 1; d >= 0; --d) {
      if (++index[d] < from.shape[d]) break;
      index[d] = 0;
    }
  }
}

}  // namespace attend
