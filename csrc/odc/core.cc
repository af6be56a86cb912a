// Waits on segment words, shared by the transports, the TCP server and the CUDA paths, and the
// owner-side failure records.
#include "odc/core.h"

#include "odc/peer.h"
#include "odc/runtime.h"

namespace jaxodc::odc {

namespace {

// Sleeps on `word` until ready(); see Core::wait_published.
template <class Pred>
void wait_for(const Core& core, std::atomic<uint32_t>* word, Pred ready, const Peer* peer, const std::string& what) {
  const double deadline = now_seconds() + core.timeout_s;
  int spins = 0;
  while (true) {
    uint32_t seen = word->load(std::memory_order_acquire);
    if (ready()) return;
    // A short spin catches the common case of an event a few microseconds away.
    if (++spins < 64) continue;
    if (core.stop.load()) throw Error(core.closed(what));
    if (peer != nullptr) peer->check_alive(what);
    double now = now_seconds();
    if (now > deadline)
      throw TimeoutError(core.who() + " timed out after " + seconds_text(core.timeout_s) + " " + what);
    futex_wait(word, seen, std::min(0.05, deadline - now));
  }
}

}  // namespace

void Core::wait_published(SegmentHeader* s, int unit, int64_t version, const Peer* peer,
                          const std::string& what) const {
  UnitEntry* e = s->unit(unit);
  wait_for(*this, &s->pub_seq, [&] { return e->version.load(std::memory_order_acquire) >= version; }, peer, what);
}

void Core::wait_slot_free(SegmentHeader* s, int client, const Peer* peer, const std::string& what) const {
  SlotHeader* slot = s->slot(client);
  wait_for(*this, &s->slot_seq, [&] { return slot->state.load(std::memory_order_acquire) == kSlotFree; }, peer,
           what);
}

void Core::wait_scalar(SegmentHeader* s, int64_t seq, const Peer* peer, const std::string& what) const {
  ScalarEntry* e = s->scalar(seq);
  wait_for(*this, &s->scalar_seq, [&] { return e->version.load(std::memory_order_acquire) >= seq; }, peer, what);
  if (e->version.load(std::memory_order_acquire) != seq)
    throw Error(what + ": the peer is out of step (it made more allgather_scalar calls)");
}

void check_scalar_count(int64_t got, int64_t want, const std::string& what) {
  if (got != want)
    throw Error(what + ": the peer is out of step (it posted " + std::to_string(got) + " values, this rank " +
                std::to_string(want) + ": every rank must pass vectors of the same length)");
}

void Core::record_push_error(const std::string& msg) {
  std::lock_guard<std::mutex> lock(error_mu);
  if (push_error.empty()) push_error = msg;
}

void Core::record_client_failure(int client, const std::string& msg) {
  std::lock_guard<std::mutex> lock(error_mu);
  if (client_failure[client].empty()) client_failure[client] = msg;
}

}  // namespace jaxodc::odc
