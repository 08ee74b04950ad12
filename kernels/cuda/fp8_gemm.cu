// FP8 (e4m3) GEMMs with fused epilogues on Hopper: CUTLASS 3 warp-specialised kernels.
//
// D (m, n) bf16 = epilogue(acc * sa[m] * sb[n]), acc = A (m, k) e4m3 row-major times B (n, k)
// e4m3 row-major (the weight), float32 accumulation with the tensor cores' fast accumulation (as
// torch._scaled_mm's use_fast_accum). sa is the activation's per-row scale, sb the weight's
// per-channel scale. Epilogues (EPI_*), applied in float32 before the one rounding to bf16:
//   SCALE  D = s                       (s = acc * sa * sb)
//   ADD    D = s + C                   (C bf16 (m, n): the residual stream)
//   GELU   D = gelu_tanh(s)            (the gate half of a GeGLU)
//   MUL    D = s * C                   (the up half: C holds gelu(gate))
// Every entry point takes the current stream and a caller-owned workspace, so it is captured in
// a CUDA graph like any other kernel. Built by flashrt.kernels.nvcc for sm_90a with CUTLASS's
// headers (the nvidia-cutlass package) on the include path.

#include <cuda_runtime.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/epilogue/thread/activation.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

using namespace cute;
namespace fus = cutlass::epilogue::fusion;

using E4M3 = cutlass::float_e4m3_t;
using BF16 = cutlass::bfloat16_t;
constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;

enum Epi { EPI_SCALE = 0, EPI_ADD = 1, EPI_GELU = 2, EPI_MUL = 3 };

template <class Tile>
struct Trees {
  using Acc = fus::Sm90AccFetch;
  using RowScale = fus::Sm90ColBroadcast<0, Tile, float, float, Stride<_1, _0, int64_t>>;  // sa[m]
  using ColScale = fus::Sm90RowBroadcast<0, Tile, float, float, Stride<_0, _1, int64_t>>;  // sb[n]
  using Src = fus::Sm90SrcFetch<BF16>;
  using AccRow = fus::Sm90EVT<fus::Sm90Compute<cutlass::multiplies, float, float, kRound>, Acc, RowScale>;
  using Scale = fus::Sm90EVT<fus::Sm90Compute<cutlass::multiplies, BF16, float, kRound>, AccRow, ColScale>;
  using Add = fus::Sm90EVT<fus::Sm90Compute<cutlass::multiply_add, BF16, float, kRound>, AccRow, ColScale, Src>;
  using Scaled = fus::Sm90EVT<fus::Sm90Compute<cutlass::multiplies, float, float, kRound>, AccRow, ColScale>;
  using Gelu = fus::Sm90EVT<fus::Sm90Compute<cutlass::epilogue::thread::GELU_taylor, BF16, float, kRound>, Scaled>;
  using Mul = fus::Sm90EVT<fus::Sm90Compute<cutlass::multiplies, BF16, float, kRound>, Scaled, Src>;
};

template <int EPI, class Tile, class Cluster, bool Coop>
struct Gemm {
  using T = Trees<Tile>;
  using Tree = std::conditional_t<
      EPI == EPI_SCALE, typename T::Scale,
      std::conditional_t<EPI == EPI_ADD, typename T::Add, std::conditional_t<EPI == EPI_GELU, typename T::Gelu, typename T::Mul>>>;
  static constexpr bool kSrc = EPI == EPI_ADD || EPI == EPI_MUL;
  using ElementC = std::conditional_t<kSrc, BF16, void>;
  using Layout = cutlass::layout::RowMajor;
  using Schedule = std::conditional_t<Coop, cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8FastAccum,
                                      cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8FastAccum>;
  using EpiSchedule =
      std::conditional_t<Coop, cutlass::epilogue::TmaWarpSpecializedCooperative, cutlass::epilogue::TmaWarpSpecialized>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster, cutlass::epilogue::collective::EpilogueTileAuto,
      float, float, ElementC, Layout, 8, BF16, Layout, 8, EpiSchedule, Tree>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, E4M3, cutlass::layout::RowMajor, 16, E4M3,
      cutlass::layout::ColumnMajor, 16, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      Schedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Device = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  using Raster = typename cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90::RasterOrderOptions;

