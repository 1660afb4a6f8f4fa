// Layout checks shared by the kernel families, and the plain structs their kernels receive.
//
// A batched matrix argument is a TensorDesc of shape (..., rows, cols). The leading dims of size > 1
// form the batch; every operand of one launch has the same batch shape and carries its own batch
// strides, so views (transposes, slices, expanded batches) need no copy. Offsets are int64
// everywhere: batch * rows * cols overflows int32 for stacked large weights.
#pragma once

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "common.h"

namespace spectral_ops {

constexpr int kMaxBatchDims = kMaxDims - 2;

struct Dim {
  int64_t size;
  int64_t stride;
};

// The tensor's dims of size > 1, outermost first, with neighbours merged where the memory runs on
// from one into the other. Merging keeps the row-major element order.
inline std::vector<Dim> merged_dims(const TensorDesc& t) {
  std::vector<Dim> dims;
  for (int i = 0; i < t.ndim(); ++i) {
    if (t.shape[i] == 1) continue;
    if (!dims.empty() && dims.back().stride == t.strides[i] * t.shape[i]) {
      dims.back() = {dims.back().size * t.shape[i], t.strides[i]};
    } else {
      dims.push_back({t.shape[i], t.strides[i]});
    }
  }
  return dims;
}

// A written tensor whose elements share memory would race with itself. Sufficient test: ordered by
// stride, each dim must step past everything the smaller dims reach.
inline void check_no_overlap(const TensorDesc& t) {
  if (t.numel() == 0) return;
  std::vector<Dim> dims = merged_dims(t);
  std::sort(dims.begin(), dims.end(), [](const Dim& a, const Dim& b) { return a.stride < b.stride; });
  int64_t extent = 1;
  for (const Dim& dim : dims) {
    if (dim.stride < extent) {
      throw std::invalid_argument(t.describe() + ": elements overlap in memory, so it cannot be written");
    }
    extent += (dim.size - 1) * dim.stride;
  }
}

inline bool is_contiguous(const TensorDesc& t) {
  int64_t expected = 1;
  for (int i = t.ndim() - 1; i >= 0; --i) {
    if (t.shape[i] != 1 && t.strides[i] != expected) return false;
    expected *= t.shape[i];
  }
  return true;
}

inline void check_contiguous(const TensorDesc& t) {
  if (t.numel() > 0 && !is_contiguous(t)) throw std::invalid_argument(t.describe() + ": must be contiguous");
}

// [first byte, one past the last byte) that the tensor can touch; empty for an empty tensor.
inline std::pair<uint64_t, uint64_t> byte_span(const TensorDesc& t) {
  if (t.numel() == 0) return {t.data, t.data};
  uint64_t last = 0;
  for (int i = 0; i < t.ndim(); ++i) last += static_cast<uint64_t>((t.shape[i] - 1) * t.strides[i]);
  return {t.data, t.data + (last + 1) * static_cast<uint64_t>(element_size(t.dtype))};
}

inline bool same_view(const TensorDesc& a, const TensorDesc& b) {
  return a.data == b.data && a.dtype == b.dtype && a.shape == b.shape && a.strides == b.strides;
}

// Kernels read `other` while they write `written`, from other threads and blocks: they must not share
// memory. The test is on address spans, so two interleaved views are refused even if disjoint.
inline void check_disjoint(const TensorDesc& written, const TensorDesc& other) {
  const auto [w0, w1] = byte_span(written);
  const auto [o0, o1] = byte_span(other);
  if (w0 < o1 && o0 < w1) {
    throw std::invalid_argument(std::string(written.name) + " overlaps " + other.name +
                                " in memory; the kernel reads " + other.name + " while it writes " + written.name);
  }
}

inline void check_dtype(const TensorDesc& t, std::initializer_list<DType> allowed, const char* what) {
  if (std::find(allowed.begin(), allowed.end(), t.dtype) == allowed.end()) {
    throw TypeError(std::string(t.name) + ": dtype " + dtype_name(t.dtype) + " is not supported; " + what);
  }
}

inline void check_same_device(const TensorDesc& reference, const TensorDesc& t) {
  if (t.device != reference.device) {
    throw std::invalid_argument("device mismatch: " + std::string(reference.name) + " is on " +
                                format_device(reference.device) + " but " + t.name + " is on " +
                                format_device(t.device));
  }
}

inline void check_matrix_dims(const TensorDesc& t) {
  if (t.ndim() < 2) {
    throw std::invalid_argument(std::string(t.name) + ": expected a (..., rows, cols) tensor, got shape " +
                                format_dims(t.shape));
  }
}

inline int64_t rows_of(const TensorDesc& t) { return t.shape[t.ndim() - 2]; }
inline int64_t cols_of(const TensorDesc& t) { return t.shape[t.ndim() - 1]; }

inline std::vector<int64_t> batch_dims(const TensorDesc& t) {
  return std::vector<int64_t>(t.shape.begin(), t.shape.end() - 2);
}

inline void check_same_batch(const TensorDesc& reference, const TensorDesc& t) {
  if (batch_dims(t) != batch_dims(reference)) {
    throw std::invalid_argument("batch shape mismatch: " + std::string(reference.name) + " has shape " +
                                format_dims(reference.shape) + " but " + t.name + " has shape " +
                                format_dims(t.shape) + " (leading dims must be equal; no broadcasting)");
  }
}

// The leading dims of size > 1. Every operand of a launch shares the batch shape, so the same positions
// index all of them.
struct BatchShape {
  int ndim;
  int64_t count;
  int64_t sizes[kMaxBatchDims];
};

inline std::vector<int> batch_positions(const TensorDesc& t) {
  std::vector<int> positions;
  for (int i = 0; i + 2 < t.ndim(); ++i) {
    if (t.shape[i] != 1) positions.push_back(i);
  }
  if (positions.size() > static_cast<size_t>(kMaxBatchDims)) {
    throw std::invalid_argument(t.describe() + ": " + std::to_string(positions.size()) +
                                " leading dims of size > 1; at most " + std::to_string(kMaxBatchDims) +
                                " are supported (reshape the batch first)");
  }
  return positions;
}

inline BatchShape make_batch(const TensorDesc& t, const std::vector<int>& positions) {
  BatchShape batch{static_cast<int>(positions.size()), 1, {}};
  for (size_t k = 0; k < positions.size(); ++k) {
    batch.sizes[k] = t.shape[positions[k]];
    batch.count *= batch.sizes[k];
  }
  return batch;
}

// One batched matrix as a kernel sees it. `data` is null for an absent optional operand.
struct MatrixView {
  void* data;
  DType dtype;
  int64_t row_stride;
  int64_t col_stride;
  int64_t batch_strides[kMaxBatchDims];
};

inline MatrixView make_view(const TensorDesc& t, const std::vector<int>& positions) {
  MatrixView view{t.ptr<void>(), t.dtype, t.strides[t.ndim() - 2], t.strides[t.ndim() - 1], {}};
  for (size_t k = 0; k < positions.size(); ++k) view.batch_strides[k] = t.strides[positions[k]];
  return view;
}

inline MatrixView transposed(MatrixView view) {
  std::swap(view.row_stride, view.col_stride);
  return view;
}

// A scale applied in a kernel: `value`, times one fp32 value per matrix when `per_matrix` is given (a
// device vector, so norms and learning rates held on the GPU never cost a host sync, and a step can be
// captured in a CUDA graph).
struct ScaleArg {
  double value;
  std::optional<TensorDesc> per_matrix;
};

struct DeviceScale {
  float value;
  const float* per_matrix;
};

// The validated device vector of a scale, or null.
inline const float* per_matrix_pointer(const ScaleArg& scale, int64_t count, const TensorDesc& reference) {
  if (!scale.per_matrix) return nullptr;
  const TensorDesc& vector = *scale.per_matrix;
  check_dtype(vector, {DType::kFloat32}, "per-matrix scales are float32");
  check_same_device(reference, vector);
  if (vector.numel() != count || !is_contiguous(vector)) {
    throw std::invalid_argument(vector.describe() + ": must be contiguous with one value per matrix (" +
                                std::to_string(count) + ")");
  }
  return vector.ptr<const float>();
}

inline DeviceScale make_scale(const char* name, const ScaleArg& scale, int64_t count, const TensorDesc& reference) {
  const float value = static_cast<float>(scale.value);
  if (!std::isfinite(value)) {
    throw std::invalid_argument(std::string(name) + " = " + std::to_string(scale.value) +
                                " is not a finite float32 number");
  }
  return {value, per_matrix_pointer(scale, count, reference)};
}

}  // namespace spectral_ops
