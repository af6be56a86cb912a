// One all-reduce over the endpoint's ring: the piece schedule and the full-duplex socket loop
// (OpRunner), and the host-memory side of an op (CpuOps), which works in place on host arrays.
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>

#include <algorithm>
#include <cstring>

#include "ring/host_kernels.h"
#include "transport/link_shaper.h"
#include "ring/ring.h"
#include "ring/ring_state.h"
#include "ring/staged_ops.h"
#include "ring/testing/host_dev.h"
#include "transport/tcp_socket.h"

namespace jaxodc::ring {

using tcp::ErrKind;
using tcp::TcpError;


// Host arrays: sends point straight into x / out, all-gather pieces are received in place, partial
// results live in out (x is only read).
template <DType D>
class CpuOps final : public PieceOps {
  using T = typename Traits<D>::T;
  using K = Kernels<D>;

 public:
  // Scratch the op needs (codes of the whole array, one send and one receive piece); the caller
  // keeps it cached across ops so no op pays for allocating and zero-filling megabytes.
  static size_t scratch_bytes(const OpLayout& L) {
    if (L.quant == Quant::kNone) return L.piece_elems * L.elem_size;
    return (L.count + 2 * L.piece_elems) * L.quant_size;
  }
  CpuOps(const OpLayout& L, const char* x, char* out, char* scratch) : L_(L), x_(x), out_(out) {
    if (L.quant != Quant::kNone) {
      agq_ = scratch;
      sendq_ = agq_ + L.count * L.quant_size;
      recvbuf_ = sendq_ + L.piece_elems * L.quant_size;
      agmeta_.resize(L.num_qpieces);
      range_.resize(L.num_qpieces);
    } else {
      recvbuf_ = scratch;
    }
  }

  const char* send_payload(const Piece& p, QMeta* meta, size_t* nbytes) override {
    size_t es = L_.elem_size, qs = L_.quant_size;
    if (L_.reduce_scatter(p)) {
      const char* src = (p.step == 0 ? x_ : out_) + p.off * es;
      if (L_.quant == Quant::kNone) {
        *nbytes = p.n * es;
        return src;
      }
      // step 0 quantises the input (range pass + codes); later steps reuse the range on_recv took
      *meta = p.step == 0 ? quantize(src, sendq_, p.n) : quantize_range(src, sendq_, p.n, range_[p.qidx]);
      *nbytes = p.n * qs;
      return sendq_;
    }
    if (L_.quant == Quant::kNone) {
      *nbytes = p.n * es;
      return out_ + p.off * es;
    }
    *meta = agmeta_[p.qidx];
    *nbytes = p.n * qs;
    return agq_ + p.off * qs;
  }

  char* recv_target(const Piece& p) override {
    if (L_.reduce_scatter(p)) return recvbuf_;
    return L_.quant == Quant::kNone ? out_ + p.off * L_.elem_size : agq_ + p.off * L_.quant_size;
  }

  void on_recv(const Piece& p, QMeta m) override {
    T* os = reinterpret_cast<T*>(out_) + p.off;
    if (L_.reduce_scatter(p)) {
      bool last = L_.last_reduce(p);
      const T* xs = reinterpret_cast<const T*>(x_) + p.off;
      if (L_.quant == Quant::kNone) {
        K::reduce(reinterpret_cast<const T*>(recvbuf_), xs, os, p.n, L_.op, last, L_.world);
        return;
      }
      // Reduce and take the range of the result in one pass: the next hop (or, on the owner, the
      // single quantisation right below) needs exactly that range.
      Range& rg = range_[p.qidx];
      if (L_.quant == Quant::kU8)
        K::template reduce_q_range<uint8_t>(reinterpret_cast<const uint8_t*>(recvbuf_), m, xs, os, p.n, L_.op,
                                            last, L_.world, &rg.lo, &rg.hi);
      else
        K::template reduce_q_range<uint16_t>(reinterpret_cast<const uint16_t*>(recvbuf_), m, xs, os, p.n,
                                             L_.op, last, L_.world, &rg.lo, &rg.hi);
      if (last) {  // the owner's single quantisation; it keeps the decoded values it sends
        char* q = agq_ + p.off * L_.quant_size;
        if (L_.quant == Quant::kU8)
          agmeta_[p.qidx] = K::template quantize_dequantize<uint8_t>(os, reinterpret_cast<uint8_t*>(q), p.n, 255.0f,
                                                                     rg.lo, rg.hi);
        else
          agmeta_[p.qidx] = K::template quantize_dequantize<uint16_t>(os, reinterpret_cast<uint16_t*>(q), p.n,
                                                                      65535.0f, rg.lo, rg.hi);
      }
    } else if (L_.quant != Quant::kNone) {
      agmeta_[p.qidx] = m;
      dequantize(agq_ + p.off * L_.quant_size, m, os, p.n);
    }
  }

