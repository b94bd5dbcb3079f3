// Uses attend as an installed package would be used.
#include <attend/attend.hpp>
#include <cstdio>
#include <vector>
int main() {
  std::vector<float> q(2 * 3 * 4, 0.5f);
  auto r =
      attend::scaled_dot_product_attention(attend::TensorView(q.data(), attend::Shape{2, 3, 4}),
                                           attend::TensorView(q.data(), attend::Shape{2, 3, 4}),
                                           attend::TensorView(q.data(), attend::Shape{2, 3, 4}));
  std::printf("%s %s %f\n", attend::version(), r.output.shape().str().c_str(),
              r.output.data_as<float>()[0]);
}
