// Probe (#13): is there a cuBLASLt algorithm for an 8B layer's decode GEMMs (32 or 128 rows) faster
// than the one cuBLAS picks? The library calls cuBLAS through torch for q/k/v and o (and the base
// model's down), so its GEMM is cuBLAS's heuristic choice; session 30 timed that choice and
// cuBLASLt's first heuristic only. Here every algorithm cuBLASLt's heuristic offers (up to 128),
// and the fastest eight again with other split-K counts and reduction schemes, are timed the way
// probe_gemm_bound.py times its kernels: 32 layers of distinct weights in one CUDA graph, each GEMM
// after a small kernel that writes its input (a stand-in for the RMSNorm), microseconds a layer.
// Each candidate's output is checked against cublasGemmEx's (torch's call) before it is timed.
//
// Build and run on the GPU machine (nvcc from the CUDA toolkit):
//   nvcc -O2 -std=c++17 -arch=sm_90a benchmarks/cublaslt_search.cu -lcublasLt -lcublas -o /tmp/search
//   /tmp/search out.csv 128 32
// Writes one CSV row per timed candidate: rows, site, n, k, kind (gemmex / heuristic / split),
// rank in the heuristic, algo id, tile, stages, split-K, reduction scheme, cluster shape, swizzle,
// workspace bytes, us a layer (input kernel + GEMM), us of the input kernel alone, max error.
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
  fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); exit(1); } } while (0)
#define LK(x) do { cublasStatus_t s_ = (x); if (s_ != CUBLAS_STATUS_SUCCESS) { \
  fprintf(stderr, "%s:%d cublas status %d\n", __FILE__, __LINE__, (int)s_); exit(1); } } while (0)

static const int kLayers = 32;
static const size_t kWorkspace = 64u << 20;

// The GEMM's input written by a kernel before it, as the RMSNorm does in a step.
__global__ void write_input(const __nv_bfloat16* src, __nv_bfloat16* dst, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) dst[i] = __float2bfloat16(__bfloat162float(src[i]) * 1.0f);
}

__global__ void fill_random(__nv_bfloat16* p, size_t n, unsigned seed, float scale) {
  size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  if (i >= n) return;
  unsigned h = (unsigned)(i * 2654435761u) ^ (seed * 40503u);
  h ^= h >> 13; h *= 0x5bd1e995u; h ^= h >> 15;
  p[i] = __float2bfloat16(((h & 0xFFFF) / 65535.0f - 0.5f) * 2.0f * scale);
}

struct Site { const char* name; int n, k; };

struct Bufs {
  __nv_bfloat16 *src, *x;
  std::vector<__nv_bfloat16*> w, y;
  void* ws;
};

struct Candidate {
  std::string kind;
  int rank;
  cublasLtMatmulAlgo_t algo;
  size_t workspace;
};

static unsigned cfg(const cublasLtMatmulAlgo_t& a, cublasLtMatmulAlgoConfigAttributes_t attr) {
  uint64_t v = 0;
  size_t written = 0;
  if (cublasLtMatmulAlgoConfigGetAttribute(&a, attr, &v, sizeof(v), &written) != CUBLAS_STATUS_SUCCESS) return 0;
  return (unsigned)v;
}

// Mean microseconds of one replay of g over `iters`, after warm-up.
static double time_graph(cudaGraphExec_t g, cudaStream_t s, int iters) {
  for (int i = 0; i < 3; ++i) CK(cudaGraphLaunch(g, s));
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  CK(cudaEventRecord(a, s));
  for (int i = 0; i < iters; ++i) CK(cudaGraphLaunch(g, s));
  CK(cudaEventRecord(b, s));
  CK(cudaEventSynchronize(b));
  float ms = 0;
  CK(cudaEventElapsedTime(&ms, a, b));
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  return ms * 1000.0 / iters;
}

template <class F>
static cudaGraphExec_t capture(cudaStream_t s, F body) {
  cudaGraph_t g;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  body();
  CK(cudaStreamEndCapture(s, &g));
  cudaGraphExec_t e;
  CK(cudaGraphInstantiate(&e, g, 0));
  CK(cudaGraphDestroy(g));
  return e;
}

