// SHA-256 (FIPS 180-4) and HMAC-SHA256 (RFC 2104), used for peer authentication without sending
// the shared secret. Tested against Python's hashlib/hmac.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace jaxodc::crypto {

using Digest = std::array<uint8_t, 32>;

class Sha256 {
 public:
  Sha256();
  void update(const void* data, size_t n);
  Digest finish();

 private:
  void block(const uint8_t* p);
  uint32_t h_[8];
  uint8_t buf_[64];
  size_t buf_len_ = 0;
  uint64_t total_ = 0;
};

Digest sha256(const void* data, size_t n);
Digest hmac_sha256(const void* key, size_t key_len, const void* msg, size_t msg_len);
bool digest_equal(const Digest& a, const Digest& b);  // constant time

}  // namespace jaxodc::crypto
