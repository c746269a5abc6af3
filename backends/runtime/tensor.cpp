#include "backends/runtime/tensor.h"

#include <fmt/format.h>

namespace pdsim::runtime {

namespace {

struct DTypeInfo {
    DType dtype;
    std::string_view name;
    size_t size;
};

constexpr std::array<DTypeInfo, 6> kDTypes{{
    {DType::kF32, "fp32", 4},
    {DType::kBF16, "bf16", 2},
    {DType::kF16, "fp16", 2},
    {DType::kFP8E4M3, "fp8_e4m3", 1},
    {DType::kI32, "int32", 4},
    {DType::kI64, "int64", 8},
}};

const DTypeInfo& info(DType dtype) {
    for (const DTypeInfo& i : kDTypes) {
        if (i.dtype == dtype) return i;
    }
    return kDTypes[0];  // unreachable for valid enumerators
}

template <typename View, typename Ptr>
View contiguous(Ptr data, DType dtype, Device device, std::initializer_list<int64_t> shape) {
    View v;
    v.data = data;
    v.dtype = dtype;
    v.device = device;
    v.rank = static_cast<int>(std::min<size_t>(shape.size(), kMaxTensorRank));
    int d = 0;
    for (int64_t s : shape) {
        if (d >= kMaxTensorRank) break;
        v.shape[static_cast<size_t>(d++)] = s;
    }
    int64_t stride = 1;
    for (int i = v.rank - 1; i >= 0; --i) {
        v.strides[static_cast<size_t>(i)] = stride;
        stride *= v.shape[static_cast<size_t>(i)];
    }
    return v;
}

std::string shape_text(const ConstTensorView& v) {
    std::string s = "[";
    for (int d = 0; d < v.rank; ++d) s += fmt::format("{}{}", d ? ", " : "", v.size(d));
    return s + "]";
}

}  // namespace

size_t dtype_size(DType dtype) {
    return info(dtype).size;
}
std::string_view dtype_name(DType dtype) {
    return info(dtype).name;
}

StatusOr<DType> parse_dtype(std::string_view text) {
    for (const DTypeInfo& i : kDTypes) {
        if (i.name == text) return i.dtype;
    }
    if (text == "float32") return DType::kF32;
    if (text == "bfloat16") return DType::kBF16;
    if (text == "float16") return DType::kF16;
    if (text == "fp8") return DType::kFP8E4M3;
    std::string known;
    for (const DTypeInfo& i : kDTypes)
        known += fmt::format("{}{}", known.empty() ? "" : ", ", i.name);
    return PDSIM_ERROR(StatusCode::kInvalidArgument, "unknown dtype '{}' (expected one of: {})",
                       text, known);
}

TensorView make_view(void* data, DType dtype, Device device, std::initializer_list<int64_t> shape) {
    return contiguous<TensorView>(data, dtype, device, shape);
}
ConstTensorView make_view(const void* data, DType dtype, Device device,
                          std::initializer_list<int64_t> shape) {
    return contiguous<ConstTensorView>(data, dtype, device, shape);
}
TensorView host_view(float* data, std::initializer_list<int64_t> shape) {
    return make_view(static_cast<void*>(data), DType::kF32, Device{}, shape);
}
ConstTensorView host_view(const float* data, std::initializer_list<int64_t> shape) {
    return make_view(static_cast<const void*>(data), DType::kF32, Device{}, shape);
}
TensorView host_view(int32_t* data, std::initializer_list<int64_t> shape) {
    return make_view(static_cast<void*>(data), DType::kI32, Device{}, shape);
}
ConstTensorView host_view(const int32_t* data, std::initializer_list<int64_t> shape) {
    return make_view(static_cast<const void*>(data), DType::kI32, Device{}, shape);
}

std::string describe(const ConstTensorView& v) {
    return fmt::format("{}{} {}:{}", dtype_name(v.dtype), shape_text(v),
                       device_kind_name(v.device.kind), v.device.index);
}

Status check_view(const ConstTensorView& view, std::string_view name, const ViewSpec& spec) {
    if (view.data == nullptr) {
        if (spec.allow_null) return {};
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "{}: null data pointer", name);
    }
    if (spec.dtypes.size() > 0) {
        bool ok = false;
        std::string want;
        for (DType d : spec.dtypes) {
            ok = ok || d == view.dtype;
            want += fmt::format("{}{}", want.empty() ? "" : " or ", dtype_name(d));
        }
        if (!ok) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument, "{}: dtype {}, expected {}", name,
                               dtype_name(view.dtype), want);
        }
    }
    if (view.device.kind != spec.device) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "{}: memory on {}, expected {}", name,
                           device_kind_name(view.device.kind), device_kind_name(spec.device));
    }
    const int want_rank = static_cast<int>(spec.shape.size());
    bool shape_ok = view.rank == want_rank;
    int d = 0;
    for (int64_t s : spec.shape) {
        if (shape_ok && s >= 0 && view.size(d) != s) shape_ok = false;
        ++d;
    }
    if (!shape_ok) {
        std::string want = "[";
        d = 0;
        for (int64_t s : spec.shape) {
            want += fmt::format("{}{}", d++ ? ", " : "", s >= 0 ? fmt::format("{}", s) : "*");
        }
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "{}: shape {}, expected {}", name,
                           shape_text(view), want + "]");
    }
    for (int i = 0; i < view.rank; ++i) {
        if (view.stride(i) < 0) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument, "{}: negative stride in dim {}", name,
                               i);
        }
    }
    if (spec.contiguous && !view.is_contiguous()) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "{}: not contiguous ({})", name,
                           describe(view));
    }
    return {};
}

}  // namespace pdsim::runtime
