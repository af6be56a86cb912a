// CPU handlers of the varlen attention ops: argument checks, then the kernel (varlen_attention.h)
// over every run of every (batch row, head).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "attention/ffi.h"
#include "attention/varlen_attention.h"

namespace jaxodc::attention {

namespace {

ffi::Error pick_isa(const char* op, int64_t isa, const Isa** out) {
  if (isa == 0) {
    for (int i = kNumIsas - 1; i >= 0; --i)
      if (kIsas[i].supported()) return *out = &kIsas[i], ffi::Error::Success();
  }
  if (isa < 1 || isa > kNumIsas || !kIsas[isa - 1].supported())
    return ffi::Error::InvalidArgument(std::string(op) + ": instruction set id " + std::to_string(isa) +
                                       " is not available on this CPU");
  *out = &kIsas[isa - 1];
  return ffi::Error::Success();
}

std::string dtype_name(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::F64: return "float64";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::S64: return "int64";
    default: return "dtype#" + std::to_string(static_cast<int>(t));
  }
}

std::string describe(const ffi::AnyBuffer& x) {
  std::string s = dtype_name(x.element_type()) + "[";
  auto dims = x.dimensions();
  for (std::size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

// Checks `x` is `type` with dimensions `want` (-1: any), naming the argument and its shape.
ffi::Error check_arg(const char* op, const char* name, const ffi::AnyBuffer& x, ffi::DataType type,
                     std::vector<int64_t> want, const char* layout) {
  auto dims = x.dimensions();
  bool ok = x.element_type() == type && dims.size() == want.size();
  for (std::size_t i = 0; ok && i < want.size(); ++i) ok = want[i] < 0 || dims[i] == want[i];
  if (ok) return ffi::Error::Success();
  std::string expect = dtype_name(type) + " " + layout;
  if (want.size() && want[0] >= 0) {
    expect += " = [";
    for (std::size_t i = 0; i < want.size(); ++i) expect += (i ? ", " : "") + std::to_string(want[i]);
    expect += "]";
  }
  return ffi::Error::InvalidArgument(std::string(op) + ": " + name + " must be " + expect + ", got " + describe(x));
}

struct Geometry {
  int64_t B, T, H, Dh;
  float scale;
};

ffi::Error check_common(const char* op, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                        const ffi::AnyBuffer& seg, Geometry* g) {
  if (auto e = check_arg(op, "q", q, ffi::DataType::F32, {-1, -1, -1, -1}, "[B, T, H, Dh]"); e.failure()) return e;
  auto d = q.dimensions();
  *g = Geometry{d[0], d[1], d[2], d[3], d[3] > 0 ? 1.f / std::sqrt(static_cast<float>(d[3])) : 1.f};
  // Tile offsets inside one run are int: T * (padded Dh) must fit.
  if (g->Dh < 1 || g->T * (g->Dh + 64) > std::numeric_limits<int>::max())
    return ffi::Error::InvalidArgument(std::string(op) + ": q " + describe(q) +
                                       " is outside the kernel's range (Dh >= 1, T * (Dh + 64) < 2^31)");
  const std::vector<int64_t> bthd = {g->B, g->T, g->H, g->Dh};
  if (auto e = check_arg(op, "k", k, ffi::DataType::F32, bthd, "[B, T, H, Dh] like q"); e.failure()) return e;
  if (auto e = check_arg(op, "v", v, ffi::DataType::F32, bthd, "[B, T, H, Dh] like q"); e.failure()) return e;
  return check_arg(op, "segment_ids", seg, ffi::DataType::S32, {g->B, g->T}, "[B, T]");
}

// Calls fn(start, length, padding) for each run of batch row `b` (a padding token is its own run).
template <typename Fn>
void for_each_run(const int32_t* seg, int64_t T, Fn&& fn) {
  int64_t t = 0;
  while (t < T) {
    int64_t e = t + 1;
    if (seg[t] != 0)
      while (e < T && seg[e] == seg[t]) ++e;
    fn(t, e - t, seg[t] == 0);
    t = e;
  }
}

// Runs fn(scratch, at, lse_at, n, pad) for every run of every (batch row, head), denormals
// flushed: `at` indexes the run's first token in [B, T, H, Dh] arrays, `lse_at` in [B, H, T] ones;
// n is the run's length, pad whether it is a padding token.
template <typename Fn>
ffi::Error for_each_head_run(const char* op, const Geometry& g, const int32_t* seg, Fn&& fn) {
  FlushDenormals ftz;
  try {
    Scratch w;
    for (int64_t b = 0; b < g.B; ++b)
      for_each_run(seg + b * g.T, g.T, [&](int64_t s0, int64_t n, bool pad) {
        for (int64_t h = 0; h < g.H; ++h) fn(w, ((b * g.T + s0) * g.H + h) * g.Dh, (b * g.H + h) * g.T + s0, n, pad);
      });
  } catch (const std::bad_alloc&) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted, std::string(op) + ": out of memory for scratch tiles");
  }
  return ffi::Error::Success();
}

ffi::Error ForwardImpl(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer seg,
                       ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> lse, int64_t isa) {
  static const char* op = "varlen_attention_fwd";
  Geometry g;
  const Isa* impl;
  if (auto e = check_common(op, q, k, v, seg, &g); e.failure()) return e;
  if (auto e = check_arg(op, "o", *o, ffi::DataType::F32, {g.B, g.T, g.H, g.Dh}, "[B, T, H, Dh]"); e.failure()) return e;
  if (auto e = check_arg(op, "lse", *lse, ffi::DataType::F32, {g.B, g.H, g.T}, "[B, H, T]"); e.failure()) return e;
  if (auto e = pick_isa(op, isa, &impl); e.failure()) return e;
  const float* qp = static_cast<const float*>(q.untyped_data());
  const float* kp = static_cast<const float*>(k.untyped_data());
  const float* vp = static_cast<const float*>(v.untyped_data());
  const int32_t* sp = static_cast<const int32_t*>(seg.untyped_data());
  float* op_ = static_cast<float*>(o->untyped_data());
  float* lp = static_cast<float*>(lse->untyped_data());
  const std::ptrdiff_t ts = g.H * g.Dh;
  return for_each_head_run(op, g, sp, [&](Scratch& w, std::ptrdiff_t at, std::ptrdiff_t lse_at, int64_t n, bool pad) {
    float* l = lp + lse_at;
    if (pad || n == 1) {  // attends only to itself: o = v, lse = its one scaled score
      float s = 0.f;
      for (int64_t d = 0; d < g.Dh; ++d) s += qp[at + d] * kp[at + d];
      std::memcpy(op_ + at, vp + at, sizeof(float) * g.Dh);
      *l = s * g.scale;
    } else {
      impl->fwd(qp + at, kp + at, vp + at, op_ + at, l, ts, static_cast<int>(n), static_cast<int>(g.Dh), g.scale, w);
    }
  });
}

ffi::Error BackwardImpl(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer seg, ffi::AnyBuffer o,
                        ffi::AnyBuffer lse, ffi::AnyBuffer dout, ffi::Result<ffi::AnyBuffer> dq,
                        ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv, int64_t isa) {
  static const char* op = "varlen_attention_bwd";
  Geometry g;
  const Isa* impl;
  if (auto e = check_common(op, q, k, v, seg, &g); e.failure()) return e;
  const std::vector<int64_t> bthd = {g.B, g.T, g.H, g.Dh};
  if (auto e = check_arg(op, "o", o, ffi::DataType::F32, bthd, "[B, T, H, Dh] like q"); e.failure()) return e;
  if (auto e = check_arg(op, "lse", lse, ffi::DataType::F32, {g.B, g.H, g.T}, "[B, H, T]"); e.failure()) return e;
  if (auto e = check_arg(op, "do", dout, ffi::DataType::F32, bthd, "[B, T, H, Dh] like q"); e.failure()) return e;
  for (auto [name, r] : {std::pair{"dq", &dq}, std::pair{"dk", &dk}, std::pair{"dv", &dv}})
    if (auto e = check_arg(op, name, **r, ffi::DataType::F32, bthd, "[B, T, H, Dh] like q"); e.failure()) return e;
  if (auto e = pick_isa(op, isa, &impl); e.failure()) return e;
  const float* qp = static_cast<const float*>(q.untyped_data());
  const float* kp = static_cast<const float*>(k.untyped_data());
  const float* vp = static_cast<const float*>(v.untyped_data());
  const float* opp = static_cast<const float*>(o.untyped_data());
  const float* dop = static_cast<const float*>(dout.untyped_data());
  const float* lp = static_cast<const float*>(lse.untyped_data());
  const int32_t* sp = static_cast<const int32_t*>(seg.untyped_data());
  float* dqp = static_cast<float*>(dq->untyped_data());
  float* dkp = static_cast<float*>(dk->untyped_data());
  float* dvp = static_cast<float*>(dv->untyped_data());
  const std::ptrdiff_t ts = g.H * g.Dh;
  return for_each_head_run(op, g, sp, [&](Scratch& w, std::ptrdiff_t at, std::ptrdiff_t lse_at, int64_t n, bool pad) {
    if (pad || n == 1) {  // o = v: dv = do, and dS = P (do.v - do.o) = 0 gives dq = dk = 0
      std::memcpy(dvp + at, dop + at, sizeof(float) * g.Dh);
      std::memset(dqp + at, 0, sizeof(float) * g.Dh);
      std::memset(dkp + at, 0, sizeof(float) * g.Dh);
      return;
    }
    impl->bwd(qp + at, kp + at, vp + at, opp + at, dop + at, lp + lse_at, dqp + at, dkp + at, dvp + at, ts,
              static_cast<int>(n), static_cast<int>(g.Dh), g.scale, w);
  });
}

}  // namespace

