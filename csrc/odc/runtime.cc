// The runtime's life: construction (segment, accumulators, server and daemon threads), the device
// and NVSHMEM set-up, connecting to the peers (one transport class each), and close.
#include "odc/runtime.h"

#include <sys/mman.h>

#include <cstdlib>
#include <cstring>

#include "common/handles.h"
#include "odc/core.h"
#include "odc/host_cache.h"
#include "odc/peer.h"
#include "odc/segment.h"
#include "odc/wire.h"

namespace jaxodc::odc {

namespace {

Handles<Runtime>& live_runtimes() {
  static Handles<Runtime> handles;
  return handles;
}

}  // namespace

Runtime* runtime_by_handle(int64_t handle) { return live_runtimes().find(handle); }

Runtime::Runtime(int rank, int world, const std::string& job_id, const std::vector<int64_t>& unit_numels,
                 double timeout_s, const std::string& listen_host, int64_t slot_elems, const std::string& secret)
    : job_id_(job_id),
      core_(std::make_unique<Core>(rank, Layout(rank, world, unit_numels, slot_elems), timeout_s)),
      compressor_(std::make_unique<Compressor>()) {
  for (char c : job_id)
    if (!(isalnum(static_cast<unsigned char>(c)) || c == '_'))
      throw Error("job id '" + job_id + "' may hold only letters, digits and '_'");
  const Layout& layout = core_->layout;
  shm_name_ = "/jaxodc_" + job_id + "_" + std::to_string(rank);
  segment_ = std::make_unique<Mapping>(create_segment(shm_name_, job_id, rank, layout));
  linked_ = true;
  try {
    start(rank, world, listen_host, secret);
  } catch (...) {
    unlink_segment();  // a constructor that throws gets no destructor: the name would outlive us
    throw;
  }
}

void Runtime::start(int rank, int world, const std::string& listen_host, const std::string& secret) {
  Core& core = *core_;
  const Layout& layout = core.layout;
  core.seg = segment_->seg;
  core.client_failure.assign(world, "");

  for (int u = 0; u < layout.num_units(); ++u) {
    accum_.push_back(std::make_unique<Accumulator>(layout.shards[u], true, core.who() + " unit " + std::to_string(u)));
    accum_mu_.push_back(std::make_unique<std::mutex>());
  }
  last_fetched_.assign(layout.num_units(), -1);
  grad_lent_.assign(layout.num_units(), 0);

  peers_.resize(world);
  peers_[rank] = std::make_unique<SelfPeer>(core, *this);
  core.identity = auth::Identity{secret, "odc_tcp", job_id_};
  if (world > 1) server_ = std::make_unique<TcpServer>(core, listen_host);
  daemon_ = std::thread([this] { daemon_loop(); });
}

Runtime::~Runtime() {
  try {
    close(false);
  } catch (...) {
  }
}

int Runtime::rank() const { return core_->rank; }
int Runtime::world() const { return core_->layout.world; }
int Runtime::num_units() const { return core_->layout.num_units(); }
int64_t Runtime::slot_elems() const { return core_->layout.slot_elems; }
uint64_t Runtime::layout_hash() const { return core_->layout.hash; }
int Runtime::port() const { return server_ ? server_->port() : 0; }
int Runtime::device() const { return core_->dev ? core_->dev->ordinal() : -1; }
bool Runtime::nvshmem_active() const { return core_->dev && core_->dev->nvshmem_active(); }

const std::string& Runtime::device_uuid() const {
  static const std::string none;
  return core_->dev ? core_->dev->uuid() : none;
}

int64_t Runtime::numel(int unit) const {
  check_unit(unit, "numel");
  return core_->layout.numels[unit];
}

int64_t Runtime::shard_size(int unit) const {
  check_unit(unit, "shard_size");
  return core_->layout.shards[unit];
}

void Runtime::piece(int unit, int owner, int64_t* lo, int64_t* n) const { core_->layout.piece(unit, owner, lo, n); }

Stats Runtime::stats() const {
  const Layout& layout = core_->layout;
  Stats s;
  s.slot_bytes = layout.slot_elems * 4 * layout.world;
  for (int64_t sh : layout.shards) s.master_bytes += sh * 4;
  for (const auto& a : accum_) s.accum_bytes += a->bytes();
  s.segment_bytes = static_cast<int64_t>(segment_->bytes);
  s.pushes_received = pushes_received_.load();
  s.bytes_received = bytes_received_.load();
  s.device_bytes = core_->dev ? core_->dev->bytes() : 0;
  return s;
}

void Runtime::check_unit(int unit, const char* op) const {
  if (unit < 0 || unit >= num_units())
    throw Error(std::string(op) + ": " + core_->who() + " has no unit " + std::to_string(unit) + " (" +
                std::to_string(num_units()) + " units registered)");
}

void Runtime::check_open(const char* op) const {
  if (closed_) throw Error(std::string(op) + ": the ODC runtime of " + core_->who() + " is closed");
}

void Runtime::check_buffer(const char* op, int unit, int64_t expected, const char* buffer, int64_t got) const {
  check_open(op);
  check_unit(unit, op);
  if (got != expected)
    throw Error(std::string(op) + ": " + core_->who() + " unit " + std::to_string(unit) + " needs " +
                std::to_string(expected) + " elements, the " + buffer + " holds " + std::to_string(got));
}

void Runtime::enable_device(int ordinal) {
  check_open("enable_device");
  const std::string who = core_->who() + ": enable_device(" + std::to_string(ordinal) + ")";
  if (core_->dev) throw Error(who + ": device " + std::to_string(core_->dev->ordinal()) + " is already enabled");
  if (connected_) throw Error(who + ": must be called before connect");
  core_->dev = make_device(*core_, ordinal);
}

void Runtime::set_link(double bytes_per_s, double latency_s) {
  check_open("set_link");
  // Before connect, and before this rank's address reaches any peer: the server's connection
  // threads read the setting when a peer connects.
  if (connected_) throw Error(core_->who() + ": set_link must be called before connect");
  core_->link_rate = bytes_per_s > 0 ? bytes_per_s : 0;
  core_->link_latency = latency_s > 0 ? latency_s : 0;
}

void Runtime::set_exact_sum(bool exact) {
  check_open("set_exact_sum");
  if (connected_) throw Error(core_->who() + ": set_exact_sum must be called before connect");
  if (exact == exact_sum()) return;
  const Layout& layout = core_->layout;
  for (int u = 0; u < layout.num_units(); ++u)
    accum_[u] = std::make_unique<Accumulator>(layout.shards[u], exact, core_->who() + " unit " + std::to_string(u));
}

bool Runtime::exact_sum() const { return accum_.empty() || accum_[0]->exact(); }

void Runtime::add_range(int unit, int64_t offset, int64_t size, double fraction, double ratio, uint64_t seed,
                        bool compress) {
  check_open("add_range");
  check_unit(unit, "add_range");
  try {
    compressor_->add(unit, core_->layout.numels[unit], offset, size, fraction, ratio, seed, compress);
  } catch (const Error& e) {
    throw Error(core_->who() + ": " + e.what());
  }
}

UnitTraffic Runtime::traffic(int unit) {
  check_unit(unit, "traffic");
  return compressor_->traffic(unit);
}

std::vector<float> Runtime::residual(int unit, int64_t offset) const {
  check_unit(unit, "residual");
  try {
    return compressor_->residual(unit, offset);
  } catch (const Error& e) {
    throw Error(core_->who() + ": " + e.what());
  }
}

void Runtime::set_residual(int unit, int64_t offset, const float* values, int64_t n) {
  check_unit(unit, "set_residual");
  try {
    compressor_->set_residual(unit, offset, values, n);
  } catch (const Error& e) {
    throw Error(core_->who() + ": " + e.what());
  }
}

std::string Runtime::nvshmem_uniqueid() {
  check_open("nvshmem_uniqueid");
  const std::string who = core_->who() + ": nvshmem_uniqueid";
  if (!nvshmem_api()) throw Error(who + ": the nvshmem plugin is not loaded: " + nvshmem_load_error());
  if (!core_->dev) throw Error(who + ": this rank has no device (enable_device first)");
  return core_->dev->nvshmem_uniqueid(who);
}

void Runtime::init_nvshmem(const std::string& uid, const std::vector<int>& pe_of_rank) {
  check_open("init_nvshmem");
  std::string peers;
  int npes = 0;
  for (size_t r = 0; r < pe_of_rank.size(); ++r) {
    if (pe_of_rank[r] < 0) continue;
    ++npes;
    if (static_cast<int>(r) != rank()) peers += (peers.empty() ? "" : ", ") + std::to_string(r);
  }
  const std::string who = core_->who() + ": nvshmem transport (NVSHMEM job with rank(s) " +
                          (peers.empty() ? std::string("none") : peers) + ")";
  if (nvshmem_active()) throw Error(who + ": NVSHMEM is already initialised by this runtime");
  if (connected_) throw Error(who + ": init_nvshmem must come before connect");
  if (static_cast<int>(pe_of_rank.size()) != world())
    throw Error(who + ": expected a PE for each of the " + std::to_string(world()) + " ranks, got " +
                std::to_string(pe_of_rank.size()));
  const int pe = pe_of_rank[rank()];
  if (pe < 0 || pe >= npes)
    throw Error(who + ": this rank's PE " + std::to_string(pe) + " is outside [0, " + std::to_string(npes) + ")");
  if (!core_->dev)
    throw Error(who + ": this rank has no CUDA device block (Runtime(device=...) is None, or no usable CUDA "
                      "device); nvshmem needs one on both sides of a pair");
  if (uid.size() != JAXODC_NVSHMEM_UID_BYTES)
    throw Error(who + ": the NVSHMEM unique id holds " + std::to_string(uid.size()) + " bytes, expected " +
                std::to_string(JAXODC_NVSHMEM_UID_BYTES));
  if (!nvshmem_api()) throw Error(who + ": the nvshmem plugin is not loaded: " + nvshmem_load_error());
  core_->dev->join_nvshmem(who, uid, pe, npes, pe_of_rank);
}

void Runtime::connect(const std::vector<PeerConfig>& configs) {
  check_open("connect");
  Core& core = *core_;
  if (static_cast<int>(configs.size()) != world())
    throw Error("connect: expected " + std::to_string(world()) + " peer configs, got " +
                std::to_string(configs.size()));
  connected_ = true;
  for (const PeerConfig& cfg : configs) {
    if (cfg.rank < 0 || cfg.rank >= world()) throw Error("connect: bad peer rank " + std::to_string(cfg.rank));
    if (cfg.rank == rank()) continue;
    auto mapped = [&] { return map_segment(cfg.shm_name, cfg.rank, rank(), core.layout); };
    switch (cfg.transport) {
      case Transport::kShm: peers_[cfg.rank] = std::make_unique<ShmPeer>(core, cfg.rank, mapped()); break;
      case Transport::kCudaIpc: peers_[cfg.rank] = make_cuda_ipc_peer(core, cfg.rank, mapped()); break;
      case Transport::kTcp:
        if (host_cache_ && host_cache_->caches(cfg.rank))
          peers_[cfg.rank] = std::make_unique<CachedPeer>(core, std::make_unique<TcpPeer>(core, cfg), *host_cache_);
        else
          peers_[cfg.rank] = std::make_unique<TcpPeer>(core, cfg);
        break;
      case Transport::kNvshmem: peers_[cfg.rank] = make_nvshmem_peer(core, cfg); break;
      default: throw Error("connect: peer " + std::to_string(cfg.rank) + " cannot use the 'self' transport");
    }
  }
  handle_ = live_runtimes().add(this);
}

void Runtime::create_host_cache(const std::string& name, const std::vector<int>& remote) {
  check_open("create_host_cache");
  if (connected_) throw Error("create_host_cache: " + core_->who() + ": call it before connect");
  host_cache_ = HostCache::create(name, core_->layout, remote, core_->who());
}

void Runtime::open_host_cache(const std::string& name) {
  check_open("open_host_cache");
  if (connected_) throw Error("open_host_cache: " + core_->who() + ": call it before connect");
  host_cache_ = HostCache::open(name, core_->layout, core_->who());
}

void Runtime::unlink_host_cache() {
  if (host_cache_) host_cache_->unlink();
}

int64_t Runtime::host_cache_bytes() const { return host_cache_ ? host_cache_->data_bytes() : 0; }

int64_t Runtime::gather_wire_bytes() const {
  int64_t n = 0;
  for (const auto& p : peers_)
    if (p) n += p->gather_bytes();
  return n;
}

int64_t Runtime::gather_cache_hits() const {
  int64_t n = 0;
  for (const auto& p : peers_)
    if (p) n += p->cache_hits();
  return n;
}

void Runtime::unlink_segment() {
  if (linked_) {
    shm_unlink(shm_name_.c_str());
    linked_ = false;
  }
}

void Runtime::close(bool collective) {
  if (closed_) return;
  Core& core = *core_;
  live_runtimes().remove(handle_);  // jitted calls started from now on fail with a clear error
  for (auto& p : peers_)
    if (p) p->say_goodbye();
  signal_event(&core.seg->closing);
  core.stop.store(true);
  core.seg->closing.store(1);
  futex_wake_all(&core.seg->doorbell);
  if (daemon_.joinable()) daemon_.join();
  if (server_) server_->stop();
  // The server recorded its last client failures; transports that must not wait for a lost peer
  // during their teardown (NVSHMEM's is collective) learn of them now.
  for (int r = 0; r < world(); ++r)
    if (peers_[r] && !core.client_failure[r].empty()) peers_[r]->link_failed();
  // The device goes after the daemon (which uses it) and around the peers' release (they unmap
  // the peers' device blocks, and my block is freed only once the peers unmapped it).
  if (core.dev) core.dev->leave(collective);
  for (auto& p : peers_)
    if (p) p->close();
  if (core.dev) core.dev->release();
  unlink_segment();
  unlink_host_cache();
  // My own segment stays mapped until destruction: arrays lent by master_view may outlive
  // close() (they keep this object alive), and must not point at unmapped memory.
  closed_ = true;
}

}  // namespace jaxodc::odc