 private:
  QMeta quantize(const char* src, char* dst, size_t n) {
    const T* v = reinterpret_cast<const T*>(src);
    if (L_.quant == Quant::kU8) return K::template quantize<uint8_t>(v, reinterpret_cast<uint8_t*>(dst), n, 255.0f);
    return K::template quantize<uint16_t>(v, reinterpret_cast<uint16_t*>(dst), n, 65535.0f);
  }
  QMeta quantize_range(const char* src, char* dst, size_t n, Range rg) {
    const T* v = reinterpret_cast<const T*>(src);
    if (L_.quant == Quant::kU8)
      return K::template quantize_range<uint8_t>(v, reinterpret_cast<uint8_t*>(dst), n, 255.0f, rg.lo, rg.hi);
    return K::template quantize_range<uint16_t>(v, reinterpret_cast<uint16_t*>(dst), n, 65535.0f, rg.lo, rg.hi);
  }
  void dequantize(const char* q, QMeta m, T* out, size_t n) {
    if (L_.quant == Quant::kU8) K::template dequantize<uint8_t>(reinterpret_cast<const uint8_t*>(q), m, out, n);
    else K::template dequantize<uint16_t>(reinterpret_cast<const uint16_t*>(q), m, out, n);
  }

  OpLayout L_;
  const char* x_;
  char* out_;
  char *sendq_ = nullptr, *recvbuf_ = nullptr, *agq_ = nullptr;
  std::vector<QMeta> agmeta_;
  std::vector<Range> range_;  // per piece: range of the reduced values this peer forwards
};

struct OpRunner {
  Endpoint* ep;
  std::shared_ptr<RingState> rs;
  uint32_t tag;
  OpLayout L;
  int out_slot = -1, in_idx = -1;
  int out_fd = -1, in_fd = -1;
  std::shared_ptr<Link> link;
  std::unique_ptr<PieceOps> ops;

  std::vector<size_t> step_begin_send, step_begin_recv;
  std::vector<Piece> sends, recvs;
  std::vector<double> recv_done_t;

  std::string where() const {
    return " (all_reduce tag " + std::to_string(tag) + ", epoch " + std::to_string(rs->epoch) + ")";
  }

  size_t chunk_start(int c) const { return static_cast<size_t>((unsigned __int128)L.count * c / L.world); }

  void build() {
    int W = L.world, r = L.rank;
    size_t P = L.piece_elems;
    std::vector<size_t> qbase(W + 1, 0);
    for (int c = 0; c < W; ++c) {
      size_t len = chunk_start(c + 1) - chunk_start(c);
      qbase[c + 1] = qbase[c] + (len + P - 1) / P;
    }
    L.num_qpieces = qbase[W];
    auto pieces = [&](int step, int c, std::vector<Piece>& v) {
      size_t s = chunk_start(c), e = chunk_start(c + 1);
      size_t k = 0;
      for (size_t o = s; o < e; o += P, ++k) v.push_back({step, c, o, std::min(P, e - o), qbase[c] + k});
    };
    for (int j = 0; j < 2 * W - 2; ++j) {
      int sc, rc;
      if (j < W - 1) {
        sc = ((r - j) % W + W) % W;
        rc = ((r - j - 1) % W + W) % W;
      } else {
        int s = j - (W - 1);
        sc = ((r + 1 - s) % W + W) % W;
        rc = ((r - s) % W + W) % W;
      }
      step_begin_send.push_back(sends.size());
      pieces(j, sc, sends);
      step_begin_recv.push_back(recvs.size());
      pieces(j, rc, recvs);
    }
    step_begin_send.push_back(sends.size());
    step_begin_recv.push_back(recvs.size());
    recv_done_t.assign(recvs.size(), 0.0);
  }