  static typename Device::Arguments arguments(const void* a, int64_t lda, const void* b, int64_t ldb, const float* sa,
                                               const float* sb, const void* c, int64_t ldc, void* d, int64_t ldd, int m,
                                               int n, int k, int sms, int swizzle, int raster) {
    using SA = typename Kernel::StrideA;
    using SB = typename Kernel::StrideB;
    using SC = typename Kernel::StrideC;
    using SD = typename Kernel::StrideD;
    SA stride_a{lda, Int<1>{}, int64_t(0)};
    SB stride_b{ldb, Int<1>{}, int64_t(0)};
    SC stride_c{};
    if constexpr (kSrc) stride_c = SC{ldc, Int<1>{}, int64_t(0)};
    SD stride_d{ldd, Int<1>{}, int64_t(0)};
    typename T::AccRow::Arguments acc_row{{}, {sa, 0.f, {}}, {}};
    typename T::ColScale::Arguments col{sb, 0.f, {}};
    typename Epilogue::FusionCallbacks::Arguments fusion;
    if constexpr (EPI == EPI_SCALE) fusion = {acc_row, col, {}};
    if constexpr (EPI == EPI_ADD) fusion = {acc_row, col, {}, {}};
    if constexpr (EPI == EPI_GELU) fusion = {{acc_row, col, {}}, {}};
    if constexpr (EPI == EPI_MUL) fusion = {{acc_row, col, {}}, {}, {}};
    cutlass::KernelHardwareInfo hw;
    hw.device_id = 0;
    hw.sm_count = sms;
    using CPtr = std::conditional_t<kSrc, BF16 const*, void const*>;
    typename Device::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {m, n, k, 1},
        {static_cast<E4M3 const*>(a), stride_a, static_cast<E4M3 const*>(b), stride_b},
        {fusion, static_cast<CPtr>(c), stride_c, static_cast<BF16*>(d), stride_d},
        hw};
    // The order tiles are handed out in: runs of `swizzle` tiles along the raster's other
    // dimension, so tiles that share operand rows run together while those rows are in L2.
    args.scheduler.max_swizzle_size = swizzle;
    args.scheduler.raster_order = static_cast<Raster>(raster);
    return args;
  }

  // 0: launched; 1: the shapes or alignment are refused; 2: the workspace is too small; 3: launch failed.
  static int run(const void* a, int64_t lda, const void* b, int64_t ldb, const float* sa, const float* sb,
                 const void* c, int64_t ldc, void* d, int64_t ldd, int m, int n, int k, int sms, int swizzle, int raster,
                 void* workspace, size_t workspace_bytes, cudaStream_t stream) {
    auto args = arguments(a, lda, b, ldb, sa, sb, c, ldc, d, ldd, m, n, k, sms, swizzle, raster);
    Device gemm;
    if (gemm.can_implement(args) != cutlass::Status::kSuccess) return 1;
    if (Device::get_workspace_size(args) > workspace_bytes) return 2;
    if (gemm.initialize(args, workspace, stream) != cutlass::Status::kSuccess) return 3;
    return gemm.run(stream) == cutlass::Status::kSuccess ? 0 : 3;
  }

  static size_t workspace(int m, int n, int k, int sms) {
    return Device::get_workspace_size(
        arguments(nullptr, k, nullptr, k, nullptr, nullptr, nullptr, n, nullptr, n, m, n, k, sms, 1, 0));
  }
};

