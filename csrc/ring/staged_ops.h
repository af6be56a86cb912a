// Memory backend of the ring engine for data that lives in device memory: pieces are staged
// through (pinned) host buffers and every reduce / quantise / dequantise runs on the device. The
// device is a policy so the very same piece logic runs with CUDA (ffi_cuda.cu) and, for tests on
// machines without a GPU, with host memory standing in for the device (HostDev, testing/host_dev.h).
//
// Dev provides: host(slot, bytes) / dev(slot, bytes) scratch; d2h, h2d copies (ordered on one
// queue); reduce<D>, reduce_q<D,Q>, quantize<D,Q> (range + codes + DevMeta on the device),
// dequant<D,Q> (metadata from the device when `meta` is given, else `mv`); sync() waits for the queue.
#pragma once

#include <algorithm>
#include <vector>

#include "ring/engine.h"

namespace jaxodc::ring {

struct DevMeta {  // quantisation parameters of one piece as computed on the device
  QMeta m;
  float inv;
};

enum HostSlot { kSendH = 0, kRecvH = 1, kAgqH = 2, kMetaH = 3 };
enum DevSlot { kRecvD = 0, kQD = 1, kMetaD = 2 };

template <DType D, typename Q, typename Dev>
class StagedOps final : public PieceOps {
  using T = typename Traits<D>::T;

 public:
  // x / out are device pointers (out must not alias x).
  StagedOps(const OpLayout& L, Dev& dev, const char* x, char* out) : L_(L), dev_(dev), x_(x), out_(out) {
    size_t piece = L.piece_elems * L.elem_size;
    send_h_ = dev_.host(kSendH, piece);
    recv_h_ = dev_.host(kRecvH, piece);
    recv_d_ = dev_.dev(kRecvD, piece);
    meta_h_ = reinterpret_cast<DevMeta*>(dev_.host(kMetaH, sizeof(DevMeta)));
    meta_d_ = reinterpret_cast<DevMeta*>(dev_.dev(kMetaD, sizeof(DevMeta)));
    if (quantized()) {
      q_d_ = reinterpret_cast<Q*>(dev_.dev(kQD, L.piece_elems * sizeof(Q)));
      agq_h_ = dev_.host(kAgqH, std::max<size_t>(1, L.count * sizeof(Q)));
      agmeta_.resize(L.num_qpieces);
    }
  }

  const char* send_payload(const Piece& p, QMeta* meta, size_t* nbytes) override {
    size_t es = L_.elem_size;
    if (L_.reduce_scatter(p)) {
      const char* src = (p.step == 0 ? x_ : out_) + p.off * es;
      if (!quantized()) {
        dev_.d2h(send_h_, src, p.n * es);
        dev_.sync();
        *nbytes = p.n * es;
        return send_h_;
      }
      dev_.template quantize<D, Q>(reinterpret_cast<const T*>(src), q_d_, p.n, levels(), meta_d_);
      dev_.d2h(send_h_, q_d_, p.n * sizeof(Q));
      dev_.d2h(meta_h_, meta_d_, sizeof(DevMeta));
      dev_.sync();
      *meta = meta_h_->m;
      *nbytes = p.n * sizeof(Q);
      return send_h_;
    }
    if (!quantized()) {
      dev_.d2h(send_h_, out_ + p.off * es, p.n * es);
      dev_.sync();
      *nbytes = p.n * es;
      return send_h_;
    }
    *meta = agmeta_[p.qidx];  // forwarded unchanged: the owner's bytes
    *nbytes = p.n * sizeof(Q);
    return agq_h_ + p.off * sizeof(Q);
  }

  char* recv_target(const Piece& p) override {
    if (!L_.reduce_scatter(p) && quantized()) return agq_h_ + p.off * sizeof(Q);
    return recv_h_;
  }

  void on_recv(const Piece& p, QMeta m) override {
    size_t es = L_.elem_size;
    T* os = reinterpret_cast<T*>(out_ + p.off * es);
    if (L_.reduce_scatter(p)) {
      bool last = L_.last_reduce(p);
      const T* xs = reinterpret_cast<const T*>(x_ + p.off * es);
      dev_.h2d(recv_d_, recv_h_, p.n * (quantized() ? sizeof(Q) : es));
      if (!quantized())
        dev_.template reduce<D>(reinterpret_cast<const T*>(recv_d_), xs, os, p.n, L_.op, last, L_.world);
      else
        dev_.template reduce_q<D, Q>(reinterpret_cast<const Q*>(recv_d_), m, xs, os, p.n, L_.op, last, L_.world);
      if (last && quantized()) {  // the owner's single quantisation; it keeps the same values
        dev_.template quantize<D, Q>(os, q_d_, p.n, levels(), meta_d_);
        dev_.template dequant<D, Q>(q_d_, meta_d_, QMeta{0, 0}, os, p.n);
        dev_.d2h(agq_h_ + p.off * sizeof(Q), q_d_, p.n * sizeof(Q));
        dev_.d2h(meta_h_, meta_d_, sizeof(DevMeta));
        dev_.sync();
        agmeta_[p.qidx] = meta_h_->m;
        return;
      }
      dev_.sync();  // recv_h is reused by the next piece
      return;
    }
    if (!quantized()) {
      dev_.h2d(os, recv_h_, p.n * es);
    } else {
      agmeta_[p.qidx] = m;
      dev_.h2d(recv_d_, agq_h_ + p.off * sizeof(Q), p.n * sizeof(Q));
      dev_.template dequant<D, Q>(reinterpret_cast<const Q*>(recv_d_), nullptr, m, os, p.n);
    }
    dev_.sync();
  }

 private:
  bool quantized() const { return L_.quant != Quant::kNone; }
  float levels() const { return sizeof(Q) == 1 ? 255.0f : 65535.0f; }

  OpLayout L_;
  Dev& dev_;
  const char* x_;
  char* out_;
  char *send_h_ = nullptr, *recv_h_ = nullptr, *recv_d_ = nullptr, *agq_h_ = nullptr;
  Q* q_d_ = nullptr;
  DevMeta *meta_h_ = nullptr, *meta_d_ = nullptr;
  std::vector<QMeta> agmeta_;
};

// Picks the StagedOps instantiation for a layout (uint8 codes type when not quantised: unused).
template <typename Dev>
std::unique_ptr<PieceOps> make_staged_ops(const OpLayout& L, Dev& dev, const char* x, char* y) {
  auto pick = [&](auto tag) -> std::unique_ptr<PieceOps> {
    constexpr DType D = decltype(tag)::value;
    if (L.quant == Quant::kU16) return std::make_unique<StagedOps<D, uint16_t, Dev>>(L, dev, x, y);
    return std::make_unique<StagedOps<D, uint8_t, Dev>>(L, dev, x, y);
  };
  switch (L.dtype) {
    case DType::kF32: return pick(std::integral_constant<DType, DType::kF32>{});
    case DType::kF64: return pick(std::integral_constant<DType, DType::kF64>{});
    case DType::kF16: return pick(std::integral_constant<DType, DType::kF16>{});
    case DType::kBF16: return pick(std::integral_constant<DType, DType::kBF16>{});
    case DType::kI32: return pick(std::integral_constant<DType, DType::kI32>{});
    default: return pick(std::integral_constant<DType, DType::kI64>{});
  }
}

}  // namespace jaxodc::ring