  // Index of the received piece a send item depends on, or -1 (step 0 sends local data). Send
  // step j carries the chunk received at step j-1, so piece p depends on that step's piece p.
  long dep_of(size_t si) const {
    const Piece& it = sends[si];
    if (it.step == 0) return -1;
    size_t p = si - step_begin_send[it.step];
    return static_cast<long>(step_begin_recv[it.step - 1] + p);
  }

  void check_abort() {
    std::lock_guard<std::mutex> g(rs->mu);
    if (rs->aborted) throw TcpError(ErrKind::kAborted, "aborted");
  }

  void acquire() {
    double dl = now_seconds() + ep->timeout_s_;
    std::unique_lock<std::mutex> g(rs->mu);
    uint64_t ticket = rs->next_ticket++;
    auto fail = [&](ErrKind k, const std::string& msg) {
      rs->cancelled.insert(ticket);
      rs->advance_serving();
      rs->cv.notify_all();
      throw TcpError(k, msg);
    };
    while (true) {
      if (rs->aborted) fail(ErrKind::kAborted, "aborted");
      if (!rs->broken.empty()) fail(ErrKind::kConnection, rs->broken);
      if (rs->serving == ticket) {
        for (size_t s = 0; s < rs->out_busy.size(); ++s)
          if (!rs->out_busy[s]) { out_slot = static_cast<int>(s); break; }
        if (out_slot >= 0) {
          rs->out_busy[out_slot] = true;
          rs->serving++;
          rs->advance_serving();
          rs->cv.notify_all();
          break;
        }
      }
      if (now_seconds() > dl)
        fail(ErrKind::kTimeout, "timed out waiting for a free connection to next peer " + rs->next);
      rs->cv.wait_for(g, std::chrono::milliseconds(50));
    }
    out_fd = rs->out_fds[out_slot];
  }

  void release(bool ok) {
    std::lock_guard<std::mutex> g(rs->mu);
    if (out_slot >= 0) {
      if (ok) rs->out_busy[out_slot] = false;
      else shut(rs->out_fds[out_slot]);
    }
    if (in_idx >= 0) {
      if (ok) rs->in_state[in_idx] = 0;
      else { rs->in_state[in_idx] = 2; shut(rs->in_fds[in_idx]); }
    }
    rs->poke();
    rs->cv.notify_all();
  }

  StartHdr wait_incoming() {
    double dl = now_seconds() + ep->timeout_s_;
    std::unique_lock<std::mutex> g(rs->mu);
    while (true) {
      if (rs->aborted) throw TcpError(ErrKind::kAborted, "aborted");
      auto it = rs->routed.find(tag);
      if (it != rs->routed.end() && !it->second.empty()) {
        auto rt = it->second.front();
        it->second.pop_front();
        if (it->second.empty()) rs->routed.erase(it);
        in_idx = rt.idx;
        in_fd = rs->in_fds[in_idx];
        return rt.hdr;
      }
      if (!rs->broken.empty()) throw TcpError(ErrKind::kConnection, rs->broken);
      if (now_seconds() > dl)
        throw TcpError(ErrKind::kTimeout, "timed out waiting for previous peer " + rs->prev + " to start the operation");
      rs->cv.wait_for(g, std::chrono::milliseconds(50));
    }
  }

