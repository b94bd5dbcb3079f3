// multihead/linear.cpp: attend::linear_into (attend/linear.hpp), checked at the boundary, then
// the projection GEMM (kernels/gemm.hpp).
#include "attend/linear.hpp"

#include <string>
#include <utility>

#include "attend/error.hpp"
#include "attend/runtime.hpp"
#include "boundary/views.hpp"
#include "kernels/gemm.hpp"

namespace attend {
namespace {

// A float32 view of `rank` dimensions whose last stride is 1 (or whose last dimension is at
// most 1 long).
void check_operand(const char* name, const TensorView& t, int rank) {
  detail::check_view(name, t);
  if (t.dtype != DType::kFloat32) {
    throw Error(std::string("linear: ") + name + " must be float32, got " +
                dtype_name(t.dtype));
  }
  if (t.rank() != rank) {
    throw Error(std::string("linear: ") + name + " must have " + std::to_string(rank) +
                " dimension" + (rank > 1 ? "s" : "") + ", got shape " + t.shape.str());
  }
  if (t.shape.back(0) > 1 && t.strides.back(0) != 1) {
    throw Error(std::string("linear: ") + name + " must have a unit last stride, got strides " +
                t.strides.str());
  }
}

}  // namespace

void linear_into(const TensorView& input, const TensorView& weight, const TensorView* bias,
                 const TensorView& output, int num_threads) {
  check_operand("input", input, 2);
  check_operand("weight", weight, 2);
  check_operand("output", output, 2);
  if (bias != nullptr) check_operand("bias", *bias, 1);
  const int64_t rows = input.shape[0], depth = input.shape[1], columns = weight.shape[0];
  if (weight.shape[1] != depth) {
    throw Error("linear: weight " + weight.shape.str() + " does not take input " +
                input.shape.str() + " (in_features must equal the input's last dimension)");
  }
  if (bias != nullptr && bias->shape[0] != columns) {
    throw Error("linear: bias " + bias->shape.str() + " must have " + std::to_string(columns) +
                " elements (out_features of weight " + weight.shape.str() + ")");
  }
  if (output.shape[0] != rows || output.shape[1] != columns) {
    throw Error("linear: output " + output.shape.str() + " must be (" + std::to_string(rows) +
                ", " + std::to_string(columns) + ")");
  }
  if (num_threads < 0) {
    throw Error("linear: num_threads must be >= 0 (0 = default), got " +
                std::to_string(num_threads));
  }
  if (rows > 1 && columns > 0 && output.strides[0] < columns) {
    throw Error("linear: output rows overlap (row stride " + std::to_string(output.strides[0]) +
                " < " + std::to_string(columns) + " columns)");
  }
  for (const auto& [name, view] : {std::pair<const char*, const TensorView*>{"input", &input},
                                   {"weight", &weight},
                                   {"bias", bias}}) {
    if (view != nullptr && detail::overlaps(output, *view)) {
      throw Error(std::string("linear: output overlaps ") + name);
    }
  }
  if (rows == 0 || columns == 0) return;
  detail::LinearParams p;
  p.rows = rows;
  p.columns = columns;
  p.depth = depth;
  p.input = input.data_as<const float>();
  p.input_row_stride = input.strides[0];
  p.weight = weight.data_as<const float>();
  p.weight_row_stride = weight.strides[0];
  p.bias = bias != nullptr ? bias->data_as<const float>() : nullptr;
  p.output = output.data_as<float>();
  p.output_row_stride = output.strides[0];
  p.num_threads = num_threads > 0 ? num_threads : default_num_threads();
  detail::linear(p);
}

}  // namespace attend