// `Args` buffer operands, `Rets` buffer results, then the `isa` attribute (the handlers take
// buffers of any dtype and check them in their Impl). Every step returns the chain's prvalue:
// bindings cannot be copied or moved by user code.
template <int Args, int Rets, typename Binding>
auto bind_buffers(Binding&& b) {
  if constexpr (Args > 0) {
    return bind_buffers<Args - 1, Rets>(std::move(b).template Arg<ffi::AnyBuffer>());
  } else if constexpr (Rets > 0) {
    return bind_buffers<0, Rets - 1>(std::move(b).template Ret<ffi::AnyBuffer>());
  } else {
    return std::move(b).template Attr<int64_t>("isa");
  }
}

// forward: q, k, v, segment ids -> out, logsumexp
XLA_FFI_DEFINE_HANDLER_SYMBOL(VarlenAttentionFwdCpu, ForwardImpl, (bind_buffers<4, 2>(ffi::Ffi::Bind())));

// backward: q, k, v, segment ids, out, logsumexp, d_out -> dq, dk, dv
XLA_FFI_DEFINE_HANDLER_SYMBOL(VarlenAttentionBwdCpu, BackwardImpl, (bind_buffers<7, 3>(ffi::Ffi::Bind())));

}  // namespace jaxodc::attention
