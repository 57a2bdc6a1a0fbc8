// zen_ds ops: Python binding. Thin on purpose: validates the device and forwards to the CPU or
// CUDA kernels (csrc/zen/cpu, csrc/zen/cuda); argument preparation lives in zen_ds/ops/compiled.py.
// The pybind11 type casters for at::Tensor only: torch/extension.h (all of libtorch's C++ API)
// took 6x longer to compile and nothing here uses it.
#include <torch/csrc/utils/pybind.h>

#include "zen_ops.h"

#ifdef ZEN_CUDA_EMULATION
namespace zen {
namespace emu {
void bind(pybind11::module_& m);  // csrc/zen/emu/zen_ops_cuda_emu.cpp
}  // namespace emu
}  // namespace zen
#endif

namespace {

using zen::PermArgs;

#if defined(ZEN_CUDA_EMULATION)
// Test-only build (zen_ds/ops/emulation.py): the CUDA launchers and kernels run on CPU tensors.
void require_cpu(const at::Tensor& t)
{
    TORCH_CHECK(t.device().is_cpu(), "the zen_ds CUDA emulation takes CPU tensors, got ", t.device());
}
#define ZEN_DISPATCH(tensor, fn, ...) (require_cpu(tensor), zen::cuda::fn(__VA_ARGS__))
#elif defined(ZEN_WITH_CUDA)
#define ZEN_DISPATCH(tensor, fn, ...) \
    ((tensor).is_cuda() ? zen::cuda::fn(__VA_ARGS__) : zen::cpu::fn(__VA_ARGS__))
#else
void require_cpu(const at::Tensor& t)
{
    TORCH_CHECK(t.device().is_cpu(), "zen_ds ops were built without CUDA but got a ", t.device(),
                " tensor; rebuild them with a CUDA toolkit or set ZEN_DS_OPS=torch");
}
#define ZEN_DISPATCH(tensor, fn, ...) (require_cpu(tensor), zen::cpu::fn(__VA_ARGS__))
#endif

at::Tensor permute(const at::Tensor& rows, int64_t num_rows, int64_t multiplier, int64_t offset)
{
    const PermArgs perm{num_rows, multiplier, 0, offset};
    return ZEN_DISPATCH(rows, permute, rows, perm, false);
}

at::Tensor unpermute(const at::Tensor& positions, int64_t num_rows, int64_t inverse, int64_t offset)
{
    const PermArgs perm{num_rows, 0, inverse, offset};
    return ZEN_DISPATCH(positions, permute, positions, perm, true);
}

at::Tensor nonzero_rows(const at::Tensor& values) { return ZEN_DISPATCH(values, nonzero_rows, values); }

std::tuple<at::Tensor, at::Tensor, at::Tensor> partition(const at::Tensor& rows,
                                                         const at::Tensor& values,
                                                         int64_t num_rows,
                                                         int64_t world_size,
                                                         int64_t multiplier,
                                                         int64_t offset,
                                                         bool int32_ids)
{
    TORCH_CHECK(rows.device() == values.device(), "zen_ds partition: rows and values on different devices");
    const PermArgs perm{num_rows, multiplier, 0, offset};
    return ZEN_DISPATCH(rows, partition, rows, values, perm, world_size, int32_ids);
}

std::tuple<at::Tensor, at::Tensor> aggregate(const at::Tensor& offsets, const at::Tensor& values,
                                             bool accum_double, int64_t terms)
{
    TORCH_CHECK(offsets.device() == values.device(), "zen_ds aggregate: offsets and values on different devices");
    const at::ScalarType acc = accum_double ? at::kDouble : at::kFloat;
    return ZEN_DISPATCH(values, aggregate, offsets, values, acc, terms);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> aggregate_bitmap(const at::Tensor& offsets,
                                                                const at::Tensor& values,
                                                                bool accum_double, int64_t universe,
                                                                int64_t terms)
{
    TORCH_CHECK(offsets.device() == values.device(),
                "zen_ds aggregate_bitmap: offsets and values on different devices");
    const at::ScalarType acc = accum_double ? at::kDouble : at::kFloat;
    return ZEN_DISPATCH(values, aggregate_bitmap, offsets, values, acc, universe, terms);
}

at::Tensor bitmap_encode(const at::Tensor& offsets, int64_t universe)
{
    return ZEN_DISPATCH(offsets, bitmap_encode, offsets, universe);
}

at::Tensor bitmap_decode(const at::Tensor& bitmap, int64_t universe, int64_t count)
{
    return ZEN_DISPATCH(bitmap, bitmap_decode, bitmap, universe, count);
}

void scatter_rows(at::Tensor out, const at::Tensor& rows, const at::Tensor& values)
{
    TORCH_CHECK(out.device() == rows.device() && out.device() == values.device(),
                "zen_ds scatter_rows: out, rows and values must share a device");
    ZEN_DISPATCH(out, scatter_rows, out, rows, values);
}

void scatter_shard(at::Tensor out, const at::Tensor& index, const at::Tensor& values, bool bitmap,
                   int64_t universe, int64_t shard_start, int64_t num_rows, int64_t inverse,
                   int64_t offset)
{
    TORCH_CHECK(out.device() == index.device() && out.device() == values.device(),
                "zen_ds scatter_shard: out, index and values must share a device");
    const PermArgs perm{num_rows, 0, inverse, offset};
    ZEN_DISPATCH(out, scatter_shard, out, index, values, bitmap, universe, shard_start, perm);
}

bool with_cuda()
{
#ifdef ZEN_WITH_CUDA
    return true;
#else
    return false;
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)
{
    m.doc() = "zen_ds sparse gradient sync ops (see zen_ds/ops/torch_ops.py for the semantics)";
    m.def("permute", &permute, "pi(rows) of the seeded Weyl permutation (int64)");
    m.def("unpermute", &unpermute, "pi^-1(positions) (int64)");
    m.def("nonzero_rows", &nonzero_rows, "ids of rows with any element other than +0.0 (NaN and -0.0 count)");
    m.def("partition", &partition, "stable counting sort of rows by owner rank");
    m.def("aggregate", &aggregate, "sum rows sharing an offset, unique offsets ascending");
    m.def("aggregate_bitmap", &aggregate_bitmap,
          "aggregate + bitmap_encode of the unique offsets over [0, universe), in one pass");
    m.def("bitmap_encode", &bitmap_encode, "little-endian uint8 bitmap of offsets");
    m.def("bitmap_decode", &bitmap_decode, pybind11::arg("bitmap"), pybind11::arg("universe"),
          pybind11::arg("count") = -1,
          "set bit positions of a bitmap (int64); count: the number of set bits if known, else -1");
    m.def("scatter_rows", &scatter_rows, "out[rows] = values, in place");
    m.def("scatter_shard", &scatter_shard,
          "out[pi^-1(shard_start + p)] = values for the shard's positions p (bitmap or COO)");
    m.def("with_cuda", &with_cuda, "whether the CUDA kernels were compiled in");
#ifdef ZEN_CUDA_EMULATION
    zen::emu::bind(m);
#endif
}
