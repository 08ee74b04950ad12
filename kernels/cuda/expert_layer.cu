// One action-expert decoder layer at few slots as ONE kernel: a cluster of 8 CTAs per slot.
//
// A `tiny` expert layer at one slot is 8 tokens of width 192: five Triton kernels (norm + q/k/v
// + rotary, attention, o projection, norm + gate/up + GeGLU, down projection), each kernel's cost
// its chain of dependent steps after waiting for the one ahead (docs/PERFORMANCE.md). Here
// the eight CTAs of a cluster load their slices of the layer's weights into shared memory
// before that wait (the weights are constants of the graph; the next layer's CTAs do so while
// this one runs), then push activations into each other's distributed shared memory, each
// CTA waiting only for the bytes it reads (an mbarrier a transfer, no cluster barrier): q/k/v ->
// attention (a 16-key chunk a warp, two chunks a CTA on up to five CTAs) -> each CTA's softmax
// states merged by the CTA that owns the row -> o projection -> gate/up + GeGLU -> down
// partials summed by the CTA that owns the column. Every transfer between CTAs is a remote
// store (a remote load's latency would sit on the critical path).
//
// Rounding follows the Triton kernels (kernels/norm_linear.py, kernels/grouped_attention.py,
// kernels/matmul.py): the normed row rounded before the norm weight, each projection rounded
// to bf16 before rotary / GELU, P rounded to bf16 before P V, the o and down projections added
// to the residual in float32 and rounded once. Only the order of sums differs (tensor-core
// mma.sync m16n8k16 tiles; attention keys split into 16-key chunks and merged).
//
// Shapes are compile-time (tiny's expert): width 192, 4 query heads of 64 over 1 key/value
// head, 8 tokens, GeGLU width 768; up to 3 context segments, at most 152 context keys.

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace cg = cooperative_groups;
typedef __nv_bfloat16 bf16;

constexpr int E = 192, HEADS = 4, D = 64, T = 8, MLP = 768;
constexpr int CL = 8;                 // CTAs a cluster (one cluster a slot)
constexpr int THREADS = 256;          // 8 warps
constexpr int PE = E + 8;             // row pitches (bf16) padded by 16 bytes: conflict-free fragments
constexpr int PA = HEADS * D + 8;
constexpr int PG = MLP / CL + 8;
constexpr int PD = D + 8;

struct Segment {
  const bf16* k;
  const bf16* v;
  const uint8_t* m;  // null: every key valid
  long long sk_n, sk_t, sv_n, sv_t, sm_n, sm_t;
  int len;
};

struct Params {
  bf16* x;  // (N, T, E) residual stream, updated in place
  const bf16* n1;
  const bf16* wqkv;  // ((HEADS + 2) * D, E): q heads, then k, then v
  const bf16* wo;    // (E, HEADS*D)
  const bf16* n2;
  const bf16* wgu;  // (2*MLP, E), gate rows first
  const bf16* wd;   // (E, MLP)
  const long long* pos0;  // (N,), element stride s_pos0 (e.g. a slot buffer's view)
  const float* inv_freq;  // (D/2,) contiguous
  long long s_pos0;
  Segment seg[3];
  int nseg;
  float eps1, eps2, scale;  // scale: log2(e) / sqrt(D)
};


