// boundary/views.cpp: see views.hpp.
#include "boundary/views.hpp"

#include <string>

#include "attend/error.hpp"

namespace attend::detail {

std::string describe(const char* name, const TensorView& t) {
  return std::string(name) + " " + t.shape.str();
}

void check_view(const char* name, const TensorView& t) {
  if (t.strides.rank() != t.shape.rank()) {
    throw Error(std::string(name) + ": strides " + t.strides.str() + " do not match shape " +
                t.shape.str());
  }
  for (int d = 0; d < t.rank(); ++d) {
    if (t.shape[d] < 0) throw Error(describe(name, t) + " has a negative dimension");
    if (t.strides[d] < 0) {
      throw Error(std::string(name) + ": negative stride " + std::to_string(t.strides[d]) +
                  " in dimension " + std::to_string(d) + " is not supported");
    }
  }
  const int64_t count = t.shape.numel();  // throws on overflow
  if (t.data == nullptr && count > 0) {
    throw Error(std::string(name) + ": data pointer is null for shape " + t.shape.str());
  }
  if (count == 0) return;
  // The byte offset of the last element must be representable (byte_range, the kernels).
  int64_t last_offset = 0;
  bool overflow = false;
  for (int d = 0; d < t.rank(); ++d) {
    int64_t term;
    overflow |= __builtin_mul_overflow(t.shape[d] - 1, t.strides[d], &term);
    overflow |= __builtin_add_overflow(last_offset, term, &last_offset);
  }
  int64_t bytes;
  overflow |= __builtin_add_overflow(last_offset, 1, &last_offset);
  overflow |=
      __builtin_mul_overflow(last_offset, static_cast<int64_t>(dtype_size(t.dtype)), &bytes);
  if (overflow) {
    throw Error(std::string(name) + ": byte offset of the last element of shape " + t.shape.str() +
                " with strides " + t.strides.str() + " overflows");
  }
}

int64_t byte_extent(const TensorView& t) {
  if (t.numel() == 0) return 0;
  int64_t last_offset = 0;
  for (int d = 0; d < t.rank(); ++d) last_offset += (t.shape[d] - 1) * t.strides[d];
  const auto size = static_cast<int64_t>(dtype_size(t.dtype));
  return last_offset * size + size;
}

ByteRange byte_range(const void* data, int64_t extent) {
  const auto* first = static_cast<const char*>(data);
  return extent > 0 ? ByteRange{first, first + extent} : ByteRange{};
}

ByteRange byte_range(const TensorView& t) { return byte_range(t.data, byte_extent(t)); }

bool ranges_overlap(const ByteRange& a, const ByteRange& b) {
  return a.first && b.first && a.first < b.last && b.first < a.last;
}

bool overlaps(const TensorView& a, const TensorView& b) {
  return ranges_overlap(byte_range(a), byte_range(b));
}

// Strides (elements) of a view broadcast to (batch..., rows, columns); `target` is that shape.
OperandStrides broadcast_strides(const char* name, const TensorView& t, const Shape& target) {
  if (t.rank() > target.rank()) {
    throw Error(describe(name, t) + " has more dimensions than the scores " + target.str());
  }
  Shape aligned;  // per target dim: the view's stride, 0 where it broadcasts
  for (int d = 0; d < target.rank(); ++d) {
    const int source = d - (target.rank() - t.rank());
    if (source < 0) {
      aligned.push_back(0);
      continue;
    }
    if (t.shape[source] == target[d]) {
      aligned.push_back(target[d] == 1 ? 0 : t.strides[source]);
    } else if (t.shape[source] == 1) {
      aligned.push_back(0);
    } else {
      throw Error(describe(name, t) + " does not broadcast to the scores " + target.str() +
                  " (dimension " + std::to_string(source) + ")");
    }
  }
  OperandStrides s;
  const int batch_rank = target.rank() - 2;
  for (int d = 0; d < batch_rank; ++d) s.batch[kMaxBatchRank - batch_rank + d] = aligned[d];
  s.row = aligned[batch_rank];
  s.column = aligned[batch_rank + 1];
  return s;
}

namespace {
// Strides of a (batch..., rows[, columns]) view with `batch_rank` batch dimensions (0 where one
// has size 1), `row` the next dimension's, the column stride 1.
OperandStrides leading_strides(const TensorView& t, int batch_rank) {
  OperandStrides s;
  for (int d = 0; d < batch_rank; ++d) {
    s.batch[kMaxBatchRank - batch_rank + d] = t.shape[d] == 1 ? 0 : t.strides[d];
  }
  s.row = t.strides[batch_rank];
  return s;
}

// `t` itself (its last stride 1) when it is float32 with a contiguous last dimension.
std::optional<TensorView> contiguous_float(const TensorView& t) {
  if (t.dtype != DType::kFloat32 || (t.strides.back(0) != 1 && t.shape.back(0) > 1)) {
    return std::nullopt;
  }
  TensorView v = t;
  v.strides[v.rank() - 1] = 1;
  return v;
}
}  // namespace

OperandStrides plain_strides(const TensorView& t) { return leading_strides(t, t.rank() - 2); }

OperandStrides row_vector_strides(const TensorView& t) {
  return leading_strides(t, t.rank() - 1);
}

// A float32 view with a contiguous last dimension: the view itself when it already is one,
// otherwise a converted copy kept alive in `storage`.
TensorView as_kernel_float(const TensorView& t, std::optional<Tensor>& storage) {
  if (const std::optional<TensorView> v = contiguous_float(t)) return *v;
  storage.emplace(DType::kFloat32, t.shape);
  convert(t, storage->view());
  return storage->view();
}

// A float32 view with a contiguous last dimension to write into: `out` itself when it is
// one, else a staging tensor kept in `storage` (copied back by the caller).
TensorView writable_kernel_float(const TensorView& out, std::optional<Tensor>& storage) {
  if (const std::optional<TensorView> v = contiguous_float(out)) return *v;
  storage.emplace(DType::kFloat32, out.shape);
  return storage->view();
}

}  // namespace attend::detail