static float max_err(const __nv_bfloat16* a, const __nv_bfloat16* b, size_t n) {
  std::vector<__nv_bfloat16> ha(n), hb(n);
  CK(cudaMemcpy(ha.data(), a, n * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(hb.data(), b, n * 2, cudaMemcpyDeviceToHost));
  float e = 0;
  for (size_t i = 0; i < n; ++i) e = std::max(e, std::fabs(__bfloat162float(ha[i]) - __bfloat162float(hb[i])));
  return e;
}

int main(int argc, char** argv) {
  if (argc < 3) { fprintf(stderr, "usage: %s out.csv ROWS [ROWS...]\n", argv[0]); return 2; }
  FILE* out = fopen(argv[1], "w");
  fprintf(out, "rows,site,n,k,kind,heuristic_rank,algo_id,tile,stages,split_k,reduction,cluster,swizzle,"
               "workspace,us_layer,us_input_kernel,us_gemm,max_err\n");
  const Site sites[] = {{"qkv", 6144, 4096}, {"qkv_folded", 6528, 4096}, {"o", 4096, 4096},
                        {"o_folded", 4224, 4096}, {"down", 4096, 14336}, {"gate_up", 28672, 4096}};
  int iters = getenv("ITERS") ? atoi(getenv("ITERS")) : 20;
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cublasHandle_t blas;
  LK(cublasCreate(&blas));
  LK(cublasSetStream(blas, s));
  cublasLtHandle_t lt;
  LK(cublasLtCreate(&lt));
  void* ws;
  CK(cudaMalloc(&ws, kWorkspace));
  LK(cublasSetWorkspace(blas, ws, kWorkspace));
  const float alpha = 1.0f, beta = 0.0f;
  for (int ai = 2; ai < argc; ++ai) {
    int m = atoi(argv[ai]);
    for (const Site& site : sites) {
      int n = site.n, k = site.k;
      Bufs b;
      CK(cudaMalloc(&b.src, (size_t)m * k * 2));
      CK(cudaMalloc(&b.x, (size_t)m * k * 2));
      fill_random<<<(m * k + 255) / 256, 256, 0, s>>>(b.src, (size_t)m * k, 7, 1.0f);
      for (int l = 0; l < kLayers; ++l) {
        __nv_bfloat16 *w, *y;
        CK(cudaMalloc(&w, (size_t)n * k * 2));
        CK(cudaMalloc(&y, (size_t)m * n * 2));
        fill_random<<<(unsigned)(((size_t)n * k + 255) / 256), 256, 0, s>>>(w, (size_t)n * k, 100 + l,
                                                                             1.0f / std::sqrt((float)k));
        b.w.push_back(w);
        b.y.push_back(y);
      }
      __nv_bfloat16* ref;
      CK(cudaMalloc(&ref, (size_t)m * n * 2));
      CK(cudaStreamSynchronize(s));
      auto input = [&]() { write_input<<<(m * k + 255) / 256, 256, 0, s>>>(b.src, b.x, m * k); };
      // torch's call: y (m x n, row-major) = x (m x k) @ W^T, W (n x k) row-major; column-major n x m.
      auto gemmex = [&](int l) {
        LK(cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &alpha, b.w[l], CUDA_R_16BF, k, b.x,
                        CUDA_R_16BF, k, &beta, b.y[l], CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      };
      cudaGraphExec_t g_in = capture(s, [&]() { for (int l = 0; l < kLayers; ++l) input(); });
      double us_in = time_graph(g_in, s, iters) / kLayers;
      CK(cudaGraphExecDestroy(g_in));
      input();
      gemmex(0);
      CK(cudaMemcpyAsync(ref, b.y[0], (size_t)m * n * 2, cudaMemcpyDeviceToDevice, s));
      CK(cudaStreamSynchronize(s));
      cudaGraphExec_t g_ex = capture(s, [&]() { for (int l = 0; l < kLayers; ++l) { input(); gemmex(l); } });
      double us_ex = time_graph(g_ex, s, iters) / kLayers;
      CK(cudaGraphExecDestroy(g_ex));
      fprintf(out, "%d,%s,%d,%d,gemmex,,,,,,,,,,%.3f,%.3f,%.3f,0\n", m, site.name, n, k, us_ex, us_in, us_ex - us_in);
      printf("m=%d %-10s gemmex          %8.2f us a layer (input kernel %.2f)\n", m, site.name, us_ex, us_in);
      fflush(stdout);

      cublasLtMatmulDesc_t op;
      LK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
      cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
      LK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
      LK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
      cublasLtMatrixLayout_t la, lb, lc;
      LK(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, k, n, k));
      LK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, k, m, k));
      LK(cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, n, m, n));
      cublasLtMatmulPreference_t pref;
      LK(cublasLtMatmulPreferenceCreate(&pref));
      size_t wsb = kWorkspace;
      LK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof(wsb)));
      std::vector<cublasLtMatmulHeuristicResult_t> res(128);
      int found = 0;
      LK(cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, lc, lc, pref, 128, res.data(), &found));
      std::vector<Candidate> cands;
      for (int i = 0; i < found; ++i)
        if (res[i].state == CUBLAS_STATUS_SUCCESS) cands.push_back({"heuristic", i, res[i].algo, res[i].workspaceSize});

      auto run_candidate = [&](const Candidate& c) -> double {
        auto lt_gemm = [&](int l) {
          return cublasLtMatmul(lt, op, &alpha, b.w[l], la, b.x, lb, &beta, b.y[l], lc, b.y[l], lc, &c.algo, ws,
                                c.workspace, s);
        };
        CK(cudaMemsetAsync(b.y[0], 0, (size_t)m * n * 2, s));
        input();
        if (lt_gemm(0) != CUBLAS_STATUS_SUCCESS) { cudaGetLastError(); return -1; }
        if (cudaStreamSynchronize(s) != cudaSuccess) { fprintf(stderr, "candidate failed\n"); exit(1); }
        float err = max_err(b.y[0], ref, (size_t)m * n);
        double us = -1;
        if (err <= 0.05f) {
          cudaGraphExec_t g = capture(s, [&]() { for (int l = 0; l < kLayers; ++l) { input(); lt_gemm(l); } });
          us = time_graph(g, s, iters) / kLayers;
          CK(cudaGraphExecDestroy(g));
        }
        const cublasLtMatmulAlgo_t& a = c.algo;
        fprintf(out, "%d,%s,%d,%d,%s,%d,%u,%u,%u,%u,%u,%u,%u,%zu,%.3f,%.3f,%.3f,%.4f\n", m, site.name, n, k,
                c.kind.c_str(), c.rank, cfg(a, CUBLASLT_ALGO_CONFIG_ID), cfg(a, CUBLASLT_ALGO_CONFIG_TILE_ID),
                cfg(a, CUBLASLT_ALGO_CONFIG_STAGES_ID), cfg(a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM),
                cfg(a, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME), cfg(a, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID),
                cfg(a, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING), c.workspace, us, us_in, us < 0 ? -1.0 : us - us_in, err);
        fflush(out);
        return us;
      };

      std::vector<std::pair<double, int>> timed;
      double us_first = -1;
      for (size_t i = 0; i < cands.size(); ++i) {
        double us = run_candidate(cands[i]);
        if (i == 0) us_first = us;
        if (us > 0) timed.push_back({us, (int)i});
      }
      std::sort(timed.begin(), timed.end());
      if (!timed.empty())
        printf("m=%d %-10s heuristic: %zu offered, first %.2f, best %.2f (rank %d)\n", m, site.name, cands.size(),
               us_first, timed[0].first, cands[timed[0].second].rank);
      // The fastest eight again with other split-K counts and reduction schemes.
      const unsigned splits[] = {1, 2, 3, 4, 6, 8, 12, 16};
      const unsigned schemes[] = {CUBLASLT_REDUCTION_SCHEME_INPLACE, CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE,
                                  CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE};
      double best_split = 1e30;
      for (size_t t = 0; t < timed.size() && t < 8; ++t) {
        const Candidate& base = cands[timed[t].second];
        for (unsigned sk : splits) {
          for (unsigned sch : schemes) {
            if (sk == 1 && sch != CUBLASLT_REDUCTION_SCHEME_INPLACE) continue;
            Candidate c = base;
            c.kind = "split";
            uint32_t v = sk;
            if (cublasLtMatmulAlgoConfigSetAttribute(&c.algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &v, sizeof(v)) !=
                CUBLAS_STATUS_SUCCESS) continue;
            uint32_t r = sk == 1 ? CUBLASLT_REDUCTION_SCHEME_NONE : sch;
            if (cublasLtMatmulAlgoConfigSetAttribute(&c.algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &r, sizeof(r)) !=
                CUBLAS_STATUS_SUCCESS) continue;
            if (sk == cfg(base.algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM) &&
                r == cfg(base.algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME)) continue;
            cublasLtMatmulHeuristicResult_t chk;
            if (cublasLtMatmulAlgoCheck(lt, op, la, lb, lc, lc, &c.algo, &chk) != CUBLAS_STATUS_SUCCESS) continue;
            if (chk.workspaceSize > kWorkspace) continue;
            c.workspace = chk.workspaceSize;
            double us = run_candidate(c);
            if (us > 0) best_split = std::min(best_split, us);
          }
        }
      }
      printf("m=%d %-10s best split-K variant %.2f us a layer\n", m, site.name, best_split);
      fflush(stdout);
      cublasLtMatmulPreferenceDestroy(pref);
      cublasLtMatrixLayoutDestroy(la);
      cublasLtMatrixLayoutDestroy(lb);
      cublasLtMatrixLayoutDestroy(lc);
      cublasLtMatmulDescDestroy(op);
      for (int l = 0; l < kLayers; ++l) { CK(cudaFree(b.w[l])); CK(cudaFree(b.y[l])); }
      CK(cudaFree(b.src));
      CK(cudaFree(b.x));
      CK(cudaFree(ref));
    }
  }
  fclose(out);
  return 0;
}