  void run(const OpsFactory& make) {
    link = ep->link_for(rs->next);
    acquire();
    StartHdr mine{kStartMagic, tag, rs->epoch, L.count, static_cast<uint32_t>(L.dtype), static_cast<uint32_t>(L.op),
                  static_cast<uint32_t>(L.quant), static_cast<uint32_t>(L.piece_elems)};
    tcp::send_all(out_fd, &mine, sizeof(mine), now_seconds() + ep->timeout_s_, nullptr,
                  "sending operation header to next peer " + rs->next);
    ep->bytes_sent += sizeof(mine);
    StartHdr theirs = wait_incoming();
    if (theirs.count != mine.count || theirs.dtype != mine.dtype || theirs.op != mine.op ||
        theirs.quant != mine.quant || theirs.piece_elems != mine.piece_elems)
      throw TcpError(ErrKind::kProtocol,
                     "previous peer " + rs->prev + " started a different operation with the same tag: count " +
                         std::to_string(theirs.count) + " vs " + std::to_string(L.count) + ", dtype " +
                         std::to_string(theirs.dtype) + " vs " + std::to_string(mine.dtype) + ", op " +
                         std::to_string(theirs.op) + " vs " + std::to_string(mine.op) + ", quantize " +
                         std::to_string(theirs.quant) + " vs " + std::to_string(mine.quant) + ", piece " +
                         std::to_string(theirs.piece_elems) + " vs " + std::to_string(mine.piece_elems));
    build();
    ops = make(L);

    const size_t wire_es = L.quant == Quant::kNone ? L.elem_size : L.quant_size;
    double t_start = now_seconds();
    double latency = link->lat();
    size_t si = 0, ri = 0;
    // send state: header + payload of sends[si]
    bool prepared = false;
    FrameHdr sh{};
    const char* spay = nullptr;
    size_t snb = 0, ssent = 0;
    double release_t = 0;
    double pace_t = 0;  // emulated link: no tokens before this time
    // receive state: header + payload of recvs[ri]
    FrameHdr rh{};
    size_t rgot = 0;
    char* rdst = nullptr;
    double last_progress = now_seconds();
    while (si < sends.size() || ri < recvs.size()) {
      check_abort();
      double now = now_seconds();
      double wait = 0.05;
      bool want_out = false;
      if (si < sends.size()) {
        if (!prepared) {
          long d = dep_of(si);
          if (d < 0 || static_cast<size_t>(d) < ri) {
            QMeta m{0, 0};
            spay = ops->send_payload(sends[si], &m, &snb);
            sh = {kFrameMagic, tag, static_cast<uint32_t>(si), static_cast<uint32_t>(snb), m.lo, m.scale, rs->epoch};
            ssent = 0;
            // emulated latency: a piece leaves `latency` after it became ready
            release_t = (d < 0 ? t_start : recv_done_t[d]) + latency;
            prepared = true;
          }
        }
        if (prepared) {
          double ready = std::max(release_t, pace_t);
          if (now < ready) wait = std::min(wait, ready - now);
          else want_out = true;
        }
      }
      pollfd fds[2] = {{out_fd, static_cast<short>(want_out ? POLLOUT : 0), 0},
                       {in_fd, static_cast<short>(ri < recvs.size() ? POLLIN : 0), 0}};
      // ppoll: microsecond timeouts, so latency / pacing waits do not round up to whole ms
      timespec ts{static_cast<time_t>(wait), static_cast<long>((wait - static_cast<double>(static_cast<time_t>(wait))) * 1e9)};
      int rc = ppoll(fds, 2, &ts, nullptr);
      if (rc < 0 && errno != EINTR) throw TcpError(ErrKind::kConnection, std::string("poll: ") + strerror(errno));
      bool progress = false;
      if (want_out && (fds[0].revents & (POLLOUT | POLLERR | POLLHUP))) {
        size_t total = sizeof(FrameHdr) + snb;
        double tw = 0;
        size_t grant = link->take(total - ssent, &tw);
        if (grant > 0) {
          iovec iov[2];
          int niov = 0;
          size_t budget = grant;
          if (ssent < sizeof(FrameHdr)) {
            size_t h = std::min(budget, sizeof(FrameHdr) - ssent);
            iov[niov++] = {reinterpret_cast<char*>(&sh) + ssent, h};
            budget -= h;
          }
          if (budget > 0) {
            size_t po = ssent > sizeof(FrameHdr) ? ssent - sizeof(FrameHdr) : 0;
            iov[niov++] = {const_cast<char*>(spay) + po, std::min(budget, snb - po)};
          }
          msghdr mh{};
          mh.msg_iov = iov;
          mh.msg_iovlen = niov;
          ssize_t k = sendmsg(out_fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
          if (k < 0) {
            link->refund(grant);
            if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
              throw TcpError(ErrKind::kConnection, "send to next peer " + rs->next + " failed: " + strerror(errno));
          } else {
            link->refund(grant - static_cast<size_t>(k));
            ssent += static_cast<size_t>(k);
            ep->bytes_sent += static_cast<uint64_t>(k);
            progress = k > 0;
            if (ssent == total) {
              ++si;
              prepared = false;
            }
          }
        } else {
          pace_t = now_seconds() + tw;  // keep receiving while the emulated link refills
        }
      }
      if (ri < recvs.size() && (fds[1].revents & (POLLIN | POLLERR | POLLHUP))) {
        const Piece& it = recvs[ri];
        char* dst;
        size_t want;
        if (rgot < sizeof(FrameHdr)) {
          dst = reinterpret_cast<char*>(&rh) + rgot;
          want = sizeof(FrameHdr) - rgot;
        } else {
          dst = rdst + (rgot - sizeof(FrameHdr));
          want = sizeof(FrameHdr) + rh.nbytes - rgot;
        }
        ssize_t k = recv(in_fd, dst, want, MSG_DONTWAIT);
        if (k == 0) throw TcpError(ErrKind::kConnection, "connection closed by previous peer " + rs->prev);
        if (k < 0) {
          if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
            throw TcpError(ErrKind::kConnection, "receive from previous peer " + rs->prev + " failed: " + strerror(errno));
        } else {
          rgot += static_cast<size_t>(k);
          ep->bytes_received += static_cast<uint64_t>(k);
          progress = true;
          if (rgot == sizeof(FrameHdr) && static_cast<size_t>(k) == want) {
            if (rh.magic != kFrameMagic || rh.tag != tag || rh.seq != ri || rh.nbytes != it.n * wire_es ||
                rh.epoch != rs->epoch)
              throw TcpError(ErrKind::kProtocol, "protocol error from previous peer " + rs->prev + ": unexpected frame");
            rdst = ops->recv_target(it);
          }
          if (rgot > sizeof(FrameHdr) && rgot == sizeof(FrameHdr) + rh.nbytes) {
            ops->on_recv(it, {rh.qlo, rh.qscale});
            recv_done_t[ri] = now_seconds();
            ++ri;
            rgot = 0;
          }
        }
      }
      if (progress) {
        last_progress = now_seconds();
      } else if (now_seconds() - last_progress > ep->timeout_s_) {
        throw TcpError(ErrKind::kTimeout, ri < recvs.size()
                                              ? "timed out receiving from previous peer " + rs->prev
                                              : "timed out sending to next peer " + rs->next);
      }
    }
  }
};

OpResult Endpoint::run_op(size_t count, DType dtype, Op op, Quant quant, uint32_t tag, const OpsFactory& make,
                          const std::function<void()>& single) {
  OpResult res;
  std::shared_ptr<RingState> rs;
  {
    std::lock_guard<std::mutex> g(mu_);
    rs = ring_;
  }
  auto where = " (all_reduce tag " + std::to_string(tag) + ")";
  if (!rs) return {Status::kInvalid, "endpoint " + address_ + " is not connected: call connect_ring first"};
  if (quant != Quant::kNone && !dtype_is_float(dtype))
    return {Status::kInvalid, "quantized all_reduce needs a floating dtype" + where};
  {
    std::lock_guard<std::mutex> g(rs->mu);
    if (rs->aborted) return {Status::kAborted, "endpoint " + address_ + " was aborted; reconnect with a new epoch" + where};
    if (!rs->broken.empty()) return {Status::kConnection, rs->broken + where};
  }
  if (rs->world == 1) {
    try {
      single();
    } catch (const std::exception& e) {
      return {Status::kInvalid, std::string(e.what()) + where};
    }
    ops_ok++;
    return res;
  }
  size_t es = dtype_size(dtype);
  OpLayout L{rs->world, rs->rank, count, std::max<size_t>(1, piece_bytes_ / es), es, quant_size(quant), 0,
             dtype, op, quant};
  OpRunner R{this, rs, tag, L};
  bool ok = false;
  try {
    R.run(make);
    ok = true;
  } catch (const std::exception& e) {
    const auto* te = dynamic_cast<const TcpError*>(&e);
    bool aborted;
    {
      std::lock_guard<std::mutex> g(rs->mu);
      aborted = rs->aborted;
      if (!aborted && rs->broken.empty()) rs->broken = e.what();
    }
    if (aborted || (te && te->kind == ErrKind::kAborted))
      res = {Status::kAborted, "all_reduce aborted on " + address_ + R.where() + "; input buffer restored"};
    else if (te)
      res = {te->kind == ErrKind::kTimeout ? Status::kTimeout : Status::kConnection,
             std::string(e.what()) + R.where() + " on " + address_};
    else
      res = {Status::kInvalid, std::string(e.what()) + R.where() + " on " + address_};
  }
  R.release(ok);
  if (ok) ops_ok++;
  else ops_failed++;
  return res;
}

OpResult Endpoint::all_reduce(const void* x, void* out, size_t count, DType dtype, Op op, Quant quant, uint32_t tag) {
  size_t nbytes = count * dtype_size(dtype);
  const char* xb = static_cast<const char*>(x);
  char* ob = static_cast<char*>(out);
  // Aliased in/out runs into a cached work buffer and commits with one memcpy at the end.
  bool aliased = nbytes > 0 && xb < ob + nbytes && ob < xb + nbytes;
  std::vector<char>* work = nullptr;
  std::vector<char>* scratch = nullptr;
  char* target = ob;
  auto make = [&](const OpLayout& L) -> std::unique_ptr<PieceOps> {
    if (aliased) {
      work = take_work(nbytes);
      target = work->data();
    }
    scratch = take_work(CpuOps<DType::kF32>::scratch_bytes(L));
    char* sc = scratch->data();
    switch (L.dtype) {
      case DType::kF32: return std::make_unique<CpuOps<DType::kF32>>(L, xb, target, sc);
      case DType::kF64: return std::make_unique<CpuOps<DType::kF64>>(L, xb, target, sc);
      case DType::kF16: return std::make_unique<CpuOps<DType::kF16>>(L, xb, target, sc);
      case DType::kBF16: return std::make_unique<CpuOps<DType::kBF16>>(L, xb, target, sc);
      case DType::kI32: return std::make_unique<CpuOps<DType::kI32>>(L, xb, target, sc);
      default: return std::make_unique<CpuOps<DType::kI64>>(L, xb, target, sc);
    }
  };
  OpResult r = run_op(count, dtype, op, quant, tag, make, [&] {
    if (ob != xb) std::memmove(ob, xb, nbytes);
  });
  if (work) {
    if (r.status == Status::kOk) std::memcpy(ob, work->data(), nbytes);  // commit: x overwritten only now
    give_work(work);
  }
  if (scratch) give_work(scratch);
  return r;
}

OpResult Endpoint::all_reduce_staged(const void* x, void* out, size_t count, DType dtype, Op op, Quant quant,
                                     uint32_t tag) {
  HostDev dev;
  size_t nbytes = count * dtype_size(dtype);
  return run_op(
      count, dtype, op, quant, tag,
      [&](const OpLayout& L) { return make_staged_ops(L, dev, static_cast<const char*>(x), static_cast<char*>(out)); },
      [&] { std::memmove(out, x, nbytes); });
}

}  // namespace jaxodc::ring
