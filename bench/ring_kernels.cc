// Single-process CPU cost of the ring's host piece kernels (f32 data, uint8/uint16 codes), in ns
// per f32 element, and the modelled per-rank kernel time of one quantised all-reduce.
//   g++ -O3 -std=c++17 -Icsrc bench/ring_kernels.cc -o /tmp/ring_kernels && /tmp/ring_kernels [MB] [W]
// Pieces are processed one at a time (1 MiB of f32 each, the ring's default) like the ring does.
// The modelled time is given for the fused passes the ring runs and, for comparison, for the
// unfused sequence of the same stages.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "ring/host_kernels.h"

using namespace jaxodc::ring;
using K = Kernels<DType::kF32>;

static volatile float g_sink;
// The ring passes op / last as runtime values; volatile keeps the compiler from specialising on them.
static volatile Op g_sum = Op::kSum, g_avg = Op::kAvg;
static volatile bool g_false = false, g_true = true;

template <typename F>
double ns_per_elem(size_t n, size_t piece, F&& f) {
  double best = 1e30;
  for (int rep = 0; rep < 7; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    for (size_t o = 0; o < n; o += piece) f(o, std::min(piece, n - o));
    double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::min(best, dt * 1e9 / n);
  }
  return best;
}

template <typename Q>
void run(size_t n, int W, const char* name, float levels) {
  const size_t P = (1 << 20) / 4;
  std::vector<float> x(n), out(n), in(n);
  std::vector<Q> q(n);
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  for (size_t i = 0; i < n; ++i) { x[i] = nd(rng); in[i] = nd(rng); }
  std::vector<QMeta> metas((n + P - 1) / P);
  for (size_t o = 0; o < n; o += P) metas[o / P] = K::quantize<Q>(in.data() + o, q.data() + o, std::min(P, n - o), levels);
  auto meta = [&](size_t o) { return metas[o / P]; };

  double mm = ns_per_elem(n, P, [&](size_t o, size_t k) { float lo, hi; minmax_f32(x.data() + o, k, &lo, &hi); g_sink = lo + hi; });
  double quant = ns_per_elem(n, P, [&](size_t o, size_t k) { g_sink = K::quantize<Q>(x.data() + o, q.data() + o, k, levels).lo; });
  double red = ns_per_elem(n, P, [&](size_t o, size_t k) { K::reduce_q<Q>(q.data() + o, meta(o), x.data() + o, out.data() + o, k, g_sum, g_false, W); });
  double red_last = ns_per_elem(n, P, [&](size_t o, size_t k) { K::reduce_q<Q>(q.data() + o, meta(o), x.data() + o, out.data() + o, k, g_avg, g_true, W); });
  double deq = ns_per_elem(n, P, [&](size_t o, size_t k) { K::dequantize<Q>(q.data() + o, meta(o), out.data() + o, k); });
  double redf = ns_per_elem(n, P, [&](size_t o, size_t k) { K::reduce(in.data() + o, x.data() + o, out.data() + o, k, g_sum, g_false, W); });
  std::printf("%s: minmax %.3f  quantize(range+codes) %.3f  reduce_q(sum) %.3f  reduce_q(avg,last) %.3f  "
              "dequantize %.3f  reduce f32(sum) %.3f  [ns/elem]\n", name, mm, quant, red, red_last, deq, redf);
  // Per-rank kernel work of one all-reduce of n elements, in units of chunk passes (chunk = n/W):
  // step-0 send quantises x; W-2 intermediate steps reduce then quantise; the owner reduces,
  // quantises and dequantises; the all-gather dequantises W-1 chunks.
  double c = double(n) / W;
  double seq = c * (quant + (W - 2) * (red + quant) + (red_last + quant + deq) + (W - 1) * deq);
  double rmm = ns_per_elem(n, P, [&](size_t o, size_t k) { float lo, hi; K::reduce_q_range<Q>(q.data() + o, meta(o), x.data() + o, out.data() + o, k, g_sum, g_false, W, &lo, &hi); g_sink = lo; });
  double rmm_last = ns_per_elem(n, P, [&](size_t o, size_t k) { float lo, hi; K::reduce_q_range<Q>(q.data() + o, meta(o), x.data() + o, out.data() + o, k, g_avg, g_true, W, &lo, &hi); g_sink = lo; });
  double codes = ns_per_elem(n, P, [&](size_t o, size_t k) { K::quantize_range<Q>(x.data() + o, q.data() + o, k, levels, -4.f, 4.f); });
  double qdq = ns_per_elem(n, P, [&](size_t o, size_t k) { K::quantize_dequantize<Q>(out.data() + o, q.data() + o, k, levels, -4.f, 4.f); });
  std::printf("%s fused: reduce_q+range(sum) %.3f  reduce_q+range(avg,last) %.3f  codes(given range) %.3f  "
              "codes+dequantize %.3f  [ns/elem]\n", name, rmm, rmm_last, codes, qdq);
  double fused = c * ((mm + codes) + (W - 2) * (rmm + codes) + (rmm_last + qdq) + (W - 1) * deq);
  std::printf("%s per-rank kernel time of one %zu-element all-reduce at W=%d: %.2f ms (unfused sequence %.2f ms)\n",
              name, n, W, fused * 1e-6, seq * 1e-6);
}

int main(int argc, char** argv) {
  double mb = argc > 1 ? std::atof(argv[1]) : 16;
  int W = argc > 2 ? std::atoi(argv[2]) : 4;
  size_t n = static_cast<size_t>(mb * (1 << 20)) / 4;
  run<uint8_t>(n, W, "uint8 ", 255.0f);
  run<uint16_t>(n, W, "uint16", 65535.0f);
  return 0;
}
