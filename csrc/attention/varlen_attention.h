// The variable-length causal attention kernel (CPU): token i attends to token j iff j <= i and j
// lies in the same contiguous run of equal segment ids as i; a padding token (segment id 0) attends
// only to itself. It works on one run (one packed sample) of one (batch row, head) at a time, so a
// row costs a * sum(s^2) + b * sum(s) in its sample lengths s, not a * T^2. ffi_cpu.cc runs it over
// whole [B, T, H, Dh] arrays as XLA FFI handlers.
#pragma once

#include <cstddef>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#define JAXODC_ATTENTION_X86 1
#endif

namespace jaxodc::attention {

// Per-call scratch buffers, grown on demand (one call runs on one thread).
struct Scratch {
  std::vector<float> buf[11];
  float* get(int slot, std::size_t n) {
    if (buf[slot].size() < n) buf[slot].resize(n);
    return buf[slot].data();
  }
};

// One run of n tokens: q, k, v, o (and their gradients) are rows `stride` floats apart, Dh floats
// each; lse holds the run's n log-sum-exps. Arguments: forward (q, k, v, o, lse, stride, n, Dh,
// scale, scratch), backward (q, k, v, o, do, lse, dq, dk, dv, stride, n, Dh, scale, scratch).
using ForwardFn = void (*)(const float*, const float*, const float*, float*, float*, std::ptrdiff_t, int, int, float,
                           Scratch&);
using BackwardFn = void (*)(const float*, const float*, const float*, const float*, const float*, const float*,
                            float*, float*, float*, std::ptrdiff_t, int, int, float, Scratch&);

struct Isa {
  const char* name;
  ForwardFn fwd;
  BackwardFn bwd;
  bool (*supported)();
};

// The kernel compiled once per instruction set, narrowest first (the ops' `isa` attribute is an
// index + 1; 0 picks the widest supported one).
extern const Isa kIsas[];
extern const int kNumIsas;

// Denormals flushed to zero while the kernel runs (restored after): probabilities near the exp
// clamp times small values would otherwise hit the slow denormal path.
struct FlushDenormals {
#ifdef JAXODC_ATTENTION_X86
  unsigned saved = _mm_getcsr();
  FlushDenormals() { _mm_setcsr(saved | 0x8040); }  // FTZ | DAZ
  ~FlushDenormals() { _mm_setcsr(saved); }
#endif
};

}  // namespace jaxodc::attention