// shared memory, bytes. The first region (q/k/v weights) is dead once every CTA has passed the
// q/k/v transfer; the attention's softmax states, the down partials and the second chunks'
// states (folded into the first's before they leave the CTA) go there.
constexpr int CTXV = 160;                                  // value rows: context, own, zeros
constexpr int OWN = 24;                                    // own key rows: T, then zeros (a chunk may reach 22)
constexpr int CHUNKS = CTXV / 16;                          // 16-key chunks at most: chunk c on CTA c / 2
constexpr int PM = D + 8;                                  // merged row pitch (float): conflict-free
constexpr int RSTATE = 4 * PM + 8;                         // a chunk's state for one CTA's 4 rows: acc, max, sum
constexpr int COLS = E / CL;                               // residual columns a CTA sums and writes
constexpr int S_WQKV = 0;                                  // 64 x PE: two (head, half-tile) pairs
constexpr int SOURCES = CHUNKS / 2;                       // attention CTAs at most: a softmax state each
constexpr int PRE = 16 * PM + 32;                          // an m-tile's state: 16 rows' acc, then max and sum
constexpr int S_STATE = S_WQKV;                            // SOURCES x RSTATE float: this CTA's rows' states
constexpr int S_PART = S_STATE + SOURCES * RSTATE * 4;     // CL x COLS x T float: down partials of this CTA's columns
constexpr int S_PRE = S_PART + CL * COLS * T * 4;          // 2 x PRE float: second chunks' states (attention CTAs)
constexpr int S_Q = S_WQKV + 64 * PE * 2;                  // 32 x PD rotated queries
constexpr int S_WO = S_Q + 32 * PD * 2;                    // 32 x PA
constexpr int S_WGU = S_WO + 32 * PA * 2;                  // 192 x PE (96 gate rows, 96 up rows)
constexpr int S_WD = S_WGU + 192 * PE * 2;                 // 192 x PG (this CTA's 96 input columns)
constexpr int S_N1 = S_WD + 192 * PG * 2;                  // float E
constexpr int S_N2 = S_N1 + E * 4;                         // float E
constexpr int S_ROT = S_N2 + E * 4;                        // float 2 x T x D/2: cos, sin (rounded)
constexpr int S_X = S_ROT + 2 * T * (D / 2) * 4;           // T x PE residual
constexpr int S_Y = S_X + T * PE * 2;                      // T x PE normed
constexpr int S_ATT = S_Y + T * PE * 2;                    // T x PA attention output
constexpr int S_G = S_ATT + T * PA * 2;                    // T x PG GeGLU slice
constexpr int S_K = S_G + T * PG * 2;                      // OWN x PD own keys, then zeros
constexpr int S_V = S_K + OWN * PD * 2;                    // CTXV x PD values: context (this CTA's chunks), own, zeros
constexpr int S_BAR = S_V + CTXV * PD * 2;                 // 5 mbarriers: one a transfer (below)
constexpr int SMEM = S_BAR + 5 * 8;
static_assert(S_PRE + 2 * PRE * 4 <= S_Q, "the states and down partials must fit in the dead first region");
static_assert(S_Q % 16 == 0 && S_WO % 16 == 0 && S_X % 16 == 0 && S_ATT % 16 == 0 && S_K % 16 == 0 &&
              S_V % 16 == 0 && S_BAR % 8 == 0 && (PD * 2) % 16 == 0 && (PA * 2) % 16 == 0 && (PE * 2) % 16 == 0,
              "16-byte remote stores need 16-byte aligned rows");

__device__ __forceinline__ void mma16816(float c[4], const uint32_t a[4], const uint32_t b[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ uint32_t ld32(const bf16* p) { return *reinterpret_cast<const uint32_t*>(p); }
__device__ __forceinline__ float rnd(float v) { return __bfloat162float(__float2bfloat16(v)); }
__device__ __forceinline__ uint32_t pack(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}
__device__ __forceinline__ uint32_t pack_bf(bf16 lo, bf16 hi) {
  return (uint32_t)__bfloat16_as_ushort(lo) | ((uint32_t)__bfloat16_as_ushort(hi) << 16);
}
__device__ __forceinline__ float ex2(float v) {
  float r;
  asm("ex2.approx.f32 %0, %1;" : "=f"(r) : "f"(v));
  return r;
}
__device__ __forceinline__ void cp16(void* smem, const void* gmem) {
  uint32_t s = (uint32_t)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void grid_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void grid_release() { asm volatile("griddepcontrol.launch_dependents;"); }

// Transfers between CTAs: the sender stores into the receiver's shared memory with st.async,
// which counts the bytes down on the receiver's mbarrier for that transfer; the receiver, which
// expected the transfer's byte total, waits on its own mbarrier. No cluster-wide barrier: each
// CTA waits only for the bytes it reads.
enum Transfer { QKV, STATE, ATT, RESID, PART };
__device__ __forceinline__ uint32_t saddr(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ uint32_t mapa(uint32_t a, int rank) {  // the same offset in CTA `rank`
  uint32_t out;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(out) : "r"(a), "r"(rank));
  return out;
}
// 16, 8 or 4 bytes at local address `a` (or the value) into CTA `rank`'s copy, counted on its `bar`
__device__ __forceinline__ void push16(uint32_t a, int rank, uint32_t bar) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];"
               ::"r"(mapa(a, rank)), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "r"(mapa(bar, rank)) : "memory");
}
__device__ __forceinline__ void push8(uint32_t a, int rank, float x, float y, uint32_t bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [%0], {%1, %2}, [%3];"
               ::"r"(mapa(a, rank)), "f"(x), "f"(y), "r"(mapa(bar, rank)) : "memory");
}
__device__ __forceinline__ void push4(uint32_t a, int rank, float x, uint32_t bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];"
               ::"r"(mapa(a, rank)), "r"(__float_as_uint(x)), "r"(mapa(bar, rank)) : "memory");
}
__device__ __forceinline__ void wait_for(uint32_t bar) {  // every byte of this CTA's transfer has landed
  uint32_t done = 0;
  while (!done)
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], 0;\n"
                 " selp.u32 %0, 1, 0, p;\n}" : "=r"(done) : "r"(bar) : "memory");
}

