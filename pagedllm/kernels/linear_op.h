// A linear layer as the C++ decoder stack runs it: whatever holds its weights (bf16 packed for
// oneDNN's layout, fp32 or bf16 in 16-column blocks, quantized records) and computes
// [rows, in] -> [rows, out] (after SiLU-and-mul, for a gated MLP's gate_up). Python builds one per
// layer through its linear method (layers/linear.py's kernel_spec) and may call it too.
#pragma once

#include <torch/extension.h>

class LinearOp {
 public:
  virtual ~LinearOp() = default;
  // out: a contiguous [rows, out_features()] tensor to write the result into (the decoder stack's
  // reused buffers), or an undefined one for a new tensor. Returns the result.
  virtual torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& out) const = 0;
  virtual int64_t out_features() const = 0;  // of the result (after SiLU-and-mul: half the product's)

 protected:
  torch::Tensor output(const torch::Tensor& x, const torch::Tensor& out) const {
    if (!out.defined()) return torch::empty({x.size(0), out_features()}, x.options());
    TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == out_features() && out.is_contiguous() &&
                    out.scalar_type() == x.scalar_type(),
                "a contiguous [", x.size(0), ", ", out_features(), "] output of the activations' dtype expected");
    return out;
  }
};
