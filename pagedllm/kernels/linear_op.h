// A linear layer as the C++ decoder stack runs it: whatever holds its weights (bf16 packed for
// oneDNN's layout, quantized records) and computes [rows, in] -> [rows, out] (after SiLU-and-mul,
// for a gated MLP's gate_up). Python builds one per layer through its linear method
// (layers/linear.py's kernel_spec) and may call it too.
#pragma once

#include <torch/extension.h>

class LinearOp {
 public:
  virtual ~LinearOp() = default;
  virtual torch::Tensor forward(const torch::Tensor& x) const = 0;
};