// rows x cols (bf16, cols a multiple of 8) from global (row stride gs) to shared (pitch ps)
__device__ __forceinline__ void stage(bf16* s, int ps, const bf16* g, long long gs, int rows, int cols) {
  int per = cols / 8;
  for (int i = threadIdx.x; i < rows * per; i += THREADS) {
    int r = i / per, c = (i % per) * 8;
    cp16(s + r * ps + c, g + r * gs + c);
  }
}

// c[t] = W_t[16 rows] . act^T over nk k-steps of 16 for NT tiles sharing the activations (A = W_t,
// row-major, pitch pw, tile t at w + t wstride; B[k][n] = act[n][k]). Each tile's k-steps are dealt
// to CH accumulators summed at the end: NT CH independent chains of nk / CH dependent mma.
template <int NT, int CH>
__device__ __forceinline__ void tiles(float (&c)[NT][4], const bf16* w, int wstride, int pw, const bf16* act, int pa,
                                      int nk) {
  const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  float d[NT][CH][4];
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int h = 0; h < CH; ++h) d[t][h][0] = d[t][h][1] = d[t][h][2] = d[t][h][3] = 0.f;
#pragma unroll
  for (int ks = 0; ks < nk; ks += CH)
#pragma unroll
    for (int h = 0; h < CH; ++h) {
      const bf16* b = act + g * pa + 2 * q + 16 * (ks + h);
      const uint32_t bf[2] = {ld32(b), ld32(b + 8)};
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        const bf16* a = w + t * wstride + g * pw + 2 * q + 16 * (ks + h);
        const uint32_t af[4] = {ld32(a), ld32(a + 8 * pw), ld32(a + 8), ld32(a + 8 * pw + 8)};
        mma16816(d[t][h], af, bf);
      }
    }
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      c[t][e] = d[t][0][e];
#pragma unroll
      for (int h = 1; h < CH; ++h) c[t][e] += d[t][h][e];
    }
}

