// Where the bytes of one all-reduce come from and go to. The ring engine (all_reduce.cc) drives the
// sockets and the piece schedule; a PieceOps implementation owns the memory: CpuOps (all_reduce.cc)
// works in place on host arrays with zero extra copies, the CUDA handler's ops (ffi_cuda.cu) stage
// pieces through pinned host buffers and reduce/quantise with kernels on the call's stream.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>

#include "ring/reduce.h"

namespace jaxodc::ring {

// Piece `step` 0..2W-3: steps < W-1 are reduce-scatter (step 0 sends the local input, step W-2
// is the owner's final reduction), the rest all-gather. off/n in elements; qidx numbers the piece
// within the whole array (for per-piece quantisation metadata).
struct Piece {
  int step;
  int chunk;
  size_t off, n, qidx;
};

struct OpLayout {
  int world, rank;
  size_t count, piece_elems, elem_size, quant_size, num_qpieces;
  DType dtype;
  Op op;
  Quant quant;
  bool reduce_scatter(const Piece& p) const { return p.step < world - 1; }
  bool last_reduce(const Piece& p) const { return p.step == world - 2; }
};

class PieceOps {
 public:
  virtual ~PieceOps() = default;
  // Host bytes to send for piece p (raw elements, or quantised with *meta); valid until the next
  // call. Called only once the piece it depends on has been received and processed.
  virtual const char* send_payload(const Piece& p, QMeta* meta, size_t* nbytes) = 0;
  // Host memory that receives the payload of p.
  virtual char* recv_target(const Piece& p) = 0;
  // The payload of p has arrived (meta: the sender's quantisation).
  virtual void on_recv(const Piece& p, QMeta meta) = 0;
};

using OpsFactory = std::function<std::unique_ptr<PieceOps>(const OpLayout&)>;

}  // namespace jaxodc::ring
