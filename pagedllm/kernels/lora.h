// The rows of a step that run under LoRA adapters, shared by every adapter layer of the C++ decoder
// stack (lora.cpp's LoRALinear) and the stack itself: set from Python (layers/lora.py's
// LoRAContext) before each step.
#pragma once

#include <torch/extension.h>

class LoRARows {
 public:
  // row_slot: int32 [rows], -1 for the base model's rows; undefined when no row has an adapter.
  // lora_rows (int64) and lora_row_slot: the rows with an adapter and their slots, where some rows
  // have none; undefined where every row has one.
  void set(c10::optional<torch::Tensor> row_slot, c10::optional<torch::Tensor> lora_rows,
           c10::optional<torch::Tensor> lora_row_slot) {
    row_slot_ = row_slot.value_or(torch::Tensor());
    lora_rows_ = lora_rows.value_or(torch::Tensor());
    lora_row_slot_ = lora_row_slot.value_or(torch::Tensor());
  }
  bool active() const { return row_slot_.defined(); }
  const torch::Tensor& row_slot() const { return row_slot_; }
  const torch::Tensor& lora_rows() const { return lora_rows_; }
  const torch::Tensor& lora_row_slot() const { return lora_row_slot_; }

 private:
  torch::Tensor row_slot_, lora_rows_, lora_row_slot_;
};