// RMSNorm of T rows of x (pitch PE) into y: warp w takes row w
__device__ __forceinline__ void rms_norm(const bf16* x, bf16* y, const float* w, float eps) {
  int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (warp >= T) return;
  float v[E / 32], ss = 0.f;
#pragma unroll
  for (int i = 0; i < E / 32; ++i) {
    v[i] = __bfloat162float(x[warp * PE + lane + 32 * i]);
    ss += v[i] * v[i];
  }
#pragma unroll
  for (int o = 16; o; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  float r = rsqrtf(ss * (1.0f / E) + eps);
#pragma unroll
  for (int i = 0; i < E / 32; ++i) y[warp * PE + lane + 32 * i] = __float2bfloat16(rnd(v[i] * r) * w[lane + 32 * i]);
}

struct Key {  // where key j of the context + own sequence lives
  const bf16* k;
  const bf16* v;
  bool valid;
};

__device__ __forceinline__ Key context_key(const Params& p, long long n, int j) {
  Key key = {nullptr, nullptr, false};
#pragma unroll
  for (int s = 0; s < 3; ++s) {
    if (s < p.nseg && j >= 0 && j < p.seg[s].len) {
      const Segment& g = p.seg[s];
      key.k = g.k + n * g.sk_n + j * g.sk_t;
      key.v = g.v + n * g.sv_n + j * g.sv_t;
      key.valid = g.m == nullptr || g.m[n * g.sm_n + j * g.sm_t] != 0;
    }
    j -= p.seg[s].len;
    if (s + 1 >= p.nseg) j = -1;
  }
  return key;
}

__global__ void __launch_bounds__(THREADS, 1) expert_layer_kernel(const Params p) {
  extern __shared__ __align__(16) unsigned char smem[];
  cg::cluster_group cluster = cg::this_cluster();
  const int r = (int)cluster.block_rank();
  const long long n = blockIdx.y;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
  bf16* wqkv = (bf16*)(smem + S_WQKV);
  bf16* wo = (bf16*)(smem + S_WO);
  bf16* wgu = (bf16*)(smem + S_WGU);
  bf16* wd = (bf16*)(smem + S_WD);
  float* n1 = (float*)(smem + S_N1);
  float* n2 = (float*)(smem + S_N2);
  bf16* xs = (bf16*)(smem + S_X);
  bf16* ys = (bf16*)(smem + S_Y);
  bf16* att = (bf16*)(smem + S_ATT);
  bf16* gs = (bf16*)(smem + S_G);
  float* state = (float*)(smem + S_STATE);
  float* part = (float*)(smem + S_PART);
  bf16* qs = (bf16*)(smem + S_Q);
  bf16* ks = (bf16*)(smem + S_K);
  bf16* vs = (bf16*)(smem + S_V);
  float* rot = (float*)(smem + S_ROT);
  const uint32_t bar = saddr(smem + S_BAR);  // transfer X's mbarrier: bar + 8 X

  int ctx = 0;
#pragma unroll
  for (int s = 0; s < 3; ++s) ctx += s < p.nseg ? p.seg[s].len : 0;
  const int chunks = (ctx + T + 15) / 16, acta = (chunks + 1) / 2;  // 16-key chunks, attention CTAs
  if (tid == 0) {  // each mbarrier: one arrival (here) and the transfer's bytes into this CTA
    const uint32_t bytes[5] = {r < acta ? 12u * 32 * 16 : 0u, (uint32_t)acta * (4 * D + 8) * 4, CL * 32 * 16,
                               E / 16 * T * 16 * 2, CL * COLS * T * 4};
#pragma unroll
    for (int x = 0; x < 5; ++x) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar + 8 * x));
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar + 8 * x), "r"(bytes[x]));
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::);  // waited on before the first transfer
  // ---- before the wait: this CTA's weight slices (constants of the graph) ----
  // q/k/v pair P (r, and r + 8 for r < 4): head P / 2, rows 16 (P % 2) .. of its two halves
  for (int k = 0; k < 2 && r + 8 * k < 12; ++k) {
    int P = r + 8 * k, rows = D * (P / 2) + 16 * (P % 2);
    stage(wqkv + 32 * k * PE, PE, p.wqkv + (long long)rows * E, E, 16, E);
    stage(wqkv + (32 * k + 16) * PE, PE, p.wqkv + (long long)(rows + D / 2) * E, E, 16, E);
  }
  stage(wo, PA, p.wo + (long long)16 * r * HEADS * D, HEADS * D, 16, HEADS * D);
  if (r < 4) stage(wo + 16 * PA, PA, p.wo + (long long)16 * (r + 8) * HEADS * D, HEADS * D, 16, HEADS * D);
  stage(wgu, PE, p.wgu + (long long)96 * r * E, E, 96, E);
  stage(wgu + 96 * PE, PE, p.wgu + (long long)(MLP + 96 * r) * E, E, 96, E);
  stage(wd, PG, p.wd + 96 * r, MLP, E, 96);
  asm volatile("cp.async.commit_group;\n" ::);
  for (int i = tid; i < E; i += THREADS) {
    n1[i] = __bfloat162float(p.n1[i]);
    n2[i] = __bfloat162float(p.n2[i]);
  }
  // the rotary table, and on the attention CTAs (chunk c on CTA c / 2, warp 2 (c % 2) + m-tile)
  // their chunks' context values in shared memory and context keys in mma fragments (the prefix
  // and positions are written long before this kernel)
  const int mt = warp & 1, chunk = 2 * r + (warp >> 1);  // m-tile (query heads 2mt, 2mt+1) and chunk of warps 0-3
  const bool attends = warp < 4 && chunk < chunks;
  uint32_t kf[2][4][2];
  bool kv_ok[2][2];
  {
    const long long pos0 = p.pos0[n * p.s_pos0];  // rotary table: cos, sin of each token's angles, rounded
    for (int i = tid; i < T * (D / 2); i += THREADS) {
      float ang = (float)(pos0 + i / (D / 2)) * p.inv_freq[i % (D / 2)];
      rot[i] = rnd(cosf(ang));
      rot[T * (D / 2) + i] = rnd(sinf(ang));
    }
  }
  if (r < acta) {
    const int lo = 32 * r, hi = min(32 * r + 32, ctx);
    for (int i = lo * (D / 8) + tid; i < hi * (D / 8); i += THREADS) {
      Key key = context_key(p, n, i / (D / 8));
      cp16(vs + (i / (D / 8)) * PD + (i % (D / 8)) * 8, key.v + (i % (D / 8)) * 8);
    }
    asm volatile("cp.async.commit_group;\n" ::);
    for (int i = max(ctx + T, lo) + tid; i < 32 * r + 32; i += THREADS)
      for (int e = 0; e < D; ++e) vs[i * PD + e] = __float2bfloat16(0.f);
    for (int i = tid; i < (OWN - T) * PD; i += THREADS) ks[T * PD + i] = __float2bfloat16(0.f);  // padding keys
  }
  if (attends) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      Key key = context_key(p, n, 16 * chunk + 8 * j + g);  // B column n = g: key 16c + 8j + g
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        kf[j][s][0] = key.k ? ld32(key.k + 16 * s + 2 * q) : 0u;
        kf[j][s][1] = key.k ? ld32(key.k + 16 * s + 8 + 2 * q) : 0u;
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) kv_ok[j][h] = context_key(p, n, 16 * chunk + 8 * j + 2 * q + h).valid;
    }
  }
  grid_wait();  // every earlier kernel has finished: the residual stream is final
  grid_release();

  // ---- 1: norm, q/k/v projection (3 tiles a CTA) into the attention CTAs' q/k/v rows ----
  for (int i = tid; i < T * E / 8; i += THREADS) {
    int t = i / (E / 8), c = (i % (E / 8)) * 8;
    *reinterpret_cast<uint4*>(xs + t * PE + c) = *reinterpret_cast<const uint4*>(p.x + (n * T + t) * E + c);
  }
  asm volatile("cp.async.wait_all;\n" ::);
  __syncthreads();
  rms_norm(xs, ys, n1, p.eps1);
  __syncthreads();
  asm volatile("barrier.cluster.wait.aligned;\n" ::);  // every CTA of the cluster is running
  if (warp < 2 && r + 8 * warp < 12) {  // pair P: both halves of 16 columns of head P / 2
    const int P = r + 8 * warp, h = P / 2;
    float cab[2][4];  // the pair's two halves
    tiles<2, 4>(cab, wqkv + 32 * warp * PE, 16 * PE, PE, ys, PE, E / 16);
    const float *ca = cab[0], *cb = cab[1];
    bf16* dst = h < HEADS ? qs + h * T * PD : (h == HEADS ? ks : vs + ctx * PD);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int e = 16 * (P % 2) + g + 8 * (i >> 1), t = 2 * q + (i & 1);
      bf16 a = __float2bfloat16(ca[i]), b = __float2bfloat16(cb[i]), ra = a, rb = b;
      if (h <= HEADS) {  // queries and keys rotated, rounded as the reference
        float cs = rot[t * (D / 2) + e], sn = rot[T * (D / 2) + t * (D / 2) + e];
        float af = __bfloat162float(a), bf = __bfloat162float(b);
        ra = __float2bfloat16(rnd(af * cs) - rnd(bf * sn));
        rb = __float2bfloat16(rnd(bf * cs) + rnd(af * sn));
      }
      dst[t * PD + e] = ra;
      dst[t * PD + D / 2 + e] = rb;
    }
    __syncwarp();  // the 8 x 32 columns, 16 bytes a lane, to every attention CTA
    const int t = lane >> 2, c = 16 * (P % 2) + 8 * (lane & 1) + 32 * ((lane >> 1) & 1);
    for (int k = 0; k < acta; ++k) push16(saddr(dst + t * PD + c), k, bar + 8 * QKV);
  }
  if (r < acta) wait_for(bar + 8 * QKV);

  // ---- 2: attention over [context; own], one 16-key chunk a warp; each attention CTA's softmax
  // state (max, sum, unnormalised output) to the CTAs owning its rows (CTA o: rows 4o .. 4o + 3,
  // row 8 head + token) ----
  if (attends) {
    uint32_t qa[4][4];
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const bf16* a = qs + (16 * mt + g) * PD + 16 * s + 2 * q;
      qa[s][0] = ld32(a);
      qa[s][1] = ld32(a + 8 * PD);
      qa[s][2] = ld32(a + 8);
      qa[s][3] = ld32(a + 8 * PD + 8);
    }
    // own keys (and padding) of this chunk, from shared memory
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      int o = 16 * chunk + 8 * j + g - ctx;
      if (o >= 0) {
#pragma unroll
        for (int s = 0; s < 4; ++s) {
          kf[j][s][0] = ld32(ks + o * PD + 16 * s + 2 * q);
          kf[j][s][1] = ld32(ks + o * PD + 16 * s + 8 + 2 * q);
        }
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        int oh = 16 * chunk + 8 * j + 2 * q + h - ctx;
        if (oh >= 0) kv_ok[j][h] = oh < T;
      }
    }
    uint32_t vf[8][2];  // b0: keys 2q, 2q+1 of the chunk; b1: keys 2q+8, 2q+9; column: dim 8nt + g
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      const bf16* v0 = vs + (16 * chunk + 8 * b + 2 * q) * PD + g;
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) vf[nt][b] = pack_bf(v0[8 * nt], v0[PD + 8 * nt]);
    }
    float s[2][4];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
      for (int st = 0; st < 4; ++st) mma16816(s[j], qa[st], kf[j][st]);
    }
    float m_i[2], l_i[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // h: row g (c0, c1) or g + 8 (c2, c3)
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float v = kv_ok[j][e] ? s[j][2 * h + e] * p.scale : -INFINITY;
          s[j][2 * h + e] = v;
          mx = fmaxf(mx, v);
        }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_safe = mx == -INFINITY ? 0.f : mx;
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          s[j][2 * h + e] = ex2(s[j][2 * h + e] - m_safe);
          sum += s[j][2 * h + e];
        }
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      m_i[h] = mx;
      l_i[h] = sum + __shfl_xor_sync(0xffffffffu, sum, 2);
    }
    uint32_t pa[4] = {pack(s[0][0], s[0][1]), pack(s[0][2], s[0][3]), pack(s[1][0], s[1][1]),
                      pack(s[1][2], s[1][3])};
    float acc[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
      mma16816(acc[nt], pa, vf[nt]);
    }
    // the CTA's second chunk's state folded into its first's (same m-tile, through shared
    // memory): one state a CTA crosses the cluster
    float* pre = (float*)(smem + S_PRE) + mt * PRE;
    const bool pair = 2 * r + 1 < chunks;
    if (warp >= 2) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
          *reinterpret_cast<float2*>(pre + (g + 8 * h) * PM + 8 * nt + 2 * q) = make_float2(acc[nt][2 * h], acc[nt][2 * h + 1]);
        if (q == 0) {
          pre[16 * PM + g + 8 * h] = m_i[h];
          pre[16 * PM + 16 + g + 8 * h] = l_i[h];
        }
      }
    }
    if (pair && mt == 0) asm volatile("bar.sync 1, 64;" ::: "memory");  // the m-tile's two warps
    if (pair && mt == 1) asm volatile("bar.sync 2, 64;" ::: "memory");
    if (warp < 2) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (pair) {
          const float m1 = pre[16 * PM + g + 8 * h], mx = fmaxf(m_i[h], m1), ms = mx == -INFINITY ? 0.f : mx;
          const float w0 = ex2(m_i[h] - ms), w1 = ex2(m1 - ms);
          l_i[h] = l_i[h] * w0 + pre[16 * PM + 16 + g + 8 * h] * w1;
          m_i[h] = mx;
#pragma unroll
          for (int nt = 0; nt < 8; ++nt) {
            const float2 a1 = *reinterpret_cast<const float2*>(pre + (g + 8 * h) * PM + 8 * nt + 2 * q);
            acc[nt][2 * h] = acc[nt][2 * h] * w0 + a1.x * w1;
            acc[nt][2 * h + 1] = acc[nt][2 * h + 1] * w0 + a1.y * w1;
          }
        }
        const int row = 16 * mt + g + 8 * h;
        const float* dst = state + r * RSTATE;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
          push8(saddr(dst + (row & 3) * PM + 8 * nt + 2 * q), row >> 2, acc[nt][2 * h], acc[nt][2 * h + 1],
                bar + 8 * STATE);
        if (q == 0) {
          push4(saddr(dst + 4 * PM + (row & 3)), row >> 2, m_i[h], bar + 8 * STATE);
          push4(saddr(dst + 4 * PM + 4 + (row & 3)), row >> 2, l_i[h], bar + 8 * STATE);
        }
      }
    }
  }
  wait_for(bar + 8 * STATE);
  {  // merge this CTA's 4 rows (head r / 2, tokens 4 (r % 2) ..) over the attention CTAs, a thread an element
    const int lr = tid >> 6, d = tid & 63;
    float mc[SOURCES], mtot = -INFINITY;
#pragma unroll
    for (int c = 0; c < SOURCES; ++c) {
      mc[c] = c < acta ? state[c * RSTATE + 4 * PM + lr] : -INFINITY;
      mtot = fmaxf(mtot, mc[c]);
    }
    const float ms = mtot == -INFINITY ? 0.f : mtot;
    float l = 0.f, o = 0.f;
#pragma unroll
    for (int c = 0; c < SOURCES; ++c) {
      if (c < acta) {
        const float w = ex2(mc[c] - ms);
        l += state[c * RSTATE + 4 * PM + 4 + lr] * w;
        o += state[c * RSTATE + lr * PM + d] * w;
      }
    }
    att[(4 * (r & 1) + lr) * PA + (r >> 1) * D + d] = __float2bfloat16(o * (1.0f / (l == 0.f ? 1.f : l)));
  }
  __syncthreads();
  // the 4 x 64 outputs, 16 bytes a lane, to CTA `warp`
  push16(saddr(att + (4 * (r & 1) + (lane >> 3)) * PA + (r >> 1) * D + 8 * (lane & 7)), warp, bar + 8 * ATT);
  wait_for(bar + 8 * ATT);

  // ---- 3: o projection (tiles r and r + 8) onto the residual, new columns to every CTA ----
  if (warp < 2 && r + 8 * warp < E / 16) {
    float c1[1][4];
    tiles<1, 4>(c1, wo + 16 * warp * PA, 0, PA, att, PA, HEADS * D / 16);
    const float* c = c1[0];
    const int col = 16 * (r + 8 * warp);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      int t = 2 * q + (e & 1), cc = col + g + 8 * (e >> 1);
      xs[t * PE + cc] = __float2bfloat16(__bfloat162float(xs[t * PE + cc]) + c[e]);
    }
    __syncwarp();  // 8 tokens x 16 columns: 16 stores of 16 bytes for each CTA
    for (int i = lane; i < 16 * CL; i += 32) push16(saddr(xs + ((i & 15) >> 1) * PE + col + 8 * (i & 1)), i >> 4, bar + 8 * RESID);
  }
  wait_for(bar + 8 * RESID);

  // ---- 4: norm, gate/up (6 column pairs a CTA) + GeGLU, this CTA's share of the down product
  // to the CTAs owning its columns (CTA o: columns COLS o ..) ----
  rms_norm(xs, ys, n2, p.eps2);
  __syncthreads();
  if (warp < 6) {
    float cgu[2][4];  // gate and up columns 16 warp ..
    tiles<2, 4>(cgu, wgu + 16 * warp * PE, 96 * PE, PE, ys, PE, E / 16);
    const float *cg_ = cgu[0], *cu = cgu[1];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float pf = rnd(cg_[e]), qf = rnd(cu[e]);
      float z = 0.7978845608028654f * (pf + 0.044715f * pf * pf * pf);
      float th = 1.0f - __fdividef(2.0f, __expf(2.0f * z) + 1.0f);
      float act = rnd(0.5f * pf * (1.0f + th));
      gs[(2 * q + (e & 1)) * PG + 16 * warp + g + 8 * (e >> 1)] = __float2bfloat16(act * qf);
    }
  }
  __syncthreads();
  float cd[2][4];  // down tiles: warps 0-3 take tiles w and w + 8, warps 4-7 tile w
  const int nd = warp < E / 16 - 8 ? 2 : 1;
  if (nd == 2)
    tiles<2, 3>(cd, wd + 16 * warp * PG, 128 * PG, PG, gs, PG, MLP / CL / 16);
  else
    tiles<1, 3>(reinterpret_cast<float(&)[1][4]>(cd), wd + 16 * warp * PG, 0, PG, gs, PG, MLP / CL / 16);
