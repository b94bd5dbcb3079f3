// attend/tensor.hpp: dtypes, shapes, a non-owning strided view and an owning aligned tensor.
//
// Strides are counted in elements (not bytes), like PyTorch. A view never owns memory: the
// caller keeps the storage alive while the view is used.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

namespace attend {

enum class DType : uint8_t {
  kFloat32,
  kFloat16,
  kBFloat16,
  kFloat64,
  kBool,
  kInt8,
  kInt16,
  kInt32,
  kInt64,
  kUInt8,
  kUInt16,
  kUInt32,
  kUInt64,
  // 8-bit floats (OCP FP8) for K/V caches: E4M3 (PyTorch's float8_e4m3fn: no infinities,
  // largest finite 448) and E5M2 (float8_e5m2: the top byte of a float16). Conversions
  // round to nearest even and saturate to the largest finite value.
  kFloat8E4M3,
  kFloat8E5M2,
};

// Bytes per element of `dtype`.
size_t dtype_size(DType dtype);
// Lower-case name used in messages: "float32", "float16", "bool", "int64", ...
const char* dtype_name(DType dtype);
bool is_floating(DType dtype);

// A fixed-capacity list of dimensions (rank ≤ kMaxRank); no heap allocation.
class Shape {
 public:
  static constexpr int kMaxRank = 8;

  Shape() = default;
  Shape(std::initializer_list<int64_t> dims);
  static Shape from(const int64_t* dims, int rank);

  int rank() const { return rank_; }
  int64_t operator[](int i) const { return dims_[static_cast<size_t>(i)]; }
  int64_t& operator[](int i) { return dims_[static_cast<size_t>(i)]; }
  // Dimension counted from the end: back(0) is the last one.
  int64_t back(int i) const { return dims_[static_cast<size_t>(rank_ - 1 - i)]; }
  const int64_t* data() const { return dims_.data(); }
  void push_back(int64_t d);
  // Product of all dimensions (1 for rank 0). Throws attend::Error on overflow.
  int64_t numel() const;

  bool operator==(const Shape& other) const;
  bool operator!=(const Shape& other) const { return !(*this == other); }
  // "(2, 5, 64)"
  std::string str() const;

 private:
  int rank_ = 0;
  std::array<int64_t, kMaxRank> dims_{};
};

// Row-major (C order) strides, in elements, for `shape`.
Shape contiguous_strides(const Shape& shape);

// Non-owning view: pointer, dtype, shape and strides (elements). Strides may be zero
// (broadcast) or anything else non-negative. One type serves inputs and outputs, so a view
// does not carry constness (Tensor::view() of a const tensor is writable): the library reads
// through the views passed as inputs and writes only through those passed as outputs (the
// *_into calls), which must not overlap an input. A view made from const data (the
// const float* constructor) may only be passed as an input.
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  Shape shape;
  Shape strides;

  TensorView() = default;
  // Contiguous (row-major) view.
  TensorView(void* data, DType dtype, const Shape& shape);
  TensorView(void* data, DType dtype, const Shape& shape, const Shape& strides);
  // Contiguous float32 views, the common case.
  TensorView(float* data, const Shape& shape);
  TensorView(const float* data, const Shape& shape);

  int rank() const { return shape.rank(); }
  int64_t numel() const { return shape.numel(); }
  bool is_contiguous() const;

  template <typename T>
  T* data_as() const {
    return static_cast<T*>(data);
  }
};

// Owning, 64-byte aligned, contiguous tensor. Move-only; clone() copies.
class Tensor {
 public:
  Tensor() = default;
  // Uninitialized storage. Throws attend::Error when the byte count overflows or the
  // allocation fails.
  Tensor(DType dtype, const Shape& shape);
  static Tensor zeros(DType dtype, const Shape& shape);
  // A contiguous copy of any view (same dtype).
  static Tensor copy_of(const TensorView& view);

  Tensor(Tensor&& other) noexcept;
  Tensor& operator=(Tensor&& other) noexcept;
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;
  ~Tensor();

  Tensor clone() const;

  bool empty() const { return data_ == nullptr && shape_.rank() == 0; }
  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  int64_t numel() const { return shape_.numel(); }
  size_t nbytes() const { return nbytes_; }

  void* data() { return data_; }
  const void* data() const { return data_; }
  template <typename T>
  T* data_as() {
    return static_cast<T*>(data_);
  }
  template <typename T>
  const T* data_as() const {
    return static_cast<const T*>(data_);
  }

  TensorView view() const;

 private:
  void* data_ = nullptr;
  size_t nbytes_ = 0;
  DType dtype_ = DType::kFloat32;
  Shape shape_;
};

// Converts between dtypes element by element (any floating dtype to float32 and back,
// integers and bool to float32). Shapes must match; strides are honoured on both sides.
void convert(const TensorView& from, const TensorView& to);

}  // namespace attend
