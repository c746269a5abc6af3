// DType and TensorView: typed, device-tagged views of memory that backends, pools and kernels take
// instead of raw host pointers, so one interface serves CPU and GPU memory.
//
// A view does not own its memory and never allocates. `data` points at element [0, 0, ...];
// `strides` are in elements (not bytes) and may be 0 (broadcast) but never negative. A view is a
// value: copy it freely. Whether `data` may be dereferenced on the host depends on `device`
// (kCpu: yes; kCuda: only inside kernels on that device, or pinned/mapped memory the caller knows).
//
// Checking. check_view() validates a view against what a callee expects (dtype set, device kind,
// rank and sizes, -1 meaning "any") and returns kInvalidArgument naming the argument, the expected
// and the actual value, e.g. "q: dtype bf16, expected fp32". Callers check once, before enqueueing
// work, so a bad argument never reaches a kernel.
//
// Thread-safety: plain values; the memory they point at follows the stream order of its writers.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <type_traits>

#include "backends/runtime/stream.h"
#include "common/status.h"

namespace pdsim::runtime {

enum class DType : uint8_t { kF32, kBF16, kF16, kFP8E4M3, kI32, kI64 };

// Bytes per element.
[[nodiscard]] size_t dtype_size(DType dtype);
// "fp32", "bf16", "fp16", "fp8_e4m3", "int32", "int64".
[[nodiscard]] std::string_view dtype_name(DType dtype);
// Accepts the names above and "float32", "bfloat16", "float16", "fp8". kInvalidArgument otherwise,
// listing the accepted names.
[[nodiscard]] StatusOr<DType> parse_dtype(std::string_view text);

inline constexpr int kMaxTensorRank = 4;

template <bool kConst>
struct BasicTensorView {
    using Pointer = std::conditional_t<kConst, const void*, void*>;

    Pointer data = nullptr;
    DType dtype = DType::kF32;
    Device device{};
    int rank = 0;
    std::array<int64_t, kMaxTensorRank> shape{};
    std::array<int64_t, kMaxTensorRank> strides{};  // elements

    BasicTensorView() = default;
    // A view of a non-const tensor converts to a view of a const one.
    template <bool kOther>
    requires(kConst && !kOther) BasicTensorView(
        const BasicTensorView<kOther>& other)  // NOLINT(google-explicit-constructor)
        : data(other.data),
          dtype(other.dtype),
          device(other.device),
          rank(other.rank),
          shape(other.shape),
          strides(other.strides) {}

    [[nodiscard]] int64_t size(int dim) const { return shape[static_cast<size_t>(dim)]; }
    [[nodiscard]] int64_t stride(int dim) const { return strides[static_cast<size_t>(dim)]; }
    [[nodiscard]] int64_t numel() const {
        int64_t n = 1;
        for (int d = 0; d < rank; ++d) n *= shape[static_cast<size_t>(d)];
        return n;
    }
    [[nodiscard]] size_t bytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype); }
    // Row-major with no gaps (strides are the suffix products of shape).
    [[nodiscard]] bool is_contiguous() const {
        int64_t expect = 1;
        for (int d = rank - 1; d >= 0; --d) {
            if (shape[static_cast<size_t>(d)] != 1 && strides[static_cast<size_t>(d)] != expect) {
                return false;
            }
            expect *= shape[static_cast<size_t>(d)];
        }
        return true;
    }
    [[nodiscard]] bool empty() const { return data == nullptr; }
    // Typed pointer; the caller has checked dtype (check_view) and device.
    template <typename T>
    [[nodiscard]] auto as() const {
        if constexpr (kConst) {
            return static_cast<const T*>(data);
        } else {
            return static_cast<T*>(data);
        }
    }
};

using TensorView = BasicTensorView<false>;
using ConstTensorView = BasicTensorView<true>;

// A contiguous row-major view of `shape` (at most kMaxTensorRank dims).
[[nodiscard]] TensorView make_view(void* data, DType dtype, Device device,
                                   std::initializer_list<int64_t> shape);
[[nodiscard]] ConstTensorView make_view(const void* data, DType dtype, Device device,
                                        std::initializer_list<int64_t> shape);
// Host (kCpu) shorthands for the common element types.
[[nodiscard]] TensorView host_view(float* data, std::initializer_list<int64_t> shape);
[[nodiscard]] ConstTensorView host_view(const float* data, std::initializer_list<int64_t> shape);
[[nodiscard]] TensorView host_view(int32_t* data, std::initializer_list<int64_t> shape);
[[nodiscard]] ConstTensorView host_view(const int32_t* data, std::initializer_list<int64_t> shape);

// What a callee accepts; -1 in `shape` matches any size. An empty `dtypes` accepts any dtype.
struct ViewSpec {
    std::initializer_list<DType> dtypes;
    DeviceKind device = DeviceKind::kCpu;
    std::initializer_list<int64_t> shape;  // its length is the required rank
    bool contiguous = true;
    bool allow_null = false;  // a null data pointer is accepted (e.g. unused v)
};

// kInvalidArgument naming `name` when `view` does not match `spec` (see the file comment).
[[nodiscard]] Status check_view(const ConstTensorView& view, std::string_view name,
                                const ViewSpec& spec);

// "bf16[7, 8, 128] cuda:0" (for messages and logs).
[[nodiscard]] std::string describe(const ConstTensorView& view);

}  // namespace pdsim::runtime