#pragma unroll
  for (int k = 0; k < 2; ++k)
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // column 16 i + g + 8 h of tile i = warp + 8 k, tokens 2q, 2q + 1
      const int col = 16 * (warp + 8 * k) + g + 8 * h;
      if (k < nd)
        push8(saddr(part + (r * COLS + col % COLS) * T + 2 * q), col / COLS, cd[k][2 * h], cd[k][2 * h + 1],
              bar + 8 * PART);
    }
  wait_for(bar + 8 * PART);  // the last transfer: no CTA writes into this one after it

  // ---- 5: sum the eight CTAs' partial products (in rank order) onto this CTA's columns ----
  if (tid < COLS * T) {
    const int lc = tid / T, t = tid % T, col = COLS * r + lc;
    float sum = 0.f;
#pragma unroll
    for (int k = 0; k < CL; ++k) sum += part[(k * COLS + lc) * T + t];
    p.x[(n * T + t) * E + col] = __float2bfloat16(__bfloat162float(xs[t * PE + col]) + sum);
  }
}

extern "C" int flashrt_expert_layer_smem() { return SMEM; }

extern "C" int flashrt_expert_layer(const Params* p, int slots, void* stream, int dependent) {
  static cudaError_t attr = cudaFuncSetAttribute(expert_layer_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM);
  if (attr != cudaSuccess) return (int)attr;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(CL, slots, 1);
  cfg.blockDim = dim3(THREADS, 1, 1);
  cfg.dynamicSmemBytes = SMEM;
  cfg.stream = (cudaStream_t)stream;
  cudaLaunchAttribute attrs[2];
  attrs[0].id = cudaLaunchAttributeClusterDimension;
  attrs[0].val.clusterDim.x = CL;
  attrs[0].val.clusterDim.y = 1;
  attrs[0].val.clusterDim.z = 1;
  attrs[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attrs[1].val.programmaticStreamSerializationAllowed = dependent;
  cfg.attrs = attrs;
  cfg.numAttrs = 2;
  return (int)cudaLaunchKernelEx(&cfg, expert_layer_kernel, *p);
}
