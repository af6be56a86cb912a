// Internal to csrc/ring: the ring's wire format. A connection starts with the HMAC challenge-
// response (endpoint.cc) and a Hello; on ring connections every all-reduce then sends one StartHdr
// and its pieces, each a FrameHdr plus payload.
#pragma once

#include <cstdint>

namespace jaxodc::ring {

constexpr uint32_t kHelloMagic = 0x4c454831;  // hello after authentication
constexpr uint32_t kStartMagic = 0x54525331;  // start of one all-reduce on a connection
constexpr uint32_t kFrameMagic = 0x4d524631;  // one piece
constexpr uint32_t kKindRing = 1, kKindProbe = 2;

struct Hello {
  uint32_t magic, kind;
  uint64_t epoch, probe_bytes;
  uint32_t slot, addr_len;
};
struct StartHdr {
  uint32_t magic, tag;
  uint64_t epoch, count;
  uint32_t dtype, op, quant, piece_elems;
};
struct FrameHdr {
  uint32_t magic, tag, seq, nbytes;
  float qlo, qscale;
  uint64_t epoch;
};
static_assert(sizeof(FrameHdr) == 32, "frame header layout");

}  // namespace jaxodc::ring