// The tiles: 0 pingpong 128x128x128 on 1x2 clusters (the shape cuBLAS picks for these products),
// 1 cooperative 256x128x128 on 2x1 clusters (two consumer warp groups on one taller tile),
// 2 cooperative 128x256x128 on 1x2 clusters (on one wider tile).
template <int EPI, int TILE>
struct Pick;
template <int EPI>
struct Pick<EPI, 0> : Gemm<EPI, Shape<_128, _128, _128>, Shape<_1, _2, _1>, false> {};
template <int EPI>
struct Pick<EPI, 1> : Gemm<EPI, Shape<_256, _128, _128>, Shape<_2, _1, _1>, true> {};
template <int EPI>
struct Pick<EPI, 2> : Gemm<EPI, Shape<_128, _256, _128>, Shape<_1, _2, _1>, true> {};

template <int TILE>
static int dispatch(int epi, const void* a, int64_t lda, const void* b, int64_t ldb, const float* sa, const float* sb,
                    const void* c, int64_t ldc, void* d, int64_t ldd, int m, int n, int k, int sms, int swz, int ras,
                    void* ws, size_t ws_bytes, cudaStream_t s) {
  switch (epi) {
    case EPI_SCALE: return Pick<EPI_SCALE, TILE>::run(a, lda, b, ldb, sa, sb, c, ldc, d, ldd, m, n, k, sms, swz, ras, ws, ws_bytes, s);
    case EPI_ADD: return Pick<EPI_ADD, TILE>::run(a, lda, b, ldb, sa, sb, c, ldc, d, ldd, m, n, k, sms, swz, ras, ws, ws_bytes, s);
    case EPI_GELU: return Pick<EPI_GELU, TILE>::run(a, lda, b, ldb, sa, sb, c, ldc, d, ldd, m, n, k, sms, swz, ras, ws, ws_bytes, s);
    case EPI_MUL: return Pick<EPI_MUL, TILE>::run(a, lda, b, ldb, sa, sb, c, ldc, d, ldd, m, n, k, sms, swz, ras, ws, ws_bytes, s);
    default: return 1;
  }
}

extern "C" int flashrt_fp8_gemm(int tile, int epi, const void* a, int64_t lda, const void* b, int64_t ldb,
                                const float* sa, const float* sb, const void* c, int64_t ldc, void* d, int64_t ldd,
                                int m, int n, int k, int sms, int swizzle, int raster, void* workspace,
                                size_t workspace_bytes, cudaStream_t stream) {
  switch (tile) {
    case 0: return dispatch<0>(epi, a, lda, b, ldb, sa, sb, c, ldc, d, ldd, m, n, k, sms, swizzle, raster, workspace, workspace_bytes, stream);
    case 1: return dispatch<1>(epi, a, lda, b, ldb, sa, sb, c, ldc, d, ldd, m, n, k, sms, swizzle, raster, workspace, workspace_bytes, stream);
    case 2: return dispatch<2>(epi, a, lda, b, ldb, sa, sb, c, ldc, d, ldd, m, n, k, sms, swizzle, raster, workspace, workspace_bytes, stream);
    default: return 1;
  }
}

template <int TILE>
static size_t workspace_of(int epi, int m, int n, int k, int sms) {
  switch (epi) {
    case EPI_SCALE: return Pick<EPI_SCALE, TILE>::workspace(m, n, k, sms);
    case EPI_ADD: return Pick<EPI_ADD, TILE>::workspace(m, n, k, sms);
    case EPI_GELU: return Pick<EPI_GELU, TILE>::workspace(m, n, k, sms);
    default: return Pick<EPI_MUL, TILE>::workspace(m, n, k, sms);
  }
}

extern "C" size_t flashrt_fp8_gemm_workspace(int tile, int epi, int m, int n, int k, int sms) {
  switch (tile) {
    case 0: return workspace_of<0>(epi, m, n, k, sms);
    case 1: return workspace_of<1>(epi, m, n, k, sms);
    default: return workspace_of<2>(epi, m, n, k, sms);
  }
}
